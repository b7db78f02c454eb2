"""DistributedDataParallel: every rank watches its replica, rank 0 writes the run.

    python examples/ddp_example.py                  # starts 2 processes itself (gloo, on this machine)
    torchrun --nproc-per-node 2 examples/ddp_example.py   # or let torchrun start them

Rank 1 gets a poisoned batch (a NaN) at step 30: the ranks agree on the finding, and every rank
skips that step, so the replicas stay identical. The run is written to ``runs/ddp``.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwatch as gw

STEPS, POISON = 60, 30


def train(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial model on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    gw.watch(model, run="runs/ddp", overwrite=True, replica_check_every=20)  # the same line on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(rank)  # each rank its own shard of the data
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=data)
        y = x[:, :4].sum(dim=1, keepdim=True)
        if rank == 1 and step == POISON:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        optimizer.step()
    gw.unwatch(model)
    if rank == 0:
        run = gw.open_run("runs/ddp")
        print(run, flush=True)
        print(run.findings()[["step", "kind", "layer", "action", "message"]].to_string(index=False), flush=True)
    dist.barrier()  # every rank tears the group down together, not while another still reads or trains
    dist.destroy_process_group()


def spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(rank, world)


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        mp.spawn(spawned, args=(2, free), nprocs=2)
