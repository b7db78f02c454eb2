"""Prometheus exporter: serve a training run's gradient norm, loss, findings and actions for Prometheus.

    pip install -e ".[prometheus]"
    python examples/prometheus_exporter.py                  # metrics at http://127.0.0.1:9108/metrics
    python examples/prometheus_exporter.py --port 0 --steps 300

Point Prometheus at the printed address (``scrape_configs: - job_name: gradwatch, static_configs:
- targets: ['127.0.0.1:9108']``) and import ``dashboards/grafana/gradwatch.json`` into Grafana.
Batch 100 holds a point the model's log features turn into NaN: gradwatch finds it, skips the step
(``gradwatch_actions_total{action="skip"}``) and training goes on.
"""

import argparse
import time
import urllib.request

import torch
from torch import nn

import gradwatch as gw
from gradwatch.integrations import prometheus


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for a negative input


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3000)
parser.add_argument("--port", type=int, default=9108, help="0 picks a free port")
parser.add_argument("--pause", type=float, default=0.01, help="seconds between steps, to watch it live")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(LogFeatures(), nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
gw.watch(model, run="runs/prometheus", overwrite=True, console=False, prometheus=args.port)  # the one line
(exporter,) = prometheus.exporters()
print(f"metrics: {exporter.url}", flush=True)

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
    time.sleep(args.pause)
gw.unwatch(model)  # the run's series keep their final values while this process serves them

page = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
for line in page.splitlines():
    if line.startswith(("gradwatch_steps_total", "gradwatch_loss", 'gradwatch_actions_total{action="skip"')):
        print(line)
