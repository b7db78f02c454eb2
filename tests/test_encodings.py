"""Run paths with non-ASCII characters and spaces under a C locale with Python's UTF-8 mode off (issue 34):
the filesystem encoding is ASCII there, and such a path reaches Python as lone surrogates. Training, ``gradwatch
report`` and the dashboard's API each run in a process of their own under ``LC_ALL=C LANG=C PYTHONUTF8=0``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NAMES = ["étude ünïcode 試験", "with spaces"]

TRAIN = """
import sys
import torch
from torch import nn
import gradwatch as gw

for path in sys.argv[1:]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    gw.watch(model, run=path, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    for _ in range(8):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        gw.watcher(model).observe(loss=loss.detach())
    gw.unwatch(model)
print(sys.getfilesystemencoding(), sys.flags.utf8_mode)
"""

SERVE = """
import json, sys
from pathlib import Path
from starlette.testclient import TestClient
from gradwatch.dashboards.server import create_app

client = TestClient(create_app(Path(sys.argv[1])), base_url="http://127.0.0.1", raise_server_exceptions=False)
runs = client.get("/api/runs")
out = {"runs": runs.status_code, "ids": [], "each": {}}
if runs.status_code == 200:
    for row in runs.json():
        out["ids"].append(row["id"])
        out["each"][row["id"]] = {what: client.get(f"/api/run/{what}", params={"run": row["id"]}).status_code
                                  for what in ("summary", "curves", "findings", "flow")}
        out["each"][row["id"]]["name"] = client.get("/api/run/summary", params={"run": row["id"]}).json().get("name")
print(json.dumps(out, ensure_ascii=True))
"""


def c_locale() -> dict[str, str]:
    """The environment of a process under the C locale with UTF-8 mode off."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "LC_CTYPE", "LANGUAGE")}
    env.update(LC_ALL="C", LANG="C", PYTHONUTF8="0")
    return env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=c_locale(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode("utf-8", "replace")
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs, written by a training process under the C locale, in ``<root>/runs/<name>``."""
    root = tmp_path_factory.mktemp("encodings")
    done = run(["-c", TRAIN, *[f"runs/{name}" for name in NAMES]], root)
    fs, utf8 = done.stdout.decode().split()
    assert utf8 == "0"  # UTF-8 mode really off (the filesystem encoding is ASCII on Linux: fs={fs})
    assert sorted(p.name for p in (root / "runs").iterdir()) == sorted(NAMES)
    return root


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("name", NAMES)
def test_the_report_writes_a_non_ascii_run_path(runs: Path, name: str) -> None:
    done = run(["-m", "gradwatch", "report", f"runs/{name}"], runs)
    assert done.stdout == f"runs/{name}/report.html\n".encode()  # the path's own bytes, not '?'
    page = (runs / "runs" / name / "report.html").read_bytes().decode("utf-8")  # valid UTF-8
    assert f" · runs/{name} · gradwatch report</title>" in page


@pytest.mark.slow  # subprocesses
def test_the_dashboard_serves_non_ascii_run_paths(runs: Path) -> None:
    served = json.loads(run(["-c", SERVE, "runs"], runs).stdout)
    assert served["runs"] == 200
    assert sorted(served["ids"]) == sorted(NAMES)
    for name in NAMES:
        each = served["each"][name]
        assert each.pop("name") == name
        assert each == {"summary": 200, "curves": 200, "findings": 200, "flow": 200}
