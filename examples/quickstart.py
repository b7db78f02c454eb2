"""Quickstart: watch a model with one line, train as usual, then read the run back.

Run it with ``python examples/quickstart.py``; it writes ``runs/quickstart``.
"""

import torch
from torch import nn

import gradwatch as gw

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
gw.watch(model, run="runs/quickstart", overwrite=True)  # the one line

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(512, 20)
y = x[:, :5].sum(dim=1, keepdim=True)

for _ in range(200):  # an ordinary loop, unchanged
    batch = torch.randint(0, len(x), (32,))
    loss = nn.functional.mse_loss(model(x[batch]), y[batch])
    optimizer.zero_grad()
    loss.backward()
    gw.watcher(model).observe(loss=loss)  # optional: enables the loss curve
    optimizer.step()

gw.unwatch(model)  # flush and detach (also happens at exit)

run = gw.open_run("runs/quickstart")
print(run)
print("layers:", run.layers)
grads = run.metrics("grad_norm", include_global=False)
print(grads.pivot(index="step", columns="layer", values="value").tail())
print(run.scalars()[["loss", "grad_norm"]].describe())
