"""A fault on one DDP rank that a replay does not reproduce names that rank (issue 18, item 2)."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwatch as gw

from .ranks import leave_group, spawn_ranks

pytestmark = pytest.mark.slow  # two real processes on the gloo backend

WORLD, STEPS, BAD_STEP, BAD_RANK = 2, 6, 3, 1


class Flaky(nn.Module):
    """NaN on its first call of the planted step only, on one rank (a transient hardware fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            return x * float("nan")
        return x


def worker(rank: int, port: int, run: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {"rank": rank}
    ddp: Any = None  # kept past the run with its process group (ranks.leave_group)
    model: Any = None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), Flaky(), nn.Linear(16, 1))
        ddp = DistributedDataParallel(model)
        gw.watch(ddp, run=run, console=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(STEPS):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            model[1].armed = rank == BAD_RANK and step == BAD_STEP
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            gw.watcher(ddp).observe(loss=loss)
            opt.step()
        gw.unwatch(ddp)
        dist.barrier()
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        leave_group(ddp, model)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_fault_that_does_not_reproduce_names_its_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    spawn_ranks(worker, (str(run), str(tmp_path)), tmp_path, world=WORLD)  # fails if a rank hung or erred
    with gw.open_run(run) as stored:
        found = stored.findings()
    row = found[found.kind == "nonfinite"].iloc[0]
    root = row.data["root_cause"]
    assert (row.step, root["cause"], root["rank"]) == (BAD_STEP, "not_reproducible", BAD_RANK)
    assert root["seen_in"] == "output"
    assert row.data["ranks"] == [0, 1] and row.data["born_on_rank"] == BAD_RANK
    assert "cause: not reproducible (the replay stayed finite on rank 1)" in row.message
    assert row.message.endswith("(born on rank 1 of 2)")
