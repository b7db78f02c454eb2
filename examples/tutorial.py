"""Tutorial: a training script whose run fails, and the same script fixed (docs/tutorial.md).

    python examples/tutorial.py            # the failing run: gradwatch halts it at the first NaN (runs/tutorial)
    python examples/tutorial.py --fixed    # the bug fixed: a healthy run (runs/tutorial-fixed)

A price model for flat listings: the log of the area and of the neighbourhood's income, and two
plain features, into an MLP. One listing among 4,096 has no area recorded (0.0): the log of 0
is -inf, and the batch that holds it (step 60) turns the loss and every gradient into NaN.
"""

import argparse

import torch
from torch import nn

import gradwatch as gw

ROWS, BATCH, EPOCHS = 4096, 64, 3
BAD_ROW = 60 * BATCH + 17  # in the batch of step 60 (the batches are not shuffled)


class LogFeatures(nn.Module):
    """The log of the positive columns (area, income); the other columns as they are."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positive = x[:, :2]
        if self.fixed:
            positive = positive.clamp_min(1.0)  # an area or income below 1 is a missing value, not a real one
        return torch.cat([torch.log(positive), x[:, 2:]], dim=1)


def listings(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic listings (area m², income, floor, age) and their log prices."""
    gen = torch.Generator().manual_seed(seed)
    area = 20 + 180 * torch.rand(ROWS, generator=gen)
    income = 15_000 + 60_000 * torch.rand(ROWS, generator=gen)
    floor = torch.randint(0, 10, (ROWS,), generator=gen).float() / 10
    age = torch.rand(ROWS, generator=gen)
    log_price = 0.9 * area.log() + 0.6 * income.log() + 0.1 * floor - 0.3 * age
    log_price = log_price + 0.05 * torch.randn(ROWS, generator=gen)
    x = torch.stack([area, income, floor, age], dim=1)
    x[BAD_ROW, 0] = 0.0  # a listing with no area recorded
    return x, (log_price - log_price.mean()).unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="clamp the log's input (the fix)")
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y = listings()
    model = nn.Sequential(LogFeatures(args.fixed), nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    run = "runs/tutorial-fixed" if args.fixed else "runs/tutorial"
    # halt at the first NaN/Inf: the run stops where it goes wrong, its weights intact, instead of
    # training on NaN for hours (the default rules would skip the step and go on)
    gw.watch(model, run=run, overwrite=True, rules=[gw.Rule(when="nonfinite", do="halt")])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    for _epoch in range(EPOCHS):
        for start in range(0, ROWS, BATCH):
            loss = nn.functional.mse_loss(model(x[start:start + BATCH]), y[start:start + BATCH])
            optimizer.zero_grad()
            loss.backward()
            gw.watcher(model).observe(loss=loss)
            optimizer.step()
            if step % 40 == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
            step += 1
    gw.watcher(model).close()
    print(f"trained {step} steps, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
