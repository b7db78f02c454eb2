"""W&B cost: per-step cost of ``gw.watch(model, sinks=["wandb"])`` against ``wandb.watch(model, log="all")``.

One process, one offline W&B run (nothing leaves the machine), the overhead benchmark's seeded workloads
(``benchmarks/workloads.py``). Each variant trains its own copy of the model, built from the same seed and
fed the same batches:

- ``bare``: the plain loop (the W&B run is open, nothing is logged);
- ``wandb_watch``: ``wandb.watch(model, log="all")`` at its defaults (``log_freq=1000``: a hook on every
  parameter's gradient and one on the model, counting calls; every 1000th step a 64-bin histogram of every
  parameter and every gradient) and the loop's own ``run.log({"loss": ...})`` every step, as W&B's docs
  show it: without a log call the watch's histograms are never committed;
- ``wandb_watch_only``: the watch without the loop's logging (its hooks and histograms alone);
- ``wandb_watch_10``: ``wandb_watch`` with ``log_freq=10``, gradwatch's default sampling period: the
  watch's histograms as often as gradwatch's per-layer statistics (not its default: for reference);
- ``gradwatch``: ``gw.watch(model)`` at its defaults (run store and TensorBoard files) and
  ``observe(loss=loss)``, without W&B: what the sink adds is the next one minus this;
- ``gradwatch_wandb``: the same with ``sinks=["wandb"]``: a W&B row every step (loss, global gradient norm,
  learning rate), the per-layer statistics every 10th step (the sampled steps), findings and verdict;
- ``minimal``: the floor of the overhead benchmark (``benchmarks/variants.py``): the tensor work of
  gradwatch's default statistics alone, written by hand, with no detector, record, store or W&B: what any
  watcher that measures every step as gradwatch does costs at least. Its overhead over ``wandb_watch``'s says
  how far below ``wandb.watch`` at its defaults such a watcher can go at all.

Measurement is interleaved: after warm-up, each round runs a block of K steps of every variant in turn
(the order rotates every round); every block is timed by the wall clock, by the CPU of the training
thread (where ``wandb.watch``'s hooks run; gradwatch's sink runs in its writer thread), by the CPU of
this process (all its threads: gradwatch's writer, wandb's own) and by the CPU of wandb's service
process (``wandb-core``, which writes the offline run). On a machine shared with other work the wall
clock is the noisiest of them. Each gradwatch block ends with ``watcher.flush()`` inside the timed region.
The per-step figures are totals over all rounds divided by the steps, not medians: ``wandb.watch``
spends most of its time in one step of every 1000, which a median of blocks would leave out. The
default ``rounds x steps`` is 1000 steps per variant (after 30 of warm-up), so each watched model takes
exactly one histogram step in the timed region: its amortised cost at its defaults.

    python benchmarks/wandb_cost.py                       # mlp and cnn, 10 rounds of 100 steps
    python benchmarks/wandb_cost.py --workloads mlp --rounds 20 --steps 100 --json wandb.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import Loop, Minimal, make_loop, with_gradwatch  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

import gradwatch as gw  # noqa: E402

VARIANTS = ("bare", "wandb_watch", "wandb_watch_only", "wandb_watch_10", "gradwatch", "gradwatch_wandb", "minimal")
WARMUP = 30


@dataclass
class Totals:
    """Seconds over every timed block of one variant."""

    variant: str
    steps: int = 0
    wall: float = 0.0
    thread: float = 0.0
    cpu: float = 0.0
    service: float = 0.0
    blocks: list[float] = field(default_factory=list)

    def per_step(self, what: str) -> float:
        return 1000 * getattr(self, what) / self.steps  # ms


def service_cpu() -> float:
    """CPU seconds of this process's child processes (wandb's service, which writes the offline run)."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def setup(variant: str, loop: Loop, run: Any, root: Path) -> None:
    """Attach one variant's way of watching to its loop."""
    import wandb

    if variant.startswith("wandb_watch"):
        wandb.watch(loop.model, log="all", **({"log_freq": 10} if variant == "wandb_watch_10" else {}))
        if variant != "wandb_watch_only":  # at its defaults (log_freq=1000) or every 10 steps
            loop.on_loss = lambda loss: run.log({"loss": loss.item()})
        loop.close = lambda: wandb.unwatch(loop.model)
    elif variant == "gradwatch":
        with_gradwatch(loop, root / variant)
    elif variant == "gradwatch_wandb":
        with_gradwatch(loop, root / variant, sinks=["wandb"])
    elif variant == "minimal":
        Minimal(loop)


def measure(name: str, rounds: int, steps: int, variants: list[str], root: Path, console: Console) -> list[Totals]:
    import wandb

    workload = WORKLOADS[name]
    batches = workload.batches()
    run = wandb.init(project="gradwatch-wandb-cost", name=name, dir=str(root), mode="offline")
    loops = {v: make_loop(workload, batches) for v in variants}
    totals = {v: Totals(v) for v in variants}
    try:
        for variant, loop in loops.items():
            setup(variant, loop, run, root / name)
            loop.run(WARMUP)
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                service, thread = service_cpu(), time.thread_time()
                wall = loops[v].run(steps)
                t = totals[v]
                t.steps += steps
                t.wall += wall
                t.thread += time.thread_time() - thread
                t.cpu += loops[v].cpu
                t.service += service_cpu() - service
                t.blocks.append(wall)
            console.log(f"{name} round {r + 1}/{rounds}: " + ", ".join(
                f"{v} {1000 * totals[v].blocks[-1] / steps:.2f}" for v in variants) + " ms/step")
    finally:
        for loop in loops.values():
            loop.close()
        run.finish()
        wandb.teardown()  # waits until the service has written the run
    for variant in ("gradwatch", "gradwatch_wandb"):
        if variant in loops:
            with gw.open_run(root / name / variant) as stored:
                if stored.status != "finished":
                    console.print(f"[red]WARNING[/red] {name} {variant}: the run was left {stored.status!r}")
    return list(totals.values())


def overhead(totals: dict[str, Totals], variant: str, what: str) -> float:
    return totals[variant].per_step(what) - totals["bare"].per_step(what)


def report(name: str, found: list[Totals]) -> dict[str, Any]:
    by = {t.variant: t for t in found}
    rows = {}
    for t in found:
        rows[t.variant] = {"ms_per_step": t.per_step("wall"), "thread_cpu_ms_per_step": t.per_step("thread"),
                           "cpu_ms_per_step": t.per_step("cpu"),
                           "service_cpu_ms_per_step": t.per_step("service"), "steps": t.steps,
                           "block_seconds": t.blocks}
        if t.variant != "bare":
            rows[t.variant].update(overhead_ms=overhead(by, t.variant, "wall"),
                                   thread_overhead_ms=overhead(by, t.variant, "thread"),
                                   cpu_overhead_ms=overhead(by, t.variant, "cpu"),
                                   service_overhead_ms=overhead(by, t.variant, "service"))
    out: dict[str, Any] = {"workload": name, "variants": rows}
    for watch in ("wandb_watch", "wandb_watch_only", "wandb_watch_10"):
        for watcher, prefix in (("gradwatch_wandb", "ratio"), ("minimal", "floor_ratio")):
            if watch in by and watcher in by:
                for what in ("wall", "thread", "cpu"):
                    out[f"{prefix}_{what}_vs_{watch}"] = overhead(by, watcher, what) / overhead(by, watch, what)
    return out


def table(reports: list[dict[str, Any]]) -> Table:
    out = Table(title="Per-step cost over bare training (ms per step; totals over every timed step)")
    for column in ("workload", "variant", "ms/step", "overhead (wall)", "training thread CPU", "process CPU",
                   "W&B service CPU"):
        out.add_column(column, justify="left" if column in ("workload", "variant") else "right")
    for rep in reports:
        for variant, row in rep["variants"].items():
            out.add_row(rep["workload"], variant, f"{row['ms_per_step']:.2f}",
                        f"{row['overhead_ms']:+.3f}" if "overhead_ms" in row else "",
                        f"{row['thread_overhead_ms']:+.3f}" if "thread_overhead_ms" in row else "",
                        f"{row['cpu_overhead_ms']:+.3f}" if "cpu_overhead_ms" in row else "",
                        f"{row['service_cpu_ms_per_step']:.3f}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mlp,cnn", help="comma-separated subset of: " + ", ".join(WORKLOADS))
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS) + " (bare is always measured)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default: 10)")
    parser.add_argument("--steps", type=int, default=100, help="steps per block (default: 100)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    chosen = {v.strip() for v in args.variants.split(",") if v.strip()}
    if chosen - set(VARIANTS):
        parser.error(f"unknown variant(s) {', '.join(sorted(chosen - set(VARIANTS)))}")
    variants = [v for v in VARIANTS if v in chosen or v == "bare"]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workload(s) {', '.join(sorted(set(workloads) - set(WORKLOADS)))}")
    torch.set_num_threads(args.threads)
    os.environ.update(WANDB_SILENT="true", WANDB_CONSOLE="off")
    import wandb

    console = Console() if sys.stdout.isatty() else Console(width=140)
    reports = []
    with tempfile.TemporaryDirectory(prefix="gradwatch-wandb-cost-") as tmp:
        for name in workloads:
            reports.append(report(name, measure(name, args.rounds, args.steps, variants, Path(tmp), console)))
    console.print(table(reports))
    for rep in reports:
        for prefix, watcher in (("ratio_", "gradwatch_wandb"), ("floor_ratio_", "minimal (the floor)")):
            for key in sorted(k for k in rep if k.startswith(prefix)):
                what, watch = key.removeprefix(prefix).split("_vs_")
                console.print(f"{rep['workload']}: {watcher}'s overhead / {watch}'s ({what}): {rep[key]:.2f}",
                              highlight=False)
    out = {"torch": torch.__version__, "wandb": wandb.__version__, "gradwatch": gw.__version__,
           "threads": args.threads, "rounds": args.rounds, "steps": args.steps, "reports": reports}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
        console.print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
