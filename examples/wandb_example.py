"""Weights & Biases: gradwatch's series, findings and verdict in your own W&B run, beside your own metrics.

    pip install -e ".[wandb]"
    python examples/wandb_example.py                 # offline: nothing leaves the machine
    WANDB_MODE=online python examples/wandb_example.py   # to your W&B account (after `wandb login`)

Offline, the run is written under ./wandb/ and can be uploaded later with ``wandb sync <folder>``.
Batch 100 holds a point the model's log features turn into NaN: gradwatch finds it, skips the step,
sends an alert and puts the finding in the ``gradwatch/findings`` table; the run's summary holds
``gradwatch/verdict = fail``. Your own metrics keep their own step axis (``train/step``).
"""

import argparse
import os

import torch
import wandb
from torch import nn

import gradwatch as gw

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for a negative input


torch.manual_seed(0)
model = nn.Sequential(LogFeatures(), nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

run = wandb.init(project="gradwatch-example", mode=os.environ.get("WANDB_MODE", "offline"))
run.define_metric("train/*", step_metric="train/step")     # your own step axis, as gradwatch has its own
gw.watch(model, run="runs/wandb", overwrite=True, console=False, sinks=["wandb"])   # the one line

optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.rand(1024, 4) + 0.5
y = torch.log(x) @ torch.randn(4, 1)
for step in range(args.steps):
    batch = torch.randint(0, len(x), (32,))
    xb = x[batch].clone()
    if step == 100:
        xb[0, 0] = -1.0  # the planted NaN
    loss = nn.functional.mse_loss(model(xb), y[batch])
    optimizer.zero_grad()
    loss.backward()
    gw.watcher(model).observe(loss=loss)
    optimizer.step()
    run.log({"train/step": step, "train/loss": loss.item()})  # your own logging goes on as before

gw.watcher(model).close()   # before run.finish(): the verdict goes into the summary as gradwatch closes
print("verdict:", run.summary["gradwatch/verdict"], "| status:", run.summary["gradwatch/status"])
print("W&B run:", run.url or os.path.dirname(run.dir))
run.finish()
