"""Two spawned processes that train independent runs for the tests, beside the test process.

A test that trains many runs independent of each other (the healthy sweep's configurations, a
fault injected into each hook kind in turn) hands them to this pool, started once per session,
and reads what they return and wrote: on two cores they take half the time. A run in a pool
process is what it would be in the test process: seeded by the code it runs, on one thread, a
gradwatch ``InternalWarning`` raised as an error (as ``pyproject.toml``'s filterwarnings makes it
in the tests), and an exception Python could not raise (in a ``__del__``, a finalizer ...) is
given back with the result, for the test to fail on as pytest fails it in its own process. The
function given must be importable (a module-level function of a test module), its arguments and
result picklable.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T")

#: processes that train at once
WORKERS = 2
_pool: ProcessPoolExecutor | None = None


def _started() -> None:
    import gradwatch as gw

    torch.set_num_threads(1)
    warnings.filterwarnings("error", category=gw.InternalWarning)


def _call(fn: Callable[..., T], args: tuple[Any, ...]) -> tuple[T, list[str]]:
    unraisable: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda info: unraisable.append(f"{info.exc_type.__name__}: {info.exc_value} "
                                                        f"in {info.object!r}")
    try:
        return fn(*args), unraisable
    finally:
        from gradwatch.watching import registry

        for watcher in list(registry._live):  # a call that failed leaves no model watched for the next
            watcher.close()
        sys.unraisablehook = hook


def submit(fn: Callable[..., T], *args: Any) -> Future[tuple[T, list[str]]]:
    """``fn(*args)`` in a pool process: its result to come, with the unraisable exceptions it left.

    An exception ``fn`` raises is raised by the future's ``result()``, with its traceback.
    """
    global _pool
    if _pool is None or getattr(_pool, "_broken", False):  # a process that died breaks the pool: start anew
        _pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"), initializer=_started)
    return _pool.submit(_call, fn, args)


def result(future: Future[tuple[T, list[str]]]) -> T:
    """The future's result; fails the test if the call left unraisable exceptions."""
    value, unraisable = future.result()
    assert not unraisable, unraisable
    return value


def chosen(request: pytest.FixtureRequest, name: str, *, test: str | None = None, slow: bool = False) -> list[Any]:
    """The values of parameter ``name`` of the requesting module's tests that this session runs (in order);
    only of the test function ``test``, only of the tests marked slow if ``slow``."""
    return [item.callspec.params[name] for item in request.session.items
            if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
            and name in item.callspec.params and (test is None or getattr(item, "originalname", None) == test)
            and (not slow or item.get_closest_marker("slow") is not None)]


def tested(request: pytest.FixtureRequest) -> set[str]:
    """The names of the requesting module's test functions that this session runs."""
    return {item.originalname for item in request.session.items
            if getattr(item, "module", None) is request.module and hasattr(item, "originalname")}
