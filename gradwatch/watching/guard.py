"""Guard: the one door from torch into gradwatch — every call torch makes into gradwatch goes through it.

Module forward (pre-)hooks, tensor and post-accumulate-grad hooks, optimizer step hooks, autograd
engine callbacks, a step's closure, the writer thread, ``atexit`` and the excepthook: each is a
:class:`Hook` made by a watcher's :class:`Guard`, and only this module hands a callable to torch
(:mod:`gradwatch.watching.register`, which refuses anything but a Hook; ``tests/test_architecture.py`` checks
that no other module registers anything with torch).
An exception of gradwatch's own in a hook detaches the watcher — one ``InternalWarning``, every
hook removed — and the hook returns None: to torch, a hook that changed nothing. Training goes on
as if it had never been watched. Only :class:`~gradwatch.TrainingHalted` (a rule's halt) passes.

A failure in a thread of gradwatch's own (the writer's) is told to the training loop at the next
hook that runs outside those threads. A hook runs one global check on its fast path (:data:`_ALERT`); the slow
path serves a detached guard, a failure waiting to be told, and the tests' fault injection
(:func:`inject`, by kind: :data:`KINDS`).

Hooks reach torch through :mod:`gradwatch.watching.register` only. A model's pickled form holds nothing of
gradwatch: see :mod:`gradwatch.watching.unpickled`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch

from gradwatch.errors import TrainingHalted, trimmed
from gradwatch.watching import unpickled

log = logging.getLogger("gradwatch")

#: every kind of entry point from torch (or the interpreter) into gradwatch
KINDS = {
    "forward_pre": "the root module's forward pre-hook (a new iteration)",
    "forward": "the root module's forward hook (origin tracking: the output's gradient is hooked)",
    "output_grad": "the gradient arriving at a forward call's output (origin tracking)",
    "sentinel_grad": "the sentinel parameter's gradient arriving (a backward pass begins)",
    "accumulated": "the sentinel parameter's post-accumulate-grad hook (a backward pass reached it)",
    "backward_end": "the autograd engine's callback at the end of a backward pass",
    "activation": "a leaf module's forward hook on a sampled step (activation statistics)",
    "attention": "an attention call on a sampled step's forward pass (its logits' largest value and entropy)",
    "attention_end": "the root module's forward hook that ends a sampled forward call's attention watch",
    "registration": "a submodule or parameter set on a module of the watched model (the layout may change)",
    "step_pre": "the optimizer step pre-hook (the step moment)",
    "step_post": "the optimizer step post-hook (the update is measured)",
    "closure": "a step's closure, evaluated by the optimizer (optimizer.step(closure))",
    "withhold": "an optimizer's one-shot step hooks after a halt under a framework",
    "writer": "the writer thread",
    "sink_thread": "a sink's own thread that talks to a remote service (the MLflow sink's sender)",
    "gradients_ready": "a framework's signal that the gradients are final (Watcher.gradients_ready)",
    "flush": "a flush of the latest step (Watcher.flush, a reader of this run in the same process)",
    "first_forward": "the first forward call of an instance of a watched class (it is watched then)",
    "hf_forward": "the Hugging Face Trainer callback's forward hook",
    "hf_backward": "the Hugging Face Trainer callback's backward hooks (pre-clip gradient norm)",
    "pytest_fixture": "the gw_watch pytest fixture's global forward hooks (finding the models a test trains)",
    "atexit": "closing the runs at interpreter exit",
    "excepthook": "noting an uncaught exception (the runs close as crashed)",
    "signal": "a signal that ends the process (SIGTERM): the runs close as terminated",
    "exit": "a call of sys.exit: its code is noted for the runs closed at exit",
    "fork": "a child forked from the watching process: the watchers it inherited go quiet there",
}


class InjectedFault(RuntimeError):
    """A failure planted by :func:`inject` (tests only)."""


#: set while some guard is detached, has a failure to tell, or faults are injected: hooks take the slow path
_ALERT = False
#: kind -> [calls to let pass, calls seen] while :func:`inject` runs
_FAULTS: dict[str, list[int]] = {}
#: what the planted call does instead of raising :class:`InjectedFault` (:func:`inject`'s ``fault``), or None
_PLANTED: list[Callable[[], Any]] = []
#: the guards that detached or hold a failure to tell
_ALERTED: set[Guard] = set()
#: the calls of each kind since :func:`inject` began (what a loop reaches)
ENTERED: dict[str, int] = {}
#: the kinds that are a step's moment: in distributed training, the step's collectives happen there
MOMENTS = ("step_pre", "gradients_ready", "closure")
#: the threads gradwatch started itself (:func:`thread`)
OWN_THREADS: set[int] = set()


def _realert() -> None:
    global _ALERT
    _ALERT = bool(_FAULTS or _ALERTED)


@contextmanager
def inject(kind: str | None, *, after: int = 0, fault: Callable[[], Any] | None = None) -> Iterator[dict[str, int]]:
    """Tests only: the hook of ``kind`` raises :class:`InjectedFault` at its ``after + 1``-th call
    (None: nothing raises, the calls are only counted). Yields the calls of each kind meanwhile.

    With ``fault``, that call runs ``fault()`` instead, as the hook begins (e.g. a signal handler of the
    user's that calls ``sys.exit``: whatever it raises comes out of the hook).
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown hook kind {kind!r}; known: {sorted(KINDS)}")
    ENTERED.clear()
    _FAULTS.clear()
    _FAULTS["*" if kind is None else kind] = [after, 0]
    _PLANTED[:] = [fault] if fault is not None else []
    _realert()
    try:
        yield ENTERED
    finally:
        _FAULTS.clear()
        _PLANTED.clear()
        _realert()


class Guard:
    """The guard of one watcher: makes its hooks and detaches it when one of them fails.

    Args:
        failed: detaches the watcher (``Watcher._fail``), called in a thread of the user's with the
            exception, the failing hook's kind and its arguments.
    """

    def __init__(self, failed: Callable[[BaseException, str, tuple[Any, ...]], None]) -> None:
        unpickled.install()
        self._failed = failed
        #: the watcher detached: every hook of this guard does nothing from now on
        self.dead = False
        #: a failure in a thread of gradwatch's own, told at the next hook outside those threads
        self.pending: BaseException | None = None
        #: calls of the hooks of :data:`MOMENTS` so far (did the failing one begin its step's collectives?)
        self.moments = 0

    def hook(self, kind: str, call: Callable[..., Any], cls: type[Hook] | None = None) -> Hook:
        """A hook of ``kind`` (one of :data:`KINDS`) that runs ``call`` guarded."""
        if kind not in KINDS:
            raise ValueError(f"unknown hook kind {kind!r}; add it to gradwatch.watching.guard.KINDS")
        return (cls or (Moment if kind in MOMENTS else Hook))(self, kind, call)

    def failed(self, kind: str, exc: BaseException, args: tuple[Any, ...] = ()) -> None:
        """A hook of ``kind`` raised ``exc``: the watcher detaches now, or (gradwatch's own thread) at the
        next hook of the training loop.
        """
        log.error("gradwatch: internal error in its %s hook", kind, exc_info=exc)
        if self.dead:
            return
        if threading.get_ident() in OWN_THREADS:
            self.pending = self.pending or exc
            _ALERTED.add(self)
            _realert()
            return
        self.pending = None
        self._failed(exc, kind, args)

    def detach(self) -> None:
        """The watcher detached itself: every hook of this guard does nothing from now on (one that torch
        still calls: a hook on an output of the iteration under way, a dict torch iterates now).
        """
        self.dead = True
        _ALERTED.add(self)
        _realert()

    def run(self, kind: str, call: Callable[..., Any], *args: Any) -> Any:
        """Run a public entry of gradwatch's (a framework's signal, a flush) guarded."""
        return self.hook(kind, call)(*args)


def _slow(hook: Hook) -> bool:
    """The slow path of a hook's call: whether it runs (raises an injected fault)."""
    guard = hook._guard
    if guard.dead:
        return False
    if guard.pending is not None and threading.get_ident() not in OWN_THREADS:
        exc, guard.pending = guard.pending, None
        guard.failed(hook.kind, exc)
        return False
    if _FAULTS and not torch.compiler.is_dynamo_compiling():  # a hook traced into a graph runs only there
        ENTERED[hook.kind] = ENTERED.get(hook.kind, 0) + 1
        fault = _FAULTS.get(hook.kind)
        if fault is not None:
            fault[1] += 1
            if fault[1] == fault[0] + 1:
                if _PLANTED:
                    _PLANTED[0]()
                    return True
                raise InjectedFault(f"fault injected into the {hook.kind} hook")
    return True


class Hook(unpickled.Dropped):
    """One of gradwatch's hooks (see :class:`Guard`); a copy of it (``deepcopy``, pickle) is
    :func:`unwatched`, which keeps no reference to its watcher.
    """

    __slots__ = ("_guard", "kind", "_call")
    #: torch's tensor pickling drops it without a warning
    __torch_unserializable__ = True

    def __init__(self, guard: Guard, kind: str, call: Callable[..., Any]) -> None:
        self._guard, self.kind, self._call = guard, kind, call

    def __call__(self, *args: Any) -> Any:
        """Run the hook; a failure detaches its watcher and the hook returns None."""
        try:
            if _ALERT and not _slow(self):
                return None
            return self._call(*args)
        except TrainingHalted as exc:  # the user's traceback: their frames, this hook's and the one that raised
            raise trimmed(exc) from exc.__cause__
        except Exception as exc:
            self._guard.failed(self.kind, exc, args)
            return None

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return unwatched

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return unwatched_copy, ()

    def __repr__(self) -> str:
        return f"<gradwatch {self.kind} hook {getattr(self._call, '__qualname__', self._call)!r}>"


class RootHook(Hook):
    """A hook of the root module: gradwatch's own bookkeeping of a forward call (the iteration, the
    capture a replay needs: inputs, RNG and autocast state), plain Python that belongs to no graph.

    Under ``torch.compile(watched)`` the root's hooks are frames of their own around the compiled
    forward: dynamo never traces such a frame nor anything it calls (see :func:`_untraced`), so that
    the hook runs as in eager mode, with no graph break. Where the hook is traced inside a larger
    graph instead (a compiled function that calls the model, a compiled ``nn.Sequential``), it does
    nothing there: gradwatch then sees no forward call (origin tracking attributes a NaN cheaply).
    """

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        """Run the hook (nothing when traced into a graph)."""
        if torch.compiler.is_dynamo_compiling():
            return None
        try:
            return Hook.__call__(self, *args)
        except TrainingHalted as exc:
            raise trimmed(exc) from exc.__cause__


def _untraced(function: Callable[..., Any]) -> None:
    """Have dynamo run ``function`` and every call made from it as plain Python whenever a frame of
    it would start a trace: what ``torch.compiler.disable`` does, for the frames only (a call traced
    inline is traced), without importing ``torch._dynamo`` (a second of import) before anyone compiles.

    A no-op on a torch whose dynamo has no per-code frame strategy.
    """
    try:
        from torch._C._dynamo import eval_frame
        skip = eval_frame._FrameAction.SKIP
        eval_frame.set_code_exec_strategy(function.__code__, eval_frame._FrameExecStrategy(skip, skip))
    except (ImportError, AttributeError, TypeError):  # an older torch: its compiled modules call hooks outside dynamo
        pass


class Moment(Hook):
    """A hook of a step's moment (:data:`MOMENTS`): its calls are counted."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        """Count the call, then run the hook."""
        self._guard.moments += 1
        try:
            return Hook.__call__(self, *args)
        except TrainingHalted as exc:
            raise trimmed(exc) from exc.__cause__


# A hook that starts a frame of its own under dynamo runs as plain Python: where a compiled forward
# fell back to eager (a graph break in a loop, in a nested call), torch calls the leaves' hooks from
# eager code, and dynamo would compile each call as a graph of one hook, guarded on gradwatch's
# state and recompiled on every call until its recompile limit warns. A leaf hook traced inline,
# in the graph of the module that calls it, is traced as before (see :class:`RootHook` for the root's).
for _hook in (Hook, RootHook, Moment):
    _untraced(_hook.__call__)


def hook_frame(frame: FrameType | None) -> FrameType | None:
    """The outermost call of a gradwatch hook in the stack that runs ``frame`` (None: no hook runs there)."""
    found, code = None, Hook.__call__.__code__
    while frame is not None:
        if frame.f_code is code:
            found = frame
        frame = frame.f_back
    return found


def unwatched(owner: Any, *args: Any) -> None:
    """What a copy of a gradwatch hook is, where one is copied at all: a hook that does nothing and
    removes itself on its first call. A copied model is not watched; watch it with ``gw.watch(copy)``.
    """
    for name in ("_forward_pre_hooks", "_forward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(owner, name, None)
        if isinstance(hooks, dict):
            for key in [k for k, hook in hooks.items() if hook is unwatched]:
                del hooks[key]


def unwatched_copy() -> Callable[..., None]:
    """What a pickled :class:`Hook` loads as."""
    return unwatched


def guarded(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a method through the guard of its object (``self.guard``): for gradwatch's public entries
    that a loop or a framework calls (a framework's step signal, a flush), which torch does not.
    """

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Any, *args: Any) -> Any:
            return self.guard.run(kind, method, self, *args)

        return run

    return wrap
