"""pytest plugin, fixture side: the watches a test makes, and the findings that fail it.

Imports nothing heavy at module level (torch and the rest of gradwatch load inside the methods):
the plugin that uses it is loaded by every pytest session of an environment with gradwatch.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from gradwatch.watching.watcher import Watcher

M = TypeVar("M")


@dataclass
class _Entry:
    """One model the fixture watches (or tried to)."""

    index: int
    label: str
    run_dir: Path | None
    watcher: Watcher | None
    #: why the model could not be watched
    error: str | None = None


def _has_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


class GradwatchFixture:
    """What the ``gradwatch`` fixture gives a test: watches its models, judges their runs after it.

    Attributes:
        fail_on: the severity (``"warning"`` or ``"error"``) at or above which a finding fails the test.
    """

    def __init__(self, fail_on: str, options: dict[str, Any], root: Path, prefix: str, max_lines: int) -> None:
        self.fail_on = fail_on
        self._max_lines = max_lines
        self._options = options
        self._root = root
        self._prefix = prefix
        self._entries: list[_Entry] = []
        self._handles: list[RemovableHandle] = []
        self._torch: Any = None
        self._local = threading.local()
        self._lock = threading.RLock()
        #: modules already decided on by the automatic watch (watched, or left alone for good)
        self._decided: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._stopped = False

    def __repr__(self) -> str:
        return f"GradwatchFixture(fail_on={self.fail_on!r}, runs={[str(run) for run in self.runs]})"

    @property
    def runs(self) -> list[Path]:
        """The run directories of the models watched so far, in the order they were watched."""
        return [entry.run_dir for entry in self._entries if entry.run_dir is not None]

    def watch(self, model: M, **kwargs: Any) -> M:
        """Watch ``model`` for this test and return it.

        Args:
            model: an ``nn.Module`` instance.
            **kwargs: the keyword arguments of :func:`gradwatch.watch`; they override the marker's
                and the fixture's defaults (``rules="default"``, ``console=False``). ``run`` is
                chosen by the fixture unless given.

        Returns:
            The same model, now watched. A model the test already watched itself is not watched
            again: its own run is judged (and closed) with the others, and ``kwargs`` are ignored
            with a warning.

        Raises:
            TypeError: ``model`` is not a module.
            gradwatch.ConfigError: an invalid option, or a model without trainable parameters.
        """
        from gradwatch.watching import registry

        if self._stopped:
            raise RuntimeError("the gradwatch fixture has already judged this test's runs; watch models in the test")
        if not isinstance(model, _nn_module()):
            raise TypeError(f"gradwatch.watch(model) expects a torch.nn.Module instance, got {type(model).__name__}")
        module = cast("nn.Module", model)
        with self._lock:
            existing = registry._find(module) or (registry.watcher(module) if module in registry._pending else None)
            if existing is not None:
                self._adopt(module, existing, kwargs)
            else:
                self._watch(module, **kwargs)
            self._decided.add(module)
        return model

    # ------------------------------------------------------------------ internals
    def _adopt(self, model: Any, watcher: Watcher, kwargs: dict[str, Any]) -> None:
        """Judge the run of a model handed to :meth:`watch` that the test had already watched itself."""
        if kwargs:
            from gradwatch.errors import GradwatchWarning

            warnings.warn(f"gradwatch: this model is already watched into {str(watcher.run_dir)!r}; the fixture "
                          f"judges that run and ignores {sorted(kwargs)}", GradwatchWarning, stacklevel=3)
        if any(entry.watcher is watcher for entry in self._entries):
            return
        self._entries.append(_Entry(len(self._entries), type(model).__name__, watcher.run_dir, watcher))

    def _watch(self, model: Any, *, run: str | Path | None = None, **kwargs: Any) -> Watcher:
        from gradwatch.watching import registry

        index = len(self._entries)
        run_dir = Path(run) if run is not None else self._root / f"{self._prefix}-{index}"
        registry.watch(model, run=run_dir, **{**self._options, **kwargs})
        watcher = registry.watcher(model)
        self._entries.append(_Entry(index, type(model).__name__, watcher.run_dir, watcher))
        return watcher

    def _start(self) -> None:
        """Install the global forward hooks that find the models the test runs (guarded: a failure of
        gradwatch's there removes them, with one InternalWarning, and the test goes on).
        """
        import torch

        from gradwatch.watching import guard, register

        self._torch = torch
        hooks = guard.Guard(self._broken)
        self._handles = register.every_module(hooks.hook("pytest_fixture", self._enter),
                                              hooks.hook("pytest_fixture", self._leave))

    def _broken(self, exc: BaseException, *where: Any) -> None:
        from gradwatch.errors import InternalWarning

        for handle in self._handles:
            handle.remove()
        self._handles = []
        warnings.warn(f"gradwatch's fixture stopped finding models after an internal error ({exc!r}); the test goes "
                      "on", InternalWarning, stacklevel=2)

    def _frames(self) -> list[bool]:
        """The running module forwards of this thread: whether each is, or is inside, a trainable module."""
        frames: list[bool] | None = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._torch.compiler.is_compiling():
            return
        frames = self._frames()
        if (frames and frames[-1]) or module in self._decided:
            frames.append(True)  # inside a trainable module, or a module already decided on
            return
        trainable = _has_trainable(module)
        frames.append(trainable)
        if trainable and self._torch.is_grad_enabled():  # a forward without gradients is not training
            self._auto(module, args)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._torch.compiler.is_compiling():
            return
        frames = self._frames()
        if frames:
            frames.pop()

    def _auto(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Watch an outermost trainable module at its first forward, unless something watches it already."""
        with self._lock:
            if self._stopped or module in self._decided:
                return
            self._decided.add(module)
            if _overlaps_watched(module):
                return
            try:
                watcher = self._watch(module)
            except Exception as exc:  # reported with the verdict: the test asked for its training to be judged
                self._entries.append(_Entry(len(self._entries), type(module).__name__, None, None,
                                            error=f"{type(exc).__name__}: {exc}"))
                return
        # this forward call is already past the model's own pre-hook: tell the watcher, as a decorated
        # class does at its first forward (gradwatch.watching.registry._first_forward)
        watcher._forward_started(args, {})

    def _stop(self) -> None:
        """Remove the global hooks and close the runs (idempotent); the first error is raised at the end."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._stopped:
            return
        self._stopped = True
        first: BaseException | None = None
        for entry in self._entries:
            watcher = entry.watcher
            if watcher is None or watcher.closed:
                continue
            try:
                watcher.close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def _report(self) -> str | None:
        """The failure message for this test's runs, or None when nothing reaches ``fail_on``."""
        from gradwatch.errors import RunError
        from gradwatch.judging import gate
        from gradwatch.store.reader import open_run

        blocks: list[str] = []
        count = problems = 0
        for entry in self._entries:
            head = f"model {entry.index} ({entry.label})"
            if entry.error is not None or entry.run_dir is None:
                problems += 1
                blocks.append(f"{head}: could not be watched: {entry.error}")
                continue
            try:
                frame = open_run(entry.run_dir).findings()
            except RunError as exc:
                problems += 1
                blocks.append(f"{head}, run {entry.run_dir}: could not be read: {exc}")
                continue
            bad = gate.failing(frame, self.fail_on)
            if bad.empty:
                continue
            count += len(bad)
            lines = [f"{head}, run {entry.run_dir}:"]
            lines += [f"  {item.line()}" for item in gate.items(bad.head(self._max_lines))]
            if len(bad) > self._max_lines:
                lines.append(f"  ... and {len(bad) - self._max_lines} more")
            if len(frame) > len(bad):
                lines.append(f"  ({len(frame) - len(bad)} more below {self.fail_on!r} in this run)")
            blocks.append("\n".join(lines))
        if not blocks:
            return None
        parts = []
        if count:
            noun = "finding" if count == 1 else "findings"
            parts.append(f"{count} {noun} at or above {self.fail_on!r} in the training this test ran")
        if problems:
            parts.append(f"{problems} of the models it ran could not be judged")
        tail = "(threshold: @pytest.mark.gradwatch(fail_on=...) or --gradwatch-fail-on)"
        return "\n".join([f"gradwatch: {'; '.join(parts)}", *blocks, tail])


def _nn_module() -> type:
    from torch import nn

    return nn.Module


def _overlaps_watched(module: nn.Module) -> bool:
    """Whether ``module`` is watched, about to be (a decorated class), or shares modules with a watched model."""
    from gradwatch.watching import registry

    if registry._find(module) is not None or module in registry._pending:
        return True
    inner = set(module.modules())
    for watcher in list(registry._live):
        if watcher.closed:
            continue
        try:
            model = watcher.model()
        except RuntimeError:  # its model was garbage-collected
            continue
        if model in inner or module in set(model.modules()):
            return True
    return False
