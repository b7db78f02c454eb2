"""Overhead benchmark, measuring: interleaved rounds of the variants, the RSS run, where gradwatch's time goes."""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from variants import SETUP, Loop, make_loop, with_gradwatch
from workloads import WORKLOADS, Workload

import gradwatch as gw
from gradwatch.judging import judge
from gradwatch.rootcause import capture, state
from gradwatch.step import iteration, lifecycle, origin, probe, recording, stats
from gradwatch.step import measure as measure_module
from gradwatch.watching import watcher as watching

#: finding severities that a healthy benchmark run must not produce
BAD_SEVERITIES = ("warning", "error")
RSS_EVERY = 100
MIB = 2**20


# -------------------------------------------------------------- measurement
@dataclass
class Result:
    """Block times of one variant of one workload, and the ratios to the bare block of each round."""

    workload: str
    variant: str
    steps: int
    blocks: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    #: CPU seconds of each block (every thread: the writer's too) and their ratios to bare's
    cpu: list[float] = field(default_factory=list)
    cpu_ratios: list[float] = field(default_factory=list)
    store: dict[str, float] | None = None
    health: dict[str, Any] | None = None

    @property
    def ms_per_step(self) -> float:
        return 1000 * statistics.median(self.blocks) / self.steps

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def cpu_ratio(self) -> float:
        return statistics.median(self.cpu_ratios)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "variant": self.variant, "steps_per_block": self.steps,
                "ms_per_step": self.ms_per_step, "ratio_vs_bare": self.ratio,
                "cpu_ratio_vs_bare": self.cpu_ratio, "block_seconds": self.blocks, "ratios": self.ratios,
                "block_cpu_seconds": self.cpu, "cpu_ratios": self.cpu_ratios, "store": self.store,
                "health": self.health}


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
            loop.run(workload.warmup_watched if loop.run_dir else workload.warmup)
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            times, cpu = {}, {}
            for v in order:
                times[v] = loops[v].run(steps)
                cpu[v] = loops[v].cpu
            for v in variants:
                results[v].blocks.append(times[v])
                results[v].ratios.append(times[v] / times["bare"])
                results[v].cpu.append(cpu[v])
                results[v].cpu_ratios.append(cpu[v] / cpu["bare"])
            console.log(f"{name} round {r + 1}/{rounds}: "
                        + ", ".join(f"{v} {1000 * times[v] / steps:.1f}" for v in variants) + " ms/step")
    for variant, loop in loops.items():  # closed now
        if loop.run_dir is not None:
            results[variant].store = store_size(loop)
            results[variant].health = run_health(loop, f"{name} {variant}", console)
    return list(results.values())


def rss_run(steps: int, root: Path, console: Console, name: str = "gpt") -> dict[str, Any]:
    """Train a workload watched at default settings; sample the RSS every RSS_EVERY steps."""
    workload = WORKLOADS[name]
    process = psutil.Process()
    marks = sorted({*range(RSS_EVERY, steps + 1, RSS_EVERY), max(1, steps // 10), steps})
    samples: list[tuple[int, int]] = []
    with variant_loops(f"{name}-rss", workload, ["gradwatch"], root) as loops:
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
        "workload": name,
        "steps": steps,
        "seconds": seconds,
        "samples": samples,
        "rss_after_warmup": after_warmup,
        "rss_end": rss[steps],
        "rss_peak": max(rss.values()),
        "growth_after_warmup": rss[steps] - after_warmup,
        "store": store_size(loop),
        "health": run_health(loop, f"{name} gradwatch (RSS run)", console),
    }


# ------------------------------------------------------------- attribution
#: gradwatch's entry points in the training thread (outermost calls are timed)
ENTRY_POINTS = [(probe.Probe, "_forward_pre"), (probe.Probe, "_forward_post"), (probe.Probe, "_output_grad"),
                (probe.Probe, "_sentinel_grad"), (probe.Probe, "_activation"), (iteration.Iteration, "backward_ended"),
                (iteration.Iteration, "backward_done"), (lifecycle.Lifecycle, "step_pre"),
                (recording.Recording, "step_post"), (lifecycle.Lifecycle, "signalled_step"),
                (watching.Watcher, "observe")]
#: the parts broken out of the entry points' time
PARTS = {
    "detectors, rules and actions": [(judge.Judge, "check"), (judge.Judge, "check_late"), (judge.Judge, "step")],
    "origin tracking": [(origin.Tracker, "capture"), (origin.Tracker, "output"), (capture.Capture, "keep_grad"),
                        (origin.Tracker, "clear"), (origin.Tracker, "find")],
}


@contextlib.contextmanager
def timers() -> Iterator[dict[str, float]]:
    """Time gradwatch's training-thread entry points (outermost calls) and PARTS, in seconds of the
    training thread's CPU (time spent descheduled on a busy machine is not counted).

    Must be entered before ``gw.watch``: hooks are bound when they are registered.
    """
    totals = {"gradwatch (training thread)": 0.0, **{part: 0.0 for part in PARTS}}
    depth = [0]
    saved: list[tuple[type, str, Any]] = []

    def wrap(cls: type, name: str, key: str, outermost: bool) -> None:
        original = cls.__dict__.get(name)
        if original is None:  # an entry point this version of gradwatch does not have
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if outermost and depth[0]:
                return original(*args, **kwargs)
            depth[0] += outermost
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                totals[key] += time.thread_time() - start
                depth[0] -= outermost

        saved.append((cls, name, original))
        setattr(cls, name, timed)

    for cls, name in ENTRY_POINTS:
        wrap(cls, name, "gradwatch (training thread)", True)
    for part, methods in PARTS.items():
        for cls, name in methods:
            wrap(cls, name, part, False)
    make_hook = probe.Probe.__dict__.get("_activation_hook")
    if make_hook is not None:  # an older gradwatch made one closure per leaf: time the closures it makes

        def activation_hook(self: probe.Probe, index: int, limits: Any) -> Callable[..., None]:
            hook = make_hook(self, index, limits)

            def timed(*args: Any) -> None:
                start = time.thread_time()
                hook(*args)
                totals["gradwatch (training thread)"] += time.thread_time() - start

            return timed

        saved.append((probe.Probe, "_activation_hook", make_hook))
        probe.Probe._activation_hook = activation_hook  # type: ignore[attr-defined]
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
            bare.run(workload.warmup)
            watched.run(workload.warmup_watched)
            writer = next(t for t in threading.enumerate() if t.name.startswith("gradwatch-writer-")
                          and t.name.endswith(f"{name}-attribution"))
            assert writer.native_id is not None
            for key in totals:
                totals[key] = 0.0
            cpu_before, bare_seconds, bare_cpu, done = _thread_cpu(writer.native_id), 0.0, 0.0, 0
            collections = {"bare": 0.0, "watched": 0.0}
            with collected(collections) as which:
                block = workload.steps
                while done < steps:
                    n = min(block, steps - done)
                    which[0] = "bare"
                    start = time.thread_time()
                    bare_seconds += bare.run(n)
                    bare_cpu += time.thread_time() - start
                    which[0] = "watched"
                    watched.run(n)
                    which[0] = None
                    done += n
            writer_cpu = _thread_cpu(writer.native_id) - cpu_before
        finally:
            watched.close()
    step_ms, step_cpu_ms = 1000 * bare_seconds / steps, 1000 * bare_cpu / steps
    parts = {key: 1000 * value / steps for key, value in totals.items()}
    own = parts["gradwatch (training thread)"]
    parts = {"gradwatch (training thread)": own,
             "statistics (hooks, reductions, the host read, records)": own - sum(parts[p] for p in PARTS),
             **{p: parts[p] for p in PARTS},
             "garbage collections (watched - bare)": 1000 * (collections["watched"] - collections["bare"]) / steps,
             "writer thread (CPU)": 1000 * writer_cpu / steps}
    console.log(f"{name} attribution: bare step {step_ms:.2f} ms ({step_cpu_ms:.2f} ms CPU); gradwatch training "
                f"thread {own:.3f} ms/step")
    return {"workload": name, "steps": steps, "bare_ms_per_step": step_ms, "bare_cpu_ms_per_step": step_cpu_ms,
            "ms_per_step": parts}


# ------------------------------------------------------------- cold caches
#: parts of a step that change nothing (the same arguments give the same result, no state moves), so
#: that each can be run a second time right after gradwatch runs it: (label, owner, attribute)
COLD_PARTS = [
    ("the step's vectors (numpy, from the host read)", measure_module.Measure, "vectors"),
    ("the host read (one copy)", stats, "to_host"),
    ("the RNG state (each captured forward call)", state.Rng, "get"),
]


def cold(name: str, workload: Workload, steps: int, root: Path, console: Console) -> dict[str, Any]:
    """The same code timed where gradwatch runs it and right again: why a step's Python costs more in
    training than alone.

    A loop watched at default settings trains ``steps`` steps (after warm-up); each part of
    :data:`COLD_PARTS` is run as gradwatch runs it (after the model's forward and backward passes, which
    have filled the CPU's caches with their own code and data) and then once more at once, with the same
    arguments, its result dropped. Medians over the calls, in microseconds of the training thread's CPU.
    """
    times: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label, _, _ in COLD_PARTS}
    saved: list[tuple[Any, str, Any]] = []
    counting = [False]

    def twice(label: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not counting[0]:
                return original(*args, **kwargs)
            start = time.thread_time()
            result = original(*args, **kwargs)
            middle = time.thread_time()
            original(*args, **kwargs)
            end = time.thread_time()
            times[label][0].append(middle - start)
            times[label][1].append(end - middle)
            return result

        return timed

    for label, owner, attr in COLD_PARTS:
        original = owner.__dict__[attr]
        saved.append((owner, attr, original))
        wrapped = twice(label, original)
        setattr(owner, attr, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
    try:
        loop = make_loop(workload, workload.batches())
        with_gradwatch(loop, root / f"{name}-cold")
        try:
            loop.run(workload.warmup_watched)
            counting[0] = True
            loop.run(steps)
            counting[0] = False
        finally:
            loop.close()
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)
    parts = {}
    for label, (first, again) in times.items():
        if first:
            parts[label] = {"calls_per_step": len(first) / steps, "first_us": 1e6 * statistics.median(first),
                            "again_us": 1e6 * statistics.median(again)}
    console.log(f"{name} cold: " + ", ".join(f"{label.split(' (')[0]} {p['first_us']:.1f} / {p['again_us']:.1f} us"
                                             for label, p in parts.items()))
    return {"workload": name, "steps": steps, "parts": parts}


@contextlib.contextmanager
def collected(totals: dict[str, float]) -> Iterator[list[str | None]]:
    """Add the CPU time of garbage collections to ``totals[which[0]]`` while ``which[0]`` names a key.

    A collection runs wherever an allocation crosses the threshold (inside gradwatch's code or the
    model's), so it is timed on its own: the collections of the watched blocks beyond the bare
    blocks' are those that gradwatch's allocations cause.
    """
    which: list[str | None] = [None]
    start = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            start[0] = time.thread_time()
        elif which[0] is not None and threading.current_thread() is threading.main_thread():
            totals[which[0]] += time.thread_time() - start[0]

    gc.callbacks.append(callback)
    try:
        yield which
    finally:
        gc.callbacks.remove(callback)
