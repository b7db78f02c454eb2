"""Lightning: one callback watches a LightningModule; a bad batch is found and skipped.

Run it with ``python examples/lightning_example.py`` (needs ``pip install -e ".[lightning]"``);
it writes ``runs/lightning-example``. Batch 30 holds a zero: ``log`` makes it -inf in ``features``,
the gradients go NaN, and gradwatch's default rules skip that step; training goes on and converges.
"""

import lightning.pytorch as pl
import torch
from torch import nn

import gradwatch as gw
from gradwatch.integrations.lightning import GradWatchCallback


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class LogRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = LogFeatures()
        self.head = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)  # call self(x): gradwatch hooks the forward

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


torch.manual_seed(0)
x = torch.rand(1600, 4) + 0.1
y = torch.log(x).sum(dim=1, keepdim=True)
x[30 * 16, 2] = 0.0  # one bad sample, in batch 30
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

callback = GradWatchCallback(run="runs/lightning-example", overwrite=True)  # gw.watch's arguments
trainer = pl.Trainer(max_epochs=1, accelerator="cpu", callbacks=[callback], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(LogRegression(), loader)

run = gw.open_run("runs/lightning-example")
print(f"{run.steps} steps ({trainer.global_step} optimizer steps in Lightning), status {run.status}")
for f in run.findings().itertuples():
    print(f"step {f.step}: {f.kind} in {f.layer} ({f.phase}) -> {f.action}")
loss = run.scalars()["loss"]
print(f"loss: first 10 steps {loss.iloc[:10].mean():.3f}, last 10 steps {loss.iloc[-10:].mean():.3f}")
