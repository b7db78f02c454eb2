"""End to end (issue 35, item 2): a job with both tracker sinks, preempted by SIGTERM and resumed, is one run there.

The first process trains with ``sinks=["wandb", "mlflow"]`` (W&B offline, MLflow against SQLite), checkpoints
every 10 steps and is preempted by SIGTERM after step 23: gradwatch closes its run ``terminated``, the W&B run
it started exits 1 and the MLflow run ends KILLED. The restart loads the step-20 checkpoint and trains to step
40 with ``resume=True, start_step=20``. W&B and MLflow then hold one run each: W&B's run continued under its
id, rewound to step 20 (``resume_from``), MLflow's run ended FINISHED; both pass with the restart marked,
as ``gradwatch check`` says it, and with W&B's ``_step`` the training step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

import gradwatch as gw
from tests.wandb_offline import OfflineRun, offline_runs, records

pytestmark = pytest.mark.slow  # two training subprocesses, each starting wandb's service and MLflow's store

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import gradwatch as gw

    run, ckpt, uri = sys.argv[1], sys.argv[2], sys.argv[3]
    total, pause_after = int(sys.argv[4]), int(sys.argv[5])
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
    gw.watch(model, run=run, console=False, tensorboard=False, resume=True, start_step=start,
             sinks={"wandb": {"init": {"project": "resumed"}},
                    "mlflow": {"tracking_uri": uri, "experiment": "resumed"}})
    for step in range(start, total):
        x = torch.randn(32, 8, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        if (step + 1) % 10 == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "data": data.get_state(), "step": step + 1}
            torch.save(state, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if step == pause_after:
            gw.watcher(model).flush()  # what it trained is written; then it waits to be preempted
            print("paused", flush=True)
            sys.stdin.readline()
    gw.watcher(model).close()
    print("done", flush=True)
""")


def _python(tmp_path: Path, uri: str, total: int, pause_after: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}
    args = [tmp_path / "train.py", tmp_path / "runs" / "exp", tmp_path / "ckpt.pt", uri, total, pause_after]
    return subprocess.Popen([sys.executable, *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def _run_record(run: OfflineRun) -> object:
    (log,) = run.path.glob("run-*.wandb")
    return next(r.run for r in records(log) if r.WhichOneof("record_type") == "run")


def test_a_preempted_and_resumed_job_is_one_wandb_run_and_one_mlflow_run(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # MLflow's migrations, before either process opens the store

    first = _python(tmp_path, uri, 100, 23)
    assert first.stdout is not None
    line = first.stdout.readline()
    assert line == "paused\n", first.stderr.read() if first.stderr else line
    first.send_signal(signal.SIGTERM)  # preempted: gradwatch closes the run as terminated
    _, err = first.communicate(timeout=120)
    assert first.returncode != 0, err
    with gw.open_run(tmp_path / "runs" / "exp") as killed:
        assert killed.status == "terminated" and killed.steps == 24

    second = _python(tmp_path, uri, 40, -1)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0 and out.endswith("done\n"), err
    with gw.open_run(tmp_path / "runs" / "exp") as resumed:
        assert resumed.status == "finished" and resumed.steps == 40
        (restart,) = resumed.restarts
        assert (restart["step"], restart["superseded"], restart["previous_status"]) == (20, 4, "terminated")
        losses = resumed.scalars()["loss"]
    marked = [{"restart": 1, "step": 20, "superseded": 4, "previous_status": "terminated"}]

    # W&B: one run (its id in both processes' logs), the restart's part rewound to step 20 and passing
    parts = offline_runs(tmp_path)
    assert len(parts) == 2  # wandb writes one offline log per process; `wandb sync` uploads both into one run
    ids = {_run_record(part).run_id for part in parts}
    assert len(ids) == 1, ids
    before, after = parts
    branch = _run_record(after).branch_point
    assert (branch.run, branch.metric, branch.value) == (ids.pop(), "_step", 19)  # steps from 20 on are the restart's
    assert [row["_step"] for row in before.rows] == [row["gradwatch/step"] for row in before.rows] == list(range(24))
    assert [row["_step"] for row in after.rows] == [row["gradwatch/step"] for row in after.rows] == list(range(20, 40))
    assert [row["gradwatch/global/loss"] for row in after.rows] == pytest.approx(losses.loc[20:].tolist(), rel=1e-6)
    assert {k: after.summary[f"gradwatch/{k}"] for k in ("verdict", "status", "steps", "restarts")} == {
        "verdict": "pass", "status": "finished", "steps": 40, "restarts": marked}
    assert after.exit_code == 0

    # MLflow: one run, FINISHED, passing, the restart tagged; the restart's points are the latest of each step
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("resumed")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["gradwatch.verdict"], tags["gradwatch.status"], tags["gradwatch.steps"]) == ("pass", "finished", "40")
    assert json.loads(tags["gradwatch.restarts"]) == marked
    history = client.get_metric_history(run.info.run_id, "gradwatch/global/loss")
    latest = {}
    for point in sorted(history, key=lambda m: m.timestamp):
        latest[point.step] = point.value
    assert sorted(latest) == list(range(40))
    assert [latest[s] for s in range(40)] == pytest.approx(losses.tolist(), rel=1e-6)
