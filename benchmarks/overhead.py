"""Overhead of gradwatch: per-step training time with and without it, in one process.

Three synthetic, seeded workloads (no downloads):

- ``gpt``: a small GPT-style decoder (6 pre-LN blocks, d_model 256, 4 heads, vocab 512, seq 128,
  batch 8), AdamW, cross-entropy;
- ``mlp``: 48 x (Linear(128, 128) + ReLU), batch 64, SGD, MSE -- the hook-bound worst case;
- ``cnn``: 3 conv-BN-ReLU blocks (32-64-128 channels) on 32x32x3 inputs, batch 32, SGD with
  momentum, cross-entropy.

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
  ``torch.stack(...).cpu()``.

Every gradwatch variant runs with ``console=False`` and writes its run into a temporary directory
(deleted at exit). ``--variants`` picks a subset (``bare`` is always measured: it is the baseline).

Measurement is interleaved: after warm-up, each round runs a block of K steps of every variant in
turn (the order rotates every round) and times each block with ``time.perf_counter``. Reported are
the median over rounds of each variant's per-step time, and the median over rounds of the ratio
of its block time to the bare block of the same round. gradwatch stays attached across rounds;
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
blocks interleaved with a bare loop) with a timer around each of gradwatch's entry points in the
training thread (its forward, backward and optimizer hooks, the activation hooks, ``observe``)
and around the detectors and rule engine (``Judge.check``, ``check_late``, ``step``) and
non-finite origin tracking (``Tracker.capture``, ``output_grad``, ``clear``, ``find``); the
writer thread's CPU time is read from the OS. Reported per step in ms and as a fraction of the
bare step: all of gradwatch's training-thread time, its parts, and the writer thread. (The
timers themselves add about a microsecond per call.)

``--rss-steps N`` first trains the gpt workload for N steps with gradwatch at default settings and
samples the process RSS every 100 steps, to show that memory is flat after warm-up. For every
gradwatch run the size of its run store (SQLite file plus TensorBoard event files) per 1,000
recorded steps is reported too.

Run it with::

    python benchmarks/overhead.py                                  # all workloads, ~10-15 minutes
    python benchmarks/overhead.py --workloads mlp,cnn --rounds 3   # a quick check
    python benchmarks/overhead.py --variants gradwatch,gradwatch_no_origin,anomaly --json out.json
    python benchmarks/overhead.py --workloads gpt --rounds 1 --rss-steps 2000 --json out.json
    python benchmarks/overhead.py --rounds 0 --attribute 500         # where gradwatch's time goes
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn

import gradwatch as gw
from gradwatch import detectors, judge, origin, probe, watching

SEED = 0
#: distinct batches per workload, generated once and cycled through by every variant
POOL = 8
#: warm-up steps of every variant before measuring
WARMUP = 20
#: warm-up steps of the gradwatch variants: three sampling periods, so sampled steps have run
WARMUP_WATCHED = 30
VARIANTS = ("bare", "gradwatch", "gradwatch_no_origin", "gradwatch_record_only", "gradwatch_stats_only",
            "gradwatch_all", "naive", "anomaly", "foreach")
#: finding severities that a healthy benchmark run must not produce
BAD_SEVERITIES = ("warning", "error")
#: coverage sought for the interval of a median over rounds
COVERAGE = 0.95
RSS_EVERY = 100
MIB = 2**20

Batch = tuple[Tensor, Tensor]


# ------------------------------------------------------------------ workloads
class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Small GPT-style decoder: token and learned position embeddings, blocks, LM head."""

    def __init__(self, vocab: int = 512, seq: int = 128, d_model: int = 256, heads: int = 4, layers: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_batch(gen: torch.Generator, vocab: int = 512, seq: int = 128, batch: int = 8) -> Batch:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def deep_mlp(depth: int = 48, width: int = 128) -> nn.Module:
    """Linear + ReLU layers with He initialisation, so activations neither vanish nor explode."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        linear = nn.Linear(width, width)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers)


def mlp_batch(gen: torch.Generator) -> Batch:
    return torch.randn(64, 128, generator=gen), torch.randn(64, 128, generator=gen)


def small_cnn() -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32), nn.MaxPool2d(2),
        *block(32, 64), nn.MaxPool2d(2),
        *block(64, 128), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, 10),
    )


def cnn_batch(gen: torch.Generator) -> Batch:
    return torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen)


@dataclass(frozen=True)
class Workload:
    """A model, its optimizer, its data and loss, and how it is measured by default."""

    build: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[Tensor, Tensor], Tensor]
    steps: int  # steps per block, a multiple of gradwatch's default sampling period
    rounds: int
    target: float  # the largest acceptable ratio of gradwatch at default settings to bare

    def batches(self) -> list[Batch]:
        gen = torch.Generator().manual_seed(SEED)
        return [self.batch(gen) for _ in range(POOL)]


WORKLOADS = {
    "gpt": Workload(GPT, lambda p: torch.optim.AdamW(p, lr=3e-4), gpt_batch, lm_loss, steps=10, rounds=5, target=1.04),
    "mlp": Workload(deep_mlp, lambda p: torch.optim.SGD(p, lr=1e-3), mlp_batch, F.mse_loss, steps=50, rounds=11,
                    target=1.20),
    "cnn": Workload(small_cnn, lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), cnn_batch, F.cross_entropy,
                    steps=20, rounds=9, target=1.04),
}


# ---------------------------------------------------------------- the loop
def _nothing(*args: Any) -> None:
    return None


@dataclass
class Loop:
    """One variant of one workload: its own model copy and optimizer, and an ordinary training loop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Batch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    on_loss: Callable[[Tensor], None] = _nothing
    on_backward: Callable[[], None] = _nothing
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    after_block: Callable[[], None] = _nothing
    close: Callable[[], None] = _nothing
    run_dir: Path | None = None
    done: int = 0

    def run(self, steps: int) -> float:
        """Train ``steps`` steps; return the elapsed seconds."""
        start = time.perf_counter()
        with self.context():
            for _ in range(steps):
                self.step()
        self.after_block()
        return time.perf_counter() - start

    def step(self) -> None:
        x, y = self.batches[self.done % len(self.batches)]
        self.done += 1
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        self.on_loss(loss)
        loss.backward()
        self.on_backward()
        self.optimizer.step()


def make_loop(workload: Workload, batches: list[Batch]) -> Loop:
    torch.manual_seed(SEED)
    model = workload.build()
    return Loop(model, workload.optimizer(model.parameters()), batches, workload.loss)


# ---------------------------------------------------------------- variants
def with_gradwatch(loop: Loop, run_dir: Path, **options: Any) -> None:
    """Watch the loop's model into ``run_dir``: default rules and options unless ``options`` say otherwise."""
    gw.watch(loop.model, run=run_dir, overwrite=True, **{"rules": "default", "console": False, **options})
    loop.on_loss = lambda loss: gw.watcher(loop.model).observe(loss=loss)
    loop.after_block = lambda: gw.watcher(loop.model).flush()
    loop.close = lambda: gw.unwatch(loop.model)
    loop.run_dir = run_dir


def _first_tensor(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else output[0]


def with_naive(loop: Loop, run_dir: Path) -> None:
    def grad_hook(grad: Tensor) -> None:
        grad.norm().item()

    def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
        _first_tensor(output).norm().item()

    def remove() -> None:
        for handle in handles:
            handle.remove()

    handles = [p.register_hook(grad_hook) for p in loop.model.parameters()]
    handles += [m.register_forward_hook(forward_hook) for m in loop.model.modules() if not any(m.children())]
    loop.close = remove


def with_anomaly(loop: Loop, run_dir: Path) -> None:
    loop.context = lambda: torch.autograd.set_detect_anomaly(True)


def with_foreach(loop: Loop, run_dir: Path) -> None:
    def read_norms() -> None:
        grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
        torch.stack(torch._foreach_norm(grads)).cpu()

    loop.on_backward = read_norms


SETUP: dict[str, Callable[[Loop, Path], None]] = {
    "bare": _nothing,
    "gradwatch": with_gradwatch,
    "gradwatch_no_origin": lambda loop, run_dir: with_gradwatch(loop, run_dir, origin=False),
    "gradwatch_record_only": lambda loop, run_dir: with_gradwatch(loop, run_dir, rules=None),
    "gradwatch_stats_only": lambda loop, run_dir: with_gradwatch(
        loop, run_dir, rules=None, origin=False, detectors={kind: {"enabled": False} for kind in detectors.REGISTRY}),
    "gradwatch_all": lambda loop, run_dir: with_gradwatch(loop, run_dir, sample_every=1),
    "naive": with_naive,
    "anomaly": with_anomaly,
    "foreach": with_foreach,
}


# -------------------------------------------------------------- measurement
@dataclass
class Result:
    """Block times of one variant of one workload, and the ratios to the bare block of each round."""

    workload: str
    variant: str
    steps: int
    blocks: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    store: dict[str, float] | None = None
    health: dict[str, Any] | None = None

    @property
    def ms_per_step(self) -> float:
        return 1000 * statistics.median(self.blocks) / self.steps

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "variant": self.variant, "steps_per_block": self.steps,
                "ms_per_step": self.ms_per_step, "ratio_vs_bare": self.ratio,
                "block_seconds": self.blocks, "ratios": self.ratios, "store": self.store, "health": self.health}


def store_size(loop: Loop) -> dict[str, float]:
    """Bytes of a closed run's directory (SQLite store and event files), in all and per 1,000 recorded steps.

    Also the steps trained, which differ from the steps recorded if gradwatch detached itself mid-run.
    """
    assert loop.run_dir is not None
    files = [f for f in loop.run_dir.iterdir() if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    events = sum(f.stat().st_size for f in files if f.name.startswith("events.out.tfevents."))
    with gw.open_run(loop.run_dir) as run:
        steps = run.steps
    return {"bytes": size, "event_bytes": events, "steps": steps, "trained": loop.done,
            "bytes_per_1000_steps": size / steps * 1000 if steps else float("nan")}


def run_health(loop: Loop, label: str, console: Console) -> dict[str, Any]:
    """Read a closed run back: its status and its findings, which healthy training must not have.

    Prints a line starting with WARNING if the run was not closed as finished, and one listing
    the findings of warning or error severity if there are any.
    """
    assert loop.run_dir is not None
    with gw.open_run(loop.run_dir) as run:
        status = run.status
        findings = run.findings()
    counts = {str(k): int(v) for k, v in findings["severity"].value_counts().items()}
    bad = findings[findings["severity"].isin(BAD_SEVERITIES)]
    problems = [{"step": int(f.step), "kind": f.kind, "severity": f.severity, "layer": f.layer,
                 "message": f.message, "action": f.action, "repeats": f.data.get("repeats", 1)}
                for f in bad.itertuples(index=False)]
    if status != "finished":
        console.print(f"[red]WARNING[/red] {label}: run {loop.run_dir} was left {status!r}, not 'finished'")
    if problems:
        console.print(f"[red]WARNING[/red] {label}: {len(problems)} finding(s) of warning/error severity "
                      "in healthy benchmark training (there must be none):", highlight=False)
        for f in problems:
            repeats = f" (x{f['repeats']})" if f["repeats"] != 1 else ""
            console.print(f"    step {f['step']} {f['severity']} {f['kind']} {f['layer'] or '<global>'}: "
                          f"{f['message']}{repeats}" + (f" [action: {f['action']}]" if f["action"] else ""),
                          highlight=False, markup=False)
    return {"status": status, "findings": counts, "problems": problems}


@contextlib.contextmanager
def variant_loops(name: str, workload: Workload, variants: list[str], root: Path) -> Iterator[dict[str, Loop]]:
    """A loop per variant, set up for it; closed (gradwatch unwatched) on exit."""
    batches = workload.batches()
    loops: dict[str, Loop] = {}
    try:
        for variant in variants:
            loops[variant] = make_loop(workload, batches)
            SETUP[variant](loops[variant], root / f"{name}-{variant}")
        yield loops
    finally:
        for loop in loops.values():
            loop.close()


def measure(name: str, workload: Workload, variants: list[str], rounds: int, steps: int, root: Path,
            console: Console) -> list[Result]:
    results = {v: Result(name, v, steps) for v in variants}
    with variant_loops(name, workload, variants, root) as loops:
        for loop in loops.values():
            loop.run(WARMUP_WATCHED if loop.run_dir else WARMUP)
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            times = {v: loops[v].run(steps) for v in order}
            for v in variants:
                results[v].blocks.append(times[v])
                results[v].ratios.append(times[v] / times["bare"])
            console.log(f"{name} round {r + 1}/{rounds}: "
                        + ", ".join(f"{v} {1000 * times[v] / steps:.1f}" for v in variants) + " ms/step")
    for variant, loop in loops.items():  # closed now
        if loop.run_dir is not None:
            results[variant].store = store_size(loop)
            results[variant].health = run_health(loop, f"{name} {variant}", console)
    return list(results.values())


def rss_run(steps: int, root: Path, console: Console) -> dict[str, Any]:
    """Train the gpt workload watched at default settings; sample the RSS every RSS_EVERY steps."""
    workload = WORKLOADS["gpt"]
    process = psutil.Process()
    marks = sorted({*range(RSS_EVERY, steps + 1, RSS_EVERY), max(1, steps // 10), steps})
    samples: list[tuple[int, int]] = []
    with variant_loops("gpt-rss", workload, ["gradwatch"], root) as loops:
        loop = loops["gradwatch"]
        start = time.perf_counter()
        for mark in marks:
            loop.run(mark - loop.done)
            samples.append((mark, process.memory_info().rss))
            console.log(f"rss run: step {mark}/{steps}, RSS {samples[-1][1] / MIB:.1f} MiB")
        seconds = time.perf_counter() - start
    rss = dict(samples)
    after_warmup = rss[max(1, steps // 10)]
    return {
        "steps": steps,
        "seconds": seconds,
        "samples": samples,
        "rss_after_warmup": after_warmup,
        "rss_end": rss[steps],
        "rss_peak": max(rss.values()),
        "growth_after_warmup": rss[steps] - after_warmup,
        "store": store_size(loop),
        "health": run_health(loop, "gpt gradwatch (RSS run)", console),
    }


# ------------------------------------------------------------- attribution
#: gradwatch's entry points in the training thread (outermost calls are timed)
ENTRY_POINTS = [(probe.Probe, "_forward_pre"), (probe.Probe, "_forward_post"), (probe.Probe, "_output_grad"),
                (watching.Watcher, "_backward_done"), (watching.Watcher, "_step_pre"),
                (watching.Watcher, "_step_post"), (watching.Watcher, "_signalled_step"),
                (watching.Watcher, "observe")]
#: the parts broken out of the entry points' time
PARTS = {
    "detectors, rules and actions": [(judge.Judge, "check"), (judge.Judge, "check_late"), (judge.Judge, "step")],
    "origin tracking": [(origin.Tracker, "capture"), (origin.Tracker, "output_grad"), (origin.Tracker, "clear"),
                        (origin.Tracker, "find")],
}


@contextlib.contextmanager
def timers() -> Iterator[dict[str, float]]:
    """Time gradwatch's training-thread entry points (outermost calls) and PARTS, in seconds.

    Must be entered before ``gw.watch``: hooks are bound when they are registered.
    """
    totals = {"gradwatch (training thread)": 0.0, **{part: 0.0 for part in PARTS}}
    depth = [0]
    saved: list[tuple[type, str, Any]] = []

    def wrap(cls: type, name: str, key: str, outermost: bool) -> None:
        original = cls.__dict__[name]

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if outermost and depth[0]:
                return original(*args, **kwargs)
            depth[0] += outermost
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - start
                depth[0] -= outermost

        saved.append((cls, name, original))
        setattr(cls, name, timed)

    for cls, name in ENTRY_POINTS:
        wrap(cls, name, "gradwatch (training thread)", True)
    for part, methods in PARTS.items():
        for cls, name in methods:
            wrap(cls, name, part, False)
    make_hook = probe.Probe.__dict__["_activation_hook"]

    def activation_hook(self: probe.Probe, index: int, limits: Any) -> Callable[..., None]:
        hook = make_hook(self, index, limits)

        def timed(*args: Any) -> None:
            start = time.perf_counter()
            hook(*args)
            totals["gradwatch (training thread)"] += time.perf_counter() - start

        return timed

    saved.append((probe.Probe, "_activation_hook", make_hook))
    probe.Probe._activation_hook = activation_hook  # type: ignore[method-assign]
    try:
        yield totals
    finally:
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)


def _thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process."""
    return next((t.user_time + t.system_time for t in psutil.Process().threads() if t.id == native_id), 0.0)


def attribute(name: str, workload: Workload, steps: int, root: Path, console: Console) -> dict[str, Any]:
    """Where gradwatch's time goes on one workload: per-step ms of its parts, and of a bare step."""
    batches = workload.batches()
    bare = make_loop(workload, batches)
    with timers() as totals:
        watched = make_loop(workload, batches)
        with_gradwatch(watched, root / f"{name}-attribution")
        try:
            bare.run(WARMUP)
            watched.run(WARMUP_WATCHED)
            writer = next(t for t in threading.enumerate() if t.name.startswith("gradwatch-writer-")
                          and t.name.endswith(f"{name}-attribution"))
            assert writer.native_id is not None
            for key in totals:
                totals[key] = 0.0
            cpu_before, bare_seconds, done = _thread_cpu(writer.native_id), 0.0, 0
            block = workload.steps
            while done < steps:
                n = min(block, steps - done)
                bare_seconds += bare.run(n)
                watched.run(n)
                done += n
            writer_cpu = _thread_cpu(writer.native_id) - cpu_before
        finally:
            watched.close()
    step_ms = 1000 * bare_seconds / steps
    parts = {key: 1000 * value / steps for key, value in totals.items()}
    own = parts["gradwatch (training thread)"]
    parts = {"gradwatch (training thread)": own,
             "statistics (hooks, reductions, the host read, records)": own - sum(parts[p] for p in PARTS),
             **{p: parts[p] for p in PARTS},
             "writer thread (CPU)": 1000 * writer_cpu / steps}
    console.log(f"{name} attribution: bare step {step_ms:.2f} ms; gradwatch training thread {own:.3f} ms/step")
    return {"workload": name, "steps": steps, "bare_ms_per_step": step_ms, "ms_per_step": parts}


def attribution_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Where gradwatch's time goes (default settings): ms per step, and % of a bare step")
    table.add_column("workload")
    table.add_column("bare step", justify="right")
    for part in rows[0]["ms_per_step"]:
        table.add_column(part, justify="right")
    for row in rows:
        bare = row["bare_ms_per_step"]
        table.add_row(row["workload"], f"{bare:.2f} ms",
                      *(f"{ms:.3f} ms\n{ms / bare:.1%}" for ms in row["ms_per_step"].values()))
    return table


# ------------------------------------------------------------------ report
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
    table = Table(title="Per-step time, interleaved (median over rounds)")
    for column in ("workload", "variant", "ms/step (median)", "ratio vs bare", "target", "status"):
        table.add_column(column, justify="right" if column.startswith(("ms", "ratio")) else "left")
    for r, following in zip(results, [*results[1:], None], strict=True):
        mine = [c for c in checks if (c["workload"], r.variant) == (r.workload, "gradwatch")]
        table.add_row(r.workload, r.variant, f"{r.ms_per_step:.2f}", f"{r.ratio:.3f}",
                      "\n".join(c["target"] for c in mine), "\n".join(_verdict(c["pass"]) for c in mine),
                      end_section=following is None or following.workload != r.workload)
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
    table = Table(title=f"Process RSS, gpt workload with gradwatch (default settings), {rss['steps']} steps")
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
    parser.add_argument("--workloads", default="gpt,mlp,cnn",
                        help="comma-separated subset of: " + ", ".join(WORKLOADS) + " (default: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS)
                        + " (default: all; bare is always measured, it is the baseline)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per workload (default: 5 gpt, 11 mlp, 9 cnn)")
    parser.add_argument("--steps", type=int, help="steps per block (default: 10 gpt, 50 mlp, 20 cnn)")
    parser.add_argument("--attribute", type=int, default=0, metavar="N",
                        help="also time gradwatch's parts over N steps per workload (default: 0, skip)")
    parser.add_argument("--rss-steps", type=int, default=0,
                        help="first train the gpt workload watched for N steps, sampling the RSS (default: 0, skip)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
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
    for name in ("rss_steps", "attribute"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console() if sys.stdout.isatty() else Console(width=120)
    report: dict[str, Any] = {"torch": torch.__version__, "gradwatch": gw.__version__, "threads": args.threads,
                              "variants": args.variants}
    with tempfile.TemporaryDirectory(prefix="gradwatch-overhead-") as tmp:
        root = Path(tmp)
        rss = rss_run(args.rss_steps, root, console) if args.rss_steps else None
        results: list[Result] = []
        attribution: list[dict[str, Any]] = []
        for name in args.workloads:
            workload = WORKLOADS[name]
            if args.rounds != 0:
                results += measure(name, workload, args.variants, args.rounds or workload.rounds,
                                   args.steps or workload.steps, root, console)
            if args.attribute:
                attribution.append(attribute(name, workload, args.attribute, root, console))
    checks = targets(results)
    if results:
        console.print(results_table(results, checks))
    if attribution:
        console.print(attribution_table(attribution))
    stores = [(f"{r.workload} {r.variant}", r.store) for r in results if r.store is not None]
    if rss is not None:
        stores.append((f"gpt gradwatch, {rss['steps']}-step RSS run", rss["store"]))
        console.print(rss_table(rss))
        console.print(rss_summary(rss))
    if stores:
        console.print(store_table(stores))
    healths = [(f"{r.workload} {r.variant}", r.health) for r in results if r.health is not None]
    if rss is not None:
        healths.append(("gpt gradwatch (RSS run)", rss["health"]))
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
                      origin_vs_anomaly=summary, unhealthy_runs=unhealthy)
        args.json.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
