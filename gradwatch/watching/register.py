"""Register: the only module that hands gradwatch's callables to torch (and to the interpreter).

Each function takes a :class:`gradwatch.watching.guard.Hook` — a guarded call — and refuses anything else,
so that no entry point from torch into gradwatch escapes the guard (``tests/test_architecture.py``
checks that no other module of gradwatch registers anything with torch).

The optimizer step hooks are one process-wide pair that dispatches to each watcher
(:func:`on_optimizers`): removing a hook from torch's global dict while torch iterates it breaks
the step when a later hook follows (another watcher's, another library's), so the pair leaves only
when that is safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.optim import optimizer as torch_optim
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from gradwatch.errors import TrainingHalted, trimmed
from gradwatch.watching import guard, unpickled
from gradwatch.watching.guard import Hook


def _checked(hook: Any) -> Hook:
    if not isinstance(hook, Hook):
        raise TypeError(f"gradwatch registers only guarded hooks (gradwatch.watching.guard.Hook), got {hook!r}")
    return hook


def forward_pre(module: torch.nn.Module, hook: Hook, *, with_kwargs: bool = False) -> RemovableHandle:
    """Register a forward pre-hook of ``module``."""
    handle = module.register_forward_pre_hook(_checked(hook), with_kwargs=with_kwargs)
    if with_kwargs:
        unpickled.note_extra(module._forward_pre_hooks_with_kwargs, handle.id)
    return handle


def forward(module: torch.nn.Module, hook: Hook, *, with_kwargs: bool = False,
            always_call: bool = False) -> RemovableHandle:
    """Register a forward hook of ``module`` (``always_call``: also when its forward raises)."""
    handle = module.register_forward_hook(_checked(hook), with_kwargs=with_kwargs, always_call=always_call)
    if with_kwargs:
        unpickled.note_extra(module._forward_hooks_with_kwargs, handle.id)
    return handle


def put(module: torch.nn.Module, key: int, hook: Hook) -> None:
    """Put a forward hook in ``module``'s hooks under ``key`` (a key made once: no handle per step)."""
    module._forward_hooks[key] = _checked(hook)


def push_mode(mode: TorchFunctionMode) -> None:
    """Put a torch function mode on top of this thread's stack (its ``__torch_function__`` calls only guarded hooks)."""
    mode.__enter__()


def pop_mode(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's stack if it is on top (a mode pushed after it and still there: left in
    place, and False).
    """
    depth = torch._C._len_torch_function_stack()
    if depth == 0 or torch._C._get_function_stack_at(depth - 1) is not mode:
        return False
    mode.__exit__(None, None, None)
    return True


def every_module(pre: Hook, post: Hook) -> list[RemovableHandle]:
    """Have every module's forward call ``pre(module, args)`` before and ``post(module, args, output)``
    after it (the latter also when the forward raises).
    """
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    return [register_module_forward_pre_hook(_checked(pre)), register_module_forward_hook(_checked(post),
                                                                                            always_call=True)]


def registrations(hook: Hook) -> list[RemovableHandle]:
    """Have every module's registration of a submodule or a parameter (``module.head = nn.Linear(...)``,
    ``register_parameter``, ``load_state_dict(assign=True)``) call ``hook(module, name, value)`` before it
    takes effect; ``hook`` returns None (torch would register what it returns instead).
    """
    from torch.nn.modules.module import (
        register_module_module_registration_hook,
        register_module_parameter_registration_hook,
    )

    return [register_module_module_registration_hook(_checked(hook)),
            register_module_parameter_registration_hook(_checked(hook))]


def tensor(tensor_: torch.Tensor, hook: Hook) -> RemovableHandle:
    """Register a hook on the gradient arriving at ``tensor_``."""
    return tensor_.register_hook(_checked(hook))


def accumulated(param: torch.Tensor, hook: Hook) -> RemovableHandle:
    """Register a post-accumulate-grad hook of ``param``."""
    return param.register_post_accumulate_grad_hook(_checked(hook))


def backward_end(hook: Hook) -> None:
    """Have the autograd engine call ``hook`` at the end of the running backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(_checked(hook))


def optimizer(opt: torch.optim.Optimizer, hook: Hook, *, pre: bool) -> RemovableHandle:
    """Register a step (pre-)hook of one optimizer."""
    return opt.register_step_pre_hook(_checked(hook)) if pre else opt.register_step_post_hook(_checked(hook))


def thread(hook: Hook, name: str, *, ended: Callable[[], None] | None = None) -> threading.Thread:
    """A daemon thread that runs ``hook`` (its failure is told to the training loop), started; ``ended()``
    runs in it last, however the hook ended (also when it never ran: a detached guard, an injected fault).
    """
    _checked(hook)

    def run() -> None:
        guard.OWN_THREADS.add(threading.get_ident())
        try:
            hook()
        finally:
            guard.OWN_THREADS.discard(threading.get_ident())
            if ended is not None:
                ended()

    started = threading.Thread(target=run, name=name, daemon=True)
    started.start()
    return started


def at_exit(hook: Hook) -> None:
    """Run ``hook`` at interpreter exit."""
    import atexit

    atexit.register(_checked(hook))


def at_fork(hook: Hook) -> None:
    """Run ``hook()`` in every child forked from this process (``os.fork``, multiprocessing's and DataLoader's
    ``fork``), in the child's one thread, before ``fork`` returns there.
    """
    import os

    os.register_at_fork(after_in_child=_checked(hook))


def excepthook(hook: Hook) -> None:
    """Have ``hook(kind, value, tb)`` note every uncaught exception, then the previous excepthook run."""
    import sys

    previous = sys.excepthook
    note = _checked(hook)

    def chained(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        note(kind, value, tb)
        previous(kind, value, tb)

    sys.excepthook = chained


def on_signal(signum: int, hook: Hook) -> bool:
    """Have signal ``signum`` call ``hook(signum, frame, dying)`` first, then do what it did before: call the
    handler installed before (chained), or take the signal's default action again (``dying``: the process
    ends by the signal, as it would have without gradwatch, so its exit status is the signal's).

    ``hook`` returning True takes the default action over: it calls :func:`die` itself, later.
    A handler installed later that calls this one as the handler before it decides on its own: this one
    then only calls ``hook`` (not dying). A process forked from this one (a DataLoader worker) gets the
    handler before, never ``hook``. Nothing is installed outside the main thread, over an ignored
    signal, or over a handler not set from Python.

    Returns:
        whether the handler was installed.
    """
    import os
    import signal

    note = _checked(hook)
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signum)
    if previous is None or previous == signal.SIG_IGN or getattr(previous, "gradwatch", False):
        return False
    pid = os.getpid()

    def handler(number: int, frame: Any) -> None:
        on_top = signal.getsignal(number) is handler
        if os.getpid() == pid and note(number, frame, on_top and not callable(previous)) is True:
            return  # ``hook`` ends the process by the signal itself, later (:func:`die`)
        if callable(previous):
            previous(number, frame)
        elif on_top:
            die(number)

    handler.gradwatch = True  # type: ignore[attr-defined]
    signal.signal(signum, handler)
    return True


def die(signum: int) -> None:
    """End the process by ``signum``'s default action (its exit status is the signal's); main thread only."""
    import os
    import signal

    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def after_return(frame: FrameType, hook: Hook) -> None:
    """Have ``hook()`` run as ``frame`` (running in the calling thread) returns, by tracing that thread
    until then (as a debugger does; new calls meanwhile are not traced). For a signal handler that must
    not act inside gradwatch's code it interrupted.
    """
    import sys

    note = _checked(hook)
    previous = sys.gettrace()

    def returned(at: FrameType, event: str, arg: Any) -> Any:
        if event == "return" and at is frame:
            sys.settrace(previous)
            note()
        return returned

    frame.f_trace_lines = False
    frame.f_trace = returned
    sys.settrace(lambda at, event, arg: None)


def exit_calls(hook: Hook) -> None:
    """Have ``hook(status)`` note every call of ``sys.exit(status)`` before it raises (the exit code is
    not given to ``atexit``). A ``from sys import exit`` made before, ``raise SystemExit`` and the
    ``exit()`` builtin are not seen.
    """
    import sys

    previous = sys.exit
    note = _checked(hook)

    def exit(status: Any = None, /) -> None:
        note(status)
        previous(status)

    exit.__doc__ = previous.__doc__
    sys.exit = exit  # type: ignore[assignment]


# ------------------------------------------------ the optimizer step hooks
class _Dispatch:
    """gradwatch's one pair of global optimizer step hooks, calling each watcher's in turn."""

    def __init__(self) -> None:
        self.pre: list[Hook] = []
        self.post: list[Hook] = []
        self.handles: dict[str, RemovableHandle] = {}
        self.running = ""  # "pre" or "post" while torch iterates that dict

    def step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        self._tidy("pre")
        changed, self.running = None, "pre"
        try:
            for hook in list(self.pre):
                result = hook(opt, args, kwargs)
                if isinstance(result, tuple) and len(result) == 2:
                    changed = args, kwargs = result
        except TrainingHalted as exc:  # raised from torch's optimizer step: one frame of gradwatch above the raise
            raise trimmed(exc) from exc.__cause__
        finally:
            self.running = ""
        return changed

    def step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._tidy("post")
        self.running = "post"
        try:
            for hook in list(self.post):
                hook(opt, args, kwargs)
        except TrainingHalted as exc:
            raise trimmed(exc) from exc.__cause__
        finally:
            self.running = ""

    def _tidy(self, now: str) -> None:
        """Leave torch's dicts when no watcher is left: not the one torch iterates now unless last in it."""
        if self.pre or self.post:
            return
        for which in ("pre", "post"):
            handle = self.handles.get(which)
            hooks = handle.hooks_dict_ref() if handle is not None else None
            if handle is None or (which == now and hooks is not None and next(reversed(hooks), None) != handle.id):
                continue
            handle.remove()
            del self.handles[which]

    def subscribe(self, pre: Hook, post: Hook) -> Callable[[], None]:
        self.pre.append(_checked(pre))
        self.post.append(_checked(post))
        if not self.handles:
            self.handles = {"pre": torch_optim.register_optimizer_step_pre_hook(self.step_pre),
                            "post": torch_optim.register_optimizer_step_post_hook(self.step_post)}

        def unsubscribe() -> None:
            if pre in self.pre:
                self.pre.remove(pre)
                self.post.remove(post)
            self._tidy(self.running)

        return unsubscribe


_DISPATCH = _Dispatch()


def on_optimizers(pre: Hook, post: Hook) -> Callable[[], None]:
    """Have every optimizer's step call ``pre(opt, args, kwargs)`` before and ``post(opt, args, kwargs)``
    after it; returns the function that stops it.
    """
    return _DISPATCH.subscribe(pre, post)
