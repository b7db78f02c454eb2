"""``gradwatch check`` (the CI gate) and ``gradwatch ls``, run as users run them."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
import torch
from click.testing import CliRunner
from junitparser import Error, Failure, JUnitXml
from torch import nn

import gradwatch as gw
from gradwatch.cli import check as _registers_check  # noqa: F401
from gradwatch.cli import cli
from gradwatch.store.findings import KINDS
from gradwatch.store.schema import DB_NAME, SCHEMA_VERSION


def gradwatch(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Result:
    """Run the command in this process (fast); :func:`installed` runs the console script."""
    runner = CliRunner()
    here = Path.cwd()
    try:
        os.chdir(cwd or here)
        res = runner.invoke(cli, list(args), env={"COLUMNS": "200", **(env or {})}, prog_name="gradwatch")
    finally:
        os.chdir(here)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return Result(res.exit_code, res.stdout, res.stderr)


def installed(*args: str) -> Result:
    """Run the installed ``gradwatch`` console script, as CI does."""
    done = subprocess.run(["gradwatch", *args], capture_output=True, text=True, timeout=300,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "COLUMNS": "200"})
    return Result(done.returncode, done.stdout, done.stderr)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def regression(path: Path, *, steps: int = 60, corrupt: int | None = None, poison: int | None = None,
               rules: object = "default") -> Path:
    """Train a small regression; ``corrupt`` scales one batch's targets x100 (exploding +
    loss_spike, warnings), ``poison`` puts a NaN in one batch's inputs (nonfinite, an error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1)
    watched = gw.watch(model, run=path, rules=rules, console=False, detectors={"exploding": {"warmup": 10}})
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for step in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step))
        xb, yb = x[idx].clone(), y[idx].clone()
        if step == corrupt:
            yb = yb * 100
        if step == poison:
            xb[0, 0] = float("nan")
        opt.zero_grad()
        loss = nn.functional.mse_loss(watched(xb), yb)
        loss.backward()
        gw.watcher(watched).observe(loss=loss)
        opt.step()
    gw.unwatch(watched)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "healthy": regression(root / "healthy"),
        "warnings": regression(root / "warnings", corrupt=40),
        "nan": regression(root / "nan", poison=30),
    }


def test_exit_codes_follow_the_threshold(runs: dict[str, Path]) -> None:
    assert gradwatch("check", str(runs["healthy"])).returncode == 0
    assert gradwatch("check", str(runs["healthy"]), "--fail-on", "warning").returncode == 0
    assert gradwatch("check", str(runs["warnings"])).returncode == 0, "warnings pass the default (error) gate"
    assert gradwatch("check", str(runs["warnings"]), "--fail-on", "warning").returncode == 1
    nan = installed("check", str(runs["nan"]))
    assert nan.returncode == 1 and "nonfinite" in nan.stdout
    assert gradwatch("check", str(runs["healthy"]), str(runs["nan"])).returncode == 1, "any failing run fails"


def test_text_names_layer_step_and_fix_without_colour(runs: dict[str, Path]) -> None:
    result = gradwatch("check", str(runs["nan"]))
    out = result.stdout
    assert "\x1b[" not in out, "no ANSI colour codes in a CI log"
    assert "nonfinite" in out and "30" in out and "skip" in out
    assert "try: look at the samples named" in out, "the likely fix is printed (the NaN is in the batch)"
    assert f"FAIL: 1 finding at or above error in {runs['nan']}" in out
    warn = gradwatch("check", str(runs["warnings"]), "--fail-on", "warning").stdout
    assert "exploding" in warn and "loss_spike" in warn and "40" in warn
    healthy = gradwatch("check", str(runs["healthy"]), env={"NO_COLOR": "1"}).stdout
    assert "no findings of warning or error severity" in healthy and "PASS" in healthy


def test_json_has_the_product_shape(runs: dict[str, Path]) -> None:
    one = json.loads(gradwatch("check", str(runs["nan"]), "--format", "json").stdout)
    assert one["run"] == str(runs["nan"]) and one["verdict"] == "fail" and one["steps"] == 60
    (finding,) = one["findings"]
    assert {"kind", "severity", "step", "layer", "phase", "message", "action"} <= finding.keys()
    assert (finding["kind"], finding["severity"], finding["step"], finding["action"]) == ("nonfinite", "error", 30,
                                                                                            "skip")
    assert finding["phase"] == "forward"
    several = json.loads(gradwatch("check", str(runs["healthy"]), str(runs["warnings"]), "--format", "json").stdout)
    assert [r["verdict"] for r in several] == ["pass", "pass"]
    assert {f["kind"] for f in several[1]["findings"]} == {"exploding", "loss_spike"}
    strict = json.loads(gradwatch("check", str(runs["warnings"]), "--format", "json", "--fail-on", "warning").stdout)
    assert strict["verdict"] == "fail"


def test_junit_is_read_by_a_junit_parser(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "gradwatch.xml"
    result = gradwatch("check", str(runs["healthy"]), str(runs["nan"]), str(tmp_path / "missing"),
                       "--format", "junit", "--output", str(out))
    assert result.returncode == 2, "an unreadable run is a usage error even in a report"
    assert result.stdout == "" and [p.name for p in tmp_path.iterdir()] == ["gradwatch.xml"], "no temp file left"
    xml = JUnitXml.fromfile(str(out))
    suites = {s.name: s for s in xml}
    healthy, nan, missing = (suites[str(p)] for p in (runs["healthy"], runs["nan"], tmp_path / "missing"))
    assert healthy.tests == len(KINDS) + 2 and healthy.failures == 0 and healthy.errors == 0
    assert nan.failures == 1
    failed = {case.name: case for case in nan if case.result}
    assert list(failed) == ["nonfinite"]
    (failure,) = failed["nonfinite"].result
    assert isinstance(failure, Failure) and "step 30" in failure.message
    assert missing.errors == 1 and isinstance(next(iter(missing)).result[0], Error)
    # the attributes the JUnit schema requires, checked with the standard library's parser
    root = ET.parse(out).getroot()
    assert root.tag == "testsuites" and int(root.get("tests", "0")) == 2 * (len(KINDS) + 2) + 1
    for suite in root.iter("testsuite"):
        assert {"name", "tests", "failures", "errors"} <= set(suite.keys())
        for case in suite.iter("testcase"):
            assert {"name", "classname"} <= set(case.keys())


def test_github_annotations(runs: dict[str, Path]) -> None:
    result = gradwatch("check", str(runs["nan"]), str(runs["warnings"]), "--format", "github")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    errors = [line for line in lines if line.startswith("::error ")]
    warnings = [line for line in lines if line.startswith("::warning ")]
    assert len(errors) == 1 and len(warnings) == 2
    head, body = errors[0].split("::", 2)[1:]
    assert head.startswith("error title=gradwatch nonfinite at "), "no file=: the run store is no source file"
    assert "file=" not in result.stdout and DB_NAME not in result.stdout
    assert "%2C step 30" in head, "commas in properties are escaped"
    assert "\n" not in body and "%0ATry: look at the samples named" in body, "newlines in the message are escaped"


@pytest.mark.slow  # the installed command in subprocesses
def test_unreadable_runs_exit_2_with_one_line(tmp_path: Path, runs: dict[str, Path]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / DB_NAME).write_bytes(b"not a database" * 100)
    newer = tmp_path / "newer"
    regression(newer, steps=2)
    conn = sqlite3.connect(newer / DB_NAME)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    for target, reason in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "not a gradwatch run"),
                           (tmp_path / "corrupt", "corrupted"), (newer, "upgrade gradwatch")):
        result = installed("check", str(target))
        assert result.returncode == 2, target
        assert result.stderr.count("\n") == 1 and reason in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stdout == "", "said once, on stderr"
    mixed = gradwatch("check", str(runs["healthy"]), str(tmp_path / "missing"))
    assert mixed.returncode == 2
    assert "PASS" in mixed.stdout and "missing" not in mixed.stdout, mixed.stdout  # the readable run is reported
    assert mixed.stderr.count("\n") == 1 and "does not exist" in mixed.stderr, mixed.stderr
    both = gradwatch("check", str(runs["healthy"]), str(tmp_path / "missing"), "--format", "json")
    assert both.returncode == 2
    assert [r["verdict"] for r in json.loads(both.stdout)] == ["pass", "error"], "readable runs are still reported"
    usage = gradwatch("check", str(runs["healthy"]), "--fail-on", "fatal")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert gradwatch("check").returncode == 2


def test_rules_rejudge_a_recorded_run_without_retraining(runs: dict[str, Path], tmp_path: Path) -> None:
    quiet = tmp_path / "quiet.toml"
    quiet.write_text("[detectors.exploding]\nenabled = false\n\n[detectors.loss_spike]\nz = 1.0e6\n")
    result = gradwatch("check", str(runs["warnings"]), "--fail-on", "warning", "--rules", str(quiet),
                       "--format", "json")
    assert result.returncode == 0 and json.loads(result.stdout)["findings"] == []
    strict = tmp_path / "strict.toml"
    strict.write_text('[detectors.loss_spike]\nz = 6.0\n\n[[rules]]\nwhen = "loss_spike"\ndo = "halt"\n'
                      '[[rules]]\nwhen = "exploding"\ndo = "warn"\nseverity = "error"\n')
    again = json.loads(gradwatch("check", str(runs["warnings"]), "--rules", str(strict), "--format", "json").stdout)
    found = {(f["kind"], f["step"], f["action"]) for f in again["findings"]}
    assert ("loss_spike", 40, "halt") in found, "the new rules label what they would have done"
    assert again["steps"] == 60 and gw.open_run(runs["warnings"]).findings().shape[0] == 2, "the store is untouched"


def test_bad_rules_file_is_a_usage_error(runs: dict[str, Path], tmp_path: Path) -> None:
    cases = {
        "unknown.toml": ("[detectors.explodng]\nz = 3.0\n", "unknown detector 'explodng'"),
        "setting.toml": ("[detectors.exploding]\nzz = 3.0\n", "zz"),
        "broken.toml": ("[detectors\n", "invalid TOML"),
        "rule.toml": ('[[rules]]\nwhen = "exploding"\ndo = "explode"\n', "explode"),
    }
    for name, (text, reason) in cases.items():
        (tmp_path / name).write_text(text)
        result = gradwatch("check", str(runs["healthy"]), "--rules", str(tmp_path / name))
        assert result.returncode == 2 and reason in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr and result.stdout == ""
    missing = gradwatch("check", str(runs["healthy"]), "--rules", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_ls_lists_runs_with_steps_status_and_verdict(runs: dict[str, Path], tmp_path: Path) -> None:
    root = runs["healthy"].parent
    halted = root.parent / "halted-root"
    try:
        regression(halted / "stopped", poison=5, rules=[gw.Rule(when="nonfinite", do="halt")])
    except gw.TrainingHalted:
        pass
    text = gradwatch("ls", str(root))
    assert text.returncode == 0
    for name in ("healthy", "warnings", "nan"):
        assert name in text.stdout
    rows = {r["run"]: r for r in json.loads(gradwatch("ls", str(root), "--format", "json").stdout)}
    assert rows["healthy"]["steps"] == 60 and rows["healthy"]["status"] == "finished"
    assert rows["healthy"]["worst"] is None
    assert rows["warnings"]["worst"] == "warning" and rows["nan"]["worst"] == "error"
    assert rows["nan"]["findings"] == {"info": 0, "warning": 0, "error": 1}
    (stopped,) = json.loads(gradwatch("ls", str(halted), "--format", "json").stdout)
    assert stopped["status"] == "halted" and stopped["steps"] == 6
    broken = tmp_path / "broken" / "r"
    broken.mkdir(parents=True)
    (broken / DB_NAME).write_bytes(b"garbage" * 100)
    listed = gradwatch("ls", str(tmp_path / "broken"))
    assert listed.returncode == 0 and "unreadable" in listed.stdout
    empty = tmp_path / "nothing"
    empty.mkdir()
    assert "no runs under" in gradwatch("ls", str(empty)).stdout
    missing = gradwatch("ls", str(tmp_path / "absent"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_ls_defaults_to_runs_in_the_working_directory(runs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "runs").symlink_to(runs["healthy"].parent, target_is_directory=True)
    result = gradwatch("ls", cwd=tmp_path)
    assert result.returncode == 0 and "healthy" in result.stdout
    assert os.path.isdir(tmp_path / "runs")


def test_a_run_halted_by_skips_says_where_and_why_in_check_and_the_report(tmp_path: Path) -> None:
    """No rule's finding halts it (the skips ran out): the verdict's reason is what people read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    rules = [gw.Rule(when="nonfinite", do="skip", max_consecutive=2)]
    watched = gw.watch(model, run=tmp_path / "run", rules=rules, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(gw.TrainingHalted):
        for step in range(20):
            x = torch.randn(8, 4)
            if step >= 5:
                x[0, 0] = float("nan")
            opt.zero_grad()
            nn.functional.mse_loss(watched(x), torch.zeros(8, 1)).backward()
            opt.step()
    gw.unwatch(watched)
    out = gradwatch("check", str(tmp_path / "run"))
    assert out.returncode == 1
    assert f"{tmp_path / 'run'}: 8 steps, halted at step 7: 2 steps in a row had to be skipped" in out.stdout
    report = tmp_path / "report.html"
    assert gradwatch("report", str(tmp_path / "run"), "-o", str(report)).returncode == 0
    assert "Training was halted at step 7: 2 steps in a row had to be skipped." in report.read_text()
