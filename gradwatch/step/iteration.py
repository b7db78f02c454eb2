"""Iterations: the probe's forward and backward moments, and what ends between two optimizer steps.

An iteration runs from one forward of the root module to the next. Its gradients are either
applied by an optimizer step (the lifecycle's business), kept for the next micro-batch (gradient
accumulation: the iteration joins the next step), or dropped without a step (a GradScaler
overflow: recorded as a skipped step). The next backward tells which of the last two it was, by
a sentinel parameter's gradient: still the same tensor at the same version, or not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from gradwatch.step import preclip
from gradwatch.step.buffers import Buffers
from gradwatch.step.layout import Discovered
from gradwatch.step.observed import Observed, merge
from gradwatch.step.origin import Tracker
from gradwatch.step.probe import Probe
from gradwatch.watching import guard as entry
from gradwatch.watching import register

if TYPE_CHECKING:  # the settings are built by the public face (gradwatch.options)
    from gradwatch.options import Options

log = logging.getLogger("gradwatch")


class Steps(Protocol):
    """What an iteration needs of the step lifecycle it belongs to."""

    step: int
    closed: bool

    def sampled(self, step: int) -> bool:
        """Whether ``step`` takes activation statistics."""

    def has_open_step(self) -> bool:
        """Whether a step is open (between its optimizer step and the next forward)."""

    def close_step(self) -> None:
        """Close the open step (a new iteration begins)."""

    manual: bool

    def dropped(self, observed: Observed, *, ongoing: bool) -> None:
        """Record an iteration whose gradients were dropped without an optimizer step."""

    def manual_step(self) -> None:
        """The end of a backward pass in a loop that updates the parameters by hand."""

    def follow(self) -> None:
        """Look at the model again if it changed (a registration) since the last look."""


class Iteration:
    """Tracks the iterations of one watched model through the probe's forward and backward hooks.

    Args:
        model: the watched model.
        found: its discovered layout.
        options: the run's settings.
        tracker: non-finite origin tracking (captures each forward's inputs), or None.
        steps: the lifecycle these iterations belong to.
        on_step_pre, on_step_post: the lifecycle's optimizer step hooks.
        guard: the watcher's guard, through which every hook runs.
        buffers: the copies of the model's buffers, taken at the first forward call of each step.
    """

    def __init__(self, model: nn.Module, found: Discovered, options: Options, tracker: Tracker | None,
                 steps: Steps, *, on_step_pre: Callable[..., Any], on_step_post: Callable[..., Any],
                 guard: entry.Guard, buffers: Buffers) -> None:
        self._steps, self._options, self._tracker = steps, options, tracker
        self.buffers = buffers
        buffers.watch(model)
        # the end of a backward pass, after what it queued itself (DDP's gradient reduction): made once
        self._ended = guard.hook("backward_end", self.backward_ended)
        self._ending = guard.hook("backward_end", lambda: register.backward_end(self._ended))
        self._compiled = type(model).__name__ == "OptimizedModule"
        self.found = found
        #: values observed for the coming step
        self.observed: Observed = {}
        #: the sentinel's gradient (id, version) after the last backward since the last step
        self.backward: tuple[int, int] | None = None
        #: observations and activations of an iteration that ended without a step, until the
        #: next backward tells whether it was gradient accumulation or a dropped step
        self.carry: tuple[Observed, list[Any]] | None = None
        self.probe = Probe(model, on_forward=self.forward_started, on_step_pre=on_step_pre,
                           on_step_post=on_step_post, on_backward_start=self.backward_started,
                           on_backward_end=self.backward_done,
                           on_output=tracker.output if tracker is not None else None, guard=guard)
        #: since the last backward pass, an optimizer holding none of this model's parameters stepped (a
        #: GAN's generator, whose loss reached the watched discriminator): if its gradients are then
        #: dropped, that iteration belonged to the other model's step, not to a step of this one
        self.served = False
        #: (parameter index, its gradient's id and version) when the last step opened, of a parameter
        #: the step's optimizer holds, until the next backward pass begins: still that tensor,
        #: unchanged, then means nothing cleared it between the steps
        self.at_step: tuple[int, int, int] | None = None
        self.uncleared = False  # this step's gradients were added to the previous step's
        #: steps in a row whose gradients held the previous step's (``records.GRAD_STALE``)
        self.stale = 0
        self._held: tuple[torch.Tensor, Any] | None = None  # that parameter and its gradient accumulator
        #: a backward pass has begun and its end is not reached yet (its start is told once)
        self.began = False
        #: a forward call was seen since the last step opened; it was when the open step opened
        self.forwarded = self.seen = False
        #: the iteration under way has begun with a forward call that origin tracking captured: a
        #: further forward call before its backward pass (a rollout's) only adds a capture
        self.again = False
        self._activations = options.activations
        self._attention = options.attention
        self.sentinel = 0
        #: the reference gradients' norms at the end of the last backward pass (:mod:`gradwatch.step.preclip`)
        self.refs: preclip.References | None = None
        self._ref_idx: list[int] = []
        self.relayout(found)

    def relayout(self, found: Discovered) -> None:
        """A new layout: the sentinel moves to its first trainable parameter."""
        leaves = found is self.found or found.leaf_modules is not self.found.leaf_modules  # (first, or new ones)
        self.retrained(found)
        self.buffers.watch()
        self.probe.quiet = self.again = False
        self._ref_idx, self.refs = preclip.reference_indices(found.params), None
        if self._compiled:
            self.probe.keep_root_hooks()
        if leaves and (self._compiled or self.probe.keep_hooks) and self._options.activations:  # hooks in the
            self.probe.keep_activation_hooks(found.leaf_modules)                    # graph: registered before tracing

    def retrained(self, found: Discovered) -> None:
        """A new version of the layout (some parameters frozen or unfrozen, or a new one): the sentinel stays
        on its parameter while that is a trainable one of ``found`` (else it moves to the first), and what
        this iteration remembers of a parameter by index moves to that parameter's index in ``found``.
        """
        old, self.found = self.found, found
        index = {id(p): i for i, p in enumerate(found.params)}
        kept = index.get(id(old.params[self.sentinel])) if found is not old else None
        if kept is not None and found.params[kept].requires_grad:
            self.sentinel = kept  # still a trainable parameter of the model: its hooks stand
        else:
            self.sentinel = sentinel = next(i for i, p in enumerate(found.params) if p.requires_grad)
            self.probe.watch_backward(found.params[sentinel])
            if self.backward is not None:  # an iteration under way: its gradients as the new sentinel holds them
                grad = found.params[sentinel].grad
                self.backward = (id(grad), grad._version) if grad is not None else None
        if self.at_step is not None:
            at = index.get(id(old.params[self.at_step[0]]))
            self.at_step = (at, *self.at_step[1:]) if at is not None else None

    def move_sentinel(self) -> None:
        """Put the sentinel on a parameter that does receive gradients."""
        for i, p in enumerate(self.found.params):
            if p.grad is not None:
                self.sentinel = i
                self.probe.watch_backward(p)
                return

    # ------------------------------------------- hooks (each run by the guard)
    def forward_started(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """A forward of the root module: a new iteration (it may belong to this step or the next)."""
        steps = self._steps
        if steps.closed:
            return
        if self.again:  # a further call of the iteration (a rollout's): nothing of the iteration changes; it
            tracker = self._tracker  # is captured, or (origin tracking keeps no more) the root's hooks go quiet
            if tracker is None or not tracker.capture(args, kwargs or {}):
                self.again, self.probe.quiet = False, True
            return
        self.began, self.forwarded = False, True
        if steps.has_open_step():
            steps.close_step()
        steps.follow()  # a submodule or parameter set since: this iteration runs the model as it is now
        if self.buffers.step != steps.step:  # the step's first forward call: its buffers as they are now
            self.buffers.save(steps.step)
        if self.backward is not None and self.carry is None:
            self.carry = (self.observed, self.probe.take_activations())
            self.observed = {}
        captured = self._tracker is not None and self._tracker.capture(args, kwargs or {})
        if self._activations and not self.probe.keep_hooks and self.probe.compiled_call():
            # ``torch.compile(watched)``: the graph about to be traced holds the leaves' hooks (as a compiled
            # model's does), switched on for sampled steps; registered only then, later graphs would lack them
            self.probe.keep_activation_hooks(self.found.leaf_modules)
        sampled = steps.sampled(steps.step) or (self.carry is not None and steps.sampled(steps.step + 1))
        if self._activations and not self.probe.collecting and sampled:
            self.probe.attach_activations(self.found.leaf_modules)
        if self._attention and sampled and not self.probe.keep_hooks and not self.probe.compiled_call() and \
                not torch.compiler.is_compiling() and self.probe.in_watching_thread():
            self.probe.attending.begin()  # the attention calls of this forward call (eager only)
        # the iteration has begun: until its backward pass (or the next step) a further forward call
        # changes nothing unless origin tracking captures it (a rollout's many calls cost next to nothing)
        self.probe.quiet, self.again = not captured, captured

    def backward_started(self) -> None:
        """A backward pass begins (told by the first of the sentinel's gradient and the outputs'
        gradients): the previous iteration's gradients were kept, or dropped.
        """
        self.probe.quiet = self.again = False
        steps = self._steps
        if self.began or steps.closed:
            return
        self.began = True
        if self.backward is not None:
            dropped = self.gradients_dropped()
            self.backward, served, self.served = None, self.served, False
            self.uncleared = self.uncleared and not dropped
            if dropped and served:  # another model's step (a GAN's generator's): no step of this model;
                carry, self.carry = self.carry, None  # what the loop observed meanwhile is for the next one
                self.observed = merge(carry[0], self.observed) if carry else self.observed
            elif dropped:  # the previous iteration's gradients were dropped without an optimizer step
                carry, self.carry = self.carry, None
                steps.dropped(carry[0] if carry else {}, ongoing=True)
            else:
                self.merge_carry()
        if self.at_step is not None and self._accumulates():  # the first backward pass since a step that
            grad = self.found.params[self.at_step[0]].grad          # adds to .grad: were the gradients cleared?
            self.uncleared = grad is not None and (id(grad), grad._version) == self.at_step[1:]
            self.at_step = None
        register.backward_end(self._ending)  # then the end of this backward pass

    def backward_ended(self) -> None:
        """A backward pass ended: the reference norms (pre-clip); in a loop updating by hand, the step."""
        self.began = False
        if self._steps.closed:
            return
        self.refs = preclip.take(self.found.params, self._ref_idx)
        if self._steps.manual:
            self._steps.manual_step()

    def backward_done(self, param: torch.Tensor) -> None:
        """A backward pass reached the sentinel: remember its gradient as it is now."""
        grad = param.grad
        if grad is not None:
            self.backward = (id(grad), grad._version)

    def gradients_dropped(self) -> bool:
        """Whether the gradients of the last backward were cleared (set to None or zeroed)."""
        grad = self.found.params[self.sentinel].grad
        return grad is None or (id(grad), grad._version) != self.backward

    def merge_carry(self) -> None:
        """The iteration that ended without a step was a micro-batch of gradient accumulation."""
        if self.carry is None:
            return
        (observed, acts), self.carry = self.carry, None
        self.observed = merge(observed, self.observed)
        if self._steps.sampled(self._steps.step):
            self.probe.give_back(acts)
        else:
            self.probe.detach_activations()  # attached in case this forward began the next step

    def stepped(self) -> None:
        """An optimizer step opens: the iterations since the last one are its micro-batches."""
        self.probe.quiet = self.again = False  # the next forward call closes the step
        self.backward, self.served = None, False
        # the step's forward call was seen: the next one closes the step, a value observed before it is
        # the step's (gradwatch.step.openstep); not so where a compiled graph traces the root's hooks (guard.RootHook)
        self.seen, self.forwarded = self.forwarded, False
        self.stale, self.uncleared, self.at_step = (self.stale + 1 if self.uncleared else 0), False, None
        self.merge_carry()

    def applied(self, held: int) -> None:
        """The step's gradients are what the optimizer applies (after gradwatch's own actions): remember
        one, of the parameter at ``held`` (which the step's optimizer holds), for the next backward pass.
        """
        param = self.found.params[held]
        grad = param.grad
        self.at_step = (held, id(grad), grad._version) if grad is not None else None
        if self._held is None or self._held[0] is not param:  # its gradient accumulator (held: the same node)
            edge = getattr(torch.autograd.graph, "get_gradient_edge", None)  # torch >= 2.2
            self._held = (param, edge(param).node) if edge is not None and param.requires_grad else None

    def _accumulates(self) -> bool:
        """Whether the backward pass now running adds to the held parameter's ``.grad`` (not so for a
        ``torch.autograd.grad`` call, e.g. a gradient penalty's, made before the loop clears them).
        """
        try:
            return self._held is None or bool(torch._C._will_engine_execute_node(self._held[1]))
        except RuntimeError as exc:  # torch refuses a leaf's node under autograd.grad(): no .grad is written
            return "autograd.grad" not in str(exc)  # (else: called outside a backward pass)
        except AttributeError:  # an older torch
            return True

    def aside(self, closure: Callable[[], Any]) -> Any:
        """Run a closure with gradwatch's hooks standing aside and the iteration's state kept."""
        saved = self.backward, self.observed, self.probe.paused, self.probe.quiet, self.again
        self.observed, self.probe.paused = {}, True
        try:
            return closure()
        finally:
            self.backward, self.observed, self.probe.paused, self.probe.quiet, self.again = saved

    def close(self) -> None:
        """The run closes: a last iteration whose gradients were dropped is recorded as a step."""
        self.buffers.clear()
        if self.backward is not None and not self.served and self.gradients_dropped():
            carry, self.carry = self.carry, None
            self._steps.dropped(carry[0] if carry else self.observed, ongoing=False)
