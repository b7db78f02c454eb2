"""Live dashboard: serve the dashboard from this process and watch a training run as it happens.

    python examples/live_dashboard.py                 # trains for 2,000 steps; open the printed URL meanwhile
    python examples/live_dashboard.py --steps 200 --port 6007

The same page is served by ``gradwatch dashboard runs`` from another terminal; serving it from the
training script is handy in a notebook. The model is a deep sigmoid stack, so the gradient-flow chart
shows gradients shrinking towards the input, and the vanishing-gradient detector reports it.
"""

import argparse
import time

import torch
from torch import nn

import gradwatch as gw
from gradwatch.dashboards.server import start

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2000)
parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
parser.add_argument("--pause", type=float, default=0.02, help="seconds between steps, to watch it live")
args = parser.parse_args()

torch.manual_seed(0)
layers = [nn.Linear(32, 64), nn.Sigmoid()]
for _ in range(10):
    layers += [nn.Linear(64, 64), nn.Sigmoid()]
model = nn.Sequential(*layers, nn.Linear(64, 1))
gw.watch(model, run="runs/live", overwrite=True, console=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(1024, 32)
y = torch.sin(x[:, :4].sum(dim=1, keepdim=True))

with start("runs", port=args.port) as dash:
    print(f"dashboard: {dash.url}run?run=live", flush=True)
    for _ in range(args.steps):
        batch = torch.randint(0, len(x), (64,))
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        optimizer.step()
        time.sleep(args.pause)
    gw.unwatch(model)
    print(f"trained {args.steps} steps; the dashboard stops with this script", flush=True)
