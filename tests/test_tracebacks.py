"""gradwatch's exceptions reach the user with at most two frames of gradwatch in their traceback (the
entry point the user's code or torch called, and the frame that raised), their message unchanged."""

from __future__ import annotations

import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw

HOME = str(Path(gw.__file__).resolve().parent)

#: a loop whose step 3 sees a NaN in its batch, with a rule that halts on it; nothing catches the halt
HALTED = """
import sys, torch, gradwatch as gw
from torch import nn
torch.manual_seed(0)
model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), run=sys.argv[1], overwrite=True,
                 rules=[gw.Rule(when="nonfinite", do="halt")], console=False)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    x = torch.randn(8, 4)
    if step == 3:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

WATCHED = """
import sys, gradwatch as gw
from torch import nn
gw.watch(nn.Linear(2, 2), run=sys.argv[1], overwrite=True, rules=sys.argv[2])
"""


def _run(tmp_path: Path, script: str, *args: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    return proc.stderr


def _gradwatch_frames(stderr: str) -> list[str]:
    files = re.findall(r'^  File "([^"]+)", line \d+, in \S+$', stderr, flags=re.M)
    assert files and files[0].endswith("train.py"), stderr
    return [f for f in files if str(Path(f).resolve()).startswith(HOME + "/")]


@pytest.mark.slow
def test_an_uncaught_halt_shows_two_frames_of_gradwatch(tmp_path: Path) -> None:
    run = tmp_path / "run"
    stderr = _run(tmp_path, HALTED, str(run))
    assert len(_gradwatch_frames(stderr)) <= 2, stderr
    assert "torch/optim/optimizer.py" in stderr, "the torch call that ran gradwatch's hook stays"
    with gw.open_run(run) as r:
        message = str(r.findings()["message"].iloc[0])
    last = stderr.rstrip("\n").splitlines()[-1]
    assert last == f"gradwatch.errors.TrainingHalted: gradwatch halted training at step 3: {message} (run: {run})"
    assert "During handling" not in stderr and "direct cause" not in stderr


@pytest.mark.parametrize(("rules", "message"), [
    ('[[rules]]\nwhen = "nonfinit"\ndo = "halt"\n', "rules[0]: field 'when': unknown finding kind 'nonfinit'"),
    ('[[rules]]\nwhen = "nonfinite"\ndo = "halt\n', "invalid TOML: Illegal character"),
])
def test_a_bad_rules_file_shows_two_frames_of_gradwatch(tmp_path: Path, rules: str, message: str) -> None:
    file = tmp_path / "rules.toml"
    file.write_text(rules)
    stderr = _run(tmp_path, WATCHED, str(tmp_path / "run"), str(file))
    assert len(_gradwatch_frames(stderr)) <= 2, stderr
    last = stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"gradwatch.errors.ConfigError: {file}: ") and message in last, last
    assert len(stderr.splitlines()) <= 10, stderr


def test_a_caught_halt_carries_two_frames_of_gradwatch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = gw.watch(nn.Linear(4, 1), run=tmp_path / "run", rules=[gw.Rule(when="nonfinite", do="halt")],
                     console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gw.TrainingHalted) as info:
        for step in range(6):
            x = torch.randn(8, 4)
            x[0, 0] = float("nan") if step == 2 else x[0, 0]
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    frames = traceback.extract_tb(info.value.__traceback__)
    ours = [f for f in frames if str(Path(f.filename).resolve()).startswith(HOME + "/")]
    assert len(ours) == 2 and ours[-1].name == "halt", [f"{f.filename}:{f.name}" for f in frames]
    assert str(info.value).startswith("gradwatch halted training at step 2: ")


def test_an_unknown_option_shows_two_frames_of_gradwatch(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match="unknown option 'bogus' for gw.watch") as info:
        gw.watch(nn.Linear(2, 2), run=tmp_path / "run", bogus=1)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert len([f for f in frames if str(Path(f.filename).resolve()).startswith(HOME + "/")]) <= 2
