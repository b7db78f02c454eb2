"""Overhead of gradwatch: per-step training time with and without it, in one process.

Synthetic, seeded workloads (no downloads; the large ones built from their published configs):

- ``gpt``: a small GPT-style decoder (6 pre-LN blocks, d_model 256, 4 heads, vocab 512, seq 128,
  batch 8), AdamW, cross-entropy;
- ``mlp``: 48 x (Linear(128, 128) + ReLU), batch 64, SGD, MSE -- the hook-bound worst case;
- ``cnn``: 3 conv-BN-ReLU blocks (32-64-128 channels) on 32x32x3 inputs, batch 32, SGD with
  momentum, cross-entropy;
- ``pg``: many forward calls per step: a REINFORCE rollout of 100 single-sample forward calls of
  the classic policy (Linear 4-128, dropout, ReLU, Linear 128-2, softmax), each sampling an action
  read on the host, then one Adam step per episode;
- ``many``: many modules that do next to nothing: 1,000 pre-norm residual blocks of LayerNorm,
  Linear(16, 16) and ReLU and a head (4,003 modules, 3,002 leaves, 4,004 parameters), batch 8, SGD,
  MSE -- a cost per module or per parameter shows here;
- ``gpt2`` and ``resnet50``: the realistic sizes, built from their configs: a GPT-2-small-shaped
  model (12 x 768, 12 heads, vocab 50257, tied embeddings), 2 x 128 tokens per step, AdamW; and a
  ResNet-50-shaped one (bottleneck blocks 3-4-6-3, BatchNorm, 25.6M parameters), 2 images of
  224 x 224 per step, SGD with momentum. Measured only when named (``--workloads gpt2,resnet50``):
  a step takes seconds on a CPU, so only ``bare``, ``gradwatch``, ``foreach`` and ``minimal``.

Each workload is trained in these variants, every one on its own model copy built from the same
seed and fed the same batches:

- ``bare``: the plain loop;
- ``gradwatch``: the product default -- ``gw.watch(model, rules="default")`` with every detector
  and non-finite origin tracking on; the loop also calls ``gw.watcher(model).observe(loss=loss)``;
- ``gradwatch_no_origin``: the same with ``origin=False``;
- ``gradwatch_record_only``: the same with ``rules=None`` (detect and record only, no actions);
- ``gradwatch_stats_only``: statistics only -- no detectors, no rules, no origin tracking (what
  detection and acting add is ``gradwatch`` minus this);
- ``gradwatch_all``: the default with ``sample_every=1`` (every statistic on every step);
- ``naive``: reference, a tensor hook per parameter and a forward hook per leaf module, each
  reading a norm to the host with ``.item()``;
- ``anomaly``: reference, the bare model with each block of steps under
  ``torch.autograd.set_detect_anomaly(True)``;
- ``foreach``: reference, one ``torch._foreach_norm`` over all gradients per step, read with one
  ``torch.stack(...).cpu()``;
- ``minimal``: reference, the tensor work of gradwatch's default statistics and nothing else: the
  ``foreach`` read every step and, every tenth step, the gradients' largest values, the weight
  norms, a copy of the weights and the norms of the update, and each leaf module's output norm
  and non-zero count from forward hooks registered for that step, read with one host copy (no
  detector, record or store: the floor of any watcher that takes these statistics);
- ``compiled`` and ``gradwatch_compiled`` (only when named in ``--variants``): ``torch.compile(model)``
  alone, and ``gw.watch(torch.compile(model))``; reported against each other.

Every gradwatch variant runs with ``console=False`` and writes its run into a temporary directory
(deleted at exit). ``--variants`` picks a subset (``bare`` is always measured: it is the baseline).

Measurement is interleaved: after warm-up, each round runs a block of K steps of every variant in
turn (the order rotates every round) and times each block with ``time.perf_counter`` and
``time.process_time`` (CPU of every thread of the process, gradwatch's writer thread included).
Reported are the median over rounds of each variant's per-step time, and the medians over rounds
of the ratios of its block time and block CPU to the bare block's of the same round. On a machine
shared with other work, wall-clock ratios are noisy (and with several intra-op threads, an
oversubscribed CPU makes OpenMP's barriers wait for descheduled threads); the CPU ratio with
``--threads 1`` is the steadier figure. glibc's malloc is pinned first (``--malloc``): by default it
maps and unmaps large blocks with a threshold it adapts as it goes, so that one process page-faults
on every step and the next not at all, which moved a CNN's ratio by +-3%. gradwatch stays attached across rounds;
each of its blocks ends with ``watcher.flush()`` inside the timed region, so that the work of its
writer thread is charged to gradwatch and does not spill into the next variant's block.

After a workload's rounds every run is closed and read back with ``gw.open_run(path)``: the run
must be closed as ``finished`` and, the training being healthy, hold no finding of warning or
error severity; a line starting with ``WARNING`` lists any that did appear.

At the end, per workload, the added cost of origin tracking, ``ratio(gradwatch) -
ratio(gradwatch_no_origin)``, is set against the added cost of anomaly mode, ``ratio(anomaly) -
1``, and their quotient printed ("origin tracking is N x cheaper than anomaly mode"). Noise is the
distribution-free confidence interval (95%, or [min, max] when there are too few rounds for that)
of the median of the per-round differences of the two ratios: when the added cost is <= 0 or that
interval reaches 0, it is printed as "within noise (<= x%)", x being the interval's upper end (at
least its half-width), and the quotient is taken against x -- a lower bound, said as "at least".

``--attribute N`` measures where gradwatch's own time goes, a figure that machine noise does not
drown: per workload, a loop watched at default settings trains N steps (after warm-up, in
blocks interleaved with a bare loop) with a CPU timer (``time.thread_time``) around each of
gradwatch's entry points in the training thread (its forward, backward, end-of-backward and
optimizer hooks, the activation hooks, ``observe``) and around the detectors and rule engine
(``Judge.check``, ``check_late``, ``step``) and non-finite origin tracking (``Tracker.capture``,
``output``, ``Capture.keep_grad``, ``clear``, ``find``); garbage collections are timed apart
(those of the watched blocks beyond the bare blocks'), and the writer thread's CPU time is read
from the OS. Reported per step in ms and as a fraction of the bare step's CPU: all of gradwatch's
training-thread time, its parts, the extra collections, and the writer thread. (The timers
themselves add about a microsecond per call.)

``--cold N`` shows why a step's Python costs more in training than timed alone: per workload, a
loop watched at default settings trains N steps, and three parts of gradwatch's step that change
nothing (the step's numpy vectors, the host read, the RNG state a captured forward call keeps) run
where gradwatch runs them, after the model's forward and backward passes, and then once more at
once with the same arguments. The medians of both, in microseconds of the training thread's CPU,
differ by the cost of caches the model's own work has filled (see ``docs/performance.md``).

``--memory`` measures the peak memory of ``bare``, ``gradwatch`` and ``gradwatch`` with a rollback
rule (in-memory snapshots) per workload, each in a fresh process (see ``memory.py``).

``--rss-steps N`` first trains a workload (``--rss-workload``, default gpt) for N steps with
gradwatch at default settings and samples the process RSS every 100 steps, to show that memory is
flat after warm-up. For every
gradwatch run the size of its run store (SQLite file plus TensorBoard event files) per 1,000
recorded steps is reported too.

Run it with::

    python benchmarks/overhead.py                                  # gpt, mlp, cnn, pg, many: ~10-15 minutes
    python benchmarks/overhead.py --workloads mlp,cnn --rounds 3   # a quick check
    python benchmarks/overhead.py --variants gradwatch,gradwatch_no_origin,anomaly --json out.json
    python benchmarks/overhead.py --workloads gpt --rounds 1 --rss-steps 2000 --json out.json
    python benchmarks/overhead.py --rounds 0 --rss-workload mlp --rss-steps 20000   # RSS over 20,000 steps
    python benchmarks/overhead.py --rounds 0 --attribute 500         # where gradwatch's time goes
    python benchmarks/overhead.py --workloads mlp,pg --rounds 0 --cold 300   # the same code, in the step and again
    python benchmarks/overhead.py --workloads mlp,pg --rounds 5 --threads 1 --memory
    python benchmarks/overhead.py --workloads gpt2,resnet50 --rounds 2  # the realistic sizes: minutes per round
    python benchmarks/overhead.py --workloads gpt --variants gradwatch,compiled,gradwatch_compiled
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules, beside this script

from measuring import (  # noqa: E402
    COLD_PARTS,
    MIB,
    Result,
    attribute,
    cold,
    measure,
    rss_run,
)
from memory import MEMORY_VARIANTS, overheads  # noqa: E402
from variants import OPT_IN, VARIANTS  # noqa: E402
from workloads import LARGE, WORKLOADS  # noqa: E402

import gradwatch as gw  # noqa: E402

#: coverage sought for the interval of a median over rounds
COVERAGE = 0.95


# ------------------------------------------------------------------ report
def cold_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="The same code in the step and right again: median CPU microseconds per call "
                  "(first: as gradwatch runs it, after the model's forward and backward; again: at once)")
    table.add_column("workload")
    for label, _, _ in COLD_PARTS:
        table.add_column(label, justify="right")
    for row in rows:
        cells = []
        for label, _, _ in COLD_PARTS:
            part = row["parts"].get(label)
            cells.append("-" if part is None else f"{part['first_us']:.1f} / {part['again_us']:.1f}\n"
                         f"({part['first_us'] / max(part['again_us'], 1e-9):.1f}x, {part['calls_per_step']:.2g}/step)")
        table.add_row(row["workload"], *cells)
    return table


def attribution_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Where gradwatch's time goes (default settings): CPU ms per step, and % of a bare step's CPU")
    table.add_column("workload")
    table.add_column("bare step", justify="right")
    for part in rows[0]["ms_per_step"]:
        table.add_column(part, justify="right")
    for row in rows:
        bare = row.get("bare_cpu_ms_per_step", row["bare_ms_per_step"])
        table.add_row(row["workload"], f"{bare:.2f} ms CPU\n({row['bare_ms_per_step']:.2f} ms wall)",
                      *(f"{ms:.3f} ms\n{ms / bare:.1%}" for ms in row["ms_per_step"].values()))
    return table


def _verdict(ok: bool) -> str:
    return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"


def targets(results: list[Result]) -> list[dict[str, Any]]:
    """The targets of gradwatch at default settings: a ratio cap per workload, and below naive."""
    by_key = {(r.workload, r.variant): r for r in results}
    out = []
    for (name, variant), r in by_key.items():
        if variant != "gradwatch":
            continue
        out.append({"workload": name, "target": f"ratio <= {WORKLOADS[name].target}",
                    "value": r.ratio, "pass": r.ratio <= WORKLOADS[name].target})
        naive = by_key.get((name, "naive"))
        if naive is not None:
            out.append({"workload": name, "target": "ratio < naive", "value": r.ratio, "naive": naive.ratio,
                        "pass": r.ratio < naive.ratio})
    return out


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """A distribution-free confidence interval of the median: (low, high, coverage).

    The order statistics ``x[k]`` and ``x[n-1-k]`` with the largest ``k`` whose coverage
    ``1 - 2 P(Binomial(n, 1/2) <= k)`` is at least COVERAGE; [min, max] (with its lower coverage)
    when there are too few values for that.
    """
    xs, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n

    k = 0
    while 2 * (k + 1) <= n - 1 and coverage(k + 1) >= COVERAGE:
        k += 1
    return xs[k], xs[n - 1 - k], coverage(k)


def origin_vs_anomaly(results: list[Result]) -> list[dict[str, Any]]:
    """Per workload: the added costs of origin tracking and of anomaly mode, and their quotient.

    Costs are fractions of bare training's step time. The origin cost is ``ratio(gradwatch) -
    ratio(gradwatch_no_origin)``; its noise comes from the per-round differences of the two
    ratios (see :func:`median_interval`). When the cost is <= 0 or the interval reaches 0, it is
    within noise: the bound is the interval's upper end (at least its half-width), and the
    quotient is taken against that bound, making it a lower bound.
    """
    by_key = {(r.workload, r.variant): r for r in results}
    out = []
    for name in dict.fromkeys(r.workload for r in results):
        watched, plain, anomaly = (by_key.get((name, v)) for v in ("gradwatch", "gradwatch_no_origin", "anomaly"))
        if watched is None or plain is None or anomaly is None:
            continue
        cost = watched.ratio - plain.ratio
        low, high, coverage = median_interval([a - b for a, b in zip(watched.ratios, plain.ratios, strict=True)])
        within_noise = cost <= 0 or low <= 0
        bound = max(high, cost, (high - low) / 2) if within_noise else cost
        anomaly_cost = anomaly.ratio - 1
        quotient = anomaly_cost / bound if bound > 0 and anomaly_cost > 0 else None
        out.append({"workload": name, "rounds": len(watched.ratios),
                    "origin_cost": cost, "origin_interval": [low, high], "interval_coverage": coverage,
                    "origin_within_noise": within_noise, "origin_bound": bound,
                    "anomaly_cost": anomaly_cost, "quotient": quotient,
                    "quotient_against": "noise bound" if within_noise else "measured cost"})
    return out


def summary_lines(summary: list[dict[str, Any]]) -> list[str]:
    """The origin-vs-anomaly summary in words, one line per workload and a note on the noise."""
    lines = []
    for s in summary:
        low, high = s["origin_interval"]
        if s["rounds"] < 2:
            origin = f"{s['origin_cost']:+.1%} (one round: noise unknown)"
        elif s["origin_within_noise"]:
            origin = f"within noise (<= {s['origin_bound']:.1%}; measured {s['origin_cost']:+.1%})"
        else:
            origin = f"{s['origin_cost']:+.1%}"
        quotient = s["quotient"]
        if quotient is None:
            verdict = "no quotient (no positive bound or anomaly cost; run more rounds)"
        else:
            times = f"{quotient:.1f}x" if quotient < 10 else f"{quotient:.0f}x"
            verdict = (f"origin tracking is at least {times} cheaper than anomaly mode (against the noise bound)"
                       if s["origin_within_noise"] else f"origin tracking is {times} cheaper than anomaly mode")
        lines.append(f"{s['workload']}: origin tracking {origin} [per-round differences: {low:+.1%} .. {high:+.1%}, "
                     f"{s['rounds']} rounds, {s['interval_coverage']:.0%} interval of the median]; "
                     f"anomaly mode {s['anomaly_cost']:+.1%}; {verdict}")
    if summary:
        lines.append("Added cost per step as a fraction of bare training: origin tracking = ratio(gradwatch) - "
                     "ratio(gradwatch_no_origin), anomaly mode = ratio(anomaly) - 1. The interval is "
                     "distribution-free, of the median of the per-round differences of the two ratios.")
    return lines


def results_table(results: list[Result], checks: list[dict[str, Any]]) -> Table:
    table = Table(title="Per-step time, interleaved (median over rounds); CPU: seconds of CPU of every thread")
    for column in ("workload", "variant", "ms/step (median)", "ratio vs bare", "CPU ratio", "target", "status"):
        table.add_column(column, justify="right" if column.startswith(("ms", "ratio", "CPU")) else "left")
    for r, following in zip(results, [*results[1:], None], strict=True):
        mine = [c for c in checks if (c["workload"], r.variant) == (r.workload, "gradwatch")]
        table.add_row(r.workload, r.variant, f"{r.ms_per_step:.2f}", f"{r.ratio:.3f}", f"{r.cpu_ratio:.3f}",
                      "\n".join(c["target"] for c in mine), "\n".join(_verdict(c["pass"]) for c in mine),
                      end_section=following is None or following.workload != r.workload)
    return table


def compiled_lines(results: list[Result]) -> list[str]:
    """gradwatch on a compiled model against the compiled model alone, per workload."""
    by_key = {(r.workload, r.variant): r for r in results}
    lines = []
    for name in dict.fromkeys(r.workload for r in results):
        watched, plain = by_key.get((name, "gradwatch_compiled")), by_key.get((name, "compiled"))
        if watched is None or plain is None:
            continue
        ratios = [a / b for a, b in zip(watched.blocks, plain.blocks, strict=True)]
        cpu = [a / b for a, b in zip(watched.cpu, plain.cpu, strict=True)]
        lines.append(f"{name}: gw.watch(torch.compile(model)) vs torch.compile(model): ratio "
                     f"{statistics.median(ratios):.3f} (CPU {statistics.median(cpu):.3f}); the compiled model vs "
                     f"eager bare: {plain.ratio:.3f}")
    return lines


def memory_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Peak memory, each variant in a fresh process (RSS; CUDA allocated when on a GPU)")
    for column in ("workload", "steps", *(f"{v} peak" for v in MEMORY_VARIANTS),
                   *(f"{v} overhead" for v in MEMORY_VARIANTS[1:])):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for row in rows:
        peaks = [f"{row['peaks'][v]['peak_rss'] / MIB:,.0f} MiB" for v in MEMORY_VARIANTS]
        extra = [f"{row[f'{v}_rss_overhead'] / MIB:+,.1f} MiB" for v in MEMORY_VARIANTS[1:]]
        if row["peaks"]["bare"].get("cuda_peak") is not None:
            peaks = [f"{p}\n{row['peaks'][v]['cuda_peak'] / MIB:,.0f} MiB (CUDA)"
                     for p, v in zip(peaks, MEMORY_VARIANTS, strict=True)]
            extra = [f"{e}\n{row[f'{v}_cuda_overhead'] / MIB:+,.1f} MiB (CUDA)"
                     for e, v in zip(extra, MEMORY_VARIANTS[1:], strict=True)]
        table.add_row(row["workload"], str(row["steps"]), *peaks, *extra)
    return table


def store_table(rows: list[tuple[str, dict[str, float]]]) -> Table:
    table = Table(title="Run store size (gradwatch.sqlite + TensorBoard event files)")
    for column in ("run", "steps trained", "steps recorded", "bytes", "of which events", "KiB per 1,000 steps"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, store in rows:
        recorded = str(store["steps"]) if store["steps"] == store["trained"] else f"[red]{store['steps']}[/red]"
        table.add_row(name, str(store["trained"]), recorded, f"{store['bytes']:,}", f"{store['event_bytes']:,}",
                      f"{store['bytes_per_1000_steps'] / 1024:,.1f}")
    return table


def rss_table(rss: dict[str, Any]) -> Table:
    table = Table(title=f"Process RSS, {rss['workload']} workload with gradwatch (default settings), "
                        f"{rss['steps']} steps")
    table.add_column("step", justify="right")
    table.add_column("RSS (MiB)", justify="right")
    for step, value in rss["samples"]:
        table.add_row(str(step), f"{value / MIB:.1f}")
    return table


def rss_summary(rss: dict[str, Any]) -> str:
    return (f"RSS after warm-up (step {max(1, rss['steps'] // 10)}): {rss['rss_after_warmup'] / MIB:.1f} MiB; "
            f"at the end: {rss['rss_end'] / MIB:.1f} MiB; peak sampled: {rss['rss_peak'] / MIB:.1f} MiB; "
            f"growth after warm-up: {rss['growth_after_warmup'] / MIB:+.1f} MiB "
            f"({rss['seconds'] / rss['steps'] * 1000:.0f} ms/step)")


# --------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w not in LARGE),
                        help="comma-separated subset of: " + ", ".join(WORKLOADS) + " (default: all but "
                        + ", ".join(LARGE) + ", measured only when named: their steps take seconds on a CPU)")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in OPT_IN),
                        help="comma-separated subset of: " + ", ".join(VARIANTS)
                        + " (default: all but " + ", ".join(OPT_IN) + ", which compile the model; bare is "
                        "always measured, it is the baseline; a workload with a list of its own, such as gpt2, "
                        "measures only the chosen ones in it)")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds per workload (default: " + ", ".join(
                            f"{w.rounds} {name}" for name, w in WORKLOADS.items()) + ")")
    parser.add_argument("--steps", type=int, help="steps per block (default: " + ", ".join(
        f"{w.steps} {name}" for name, w in WORKLOADS.items()) + ")")
    parser.add_argument("--attribute", type=int, default=0, metavar="N",
                        help="also time gradwatch's parts over N steps per workload (default: 0, skip)")
    parser.add_argument("--cold", type=int, default=0, metavar="N",
                        help="also time parts of gradwatch's step where it runs them and right again, over N steps "
                        "per workload (default: 0, skip)")
    parser.add_argument("--rss-steps", type=int, default=0,
                        help="first train a workload watched for N steps, sampling the RSS (default: 0, skip)")
    parser.add_argument("--rss-workload", default="gpt", choices=list(WORKLOADS),
                        help="the workload of the RSS run (default: gpt)")
    parser.add_argument("--memory", action="store_true",
                        help="also measure the peak memory of bare, gradwatch and gradwatch with a rollback rule, "
                        "each in a fresh process, per workload")
    parser.add_argument("--memory-steps", type=int, default=20, metavar="N",
                        help="steps after warm-up in each memory run (default: 20)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    parser.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                        help="pinned (default): keep glibc's malloc from returning large freed blocks to the system "
                        "and mapping them again, which adds page faults whose number varies from process to "
                        "process (+-3%% of a CNN step); default: leave the allocator as it is")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    chosen = {v.strip() for v in args.variants.split(",") if v.strip()}
    unknown = sorted(chosen - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in chosen or v == "bare"]
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.rounds is not None and args.rounds < 0:
        parser.error("--rounds must not be negative (0: only the attribution or the RSS run)")
    for name in ("rss_steps", "attribute", "cold"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    return args


def pin_malloc() -> bool:
    """Keep glibc's malloc from unmapping and trimming large freed blocks (``mallopt``); False where
    there is no glibc (the allocator is then left alone).

    A training step frees and allocates tensors of megabytes. By default glibc serves them with
    ``mmap`` above a threshold that it adapts as it goes, so whether a step page-faults on fresh
    memory depends on the process's history: two runs of the same loop differed by 2.8 ms of
    kernel time per CNN step. Bare and watched loops share the process, hence the allocator; pinned,
    the ratio measures gradwatch rather than that history.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    big = 1 << 30
    return bool(mallopt(m_mmap_threshold, big)) and bool(mallopt(m_trim_threshold, big))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console() if sys.stdout.isatty() else Console(width=120)
    report: dict[str, Any] = {"torch": torch.__version__, "gradwatch": gw.__version__, "threads": args.threads,
                              "variants": args.variants}
    with tempfile.TemporaryDirectory(prefix="gradwatch-overhead-") as tmp:
        root = Path(tmp)
        rss = rss_run(args.rss_steps, root, console, args.rss_workload) if args.rss_steps else None
        pinned = args.malloc == "pinned" and pin_malloc()  # after the RSS run: pinned memory is not returned
        report["malloc_pinned"] = pinned
        results: list[Result] = []
        attribution: list[dict[str, Any]] = []
        colds: list[dict[str, Any]] = []
        memory: list[dict[str, Any]] = []
        for name in args.workloads:
            workload = WORKLOADS[name]
            chosen = [v for v in args.variants if workload.variants is None or v in workload.variants]
            if args.rounds != 0:
                results += measure(name, workload, chosen, args.rounds or workload.rounds,
                                   args.steps or workload.steps, root, console)
            if args.memory:
                memory.append(overheads(name, args.memory_steps, args.threads))
                console.log(f"{name} memory: gradwatch {memory[-1]['gradwatch_rss_overhead'] / MIB:+.1f} MiB RSS")
            if args.attribute:
                attribution.append(attribute(name, workload, args.attribute, root, console))
            if args.cold:
                colds.append(cold(name, workload, args.cold, root, console))
    checks = targets(results)
    if results:
        console.print(results_table(results, checks))
    for line in compiled_lines(results):
        console.print(line, highlight=False, markup=False)
    if attribution:
        console.print(attribution_table(attribution))
    if colds:
        console.print(cold_table(colds))
    if memory:
        console.print(memory_table(memory))
    stores = [(f"{r.workload} {r.variant}", r.store) for r in results if r.store is not None]
    if rss is not None:
        stores.append((f"{rss['workload']} gradwatch, {rss['steps']}-step RSS run", rss["store"]))
        console.print(rss_table(rss))
        console.print(rss_summary(rss))
    if stores:
        console.print(store_table(stores))
    healths = [(f"{r.workload} {r.variant}", r.health) for r in results if r.health is not None]
    if rss is not None:
        healths.append((f"{rss['workload']} gradwatch (RSS run)", rss["health"]))
    unhealthy = [label for label, h in healths if h["problems"] or h["status"] != "finished"]
    if unhealthy:
        console.print(f"[red]WARNING[/red] healthy-run check failed for: {', '.join(unhealthy)} (listed above)")
    elif healths:
        console.print(f"Healthy-run check: all {len(healths)} gradwatch runs closed as finished, "
                      "with no finding of warning or error severity.")
    summary = origin_vs_anomaly(results)
    if summary:
        console.print("\n[bold]Origin tracking vs anomaly mode[/bold]")
        for line in summary_lines(summary):
            console.print(line, highlight=False, markup=False)
    elif not {"gradwatch", "gradwatch_no_origin", "anomaly"} <= set(args.variants):
        console.print("(origin-vs-anomaly summary skipped: it needs the variants gradwatch, gradwatch_no_origin "
                      "and anomaly)")
    if args.json is not None:
        report.update(results=[r.to_dict() for r in results], targets=checks, rss=rss, attribution=attribution,
                      cold=colds, origin_vs_anomaly=summary, unhealthy_runs=unhealthy, memory=memory,
                      compiled=compiled_lines(results))
        args.json.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
