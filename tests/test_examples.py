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
