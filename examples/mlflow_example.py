"""gradwatch into MLflow: a run's statistics, findings and verdict in the active MLflow run.

Run it as written (``pip install -e ".[mlflow]"``): it logs into a SQLite tracking store,
``mlflow.db`` in the working directory (``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows
it). One batch holds a NaN at step 60; the default rules skip that step and training goes on.
"""

from __future__ import annotations

import mlflow
import torch
from mlflow import MlflowClient
from torch import nn

import gradwatch as gw

mlflow.set_tracking_uri("sqlite:///mlflow.db")
mlflow.set_experiment("gradwatch-example")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(256, 8)
y = x @ torch.randn(8, 1)

with mlflow.start_run(run_name="gradwatch-example") as run:
    mlflow.log_param("lr", 1e-2)  # your own logging goes on as usual, into the same run
    gw.watch(model, run="runs/mlflow_example", overwrite=True, sinks=["mlflow"])
    for step in range(100):
        batch = x.clone()
        if step == 60:
            batch[0, 0] = float("nan")  # a bad batch: the default rules skip this step
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(batch), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)  # sends the findings table and the verdict before the MLflow run ends

found = MlflowClient().get_run(run.info.run_id)
tags = found.data.tags
print(f"MLflow run {run.info.run_id}: verdict {tags['gradwatch.verdict']}, worst finding {tags['gradwatch.worst']}, "
      f"{sum(key.startswith('gradwatch/') for key in found.data.metrics)} gradwatch metrics")
