"""A folder named ``gradwatch`` where Python runs (an output folder, say) hides an editable install of
gradwatch: ``import gradwatch`` imports the folder, an empty namespace package. Nothing of gradwatch's
runs in a script that then fails on ``gw.open_run``, but ``python -m gradwatch`` says what happened in
one line, and the ``gradwatch`` command (which the folder does not hide) names the folder.

Each case runs in a subprocess in a temporary folder, as a user would, with gradwatch as installed
(no PYTHONPATH to this checkout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import gradwatch
from gradwatch.cli.shadowed import hiding_folder

pytestmark = pytest.mark.slow  # subprocesses

SCRIPT = Path(sysconfig.get_path("scripts")) / "gradwatch"  # the installed command


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_gradwatch_folder_that_hides_the_package_is_named(tmp_path: Path) -> None:
    tmp_path = tmp_path.resolve()  # as the current directory reads
    folder = tmp_path / "gradwatch"
    (folder / "exp1").mkdir(parents=True)  # the user's own output folder
    imported = run([sys.executable, "-c", "import gradwatch; print(getattr(gradwatch, '__file__', None))"], tmp_path)
    if imported.stdout.strip() != "None":
        pytest.skip(f"gradwatch is not an editable install here ({imported.stdout.strip()}): a folder cannot hide it")

    module = run([sys.executable, "-m", "gradwatch", "ls"], tmp_path)
    assert module.returncode == 2 and module.stdout == "", module.stdout + module.stderr
    assert module.stderr.count("\n") == 1 and "Traceback" not in module.stderr, module.stderr
    assert module.stderr.startswith(f"gradwatch: error: the folder '{folder}' was imported as the gradwatch package, "
                                    f"in place of gradwatch installed at '{Path(gradwatch.__file__).parent}'")
    assert "rename that folder" in module.stderr

    if not SCRIPT.is_file():
        pytest.skip(f"no gradwatch command at {SCRIPT}")
    command = run([str(SCRIPT), "--version"], tmp_path)
    assert command.returncode == 0 and command.stdout.startswith("gradwatch, version"), command.stderr
    assert command.stderr == (f"gradwatch: warning: the folder '{folder}' hides the gradwatch package from Python "
                              "run in this directory: `import gradwatch` there imports that folder instead "
                              "(AttributeError: module 'gradwatch' has no attribute ...); rename it, e.g. to runs/\n")

    folder.rename(tmp_path / "runs")  # renamed: nothing hides gradwatch any more
    assert run([str(SCRIPT), "--version"], tmp_path).stderr == ""
    assert run([sys.executable, "-m", "gradwatch", "ls"], tmp_path).returncode == 0


def test_only_a_folder_other_than_gradwatch_itself_is_named(tmp_path: Path) -> None:
    tmp_path = tmp_path.resolve()
    assert hiding_folder(Path(gradwatch.__file__).resolve().parents[1]) is None  # the package's own folder
    assert hiding_folder(tmp_path) is None  # no such folder
    (tmp_path / "gradwatch").mkdir()
    (tmp_path / "gradwatch" / "__init__.py").write_text("")  # a package of the user's own: it hides any install
    assert hiding_folder(tmp_path) == tmp_path / "gradwatch"
