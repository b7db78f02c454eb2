"""Run setup: a run's store, sinks, writer thread and action plugins before its first step (resumed: its start)."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from gradwatch.actions import Action
from gradwatch.config import Config
from gradwatch.errors import GradwatchWarning
from gradwatch.judging.judge import Judge, build_plugin_actions
from gradwatch.options import Options
from gradwatch.sinks import plugin_sinks
from gradwatch.sinks.store import Store
from gradwatch.step.layout import Discovered, unwrap
from gradwatch.store import resume
from gradwatch.store.records import Layout
from gradwatch.store.thread import Writer
from gradwatch.store.writer import create_store, default_meta
from gradwatch.watching.guard import Guard

log = logging.getLogger("gradwatch")


@dataclass
class Outputs:
    """Where a run's records go, as this process writes them."""

    writer: Writer
    #: the options as this process applies them (a rank that does not write prints nothing)
    options: Options
    #: the process group this process trains in with others (``integrations.distributed.Group``), or None
    group: Any
    #: whether this process writes the run (rank 0, or the only process)
    writes: bool
    #: the action plugins the rules name, built before anything was written
    plugin_actions: dict[str, Action]
    #: the stored run this process continues (``resume=True`` and a run there), None for a new run
    restart: resume.Restart | None = None


def distributed_group(options: Options) -> Any:
    """The process group this process trains in with others, as gradwatch uses it; None if alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from gradwatch.integrations.distributed import Group

    return Group(options.replica_check_every, options.replica_tolerance)


def run_meta(model: nn.Module, found: Discovered, options: Options, config: Config) -> dict[str, Any]:
    """The run's metadata: the model, its parameter counts, the options and the rules."""
    return {
        **default_meta(),
        "model": type(unwrap(model)).__name__,
        "parameters": int(sum(found.layout.param_numel)),
        "trainable": int(sum(p.numel() for p in found.params if p.requires_grad)),
        "options": options.to_dict(),
        "rules": config.describe(),
    }


def open_outputs(run_dir: Path, meta: dict[str, Any], options: Options, config: Config, guard: Guard,
                 layout: Layout | None = None) -> Outputs:
    """Create the run (on the writing rank), or with ``resume`` continue the one stored there with a
    model of ``layout``, and start its writer thread.

    Everything that can fail for a reason of the user's (a port in use, a plugin that cannot be
    built, a run directory that cannot be written) fails here, before training, and leaves no
    run directory behind that this call created.
    """
    group = distributed_group(options)  # None unless one of several ranks of a process group
    writes = group is None or group.writes
    sinks: list[Any] = []
    if not writes:  # the other ranks measure and judge alike; rank 0 writes the run and prints
        options = dataclasses.replace(options, console=False, tensorboard=False, prometheus=None)
    if options.prometheus is not None and options.prometheus is not False:
        from gradwatch.integrations.prometheus import sink_for

        # binds the port first: a port in use fails gw.watch with a clear error and no run written
        sinks.append(sink_for(options.prometheus, run=run_dir.name, model=meta["model"]))
    plugin_actions = build_plugin_actions(config)  # before anything is written: a plugin may fail to build
    fresh = not run_dir.exists()
    restart = None
    try:
        if writes:
            if group is not None:
                meta["world_size"] = group.size
            if options.resume and layout is not None and resume.stored(run_dir):
                restart = resume.resume_store(run_dir, meta, options.start_step, layout)
                sinks.insert(0, Store(run_dir / resume.DB_NAME))
            else:
                sinks.insert(0, Store(create_store(run_dir, meta, overwrite=options.overwrite)))
        if options.tensorboard:
            from gradwatch.sinks.tensorboard import TensorBoard

            # a resumed run's earlier events from its first step on are purged (TensorBoard's purge_step)
            sinks.append(TensorBoard(run_dir, purge_step=restart.step if restart is not None else None))
        if writes:
            sinks += plugin_sinks(options.sinks, run_dir)
    except BaseException:
        for sink in sinks:
            sink.close("crashed")
        if fresh and writes:  # nothing half-written is left behind: the run never started
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    writer = Writer(sinks, queue_size=options.queue_size, flush_seconds=options.flush_seconds, name=run_dir.name,
                    guard=guard)
    return Outputs(writer, options, group, writes, plugin_actions, restart)


#: stored steps before the restart replayed into the detectors (longer than their default windows)
PRIME_STEPS = 1000


def first_step(out: Outputs, found: Discovered, options: Options, run_dir: Path) -> tuple[Discovered, int]:
    """The model's layout as this process records it, and the number of its first step.

    A resumed run goes on with its stored layout version when the model's layout is the same, else
    with a new version (and a warning); a new run starts at ``start_step`` (default 0). A rank that
    does not write a resumed run takes ``start_step``, or the step after the last stored one.
    """
    restart = out.restart
    if restart is None:
        if options.start_step is not None:
            return found, options.start_step
        if options.resume and not out.writes and resume.stored(run_dir):
            return found, resume.next_step(run_dir)
        return found, 0
    if restart.changed is not None:
        warnings.warn(_changed(run_dir, restart), GradwatchWarning, stacklevel=4)
    layout = dataclasses.replace(found.layout, version=restart.version)
    return dataclasses.replace(found, layout=layout), restart.step


def _changed(run_dir: Path, restart: resume.Restart) -> str:
    assert restart.changed is not None

    def names(items: list[str]) -> str:
        return ", ".join(repr(n) for n in items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")

    verbs = (("added", "adds"), ("removed", "removes"), ("changed", "changes the type or size of"))
    how = "; ".join(f"{verb} {names(restart.changed[key])}" for key, verb in verbs if restart.changed[key])
    return (f"gradwatch: the model resuming run {str(run_dir)!r} at step {restart.step} has another layout than "
            f"the run's ({how}); it goes on as a new layout version, recorded in the run's metadata "
            "(layout_changes)")


def prime(judge: Judge, out: Outputs, run_dir: Path) -> None:
    """Prime a resumed run's judge with the stored steps before the restart (see :meth:`Judge.resume`)."""
    restart = out.restart
    if restart is None:
        return
    from gradwatch.store.reader import Run

    try:
        with Run(run_dir) as run:
            records = run.records(steps=slice(max(0, restart.step - PRIME_STEPS), restart.step))
            repeats = {"info": 0, "warning": 0, "error": 0}  # the kept findings' folded occurrences
            for severity, data in run.findings()[["severity", "data"]].itertuples(index=False):
                repeats[severity] = repeats.get(severity, 0) + max(int(data.get("repeats", 1)), 1) - 1
            primed = judge.resume(records, restart.next_finding, restart.counts, restart.worst, repeats)
    except Exception as exc:  # a stored history that cannot be read: the detectors warm up afresh, training goes on
        judge.resume([], restart.next_finding, restart.counts, restart.worst)
        warnings.warn(f"gradwatch: the steps stored before step {restart.step} of run {str(run_dir)!r} could not be "
                      f"replayed into the detectors ({exc}); they warm up afresh", GradwatchWarning, stacklevel=4)
        return
    log.info("gradwatch: run %s resumed at step %d (restart %d; %d stored steps superseded, %d replayed into the "
             "detectors)", run_dir, restart.step, restart.restart, restart.superseded, primed)
