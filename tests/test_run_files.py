"""Commands never destroy a run (issue 27, item 6), and ``ls`` lists every run under a folder (item 8)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import gradwatch as gw
from gradwatch.errors import GradwatchError
from gradwatch.report import write as write_report
from gradwatch.store.schema import DB_NAME
from tests.test_check import gradwatch, regression


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return regression(tmp_path_factory.mktemp("files") / "exp1", steps=20)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _targets(run: Path) -> list[str]:
    events = next(p.name for p in run.iterdir() if p.name.startswith("events.out.tfevents."))
    return [DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", f"{DB_NAME}-journal", "verdict.json", "gradwatch.lock",
            events, "skip_samples.txt", "snapshot-000000010.pt"]


@pytest.mark.parametrize("command", ["report", "check"])
def test_an_output_onto_a_runs_own_file_is_refused(run: Path, tmp_path: Path, command: str) -> None:
    before = _digest(run)
    link = tmp_path / "innocent.html"
    link.symlink_to(run / DB_NAME)
    relative = os.path.relpath(run / "verdict.json", tmp_path)
    for target in [*(str(run / name) for name in _targets(run)), str(link), relative,
                   str(run / ".." / run.name / DB_NAME)]:
        res = gradwatch(command, str(run), "--output", target, cwd=tmp_path)
        assert res.returncode == 2, (target, res)
        assert res.stdout == "" and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith("gradwatch: error: refusing to write the "), res.stderr
        assert "choose another output file" in res.stderr
    assert _digest(run) == before, "nothing of the run was touched"
    with gw.open_run(run) as opened:
        assert opened.steps == 20 and opened.status == "finished"


def test_a_store_read_under_another_name_is_refused_too(run: Path, tmp_path: Path) -> None:
    store = tmp_path / "copy.sqlite"
    store.write_bytes((run / DB_NAME).read_bytes())
    for command in ("report", "check"):
        res = gradwatch(command, str(store), "-o", str(store))
        assert res.returncode == 2 and "it is the run store of the run at" in res.stderr, res
    with gw.open_run(store) as opened:
        assert opened.steps == 20
    with pytest.raises(GradwatchError, match="refusing to write the report"):
        write_report(run, run / DB_NAME)


def test_other_files_in_a_run_directory_are_written(run: Path, tmp_path: Path) -> None:
    assert gradwatch("report", str(run)).returncode == 0  # the default: <run>/report.html
    assert (run / "report.html").is_file()
    res = gradwatch("check", str(run), "--format", "json", "-o", str(run / "check.json"))
    assert res.returncode == 0 and json.loads((run / "check.json").read_text())["verdict"] == "pass"
    (run / "check.json").unlink()
    (run / "report.html").unlink()


def test_ls_lists_a_run_at_the_root_and_the_runs_nested_inside_it(tmp_path: Path) -> None:
    outer = regression(tmp_path / "sweep", steps=5)
    inner = [regression(outer / "trial-1", steps=6), regression(outer / "trial-2" / "seed-0", steps=7)]
    rows = json.loads(gradwatch("ls", str(outer), "--format", "json").stdout)
    assert [(row["path"], row["steps"]) for row in rows] == [(str(outer), 5), (str(inner[0]), 6),
                                                             (str(inner[1]), 7)]
    assert [row["run"] for row in rows] == [str(outer), "trial-1", str(Path("trial-2") / "seed-0")]
    text = gradwatch("ls", str(outer)).stdout
    assert "trial-1" in text and "seed-0" in text
    from_parent = json.loads(gradwatch("ls", str(tmp_path), "--format", "json").stdout)
    assert [row["run"] for row in from_parent] == ["sweep", str(Path("sweep") / "trial-1"),
                                                   str(Path("sweep") / "trial-2" / "seed-0")]
