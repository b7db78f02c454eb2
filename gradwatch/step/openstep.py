"""Record stage: the open step, from its moment until the next iteration begins, and the values
that reach it late.

A step opens at its moment (the optimizer's pre-hook, or the end of backward in a loop that
updates the parameters by hand) and closes when the next forward call begins. Many loops observe
their loss after ``optimizer.step()`` (or, updating by hand, after ``backward()``): past the
step's moment, but before any further forward call, so that this loss can only be the one the
step's own forward pass computed. Such a value joins the open step rather than the next one:
a value named ``loss``, and any tensor still attached to the autograd graph (computed by that
forward pass). Other values observed then (a learning rate read after ``scheduler.step()``) are
for the step that follows, as ``observe`` says.

The step then waits for the next step's one host read (as a sampled step's update norms do),
which reads its late tensors; at ``flush()`` and at the end of the run a read of its own does.
Its loss is judged then, one step after its moment, and a finding acts at the next step's moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradwatch.step import observed as obs
from gradwatch.store.records import StepRecord

if TYPE_CHECKING:
    from gradwatch.step.iteration import Iteration


def into(step: Open | None, it: Iteration, name: str, value: Any) -> obs.Observed:
    """Where a value observed now goes: the iteration's (for the step that follows), or the late
    values of ``step``, the open step, when it is that step's (see the module's text).

    Only where the step's own forward call was seen: where a compiled graph traces the root's hooks
    (see ``gradwatch.watching.guard.RootHook``) no forward call closes the step, and a loss observed before
    the next ``optimizer.step()`` could be the next iteration's.
    """
    if step is not None and it.seen and (name == "loss" or (isinstance(value, torch.Tensor) and value.requires_grad)):
        return step.late
    return it.observed


@dataclass
class Open:
    """A step between its moment and the start of the next iteration."""

    record: StepRecord
    optimizers: set[int] = field(default_factory=set)
    stepped: set[int] = field(default_factory=set)  # the optimizers whose step has returned
    before: dict[int, torch.Tensor] = field(default_factory=dict)  # weights before the update
    update_idx: list[int] = field(default_factory=list)
    update_parts: list[torch.Tensor] = field(default_factory=list)  # 1-D: ||delta w||, one value per update_idx
    skip: bool = False  # an action decided that this step changes nothing
    #: how many values of each name the step's moment read (a late value joins their mean)
    counts: dict[str, int] = field(default_factory=dict)
    #: values observed after the step's moment that are this step's (see :func:`into`)
    late: obs.Observed = field(default_factory=dict)

    def late_parts(self) -> list[torch.Tensor]:
        """The late values still on the device, read with the next host read."""
        return obs.device_parts(self.late)

    def fold(self, host: np.ndarray) -> float | None:
        """Put the late values into the record's scalars (``host``: :meth:`late_parts`, read).

        A name observed both before the step's moment and after it (gradient accumulation whose
        last micro-batch's loss is observed after the step) gets the mean of all its values.

        Returns:
            the step's loss when a late value changed it (None otherwise).
        """
        late, self.late = self.late, {}
        scalars = self.record.scalars
        for name, mean in obs.scalars(late, host).items():
            n, k = self.counts.get(name, 0), len(late[name])
            scalars[name] = mean if n == 0 or name not in scalars else (scalars[name] * n + mean * k) / (n + k)
        return scalars["loss"] if "loss" in late else None

