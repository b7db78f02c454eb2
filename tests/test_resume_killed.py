"""End to end: a training process killed mid-run, restarted from its checkpoint with ``resume=True``, is one run.

The first process checkpoints every 10 steps and is killed (SIGKILL: nothing of gradwatch runs) after
step 23, its run left ``running`` under a pid that is gone; it observed a NaN loss at step 22. The
restart loads the step-20 checkpoint and trains to step 40. ``open_run``, ``gradwatch check``, the
report and TensorBoard's own reader all read one continuous run of 40 steps, with the restart at
step 20 marked and the killed process's steps 20..23 superseded (kept aside, its NaN finding with them).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

import gradwatch as gw
from tests.test_resume import tensorboard_loss

pytestmark = pytest.mark.slow  # two training subprocesses, the report and TensorBoard's reader

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import gradwatch as gw

    run, ckpt = sys.argv[1], sys.argv[2]
    total, pause_after, plant = (int(a) for a in sys.argv[3:6])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    start = 0
    if os.path.exists(ckpt):  # a restart: the checkpoint's model, optimizer, data order and step
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        data.set_state(state["data"])
        start = state["step"]
    gw.watch(model, run=run, rules=None, console=False, resume=True, start_step=start)
    for step in range(start, total):
        x = torch.randn(32, 8, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        gw.watcher(model).observe(loss=float("nan") if step == plant else loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 10 == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "data": data.get_state(), "step": step + 1}
            torch.save(state, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if step == pause_after:
            gw.watcher(model).flush()  # what it trained is on disk; then it waits to be killed
            print("paused", flush=True)
            sys.stdin.readline()
    print("done", flush=True)
""")


def _python(script: Path, run: Path, ckpt: Path, total: int, pause_after: int, plant: int,
            tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(a) for a in (script, run, ckpt, total, pause_after, plant)]
    return subprocess.Popen([sys.executable, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)


def test_a_killed_run_resumed_from_its_checkpoint_reads_as_one_run(tmp_path: Path) -> None:
    script, run, ckpt = tmp_path / "train.py", tmp_path / "runs" / "exp", tmp_path / "ckpt.pt"
    script.write_text(SCRIPT)

    first = _python(script, run, ckpt, 100, 23, 22, tmp_path)
    assert first.stdout is not None
    line = first.stdout.readline()
    assert line == "paused\n", first.stderr.read() if first.stderr else line
    first.kill()  # preempted without warning: SIGKILL, nothing of gradwatch runs
    first.communicate()
    with gw.open_run(run) as killed:
        assert killed.status == "crashed" and killed.meta["status"] == "running"  # running, by a process gone
        assert killed.steps == 24 and list(killed.findings()["step"]) == [22]

    second = _python(script, run, ckpt, 40, -1, -1, tmp_path)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0 and out.endswith("done\n"), err
    with ThreadPoolExecutor(2) as commands:  # check and report read the run: started now, beside the reads below
        check_json = commands.submit(subprocess.run, [sys.executable, "-m", "gradwatch", "check", str(run), "--format",
                                                      "json"], capture_output=True, text=True, cwd=tmp_path)
        check_text = commands.submit(subprocess.run, [sys.executable, "-m", "gradwatch", "check", str(run)],
                                     capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})
        reported = commands.submit(subprocess.run, [sys.executable, "-m", "gradwatch", "report", str(run), "-o",
                                                    str(tmp_path / "r.html")], capture_output=True, text=True,
                                   cwd=tmp_path)
        _read_back(run, tmp_path, check_json, check_text, reported)


def _read_back(run: Path, tmp_path: Path, check_json: Future[subprocess.CompletedProcess[str]],
               check_text: Future[subprocess.CompletedProcess[str]],
               reported: Future[subprocess.CompletedProcess[str]]) -> None:
    """The resumed run read back: by open_run, check (JSON and text), the report and TensorBoard's readers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # open_run: one continuous run, the restart marked, the killed process's steps 20..23 kept aside
    with gw.open_run(run) as resumed:
        assert resumed.status == "finished" and resumed.steps == 40
        assert list(resumed.step_info()["step"]) == list(range(40))
        [restart] = resumed.restarts
        assert (restart["step"], restart["superseded"], restart["previous_status"]) == (20, 4, "running")
        assert resumed.findings().empty  # the NaN was the killed process's, at a superseded step
        loss = resumed.scalars()["loss"]
        assert list(loss.index) == list(range(40)) and loss.notna().all()
        old = resumed.superseded("scalars")
        old_loss = old[old["metric"] == "loss"].set_index("step")["value"]
        assert list(old_loss.index) == [20, 21, 22, 23] and math.isnan(old_loss[22])
        # the restart trained steps 20, 21 and 23 from the same checkpoint and data: the same losses
        assert old_loss.drop(22).tolist() == pytest.approx(loss.loc[[20, 21, 23]].tolist(), rel=1e-6)
        assert list(resumed.superseded("findings")["step"]) == [22]
        layers = resumed.metrics("grad_norm", include_global=False)
        assert sorted(set(layers["step"])) == list(range(40))
        expected = loss.to_numpy()

    # check: passes (the NaN was superseded), and says where the run resumed
    check = check_json.result()
    assert check.returncode == 0, check.stdout + check.stderr
    verdict = json.loads(check.stdout)
    assert verdict["verdict"] == "pass" and verdict["steps"] == 40 and verdict["findings"] == []
    assert verdict["restarts"] == [{"step": 20, "superseded": 4, "previous_status": "running",
                                    "layout_changed": False}]
    text = check_text.result()
    assert "40 steps, finished, resumed at step 20 (4 steps of the earlier process superseded)" in text.stdout

    # the report: the restart in its facts and a "resumed" line on its timeline
    report = reported.result()
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "at step 20 (4 earlier steps superseded)" in page and '"text":"resumed"' in page
    assert "No warnings or errors in 40 steps" in page

    # TensorBoard's own readers: the killed process's events from step 20 on purged, the restart's in their place
    for reader, tb_loss in tensorboard_loss(run).items():
        assert [step for step, _ in tb_loss] == list(range(40)), reader
        assert [value for _, value in tb_loss] == pytest.approx(expected.tolist(), rel=1e-6), reader
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("grad_norm/0")] == list(range(40))
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # the killed process's file is kept, read in order
