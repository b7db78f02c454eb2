"""Every script in examples/ runs as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gradwatch as gw

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run = gw.open_run(tmp_path / "runs" / "quickstart")
    assert run.steps == 200 and run.layers == ["0", "1", "2", "3", "4"]
    assert "layers: ['0', '1', '2', '3', '4']" in result.stdout
    loss = run.scalars()["loss"]
    assert loss.iloc[-20:].mean() < loss.iloc[:20].mean() / 5, "the example model learns"


def test_live_dashboard_serves_while_training(tmp_path: Path) -> None:
    import re

    import httpx

    process = subprocess.Popen([sys.executable, str(EXAMPLES / "live_dashboard.py"), "--steps", "150", "--pause",
                                "0.02"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    found = re.match(r"dashboard: (http://127\.0\.0\.1:\d+/)run\?run=live$", line.strip())
    assert found, line + (process.stderr.read() if process.stderr else "")
    progress = httpx.get(found.group(1) + "api/run/progress", params={"run": "live"}, timeout=10).json()
    assert progress["status"] == "running" and progress["steps"] < 150, "served while training"
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert "trained 150 steps" in out
    run = gw.open_run(tmp_path / "runs" / "live")
    assert run.steps == 150 and run.status == "finished"
    assert "vanishing" in set(run.findings()["kind"]), "the deep sigmoid stack's gradients fade towards the input"
