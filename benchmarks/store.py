"""Store benchmark: write and read a synthetic run of many layers x many steps.

Writes records shaped like a real watcher's (per-layer and per-parameter grad norms and
non-finite counts every step, the costlier metrics every ``--sample-every`` steps) through the
real store writer, then times the reads the report and dashboard need. Prints size per 1,000
steps, write throughput and read latencies.

    python benchmarks/store.py --layers 1000 --steps 100000
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from gradwatch.store import DB_NAME, StoreWriter, create_store, open_run
from gradwatch.store.records import ACT_METRICS, GRAD_METRICS, LAYER, PARAM, Layout, StepRecord


def synthetic_layout(layers: int) -> Layout:
    """``layers`` Linear layers, each owning one parameter, every one a leaf."""
    return Layout(
        version=1,
        layers=tuple(f"blocks.{i}.linear" for i in range(layers)),
        layer_types=("Linear",) * layers,
        layer_numel=(4096,) * layers,
        params=tuple(f"blocks.{i}.linear.weight" for i in range(layers)),
        param_numel=(4096,) * layers,
        owners=tuple((i, i) for i in range(layers)),
        leaves=tuple(range(layers)),
    )


def synthetic_record(layout: Layout, step: int, rng: np.random.Generator, sample_every: int) -> StepRecord:
    n = len(layout.layers)
    base = np.exp(rng.normal(-2.0, 1.0, n)).astype(np.float32)
    vectors = {}
    sampled = step % sample_every == 0
    for metric in GRAD_METRICS + (ACT_METRICS if sampled else ()):
        if metric not in ("grad_norm", "grad_nonfinite") and not sampled:
            continue
        values = np.zeros(n, np.float32) if metric == "grad_nonfinite" else base * rng.uniform(0.9, 1.1, n)
        vectors[(LAYER, metric)] = values.astype(np.float32)
        if metric not in ACT_METRICS:
            vectors[(PARAM, metric)] = values.astype(np.float32)
    scalars = {"grad_norm": float(np.sqrt((base**2).sum())), "loss": 2.0 / (1 + step) ** 0.3, "lr": 1e-3}
    return StepRecord(step, time.time(), layout, scalars, vectors, logged=True, sampled=sampled)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=512, help="records per transaction (the writer's batch)")
    args = parser.parse_args()

    console = Console()
    layout = synthetic_layout(args.layers)
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="gradwatch-store-bench-"))
    try:
        db = create_store(tmp, {"model": "Synthetic"}, overwrite=False)
        writer = StoreWriter(db)
        start, build = time.perf_counter(), 0.0
        for first in range(0, args.steps, args.batch):
            t0 = time.perf_counter()
            batch = [synthetic_record(layout, s, rng, args.sample_every)
                     for s in range(first, min(first + args.batch, args.steps))]
            build += time.perf_counter() - t0
            writer.write(batch)
        writer.close("finished")
        write_s = time.perf_counter() - start - build
        size = (tmp / DB_NAME).stat().st_size

        run = open_run(tmp)
        middle = layout.layers[args.layers // 2]
        reads = {
            "run.steps": timed(lambda: run.steps),
            "run.layers": timed(lambda: run.layers),
            "run.scalars() (all steps)": timed(run.scalars),
            f"one layer's grad_norm series ({middle})": timed(lambda: run.metrics("grad_norm", layers=[middle])),
            "grad_norm matrix (steps x layers)": timed(lambda: run.matrix("grad_norm")),
            "act_norm matrix (sampled steps x layers)": timed(lambda: run.matrix("act_norm")),
            "metrics(), steps 1000-1100, all layers": timed(lambda: run.metrics(steps=slice(1000, 1100))),
        }
        table = Table(title=f"store: {args.layers} layers x {args.steps} steps (sample_every={args.sample_every})")
        table.add_column("what")
        table.add_column("figure", justify="right")
        table.add_row("store size", f"{size / 2**20:.1f} MiB")
        table.add_row("size per 1,000 steps", f"{size / args.steps * 1000 / 2**20:.2f} MiB")
        table.add_row("write throughput", f"{args.steps / write_s:,.0f} steps/s ({write_s:.1f} s)")
        for name, (result, seconds) in reads.items():
            rows = len(result) if hasattr(result, "__len__") else result
            table.add_row(f"read: {name}", f"{seconds * 1000:,.0f} ms ({rows:,} rows)")
        console.print(table)
        run.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
