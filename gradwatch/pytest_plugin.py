"""pytest plugin: fail a test when the training it runs goes wrong in its gradients.

gradwatch registers this module under the ``pytest11`` entry point, so every pytest session of an
environment with gradwatch installed loads it. It therefore imports nothing heavy at module level:
torch and gradwatch's own modules are imported inside the fixture and the hooks, and a session
whose tests use neither the fixture nor the marker only gets the marker and the options registered.

- The ``gradwatch`` fixture watches the models a test hands to ``gradwatch.watch(model)`` and,
  while it is active, every outermost module with trainable parameters that the test runs forward
  with gradients enabled (found through torch's global module forward hooks).
- ``@pytest.mark.gradwatch(fail_on="error", rules="default", **watch_kwargs)`` activates the
  fixture for a test that does not request it, and overrides its settings.
- ``--gradwatch-fail-on {warning,error}`` and ``--gradwatch-runs DIR`` (ini: ``gradwatch_fail_on``,
  ``gradwatch_runs``) set the threshold and keep the runs, e.g. as CI artifacts.

When the test body has passed, every run is closed and read back; findings at or above
``fail_on`` fail the test (reported as FAILED, from the call phase), listing each finding and its
run directory. A test that fails on its own keeps its own failure: the runs are only closed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from gradwatch.pytest_fixture import GradwatchFixture

#: the thresholds ``fail_on`` accepts; the same as :data:`gradwatch.judging.gate.FAIL_ON`, repeated here so
#: that checking a marker at collection imports nothing heavy
FAIL_ON = ("warning", "error")

#: what every watch made by the fixture starts from; the marker and ``watch(**kwargs)`` override it.
#: ``overwrite``: a run directory named after a test belongs to that test, a re-run replaces it
DEFAULTS: dict[str, Any] = {"rules": "default", "console": False, "overwrite": True}

#: findings listed per run in a failure message; the rest are counted
MAX_LINES = 20

#: longest run-name prefix made from a test id before it is shortened with a digest
_MAX_NAME = 100

def _digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]


def run_name(nodeid: str) -> str:
    """A directory name made from a test's node id (``tests/test_a.py::test_b[x]`` → ``tests_test_a.py__test_b_x``)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid.replace("::", "__")).strip("._-") or "test"
    if len(name) > _MAX_NAME:
        name = f"{name[:_MAX_NAME - 9]}-{_digest(nodeid)}"
    return name


@dataclass
class _Settings:
    """Session-wide settings from the command line and the ini file."""

    fail_on: str
    runs: Path | None
    #: run-name prefix -> the node id it was given to (two ids that sanitise alike get a digest)
    names: dict[str, str] = field(default_factory=dict)
    #: run directories written under ``runs`` in this session
    written: list[Path] = field(default_factory=list)

    def prefix(self, nodeid: str) -> str:
        """The run-name prefix of a test, unique in this session."""
        name = run_name(nodeid)
        if self.names.setdefault(name, nodeid) != nodeid:
            name = f"{name}-{_digest(nodeid)}"
            self.names[name] = nodeid
        return name


# ---------------------------------------------------------------------- pytest hooks
_SETTINGS = pytest.StashKey[_Settings]()
_ACTIVE = pytest.StashKey["GradwatchFixture"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--gradwatch-fail-on`` and ``--gradwatch-runs``, and the ini options of the same names."""
    group = parser.getgroup("gradwatch", "gradwatch: fail tests whose training goes wrong in its gradients")
    group.addoption("--gradwatch-fail-on", dest="gradwatch_fail_on", choices=FAIL_ON, default=None,
                    help="fail a test watched by gradwatch on findings at or above this severity (default: error; "
                         "@pytest.mark.gradwatch(fail_on=...) overrides it)")
    group.addoption("--gradwatch-runs", dest="gradwatch_runs", metavar="DIR", default=None,
                    help="keep the runs of watched tests in DIR, one directory per model named after the test "
                         "(default: under each test's tmp_path)")
    parser.addini("gradwatch_fail_on", "default of --gradwatch-fail-on: warning or error", default="error")
    parser.addini("gradwatch_runs", "default of --gradwatch-runs, relative to the ini file", default="")


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker and resolve the session's settings (command line over ini file)."""
    config.addinivalue_line(
        "markers",
        "gradwatch(fail_on='error', rules='default', **watch_kwargs): watch the models this test trains with "
        "gradwatch and fail it on findings at or above fail_on (activates the gradwatch fixture)",
    )
    fail_on = (config.getoption("gradwatch_fail_on", None) or str(config.getini("gradwatch_fail_on")).strip()
               or "error")
    if fail_on not in FAIL_ON:
        where = f" in {config.inipath}" if config.inipath is not None else ""
        raise pytest.UsageError(f"gradwatch_fail_on = {fail_on!r}{where}: must be one of {', '.join(FAIL_ON)}")
    runs: Path | None = None
    option = config.getoption("gradwatch_runs", None)
    ini = str(config.getini("gradwatch_runs")).strip()
    if option:
        runs = config.invocation_params.dir / Path(option).expanduser()
    elif ini:
        base = config.inipath.parent if config.inipath is not None else config.rootpath
        runs = base / Path(ini).expanduser()
    config.stash[_SETTINGS] = _Settings(fail_on, runs)


def marker_options(item: pytest.Item) -> dict[str, Any]:
    """The keyword arguments of the ``gradwatch`` markers on ``item`` (the closest wins), checked.

    Raises:
        pytest.UsageError: positional arguments, an unknown ``fail_on``, or ``run``.
    """
    merged: dict[str, Any] = {}
    for marker in reversed(list(item.iter_markers("gradwatch"))):
        if marker.args:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.gradwatch takes keyword arguments only "
                                    f"(fail_on=..., rules=..., options of gw.watch), got {marker.args!r}")
        merged.update(marker.kwargs)
    if "fail_on" in merged and merged["fail_on"] not in FAIL_ON:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.gradwatch(fail_on={merged['fail_on']!r}): fail_on "
                                f"must be one of {', '.join(repr(f) for f in FAIL_ON)}")
    if "run" in merged:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.gradwatch(run=...): the plugin names one run per "
                                "model; keep them with --gradwatch-runs DIR, or pass run= to gradwatch.watch(model)")
    return merged


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check every ``gradwatch`` marker, and give its tests the fixture."""
    for item in items:
        if item.get_closest_marker("gradwatch") is None:
            continue
        marker_options(item)
        names = getattr(item, "fixturenames", None)
        if isinstance(names, list) and "gradwatch" not in names:
            names.append("gradwatch")


@pytest.fixture(name="gradwatch")
def gradwatch_fixture(request: pytest.FixtureRequest) -> Iterator[GradwatchFixture]:
    """Watch the models this test trains; fail it on gradient findings at or above ``fail_on``.

    Models handed to ``gradwatch.watch(model, **kwargs)`` are watched, and so is every outermost
    module with trainable parameters that the test runs forward with gradients enabled. Each model
    gets its own run, under ``--gradwatch-runs DIR`` or the test's ``tmp_path``. Settings: the
    ``gradwatch`` marker's keyword arguments over ``--gradwatch-fail-on`` over the ini file; runs
    use ``rules="default"`` and ``console=False`` unless the marker says otherwise.
    """
    from gradwatch.errors import ConfigError
    from gradwatch.watching import registry

    settings = request.config.stash[_SETTINGS]
    options = marker_options(request.node) if isinstance(request.node, pytest.Item) else {}
    fail_on = options.pop("fail_on", settings.fail_on)
    options = {**DEFAULTS, **options}
    try:
        registry.watch(None, **options)  # checks every option and the rules now, before the test runs
        problem = None
    except ConfigError as exc:
        problem = str(exc)
    if problem is not None:
        pytest.fail(f"gradwatch: @pytest.mark.gradwatch: {problem}", pytrace=False)
    if settings.runs is not None:
        root, prefix = settings.runs, settings.prefix(request.node.nodeid)
    else:
        root, prefix = request.getfixturevalue("tmp_path"), "gradwatch"
    from gradwatch.pytest_fixture import GradwatchFixture

    fixture = GradwatchFixture(fail_on, options, root, prefix, MAX_LINES)
    fixture._start()
    request.node.stash[_ACTIVE] = fixture
    try:
        yield fixture
    finally:
        del request.node.stash[_ACTIVE]
        try:
            fixture._stop()  # already done after a passing test; after a failing one, only clean up
        finally:
            if settings.runs is not None:
                settings.written.extend(fixture.runs)


@pytest.hookimpl(trylast=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """After a test body that passed: close its runs, and fail it on findings at or above ``fail_on``.

    Runs after the test function (``trylast``) and only when it returned normally, so the verdict is
    part of the call phase: the test reports as FAILED, not as an error at teardown, and a test that
    failed on its own keeps only its own failure.
    """
    fixture = item.stash.get(_ACTIVE, None)
    if fixture is None:
        return
    fixture._stop()
    message = fixture._report()
    if message is not None:
        pytest.fail(message, pytrace=False)


def pytest_report_header(config: pytest.Config) -> str | None:
    """One header line when runs are kept."""
    settings = config.stash.get(_SETTINGS, None)
    if settings is None or settings.runs is None:
        return None
    return f"gradwatch: fail_on={settings.fail_on}, runs kept in {settings.runs}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """Say where the kept runs are."""
    settings = config.stash.get(_SETTINGS, None)
    if settings is None or settings.runs is None or not settings.written:
        return
    noun = "run" if len(settings.written) == 1 else "runs"
    terminalreporter.write_sep("-", "gradwatch")
    terminalreporter.write_line(f"{len(settings.written)} {noun} kept in {settings.runs}")


@pytest.fixture(scope="session")
def gradwatch_healthy_records(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The step records of a healthy training run, for the contracts of :mod:`gradwatch.testing`."""
    from gradwatch.testing import healthy_records

    return healthy_records(tmp_path_factory.mktemp("gradwatch-healthy") / "run")
