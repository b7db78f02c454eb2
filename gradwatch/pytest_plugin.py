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
import threading
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pytest

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from gradwatch.watching import Watcher

#: the thresholds ``fail_on`` accepts; the same as :data:`gradwatch.gate.FAIL_ON`, repeated here so
#: that checking a marker at collection imports nothing heavy
FAIL_ON = ("warning", "error")

#: what every watch made by the fixture starts from; the marker and ``watch(**kwargs)`` override it.
#: ``overwrite``: a run directory named after a test belongs to that test, a re-run replaces it
DEFAULTS: dict[str, Any] = {"rules": "default", "console": False, "overwrite": True}

#: findings listed per run in a failure message; the rest are counted
MAX_LINES = 20

#: longest run-name prefix made from a test id before it is shortened with a digest
_MAX_NAME = 100

M = TypeVar("M")


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


@dataclass
class _Entry:
    """One model the fixture watches (or tried to)."""

    index: int
    label: str
    run_dir: Path | None
    watcher: Watcher | None
    #: why the model could not be watched
    error: str | None = None


def _has_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


class GradwatchFixture:
    """What the ``gradwatch`` fixture gives a test: watches its models, judges their runs after it.

    Attributes:
        fail_on: the severity (``"warning"`` or ``"error"``) at or above which a finding fails the test.
    """

    def __init__(self, fail_on: str, options: dict[str, Any], root: Path, prefix: str) -> None:
        self.fail_on = fail_on
        self._options = options
        self._root = root
        self._prefix = prefix
        self._entries: list[_Entry] = []
        self._handles: list[RemovableHandle] = []
        self._torch: Any = None
        self._local = threading.local()
        self._lock = threading.RLock()
        #: modules already decided on by the automatic watch (watched, or left alone for good)
        self._decided: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._stopped = False

    def __repr__(self) -> str:
        return f"GradwatchFixture(fail_on={self.fail_on!r}, runs={[str(run) for run in self.runs]})"

    @property
    def runs(self) -> list[Path]:
        """The run directories of the models watched so far, in the order they were watched."""
        return [entry.run_dir for entry in self._entries if entry.run_dir is not None]

    def watch(self, model: M, **kwargs: Any) -> M:
        """Watch ``model`` for this test and return it.

        Args:
            model: an ``nn.Module`` instance.
            **kwargs: the keyword arguments of :func:`gradwatch.watch`; they override the marker's
                and the fixture's defaults (``rules="default"``, ``console=False``). ``run`` is
                chosen by the fixture unless given.

        Returns:
            The same model, now watched. A model the test already watched itself is not watched
            again: its own run is judged (and closed) with the others, and ``kwargs`` are ignored
            with a warning.

        Raises:
            TypeError: ``model`` is not a module.
            gradwatch.ConfigError: an invalid option, or a model without trainable parameters.
        """
        from gradwatch import registry

        if self._stopped:
            raise RuntimeError("the gradwatch fixture has already judged this test's runs; watch models in the test")
        if not isinstance(model, _nn_module()):
            raise TypeError(f"gradwatch.watch(model) expects a torch.nn.Module instance, got {type(model).__name__}")
        module = cast("nn.Module", model)
        with self._lock:
            existing = registry._find(module) or (registry.watcher(module) if module in registry._pending else None)
            if existing is not None:
                self._adopt(module, existing, kwargs)
            else:
                self._watch(module, **kwargs)
            self._decided.add(module)
        return model

    # ------------------------------------------------------------------ internals
    def _adopt(self, model: Any, watcher: Watcher, kwargs: dict[str, Any]) -> None:
        """Judge the run of a model handed to :meth:`watch` that the test had already watched itself."""
        if kwargs:
            from gradwatch.errors import GradwatchWarning

            warnings.warn(f"gradwatch: this model is already watched into {str(watcher.run_dir)!r}; the fixture "
                          f"judges that run and ignores {sorted(kwargs)}", GradwatchWarning, stacklevel=3)
        if any(entry.watcher is watcher for entry in self._entries):
            return
        self._entries.append(_Entry(len(self._entries), type(model).__name__, watcher.run_dir, watcher))

    def _watch(self, model: Any, *, run: str | Path | None = None, **kwargs: Any) -> Watcher:
        from gradwatch import registry

        index = len(self._entries)
        run_dir = Path(run) if run is not None else self._root / f"{self._prefix}-{index}"
        registry.watch(model, run=run_dir, **{**self._options, **kwargs})
        watcher = registry.watcher(model)
        self._entries.append(_Entry(index, type(model).__name__, watcher.run_dir, watcher))
        return watcher

    def _start(self) -> None:
        """Install the global forward hooks that find the models the test runs."""
        import torch
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._torch = torch
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, always_call=True),
        ]

    def _frames(self) -> list[bool]:
        """The running module forwards of this thread: whether each is, or is inside, a trainable module."""
        frames: list[bool] | None = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._torch.compiler.is_compiling():
            return
        frames = self._frames()
        if (frames and frames[-1]) or module in self._decided:
            frames.append(True)  # inside a trainable module, or a module already decided on
            return
        trainable = _has_trainable(module)
        frames.append(trainable)
        if trainable and self._torch.is_grad_enabled():  # a forward without gradients is not training
            self._auto(module, args)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._torch.compiler.is_compiling():
            return
        frames = self._frames()
        if frames:
            frames.pop()

    def _auto(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Watch an outermost trainable module at its first forward, unless something watches it already."""
        with self._lock:
            if self._stopped or module in self._decided:
                return
            self._decided.add(module)
            if _overlaps_watched(module):
                return
            try:
                watcher = self._watch(module)
            except Exception as exc:  # reported with the verdict: the test asked for its training to be judged
                self._entries.append(_Entry(len(self._entries), type(module).__name__, None, None,
                                            error=f"{type(exc).__name__}: {exc}"))
                return
        # this forward call is already past the model's own pre-hook: tell the watcher, as a decorated
        # class does at its first forward (gradwatch.registry._first_forward)
        watcher._forward_started(args, {})

    def _stop(self) -> None:
        """Remove the global hooks and close the runs (idempotent); the first error is raised at the end."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._stopped:
            return
        self._stopped = True
        first: BaseException | None = None
        for entry in self._entries:
            watcher = entry.watcher
            if watcher is None or watcher.closed:
                continue
            try:
                watcher.close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def _report(self) -> str | None:
        """The failure message for this test's runs, or None when nothing reaches ``fail_on``."""
        from gradwatch import gate
        from gradwatch.errors import RunError
        from gradwatch.store.reader import open_run

        blocks: list[str] = []
        count = problems = 0
        for entry in self._entries:
            head = f"model {entry.index} ({entry.label})"
            if entry.error is not None or entry.run_dir is None:
                problems += 1
                blocks.append(f"{head}: could not be watched: {entry.error}")
                continue
            try:
                frame = open_run(entry.run_dir).findings()
            except RunError as exc:
                problems += 1
                blocks.append(f"{head}, run {entry.run_dir}: could not be read: {exc}")
                continue
            bad = gate.failing(frame, self.fail_on)
            if bad.empty:
                continue
            count += len(bad)
            lines = [f"{head}, run {entry.run_dir}:"]
            lines += [f"  {item.line()}" for item in gate.items(bad.head(MAX_LINES))]
            if len(bad) > MAX_LINES:
                lines.append(f"  ... and {len(bad) - MAX_LINES} more")
            if len(frame) > len(bad):
                lines.append(f"  ({len(frame) - len(bad)} more below {self.fail_on!r} in this run)")
            blocks.append("\n".join(lines))
        if not blocks:
            return None
        parts = []
        if count:
            noun = "finding" if count == 1 else "findings"
            parts.append(f"{count} {noun} at or above {self.fail_on!r} in the training this test ran")
        if problems:
            parts.append(f"{problems} of the models it ran could not be judged")
        tail = "(threshold: @pytest.mark.gradwatch(fail_on=...) or --gradwatch-fail-on)"
        return "\n".join([f"gradwatch: {'; '.join(parts)}", *blocks, tail])


def _nn_module() -> type:
    from torch import nn

    return nn.Module


def _overlaps_watched(module: nn.Module) -> bool:
    """Whether ``module`` is watched, about to be (a decorated class), or shares modules with a watched model."""
    from gradwatch import registry

    if registry._find(module) is not None or module in registry._pending:
        return True
    inner = set(module.modules())
    for watcher in list(registry._live):
        if watcher.closed:
            continue
        try:
            model = watcher.model()
        except RuntimeError:  # its model was garbage-collected
            continue
        if model in inner or module in set(model.modules()):
            return True
    return False


# ---------------------------------------------------------------------- pytest hooks
_SETTINGS = pytest.StashKey[_Settings]()
_ACTIVE = pytest.StashKey[GradwatchFixture]()


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
    from gradwatch import registry
    from gradwatch.errors import ConfigError

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
    fixture = GradwatchFixture(fail_on, options, root, prefix)
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
