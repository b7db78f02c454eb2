"""Preemption under the frameworks (issue 35, item 3): a real Lightning fit and a real HF Trainer run, each in a
process of its own, get SIGTERM as a cluster preempts a job; the run reads ``terminated (signal 15, SIGTERM)``
as a plain loop's does, so ``check --accept terminated`` passes a healthy preempted run.

Lightning installs its own SIGTERM handler (its signal connector): it stops the fit by raising
``SIGTERMException`` from the loop, which reached the callback's ``on_exception`` and read ``crashed``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gradwatch as gw
from tests.test_check import gradwatch

pytestmark = pytest.mark.slow  # a real framework's training in a process of its own

LIGHTNING = r'''
import sys, time
import torch
from torch import nn
import lightning.pytorch as pl
from gradwatch.integrations.lightning import GradWatchCallback

torch.manual_seed(0)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 20:
            print("ready", flush=True)
        if self.global_step > 20:
            time.sleep(0.01)
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.rand(40000, 4, generator=g), torch.randn(40000, 1, generator=g))
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10000, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[GradWatchCallback(run=sys.argv[1], console=False)])
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
print(f"fit returned at step {trainer.global_step}", flush=True)
'''

HF = r'''
import sys, time
import torch, transformers
from gradwatch.integrations.transformers import GradWatchCallback

transformers.set_seed(0)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (40000, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Ready(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 20:
            print("ready", flush=True)
        if state.global_step > 20:
            time.sleep(0.01)


model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                             n_positions=32, bos_token_id=0, eos_token_id=0))
args = transformers.TrainingArguments(output_dir=sys.argv[1] + "-out", max_steps=10000, per_device_train_batch_size=4,
                                      report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                                      logging_steps=1000, learning_rate=1e-3)
transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                     callbacks=[Ready(), GradWatchCallback(run=sys.argv[1], console=False)]).train()
print("train returned", flush=True)
'''


def _preempt(tmp_path: Path, script: str) -> tuple[int, str, Path]:
    """Run ``script``, send it SIGTERM once it trains past step 20; its exit status, stderr and run."""
    path, run = tmp_path / "train.py", tmp_path / "run"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, str(path), str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    assert proc.stdout is not None
    timer = threading.Timer(600, proc.kill)  # a child that hangs cannot hang the test
    timer.start()
    try:
        lines = []
        for line in proc.stdout:  # ends at "ready", or when the child dies
            lines.append(line)
            if line.strip() == "ready":
                break
        if not lines or lines[-1].strip() != "ready":
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the training never got ready: {''.join(lines)}{out}{err}")
        time.sleep(0.3)  # some steps past step 20
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "returned" not in out, "the training ran to its end: the signal did not stop it"
    return proc.returncode, err, run


def _reads_terminated(run: Path) -> None:
    with gw.open_run(run) as r:
        assert r.ended == {"status": "terminated", "signal": 15}
        assert r.steps > 21
    data = json.loads(gradwatch("check", str(run), "--format", "json").stdout)
    assert data["status"] == "terminated" and data["ended"] == {"status": "terminated", "signal": 15}
    assert data["unfinished"] is True and data["findings"] == []
    text = gradwatch("check", str(run))
    assert text.returncode == 1 and "terminated (signal 15, SIGTERM)" in text.stdout
    assert gradwatch("check", str(run), "--accept", "terminated").returncode == 0


def test_lightning_preempted_by_sigterm_reads_terminated(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    code, err, run = _preempt(tmp_path, LIGHTNING)
    assert "Received SIGTERM" in err, "Lightning's own SIGTERM handling stopped the fit"
    assert code == 0, err  # Lightning's SIGTERMException is a SystemExit without a code
    _reads_terminated(run)


def test_hf_trainer_preempted_by_sigterm_reads_terminated(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code, err, run = _preempt(tmp_path, HF)
    assert code == -signal.SIGTERM, f"the process ends by SIGTERM, as without gradwatch ({code}): {err}"
    _reads_terminated(run)
