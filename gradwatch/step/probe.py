"""Probe: attaches and detaches every hook gradwatch uses; hooks only launch device work.

- a forward pre-hook on the root module marks the start of an iteration;
- two hooks on one "sentinel" parameter: its gradient arriving (before it is accumulated) marks
  the start of each backward pass, its post-accumulate-grad hook the end of the pass, so that an
  iteration whose gradients were dropped without an optimizer step (a GradScaler overflow) is
  still counted as a step;
- with origin tracking, a forward hook on the root module hands each output to the tracker and
  hooks the gradient arriving at it (also a start of the backward pass, when it comes first);
- global optimizer step pre/post hooks mark the moment gradients are final and after the update;
- forward hooks on leaf modules, attached only for sampled steps, launch activation reductions.

No hook does Python work per module or per parameter on a step that takes no activation
statistics: a forward call costs the root's pre-hook (and, with origin tracking, its forward
hook), a backward pass one call at its start and one at its end. After the first forward call
of an iteration that origin tracking does not capture, the root's hooks are out of the module's
hook dicts until the next backward pass or optimizer step (a rollout of many single-sample calls
per step takes ``nn.Module``'s path without hooks), then back in their place.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.rootcause.state import first_tensor
from gradwatch.step.activations import Collected, Reduced, Slot, outputs
from gradwatch.step.attending import Attending
from gradwatch.step.calls import recomputing, transformed
from gradwatch.step.layout import bounds
from gradwatch.watching import guard as entry
from gradwatch.watching import register
from gradwatch.watching.guard import Hook, RootHook

# gradwatch's hooks are the guard's (the one door from torch into gradwatch); a model pickled by an
# older gradwatch holds ``gradwatch.step.probe._unwatched_copy``, which still loads
_unwatched_copy = entry.unwatched_copy


class Keeper(Protocol):
    """What keeps the gradient arriving at a forward call's output (origin tracking's capture)."""

    def keep_grad(self, grad: torch.Tensor | None) -> None:
        """Keep (a reference to) the gradient; None: no gradient came back through the output."""


class Probe:
    """Owns the hooks on one model; calls back into its watcher."""

    def __init__(
        self,
        model: nn.Module,
        *,
        on_forward: Callable[[tuple[Any, ...], dict[str, Any]], None],
        on_step_pre: Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]], Any],
        on_step_post: Callable[[torch.optim.Optimizer], None],
        on_backward_start: Callable[[], None],
        on_backward_end: Callable[[torch.Tensor], None],
        on_output: Callable[[torch.Tensor, bool], Keeper | None] | None = None,
        guard: entry.Guard,
    ) -> None:
        self._guard = guard
        self._on_forward = on_forward
        self._on_backward_start = on_backward_start
        self._on_backward_end = on_backward_end
        self._on_output = on_output
        pre = register.forward_pre(model, guard.hook("forward_pre", self._forward_pre, RootHook), with_kwargs=True)
        self._handles: list[RemovableHandle] = [pre]
        self._leave_optimizers = register.on_optimizers(
            guard.hook("step_pre", on_step_pre), guard.hook("step_post", lambda opt, args, kwargs: on_step_post(opt)))
        #: the root's hooks: (hook dict, key) of each, taken out of their dicts while quiet
        self._root: list[tuple[dict[int, Any], int]] = [(model._forward_pre_hooks, pre.id)]
        if on_output is not None:
            post = register.forward(model, guard.hook("forward", self._forward_post, RootHook))
            self._handles.append(post)
            self._root.append((model._forward_hooks, post.id))
        #: the root's hooks taken out while quiet: (hook dict, key, hook, keys of the hooks before it)
        self._aside: list[tuple[dict[int, Any], int, Any, frozenset[int]]] = []
        #: whether quiet takes the root's hooks out of the module (not for a compiled model, whose
        #: graph is guarded on its hooks: see :meth:`keep_root_hooks`)
        self._lift = True
        #: the thread that watches: only there are the root's hooks taken out
        self._thread = threading.get_ident()
        #: set while gradwatch itself runs the model (origin replay): every hook stands aside
        self.paused = False
        self._quiet = False
        #: a forward call of the model in train mode was seen; the latest one was in eval mode after that
        self.trained = self.evaluating = False
        self._sentinel: list[RemovableHandle] = []
        self._act_handles: list[RemovableHandle] = []
        #: the activation statistics collected since attach (or the last take)
        self.collected = Collected()
        self._leaf_hooks: list[tuple[nn.Module, Hook]] = []
        #: each leaf hook's key in its module's forward hooks (unique ids, as a handle's), and
        #: whether they are in those dicts now (a sampled step's hooks are put there by key)
        self._leaf_keys: list[int] = []
        self._leaves_in = False
        #: the leaf hooks take statistics (they are registered only while they do, unless kept)
        self.collect = False
        #: the leaf hooks stay registered (a compiled model: :meth:`keep_activation_hooks`)
        self.keep_hooks = False
        self._output_grad_hook = self._output_grad  # bound once: each output's hook is one partial of it
        self._leaves: list[tuple[int, nn.Module]] | None = None
        #: the attention calls of sampled forward calls (see :mod:`gradwatch.step.attending`); none of a transform,
        #: a recomputation, gradwatch's own replay or a call without gradients is the step's
        self.attending = Attending(model, guard)
        self.attending.skip = lambda: (self.paused or self.evaluating or not torch.is_grad_enabled() or transformed()
                                       or recomputing())

    # ------------------------------------------------------------------ root
    def in_watching_thread(self) -> bool:
        """Whether the caller runs in the thread that started watching (the training thread, as a rule)."""
        return threading.get_ident() == self._thread

    @property
    def quiet(self) -> bool:
        """The root's hooks have nothing to do until the next backward pass or optimizer step (a
        forward call after the iteration's first that origin tracking does not capture).

        While quiet they are out of the module's hook dicts, so that a rollout's many forward calls
        take ``nn.Module``'s path without hooks; they go back at their place when it ends.
        """
        return self._quiet

    @quiet.setter
    def quiet(self, value: bool) -> None:
        if value == self._quiet:
            return
        self._quiet = value
        if not self._lift:
            return
        if value:
            if not self.in_watching_thread():
                return  # another thread (DataParallel's replicas share the hook dicts): left in place
            for hooks, key in self._root:
                if key in hooks:
                    keys = list(hooks)
                    self._aside.append((hooks, key, hooks[key], frozenset(keys[:keys.index(key)])))
                    del hooks[key]
            return
        aside, self._aside = self._aside, []
        for hooks, key, hook, before in aside:
            if key in hooks:
                continue
            # back after the hooks that were before it, before the others (registered after it,
            # also while it was out)
            items = list(hooks.items())
            hooks.clear()
            hooks.update([kv for kv in items if kv[0] in before])
            hooks[key] = hook
            hooks.update([kv for kv in items if kv[0] not in before])

    @staticmethod
    def compiled_call() -> bool:
        """Whether the forward call now starting runs compiled, its root's hooks around the graph
        (``torch.compile(watched)``): the leaves' hooks are traced into the graph.
        """
        dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing was compiled
        inside = getattr(getattr(dynamo, "eval_frame", None), "_is_in_optimized_module", None)
        return bool(inside()) if inside is not None else dynamo is not None and torch.compiler.is_compiling()

    def keep_root_hooks(self) -> None:
        """Leave the root's hooks in place while quiet (a compiled model's graph is guarded on them)."""
        self.quiet = False
        self._lift = False

    def _forward_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.quiet:
            return
        # trained in train mode, now in eval mode with gradients on: a validation pass, part of no step
        self.trained, self.evaluating = self.trained or module.training, self.trained and not module.training
        if self.evaluating:
            return
        # ``is_dynamo_compiling``, not ``is_compiling``: an older torch runs these hooks around the
        # compiled forward of ``torch.compile(watched)`` with ``is_compiling`` already true
        if self._lift and torch.compiler.is_compiling():
            self.keep_root_hooks()  # and guards that graph on them
        if not self.paused and torch.is_grad_enabled() and not torch.compiler.is_dynamo_compiling() and \
                not transformed():
            self._on_forward(args, kwargs)

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.quiet or self.paused or self.evaluating or not torch.is_grad_enabled() or \
                torch.compiler.is_dynamo_compiling() or transformed():
            return
        out = first_tensor(output)
        if out is not None and out.requires_grad and self._on_output is not None:
            keeper = self._on_output(out, out is not output)  # and whether the model returned more
            if keeper is not None:  # held weakly: the keeper holds the output, whose hook this is
                register.tensor(out, self._guard.hook("output_grad", functools.partial(self._output_grad_hook,
                                                                                    weakref.ref(keeper))))

    def _output_grad(self, keeper: weakref.ref[Keeper], grad: torch.Tensor | None) -> None:
        if not self.paused:
            kept = keeper()
            if kept is not None:
                kept.keep_grad(grad)
            self._on_backward_start()

    def _sentinel_grad(self, grad: torch.Tensor) -> None:
        if not self.paused:
            self._on_backward_start()

    def watch_backward(self, param: nn.Parameter) -> None:
        """Move the sentinel hooks (which mark the start and the end of backward passes) to ``param``.

        The start is its gradient arriving, before it is accumulated into ``param.grad``: what the
        previous backward left there is still there to compare.
        """
        for handle in self._sentinel:
            handle.remove()
        self._sentinel = [register.tensor(param, self._guard.hook("sentinel_grad", self._sentinel_grad)),
                          register.accumulated(param, self._guard.hook("accumulated", self._on_backward_end))]

    # ----------------------------------------------------------- activations
    @property
    def collecting(self) -> bool:
        """Whether the activation hooks take statistics."""
        return self.collect

    def attach_activations(self, leaves: list[tuple[int, nn.Module]]) -> None:
        """Take activation statistics with forward hooks on leaf modules until :meth:`detach_activations`.

        The hooks are made once per layout and registered on each sampled step: the same objects
        each time (nothing to build per step). For a compiled model they stay registered (see
        :meth:`keep_activation_hooks`) and this only switches them on.
        """
        if self.collect:
            return
        self.collected.clear()
        if self._leaves is not leaves:
            self._make_hooks(leaves)
        if not self._act_handles and not self._leaves_in:
            # what ``register_forward_hook`` does, under keys made once: no handle to make per step
            for (module, hook), key in zip(self._leaf_hooks, self._leaf_keys):
                register.put(module, key, hook)
            self._leaves_in = True
        self.collect = True

    def keep_activation_hooks(self, leaves: list[tuple[int, nn.Module]]) -> None:
        """Register the leaf hooks now and for good, switched off (for a model compiled with
        ``torch.compile``, whose graph is traced with the hooks in it: switching them on and off
        makes two graphs, where registering them on sampled steps would not be seen by the graph).
        """
        self.detach_activations()
        self.keep_hooks = True
        self._make_hooks(leaves)
        self._act_handles = [register.forward(module, hook) for module, hook in self._leaf_hooks]

    def _make_hooks(self, leaves: list[tuple[int, nn.Module]]) -> None:
        self._remove_leaf_hooks()
        self._leaves = leaves
        # each hook bound to its leaf's slot, not to its layer index: dynamo would guard a graph that traced
        # the hook on that number, and compile the same module class's code again for each instance
        slots = self.collected.made([(index, bounds(module)) for index, module in leaves])
        self._leaf_hooks = [(module, self._guard.hook("activation", functools.partial(self._activation, slot)))
                            for (_, module), slot in zip(leaves, slots)]
        self._leaf_keys = [RemovableHandle(module._forward_hooks).id for module, _ in self._leaf_hooks]

    def _remove_leaf_hooks(self) -> None:
        for handle in self._act_handles:
            handle.remove()
        self._act_handles = []
        if self._leaves_in:
            for (module, _), key in zip(self._leaf_hooks, self._leaf_keys):
                module._forward_hooks.pop(key, None)
            self._leaves_in = False

    def _activation(self, slot: Slot, module: nn.Module, args: Any, output: Any) -> None:
        """A leaf's forward hook: launch its output's reductions (traced into a compiled graph)."""
        if not self.collect or self.paused or self.evaluating or not torch.is_grad_enabled():
            return
        # every floating or complex tensor of the output (a tuple, dict, named tuple or dataclass of them)
        outs = (output,) if type(output) is torch.Tensor and output.is_floating_point() else outputs(output)
        for out in outs:
            if self.keep_hooks or torch.compiler.is_dynamo_compiling():
                # traced into a graph (any compiled model's leaf): reduced there, where holding the output for a
                # later batched reduction is not traceable, and summed into the leaf's slot on the device
                self.collected.accumulate(slot, out)
            elif not transformed():  # a call inside a backward pass is checkpointing's second run: counted once
                self.collected.add(slot.index, out, slot.limits, recomputed=recomputing())

    def take_activations(self) -> list[Reduced]:
        """Hand over the activation statistics collected so far and start anew."""
        return self.collected.take()

    def give_back(self, taken: list[Reduced]) -> None:
        """Put statistics taken earlier (an earlier micro-batch's) before those collected since."""
        self.collected.done[:0] = taken

    def detach_activations(self) -> None:
        """Stop taking activation statistics: the leaf hooks are removed (switched off when kept)."""
        self.collect = False
        self.collected.clear()
        if not self.keep_hooks:
            self._remove_leaf_hooks()

    def detach(self) -> None:
        """Remove every hook."""
        self.quiet = False  # the root's hooks back in place, so that their handles remove them
        self.keep_hooks = False
        self.detach_activations()
        self.attending.close()
        for handle in self._sentinel:
            handle.remove()
        self._sentinel = []
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._leave_optimizers()
