"""Registry: ``gw.watch`` / ``gw.unwatch`` / ``gw.watcher`` and the weak map of watched models."""

from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from gradwatch.config import Config, resolve
from gradwatch.errors import ConfigError, GradwatchWarning, InternalWarning, boundary
from gradwatch.options import Options, run_path
from gradwatch.step.layout import unwrap
from gradwatch.watching import ending, register, unregistered
from gradwatch.watching import guard as entry
from gradwatch.watching.watcher import Watcher

M = TypeVar("M")

_watchers: weakref.WeakKeyDictionary[nn.Module, Watcher] = weakref.WeakKeyDictionary()
_live: set[Watcher] = set()
_installed = False
_terminating = False  # a signal that ends the process waits for the hook it stopped to return


def _keys(model: nn.Module) -> list[nn.Module]:
    inner = unwrap(model)
    return [model] if inner is model else [model, inner]


def _default_run(model: nn.Module) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{type(unwrap(model)).__name__}"


def _free_run_dir(run: Path) -> Path:
    """``run``, or ``run-1``, ``run-2`` ... when this process is already writing into it."""
    taken = {w.run_dir.resolve() for w in _live}
    candidate, n = run, 0
    while candidate.resolve() in taken:
        n += 1
        candidate = run.with_name(f"{run.name}-{n}")
    if n:
        warnings.warn(f"gradwatch: {str(run)!r} is in use by another watched model; writing to {str(candidate)!r}",
                      GradwatchWarning, stacklevel=3)
    return candidate


@boundary
def watch(model_or_class: Any = None, *, run: str | Path | None = None, rules: Any = "default",
          log_every: int | None = None, **options: Any) -> Any:
    """Watch a model (or every instance of a Module class): one line, then an ordinary loop.

    Args:
        model_or_class: an ``nn.Module`` instance (returned as is, now watched), an
            ``nn.Module`` subclass (every instance gets watched), or None to get a decorator.
        run: run directory, created if missing; default ``runs/<timestamp>-<model class>``.
        rules: ``"default"`` (``[tool.gradwatch]`` of the nearest pyproject.toml if it has one,
            else the built-in rules), None (detect and record only), a :class:`gradwatch.Rule`
            or a list of them, or the path of a TOML rules file.
        log_every: write full per-layer series every this many steps (default 1, or the
            config file's ``log_every``).
        **options: further settings, see :class:`gradwatch.options.Options`.

    Raises:
        TypeError: the argument is not a module or a module class.
        ConfigError: an option is invalid, or the model has no trainable parameter.
        RunError: the run directory cannot be created or written.
    """
    config = resolve(rules)
    explicit = {**options, **({"log_every": log_every} if log_every is not None else {})}
    opts = _options(config, explicit)
    if model_or_class is None:
        return lambda target: watch(target, run=run, rules=rules, log_every=log_every, **options)
    if isinstance(model_or_class, type) and issubclass(model_or_class, nn.Module):
        return _watch_class(model_or_class, run, rules, explicit)
    if not isinstance(model_or_class, nn.Module):
        raise TypeError(
            f"gw.watch expects a torch.nn.Module instance or subclass, got {type(model_or_class).__name__}; "
            "pass the model itself, e.g. gw.watch(model, run='runs/exp1')"
        )
    model = model_or_class
    if run is not None:
        run = run_path(run)  # a bad path is refused before anything is created
    existing = _find(model)
    if existing is not None:
        if run is not None and Path(run).resolve() != existing.run_dir.resolve():
            warnings.warn(f"gradwatch: this model is already watched into {str(existing.run_dir)!r}; "
                          f"ignoring run={str(run)!r}", GradwatchWarning, stacklevel=2)
        return model
    unregistered.refuse(model)  # nothing to train, its layers in a plain list: say so, before any file
    run_dir = _free_run_dir(Path(run) if run is not None else _default_run(model))
    watcher_ = Watcher(model, run_dir, opts, config, on_close=forget)
    for key in _keys(model):
        _watchers[key] = watcher_
    _live.add(watcher_)
    weakref.finalize(model, _dropped, watcher_)  # a model dropped while watched closes its run
    _install_exit_handlers()
    _install_signal_handlers()
    return model


@boundary
def check_settings(*, rules: Any = "default", log_every: int | None = None, **options: Any) -> None:
    """Check :func:`watch`'s settings without watching anything (framework callbacks do, when built).

    Raises:
        ConfigError: a rule or an option is invalid, with the same message :func:`watch` gives.
    """
    _options(resolve(rules), {**options, **({"log_every": log_every} if log_every is not None else {})})


def _options(config: Config, explicit: dict[str, Any]) -> Options:
    """Options from the config file, overridden by the keyword arguments given to watch."""
    if config.options:
        try:
            Options.from_kwargs(**config.options)  # the file's own settings first: errors name the file
        except ConfigError as exc:
            raise ConfigError(f"{config.source}: {exc}") from None
    return Options.from_kwargs(**{**config.options, **explicit})


def _watch_class(cls: type[nn.Module], run: str | Path | None, rules: Any, explicit: dict[str, Any]) -> type[nn.Module]:
    """Wrap ``cls.__init__`` so that every instance gets watched.

    Watching is deferred to the instance's first forward call (or first :func:`watcher` call),
    so that subclasses which add modules after ``super().__init__()`` are watched whole.
    """
    original = cls.__init__
    start = functools.partial(watch, run=run, rules=rules, **explicit)
    owner = os.getpid()  # an instance made in a forked child is not watched (see _forked)

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        if self not in _pending and _find(self) is None and os.getpid() == owner:
            _pending[self] = (register.forward_pre(self, _PROCESS.hook("first_forward", _first_forward)), start)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


#: instances of decorated classes not yet watched: module -> (forward pre-hook handle, watch call)
_pending: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _start_pending(module: nn.Module) -> Watcher | None:
    entry = _pending.pop(module, None)
    if entry is None:
        return None
    handle, start = entry
    handle.remove()
    start(module)
    return _find(module)


def _first_forward(module: nn.Module, inputs: Any) -> None:
    started = _start_pending(module)
    if started is not None:  # the watcher's own hook joins from the next call on
        started.guard.run("forward_pre", started._forward_started)


def _find(model: nn.Module, *, detached: bool = False) -> Watcher | None:
    """The model's open watcher; with ``detached``, also one that detached itself after an internal error."""
    for key in _keys(model):
        found = _watchers.get(key)
        if found is not None and (not found.closed or (detached and found.detached)):
            return found
    return None


def watcher(model: nn.Module) -> Watcher:
    """The :class:`Watcher` of a watched model.

    Raises:
        ConfigError: the model is not watched.
    """
    if isinstance(model, nn.Module):
        _start_pending(model)  # an instance of a decorated class not run yet: watch it now
    found = _find(model, detached=True) if isinstance(model, nn.Module) else None
    if found is None:
        raise ConfigError("this model is not watched; call gw.watch(model) first")
    return found


def unwatch(model: nn.Module) -> None:
    """Close the model's watcher and remove every hook; the model is left exactly as before."""
    entry = _pending.pop(model, None) if isinstance(model, nn.Module) else None
    if entry is not None:
        entry[0].remove()
    found = _find(model, detached=True) if isinstance(model, nn.Module) else None
    if found is not None:
        found.close()
        for key in _keys(model):  # a detached watcher stays registered until unwatched
            if _watchers.get(key) is found:
                del _watchers[key]


def forget(watcher_: Watcher) -> None:
    """Drop a closed watcher from the registry (called by :meth:`Watcher.close`).

    A watcher that detached itself after an internal error stays reachable through
    :func:`watcher`, so that a loop calling ``gw.watcher(model).observe(...)`` goes on.
    """
    _live.discard(watcher_)
    if watcher_.detached:
        return
    for key, value in list(_watchers.items()):
        if value is watcher_:
            del _watchers[key]


def flush_run(run_dir: Path) -> bool:
    """Flush the watcher of this process that writes ``run_dir``, if there is one.

    Readers call it so that a run being written in this same process is read with every step
    recorded so far on disk.

    Returns:
        whether a live watcher of this process writes the run.
    """
    target = Path(run_dir).resolve()
    for w in list(_live):
        if not w.closed and w.writes and Path(w.run_dir).resolve() == target:
            w.flush()
            return True
    return False


def _dropped(watcher_: Watcher) -> None:
    """A watched model was garbage-collected: its run closes.

    A model that is a local of the user's ``main()`` is freed while a ``sys.exit`` (a SIGTERM handler's
    included) unwinds, before ``atexit``: when ``sys.exit`` was called and the watcher took no step
    since, the run closes as that exit ends it (``exited`` with its code), not as finished.
    """
    exiting = ending.NOW.code is not None
    status, detail = ending.outcome({id(watcher_): watcher_.step}, at_exit=True) if exiting else (None, {})
    watcher_.close(status, detail)


def _forked() -> None:
    """In a child forked from this process: the watchers it inherited go quiet (:meth:`Watcher.orphan`), none
    closes a run at the child's exit, and no instance of a watched class is watched there (docs/watching.md).
    """
    ending.forked()
    for watcher_ in {*_watchers.values(), *_live}:
        watcher_.orphan()
    _live.clear()
    while _pending:
        _pending.popitem()[1][0].remove()


def _steps() -> dict[int, int]:
    return {id(w): w.step for w in _live}


def _close_all() -> None:
    """Close the runs still open as the interpreter exits: as terminated, exited, crashed or finished."""
    status, detail = ending.outcome(_steps(), at_exit=True)
    for w in list(_live):
        w.guard.run("atexit", w.close, status, detail)


def _signalled(signum: int, frame: Any, dying: bool) -> bool:
    """A signal that ends the process arrived: the runs close as terminated. When its default action
    follows, they close first: now, if the signal stopped the training thread outside gradwatch's
    hooks; else as the hook it stopped returns (closing in the middle of a step would lose it), and then
    the process ends by the signal (True: done here). A hook that does not return within
    :data:`ending.CLOSE_SECONDS` gets the signal again, and the runs are closed then.
    """
    global _terminating
    ending.NOW.signal = signum
    inside = entry.hook_frame(frame)
    if not dying or not _live:
        return False
    if inside is None or _terminating:  # closed in a thread of its own, waited for a bounded time
        register.thread(_PROCESS.hook("signal", _close_all), "gradwatch-terminated").join(ending.CLOSE_SECONDS)
        return False
    _terminating = True
    register.after_return(inside, _PROCESS.hook("signal", lambda: _terminate(signum)))
    register.thread(_PROCESS.hook("signal", lambda: ending.signal_again(signum)), "gradwatch-terminating")
    return True


def _terminate(signum: int) -> None:
    try:
        _close_all()
    finally:
        register.die(signum)


def _exiting(status: Any) -> None:
    ending.exiting(status, _steps())


def _failed(exc: BaseException, kind: str, args: tuple[Any, ...]) -> None:
    """A hook of no watcher's failed (the first forward of a watched class's instance, the excepthook)."""
    entry_ = _pending.pop(args[0], None) if kind == "first_forward" and args else None
    if entry_ is not None:  # that instance is left unwatched
        entry_[0].remove()
    warnings.warn(f"gradwatch failed ({exc!r}); training continues unwatched by it", InternalWarning, stacklevel=3)


#: the guard of the hooks that belong to no watcher
_PROCESS = entry.Guard(_failed)


def _install_exit_handlers() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    register.at_exit(_PROCESS.hook("atexit", _close_all))
    register.excepthook(_PROCESS.hook("excepthook", ending.raised))
    register.exit_calls(_PROCESS.hook("exit", _exiting))
    register.at_fork(_PROCESS.hook("fork", _forked))


def _install_signal_handlers() -> None:
    """At each ``watch``: handle SIGTERM in front of the handler there now (chained to it), unless it is ours
    already, ignored, or this is not the main thread (where only signal handlers can be set).
    """
    for signum in ending.SIGNALS:
        register.on_signal(signum, _PROCESS.hook("signal", _signalled))
