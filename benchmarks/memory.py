"""Overhead benchmark, memory: the peak memory of training with and without gradwatch, each in its own process.

A process's peak RSS only grows, so each (workload, variant) trains in a fresh child process
(this file run as a script) that reports its own peak: ``ru_maxrss`` on the CPU, and
``torch.cuda.max_memory_allocated`` when the model is on a GPU. The overhead is the watched
peak minus the bare peak. Variants:

- ``bare``: the plain loop;
- ``gradwatch``: the default configuration (flight recorder of 32 steps in memory, origin
  tracking, the CPU buffers for the update ratio's weight copies on sampled steps);
- ``gradwatch_rollback``: the default plus a rollback rule, so in-memory snapshots are kept
  (``snapshot_keep=2`` copies of model, optimizer and RNG; taken every 5 healthy steps here so
  that a short run holds them).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MEMORY_VARIANTS = ("bare", "gradwatch", "gradwatch_rollback")


def peak(workload: str, variant: str, steps: int, threads: int, timeout: float = 3600) -> dict[str, Any]:
    """Train ``workload`` for its warm-up plus ``steps`` steps in a child process; its peak memory."""
    with tempfile.TemporaryDirectory(prefix="gradwatch-memory-") as tmp:
        done = subprocess.run([sys.executable, __file__, workload, variant, str(steps), str(threads), tmp],
                              capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory run {workload}/{variant} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def overheads(workload: str, steps: int, threads: int) -> dict[str, Any]:
    """Peaks of every memory variant of one workload, and each watched one's excess over bare."""
    peaks = {v: peak(workload, v, steps, threads) for v in MEMORY_VARIANTS}
    row: dict[str, Any] = {"workload": workload, "steps": steps, "peaks": peaks}
    for v in MEMORY_VARIANTS[1:]:
        row[f"{v}_rss_overhead"] = peaks[v]["peak_rss"] - peaks["bare"]["peak_rss"]
        if peaks["bare"].get("cuda_peak") is not None:
            row[f"{v}_cuda_overhead"] = peaks[v]["cuda_peak"] - peaks["bare"]["cuda_peak"]
    return row


def _child(workload: str, variant: str, steps: int, threads: int, tmp: str) -> dict[str, Any]:
    import torch
    from variants import SETUP, make_loop, with_gradwatch
    from workloads import WORKLOADS

    import gradwatch as gw

    torch.set_num_threads(threads)
    spec = WORKLOADS[workload]
    loop = make_loop(spec, spec.batches())
    cuda = torch.cuda.is_available()
    if cuda:
        loop.model.cuda()
        loop.batches = [tuple(t.cuda() for t in batch) for batch in loop.batches]  # type: ignore[misc]
        torch.cuda.reset_peak_memory_stats()
    if variant == "gradwatch_rollback":
        with_gradwatch(loop, Path(tmp) / "run", snapshot_every=5,
                       rules=[gw.Rule(when="nonfinite", do="rollback"), gw.Rule(when="exploding", do="clip")])
    else:
        SETUP[variant](loop, Path(tmp) / "run")
    loop.run((spec.warmup_watched if variant != "bare" else spec.warmup) + steps)
    loop.close()
    return {"variant": variant, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "cuda_peak": torch.cuda.max_memory_allocated() if cuda else None}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    name, kind, n, threads, tmp = sys.argv[1:6]
    print(json.dumps(_child(name, kind, int(n), int(threads), tmp)))
