"""Ranks of a distributed run for the tests: spawned once per test session, then reused.

Starting a process that imports torch takes seconds. The distributed tests of several modules
(``tests/test_distributed.py``, the DDP fault injection of ``tests/test_never_breaks.py``,
``tests/test_rootcause_ddp.py``) hand their rank function to one set of spawned processes, which
run each call in turn. A call is what spawning the ranks for it would be: ``target(rank, port,
*args)`` on every rank at once, ``port`` free for the call's process group, each rank writing its
results to ``out/rank{rank}.json``. A rank that hangs (a deadlock in a collective) or dies fails
its call, and the ranks are spawned afresh for the next one.
"""

from __future__ import annotations

import atexit
import json
import queue
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: what a rank finished with (process groups, the DDP and FSDP modules that hold them), kept to its end
_finished: list[Any] = []


def leave_group(*holders: Any) -> None:
    """End this rank's default process group, destroying its objects only when the rank's process ends.

    torch 2.13 stashes a Python object in the thread-local state during backward (the ``"context"``
    of ``torch/autograd/graph.py``), and every collective launched there (DDP's all-reduces) captures
    it; the gloo worker thread that releases such a work takes the GIL to do so. A process group
    destroyed while its worker still releases one (right after a barrier that waited on them) joins
    that thread holding the GIL: a deadlock, seen on rank 0 in ``~ProcessGroupGloo`` from the DDP
    Reducer's dealloc. Kept here, the group and its ``holders`` are destroyed as the process exits,
    when its workers are long idle.
    """
    if dist.is_initialized():
        _finished.append(dist.distributed_c10d._get_default_group())
        _finished.extend(h for h in holders if h is not None)
        dist.destroy_process_group()


def _serve(rank: int, tasks: Any, done: Any) -> None:
    """One rank: run each ``(target, args)`` it is given, say when it returned; stop at None."""
    while True:
        task = tasks.get()
        if task is None:
            return
        target, args = task
        try:
            target(rank, *args)
        except BaseException as exc:  # the targets report their own errors: this is a bug in one
            done.put((rank, f"{type(exc).__name__}: {exc}"))
        else:
            done.put((rank, None))


class Ranks:
    """``world`` spawned processes waiting for calls."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.done = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, self.tasks[r], self.done), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def call(self, target: Callable[..., None], args: tuple[Any, ...], timeout: float) -> dict[int, str | None]:
        """Run ``target(rank, port, *args)`` on every rank; each rank's exception (None: it returned).

        Raises:
            TimeoutError: a rank did not return within ``timeout`` seconds, or died.
        """
        port = free_port()
        for tasks in self.tasks:
            tasks.put((target, (port, *args)))
        returned: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout
        while len(returned) < self.world:
            try:
                rank, error = self.done.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    raise TimeoutError from None
                continue
            returned[rank] = error
        return returned

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


_started: dict[int, Ranks] = {}


def _closed() -> None:
    for ranks in _started.values():
        ranks.close()


atexit.register(_closed)


def spawn_ranks(target: Callable[..., None], args: tuple[Any, ...], out: Path, timeout: float = 120,
                world: int = 2) -> list[dict[str, Any]]:
    """Run ``target(rank, port, *args)`` on ``world`` ranks; each writes ``out/rank{r}.json``.

    Fails if a rank hangs (a deadlock in a collective), dies or reports an ``error``; the ranks' results.
    """
    ranks = _started.get(world)
    if ranks is None or not all(p.is_alive() for p in ranks.procs):
        if ranks is not None:
            ranks.kill()
        ranks = _started[world] = Ranks(world)
    try:
        returned = ranks.call(target, args, timeout)
    except TimeoutError:
        ranks.kill()  # the next call starts afresh
        del _started[world]
        raise AssertionError("a rank hung (deadlock in a collective?) or died") from None
    for rank, error in sorted(returned.items()):
        assert error is None, f"rank {rank}: {error}"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert "error" not in r, r["error"]
    return results
