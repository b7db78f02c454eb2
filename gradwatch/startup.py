"""Run setup: the store, sinks, writer thread and action plugins of a new run, before its first step."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from gradwatch.actions import Action
from gradwatch.config import Config
from gradwatch.guard import Guard
from gradwatch.judging.judge import build_plugin_actions
from gradwatch.options import Options
from gradwatch.sinks import plugin_sinks
from gradwatch.sinks.store import Store
from gradwatch.step.layout import Discovered, unwrap
from gradwatch.store.thread import Writer
from gradwatch.store.writer import create_store, default_meta


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


def open_outputs(run_dir: Path, meta: dict[str, Any], options: Options, config: Config, guard: Guard) -> Outputs:
    """Create the run (on the writing rank) and start its writer thread.

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
    try:
        if writes:
            if group is not None:
                meta["world_size"] = group.size
            sinks.insert(0, Store(create_store(run_dir, meta, overwrite=options.overwrite)))
        if options.tensorboard:
            from gradwatch.sinks.tensorboard import TensorBoard

            sinks.append(TensorBoard(run_dir))
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
    return Outputs(writer, options, group, writes, plugin_actions)
