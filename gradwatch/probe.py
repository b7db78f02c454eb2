"""Probe: attaches and detaches every hook gradwatch uses; hooks only launch device work.

- a forward pre-hook on the root module marks the start of an iteration, and a hook on the root
  output's gradient marks the start of each backward pass;
- a post-accumulate-grad hook on one "sentinel" parameter marks the end of each backward pass,
  so that an iteration whose gradients were dropped without an optimizer step (a GradScaler
  overflow) is still counted as a step;
- global optimizer step pre/post hooks mark the moment gradients are final and after the update;
- forward hooks on leaf modules, attached only for sampled steps, launch activation reductions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from gradwatch.layout import bounds
from gradwatch.stats import activation_stats


def first_tensor(output: Any) -> torch.Tensor | None:
    """The first floating-point tensor in a module output (tensor, tuple, list, dict, ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            t = first_tensor(item)
            if t is not None:
                return t
    return None


def unwatched(owner: Any, *args: Any) -> None:
    """What a copy of a watched model (``copy.deepcopy``, ``torch.save``/``torch.load``, EMA/SWA's
    ``AveragedModel``) holds where the original has a gradwatch hook: a hook that does nothing and
    removes itself on its first call. The copy is not watched; watch it with ``gw.watch(copy)``.
    """
    for name in _HOOK_DICTS:
        hooks = getattr(owner, name, None)
        if isinstance(hooks, dict):
            for key in [k for k, hook in hooks.items() if hook is unwatched]:
                del hooks[key]


def _unwatched_copy() -> Callable[..., None]:
    """What a pickled :class:`Hook` loads as."""
    return unwatched


#: the hook dicts of modules and tensors where gradwatch registers hooks
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_post_accumulate_grad_hooks")


class Hook:
    """One of gradwatch's hooks on the user's module or parameter.

    The model is the user's: copying or saving it must work while it is watched. A copy of the
    hook (``deepcopy``, pickle) is :func:`unwatched`, which keeps no reference to this watcher.
    """

    __slots__ = ("_call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def __call__(self, *args: Any) -> Any:
        """Run the hook."""
        return self._call(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return unwatched

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _unwatched_copy, ()

    def __repr__(self) -> str:
        return f"<gradwatch hook {getattr(self._call, '__qualname__', self._call)!r}>"


class Probe:
    """Owns the hooks on one model; calls back into its watcher."""

    def __init__(
        self,
        model: nn.Module,
        *,
        on_forward: Callable[[tuple[Any, ...], dict[str, Any]], None],
        on_step_pre: Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]], Any],
        on_step_post: Callable[[torch.optim.Optimizer], None],
        on_backward_start: Callable[[torch.Tensor], None],
        on_backward_end: Callable[[torch.Tensor], None],
    ) -> None:
        self._on_forward = on_forward
        self._on_backward_start = on_backward_start
        self._on_backward_end = on_backward_end
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(Hook(self._forward_pre), with_kwargs=True),
            model.register_forward_hook(Hook(self._forward_post)),
            register_optimizer_step_pre_hook(on_step_pre),
            register_optimizer_step_post_hook(lambda opt, args, kwargs: on_step_post(opt)),
        ]
        #: set while gradwatch itself runs the model (origin replay): every hook stands aside
        self.paused = False
        #: called with the root module's output of each forward (origin tracking keeps a reference)
        self.on_output: Callable[[torch.Tensor], None] | None = None
        self._sentinel: RemovableHandle | None = None
        self._act_handles: list[RemovableHandle] = []
        #: (layer index, [norm, non-zeros(, saturated)], numel) for each leaf call since attach
        self.activations: list[tuple[int, list[torch.Tensor], int]] = []

    # ------------------------------------------------------------------ root
    def _forward_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled() and not self.paused and not torch.compiler.is_compiling():
            self._on_forward(args, kwargs)

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not self.paused and not torch.compiler.is_compiling():
            out = first_tensor(output)
            if out is not None and out.requires_grad:
                out.register_hook(self._output_grad)
                if self.on_output is not None:
                    self.on_output(out)

    def _output_grad(self, grad: torch.Tensor) -> None:
        if not self.paused:
            self._on_backward_start(grad)

    def watch_backward(self, param: nn.Parameter) -> None:
        """Move the sentinel hook (which marks the end of backward passes) to ``param``."""
        if self._sentinel is not None:
            self._sentinel.remove()
        self._sentinel = param.register_post_accumulate_grad_hook(Hook(self._on_backward_end))

    # ----------------------------------------------------------- activations
    @property
    def collecting(self) -> bool:
        """Whether activation hooks are attached."""
        return bool(self._act_handles)

    def attach_activations(self, leaves: list[tuple[int, nn.Module]]) -> None:
        """Attach forward hooks to leaf modules until :meth:`detach_activations`."""
        if self._act_handles:
            return
        self.activations = []
        for index, module in leaves:
            hook = self._activation_hook(index, bounds(module))
            self._act_handles.append(module.register_forward_hook(Hook(hook)))

    def _activation_hook(self, index: int, limits: tuple[float, float] | None) -> Callable[..., None]:
        store = self.activations

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or self.paused:
                return
            out = first_tensor(output)
            if out is not None:
                store.append((index, activation_stats(out, limits), out.numel()))

        return hook

    def take_activations(self) -> list[tuple[int, list[torch.Tensor], int]]:
        """Hand over the activation reductions collected so far and start a new list."""
        taken = list(self.activations)
        self.activations.clear()
        return taken

    def detach_activations(self) -> None:
        """Remove the leaf forward hooks."""
        for handle in self._act_handles:
            handle.remove()
        self._act_handles = []
        self.activations.clear()

    def detach(self) -> None:
        """Remove every hook."""
        self.detach_activations()
        if self._sentinel is not None:
            self._sentinel.remove()
            self._sentinel = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
