"""Causes: the root causes the detectors of one run have named, so that one cause makes one finding."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

#: a cause named this many steps ago or less still explains what the other detectors see
QUIET_STEPS = 100

#: the learning rate is too high (named by ``learning_rate`` or by ``loss_spike``'s divergence)
LR_HIGH = "learning_rate_high"
#: the learning rate is too low (named by ``learning_rate``)
LR_LOW = "learning_rate_low"
#: the gradient norm exploded (named by ``exploding``): a large update on that step is its consequence
EXPLOSION = "explosion"

#: a learning rate at least this many times the previous step's was raised by hand (or a schedule
#: restarted): a linear warmup raises it by at most 2x per step after its first, from any value above 0
RAISED = 10.0
#: steps after a raise that a spike or an explosion is blamed on it
RAISE_STEPS = 10
#: the first losses that make the loss's starting level (the lowest of them: the first losses of a run whose
#: learning rate is too high are already its updates' doing, and healthy first losses are noisy)
START_LOSSES = 3
#: the latest losses whose median is the loss's current level
LEVEL_LOSSES = 5


class Causes:
    """Shared by the detectors that one :func:`gradwatch.detectors.build` call makes.

    A detector that names a root cause notes it; another detector that sees a consequence of
    the same cause (a loss that diverges because the learning rate is too high, after the
    update-to-weight ratio already named it) asks whether it was named and stays quiet. The
    detectors are called in the same order live and when a stored run is re-judged offline, so
    both reach the same findings. A detector built on its own has a private one.
    """

    def __init__(self) -> None:
        self._named: dict[str, int] = {}
        #: per cause, where its latest episode began: (the step it was first named at, the step it began at: a
        #: learning rate's raise) -- an episode lasts while the cause is named again within QUIET_STEPS
        self._began: dict[str, tuple[int, int]] = {}
        self._lr: dict[int, float] = {}  # the learning rate of the latest steps (seen by ``lr_of``)
        self._first: list[tuple[int, float]] = []  # the first finite losses, by step (``loss_of``)
        self._recent: deque[tuple[int, float]] = deque(maxlen=LEVEL_LOSSES)
        self._signed = False  # a loss was zero or negative: it has no scale to compare levels on

    def loss_of(self, record: Any) -> None:
        """Remember the step's loss (the judge tells every step's, once it is known, live and offline alike)."""
        loss = record.scalars.get("loss")
        if loss is None or not math.isfinite(loss) or (self._recent and record.step < self._recent[-1][0]):
            return
        if self._recent and record.step == self._recent[-1][0]:  # a late value changed the step's loss (its mean)
            self._recent.pop()
            if self._first and self._first[-1][0] == record.step:
                self._first.pop()
        self._signed = self._signed or loss <= 0
        if len(self._first) < START_LOSSES:
            self._first.append((record.step, loss))
        self._recent.append((record.step, loss))

    def loss_levels(self) -> tuple[float, float, int] | None:
        """The loss's starting level (the lowest of its first losses), its current level (median of the
        latest) and the step of the latest loss; None before enough losses or for a loss without a
        scale (ever zero or negative).
        """
        if self._signed or len(self._first) < START_LOSSES or len(self._recent) < LEVEL_LOSSES:
            return None
        return min(v for _, v in self._first), _median([v for _, v in self._recent]), self._recent[-1][0]

    def lr_of(self, record: Any) -> None:
        """Remember the step's learning rate (each detector that asks :meth:`raised` tells it every step)."""
        lr = record.scalars.get("lr")
        if lr is not None and math.isfinite(lr) and record.step not in self._lr:
            self._lr[record.step] = lr
            for old in [s for s in self._lr if s <= record.step - RAISE_STEPS - 1]:
                del self._lr[old]

    def raised(self, step: int) -> tuple[int, float, float] | None:
        """The latest step at most ``RAISE_STEPS`` before ``step`` whose learning rate was raised
        ``RAISED`` times or more from the step before (not from 0: a warmup), as (step, before, after).
        """
        for k in range(step, step - RAISE_STEPS - 1, -1):
            before, after = self._lr.get(k - 1), self._lr.get(k)
            if before is not None and after is not None and before > 0 and after >= RAISED * before:
                return k, before, after
        return None

    def note(self, cause: str, step: int, since: int | None = None) -> None:
        """``cause`` was named by a finding at ``step``; ``since``: the step it began at, when known (the
        step whose learning rate was raised).
        """
        began = step if since is None else min(since, step)
        if not self.named(cause, step) or cause not in self._began:  # a new episode
            self._began[cause] = (step, began)
        else:
            first, start = self._began[cause]
            self._began[cause] = (first, min(start, began))
        self._named[cause] = max(step, self._named.get(cause, step))

    def when(self, cause: str) -> int | None:
        """The step ``cause`` was last named at (None: never)."""
        return self._named.get(cause)

    def began(self, cause: str) -> tuple[int, int] | None:
        """Where ``cause``'s latest episode began: the step it was first named at and the step it began
        at (its raise, when a learning rate was raised; else the same step). None: never named.
        """
        return self._began.get(cause)

    def named(self, cause: str, step: int, within: int = QUIET_STEPS) -> bool:
        """Whether ``cause`` was named at most ``within`` steps before ``step``."""
        last = self._named.get(cause)
        return last is not None and 0 <= step - last <= within


#: what to do about a learning rate raised just before a spike or an explosion
HINT_RAISED = (
    "the learning rate was raised just before: put it back (a scheduler or a manual change that multiplied it), "
    "or raise it gradually with a warmup"
)


def raised_lr(causes: Causes, step: int, data: dict[str, Any]) -> str:
    """A spike's or an explosion's words on the learning rate: raised ``RAISED`` times or more just
    before ``step`` (then named as the cause: see :meth:`Causes.named`), else named too high within
    the last ``QUIET_STEPS``; ``data`` gains the cause (and the raise). Empty otherwise.
    """
    found = causes.raised(step)  # a raise is told even after the learning rate was named (another event)
    if found is None and causes.named(LR_HIGH, step):  # a consequence of it: still reported, and said so
        data["cause"] = "learning_rate"
        return " The learning rate was named too high before: lower it."
    if found is None:
        return ""
    at, before, after = found
    causes.note(LR_HIGH, step, since=at)
    data.update(cause="learning_rate", lr_raised_at=at, lr_before=before, lr=after, hint=HINT_RAISED)
    return (f" The learning rate was raised {after / before:.3g}x at step {at} ({before:.3g} -> {after:.3g}): "
            "the likely cause.")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
