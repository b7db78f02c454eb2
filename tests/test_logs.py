"""Printed into a file or a pipe (a CI log), a finding is one line holding its whole message, with no
trailing spaces; on a terminal the layout wraps at the terminal's width as before."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

import gradwatch as gw

pytestmark = pytest.mark.slow  # each trains in a subprocess

#: a watched loop whose step 10 sees a NaN in its batch (the default rules skip it): a long finding
LOOP = """
import sys, torch, gradwatch as gw
from torch import nn
torch.manual_seed(0)
model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), run=sys.argv[1], overwrite=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with gw.watcher(model) as w:
    for step in range(16):
        x = torch.randn(8, 4)
        if step == 10:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); w.observe(loss=loss); opt.step()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    return {**env, "COLUMNS": "80"}  # the width a log file was wrapped at


def _messages(run: Path) -> list[str]:
    with gw.open_run(run) as r:
        messages = [str(m) for m in r.findings()["message"]]
    assert messages and any(len(m) > 160 for m in messages), "the run has a finding longer than two lines of 80"
    return messages


def _assert_one_line_each(text: str, messages: list[str]) -> None:
    lines = text.splitlines()
    assert not [line for line in lines if line != line.rstrip()], "no line ends with a space"
    finding_lines = [line for line in lines if line.startswith("gradwatch ") and " step " in line]
    for message in messages:
        holding = [line for line in finding_lines if message in line]
        assert holding, f"no line holds the whole message {message!r}:\n{text}"
        assert holding[0].startswith("gradwatch error") or holding[0].startswith("gradwatch warning")


def test_a_watched_loop_prints_each_finding_on_one_line_into_a_file(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    log = tmp_path / "train.log"
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], stdout=out,
                              stderr=subprocess.STDOUT, env=_env(), timeout=120)
    assert proc.returncode == 0, log.read_text()
    text = log.read_text()
    _assert_one_line_each(text, _messages(tmp_path / "run"))
    assert sum(line.startswith("gradwatch error step 10 nonfinite") for line in text.splitlines()) == 1


def test_a_terminal_keeps_the_wrapped_layout(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in _env().items() if k != "COLUMNS"}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], stdout=child, stderr=child,
                            env={**env, "TERM": "xterm"})
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=120) == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode())
    lines = [line.rstrip("\r") for line in text.splitlines()]
    assert lines and max(len(line) for line in lines) <= 80, "a terminal wraps at its width"
    head = next(i for i, line in enumerate(lines) if line.startswith("gradwatch error step 10 nonfinite"))
    message = _messages(tmp_path / "run")[0]
    assert message not in lines[head] and message[-20:] in " ".join(lines[head:head + 6])


def test_the_demo_prints_each_finding_on_one_line_into_a_pipe(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "gradwatch", "demo", "--run", str(tmp_path / "demo")],
                          capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    messages = _messages(tmp_path / "demo")
    _assert_one_line_each(proc.stdout, messages)
    lines = proc.stdout.splitlines()
    first = lines.index("findings:") + 1
    shown = lines[first:first + len(messages)]
    assert all(m in line for m, line in zip(messages, shown)), "a finding a line, not a table of ~24 lines each"
