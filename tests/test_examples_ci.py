"""examples/ci: the smoke test passes under the gradwatch pytest plugin and keeps readable runs; a
broken training fails it; the GitHub Actions workflow's commands do what it says, as written.

The example runs as a separate pytest session (``python -m pytest`` in a subprocess, from a copy
of the example's directory, so that its own ``pyproject.toml`` is the ini file and nothing is
written into the checkout), which loads the plugin through the installed ``pytest11`` entry point
as a user's session would; ``PYTHONPATH`` points at this checkout so that it is this checkout's
gradwatch that runs. The example's sessions (healthy, broken) and the workflow's install from a git URL
are started as the module begins, two at a time beside the test process; the tests check what they
printed and wrote.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import gradwatch as gw

from . import pool
from .venvs import fresh_venv

pytestmark = pytest.mark.slow  # the example project's own pytest session runs in a subprocess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ci"
WORKFLOW = EXAMPLE / ".github" / "workflows" / "gradwatch.yml"
TESTS = ("test_smoke_training_learns", "test_smoke_training_has_healthy_gradients")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["COLUMNS"] = "300"
    return env


def _shell(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a workflow command with bash, ``python`` and ``gradwatch`` being this interpreter's."""
    command = re.sub(r"^python ", f"{sys.executable} ", command)
    command = re.sub(r"^gradwatch ", f"{sys.executable} -m gradwatch ", command)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _workflow_commands() -> list[str]:
    """The one-line ``run:`` commands of the workflow, in order."""
    return re.findall(r"^\s+run: (?!\|)(.+)$", WORKFLOW.read_text(), re.MULTILINE)


def _project(where: Path) -> Path:
    """A copy of the example, as a team has it: at the root of its repository."""
    project = where / "project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", "runs"))
    return project


def _healthy(where: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The example's smoke tests, run once from the example's directory with their runs kept."""
    runs = where / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "--gradwatch-runs", str(runs)],
        cwd=_project(where), env=_env(), capture_output=True, text=True, timeout=300,
    )
    return result, runs


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Future[Any]]]:
    """What the tests this session runs read, started as the module begins, two at a time beside the test
    process: by test, its outcome to come."""
    names = pool.tested(request)
    with ThreadPoolExecutor(2) as runner:
        futures: dict[str, Future[Any]] = {}
        for name, function in STARTED.items():
            if name in names or (function is _healthy and names & HEALTHY):
                futures[name] = runner.submit(function, tmp_path_factory.mktemp(name.removeprefix("test_")[:40]))
        yield futures
        for future in futures.values():
            future.cancel()  # a session stopped early (-x) runs nothing it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _started_as_the_module_begins(started: dict[str, Future[Any]]) -> None:
    """Start them with the module's first test."""


@pytest.fixture(scope="module")
def healthy(started: dict[str, Future[Any]]) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The example's smoke tests, run once from the example's directory with their runs kept."""
    result: tuple[subprocess.CompletedProcess[str], Path] = started["healthy"].result()
    return result


#: the tests that read the healthy session
HEALTHY = {"test_smoke_example_passes_and_keeps_readable_runs", "test_workflow_gate_passes_on_the_healthy_runs"}


def test_smoke_example_passes_and_keeps_readable_runs(healthy: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, runs = healthy
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout and "2 runs kept in" in result.stdout
    assert sorted(p.name for p in runs.iterdir()) == sorted(f"tests_test_smoke_training.py__{t}-0" for t in TESTS)
    for name in TESTS:
        run = gw.open_run(runs / f"tests_test_smoke_training.py__{name}-0")
        assert (run.steps, run.status) == (50, "finished")
        assert run.layers == ["fc1", "act", "fc2"]
        assert run.findings().empty


def test_workflow_gate_passes_on_the_healthy_runs(healthy: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, runs = healthy
    assert result.returncode == 0, result.stdout + result.stderr
    (gate,) = [c for c in _workflow_commands() if c.startswith("gradwatch check")]
    checked = _shell(gate, cwd=runs.parent)  # the workflow's `runs/*`, relative to where the tests ran
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "::error" not in checked.stdout and "::warning" not in checked.stdout


def _broken(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The example with a learning rate that blows the gradients up at step 3: its project, the workflow's tests
    run in it, and its gate run after them."""
    project = _project(tmp_path)
    source = project / "smoke_train.py"
    text = source.read_text()
    assert text.count("lr: float = 0.05") == 1
    source.write_text(text.replace("lr: float = 0.05", "lr: float = 1.0"))  # the gradients blow up at step 3

    commands = _workflow_commands()
    (tests,) = [c for c in commands if "-m pytest" in c]
    (gate,) = [c for c in commands if c.startswith("gradwatch check")]
    return project, _shell(tests, cwd=project), _shell(gate, cwd=project)


def test_broken_training_fails_the_smoke_test_and_the_gate(started: dict[str, Future[Any]]) -> None:
    project, result, checked = started["test_broken_training_fails_the_smoke_test_and_the_gate"].result()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 failed" in result.stdout  # each on its own: the loss assertion, and the halt after 20 skipped NaN steps
    assert "gradwatch halted training" in result.stdout, result.stdout
    assert len(list((project / "runs").iterdir())) == 2

    assert checked.returncode == 1, checked.stdout + checked.stderr
    # the README's story: the learning rate named at step 0, then the gradients explode and turn NaN
    assert re.search(r"^::warning title=gradwatch learning_rate at fc2%2C step 0 of runs/.+::", checked.stdout,
                     re.MULTILINE), checked.stdout
    assert re.search(r"^::error title=gradwatch (exploding|nonfinite) at .+ of runs/.+::", checked.stdout,
                     re.MULTILINE), checked.stdout
    # what the README quotes is what the example prints
    prose = " ".join(README.read_text().split())
    (halted,) = re.findall(r'\("(gradwatch halted training at step \d+: [^"]+)"\)', prose)
    assert halted in result.stdout, halted
    _assert_quoted(_readme_annotations(), checked.stdout)


README = EXAMPLE / "README.md"


def _readme_annotations() -> list[str]:
    """The gate's annotations the README quotes (``runs/...``: a run; a line ending `` ...``: cut short)."""
    (block,) = re.findall(r"The gate\s+fails too.*?\n```\n(.*?)```", README.read_text(), re.S)
    return block.splitlines()


def _assert_quoted(quoted: list[str], output: str) -> None:
    """Each quoted line is a line of ``output``, in the same order (``...`` alone: lines left out)."""
    lines = output.splitlines()
    at = 0
    for line in (q for q in quoted if q != "..."):
        cut = line.endswith(" ...")
        pattern = re.escape(line[:-4] if cut else line).replace(re.escape("runs/..."), r"runs/[\w.\-]+")
        found = next((i for i in range(at, len(lines)) if re.fullmatch(pattern + (".*" if cut else ""), lines[i])),
                     None)
        assert found is not None, f"examples/ci/README.md quotes a line the gate does not print:\n{line}\n{output}"
        at = found + 1
    assert len([q for q in quoted if q != "..."]) >= 3


def test_workflow_installs_tests_gates_and_uploads() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: the workflow's YAML cannot be parsed")
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as true
    assert {"push", "pull_request"} <= set(triggers)
    (job,) = workflow["jobs"].values()
    steps = job["steps"]
    runs = [step.get("run", "") for step in steps]
    uses = [step.get("uses", "") for step in steps]
    torch = runs.index("python -m pip install torch --index-url https://download.pytorch.org/whl/cpu")
    package = runs.index('python -m pip install "$GRADWATCH" pytest')  # not on PyPI: no `pip install gradwatch`
    assert not any(re.search(r"pip install[^\n]*\bgradwatch\b(?!\S)", r) for r in runs), runs
    assert workflow["env"]["GRADWATCH"].startswith("gradwatch @ git+https://")
    tests = runs.index("python -m pytest --gradwatch-runs runs/")
    gate = runs.index("gradwatch check runs/* --fail-on error --format github")
    (upload,) = [i for i, u in enumerate(uses) if u.startswith("actions/upload-artifact@")]
    # the CPU build of PyTorch comes before the command it protects (which would pull CUDA torch otherwise)
    assert uses.index("actions/checkout@v4") < torch < package < tests < gate < upload
    assert steps[upload]["with"]["path"] == "runs/"
    assert "!cancelled()" in steps[gate]["if"] and "!cancelled()" in steps[upload]["if"]  # also after a failure
    assert _workflow_commands() == [runs[torch], runs[package], runs[tests], runs[gate]]  # what the tests ran


def test_workflow_installs_gradwatch_from_a_git_url_and_its_steps_pass(started: dict[str, Future[Any]]) -> None:
    """The workflow's own install command, with GRADWATCH a git URL of this repository, in a fresh venv.

    The venv sees the packages the tests run with (torch, pytest, setuptools, wheel; see
    tests/venvs.py) and pip is told by its environment, not by the command, to use no index and to
    build without isolation: nothing is downloaded.
    """
    started["test_workflow_installs_gradwatch_from_a_git_url_and_its_steps_pass"].result()  # fails as it failed


def _installed_from_a_git_url(tmp_path: Path) -> None:
    """The test above, started as the module begins: each step asserted as it goes."""
    clone = tmp_path / "gradwatch-clone"
    # a full clone: pip's own clone of a shallow one loops ("shallow roots are not allowed to be updated")
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, capture_output=True, timeout=300)
    venv = tmp_path / "venv"
    python = fresh_venv(venv)
    env = {**_env(), "GRADWATCH": f"gradwatch @ git+file://localhost{clone}", "PIP_NO_INDEX": "1",
           "PIP_NO_BUILD_ISOLATION": "0", "PIP_NO_DEPS": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "VIRTUAL_ENV": str(venv),
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH")  # the venv's gradwatch, not this checkout's
    (install,) = [c for c in _workflow_commands() if '"$GRADWATCH"' in c]
    installed = subprocess.run(["bash", "-c", install.replace("python ", f"{python} ", 1)], env=env,
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = subprocess.run([str(python), "-c", "import gradwatch; print(gradwatch.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where  # installed from the git URL into the venv
    project = _project(tmp_path)
    steps = [c for c in _workflow_commands() if "pytest --gradwatch-runs" in c or c.startswith("gradwatch check")]
    for command in steps:
        command = re.sub(r"^python ", f"{python} ", command)
        command = re.sub(r"^gradwatch ", f"{venv / 'bin' / 'gradwatch'} ", command)
        result = subprocess.run(["bash", "-c", command], cwd=project, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, command + "\n" + result.stdout + result.stderr


#: what the tests read, by test (``healthy``: the tests of HEALTHY): the function run for them as the module
#: begins, given a folder of its own
STARTED: dict[str, Callable[[Path], Any]] = {
    "healthy": _healthy,
    "test_broken_training_fails_the_smoke_test_and_the_gate": _broken,
    "test_workflow_installs_gradwatch_from_a_git_url_and_its_steps_pass": _installed_from_a_git_url,
}
