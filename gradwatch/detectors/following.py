"""Following (judging stage): whether the loss has started to follow a mechanism named while it still fell.

The instability detectors (``attention_logits``, ``output_growth``, ``adam_epsilon``) name a mechanism
before the loss shows it, as a warning. Once the loss follows -- its level (the median of its latest 5
values, shared by the detectors through :class:`~gradwatch.detectors.causes.Causes`) rises ``RISE`` times
above the lowest level it reached since the mechanism was named and back at least ``SHARE`` of the way to
where it started, or the loss turns NaN/Inf -- the same
mechanism is an error: the run is now paying for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradwatch.detectors.causes import Causes
from gradwatch.store.records import StepRecord

#: the loss's level this many times the lowest it reached since the mechanism was named: the loss follows
RISE = 1.5
#: ... and back at least this share of the way from that lowest level to where the loss started
SHARE = 0.25


@dataclass
class Following:
    """One mechanism's watch on the loss, armed when the mechanism is named.

    Attributes:
        rise: the loss's level at least this many times its lowest since :meth:`arm`: the loss follows.
    """

    rise: float = RISE
    #: the step the mechanism was named at (None: not armed)
    since: int | None = None
    #: the lowest loss level seen since then
    lowest: float = math.inf

    def arm(self, step: int) -> None:
        """The mechanism was named at ``step``: watch the loss from now on (once: a later call keeps the first)."""
        if self.since is None:
            self.since, self.lowest = step, math.inf

    def follows(self, record: StepRecord, causes: Causes) -> tuple[float, float] | None:
        """Whether the loss follows now, as (its lowest level since it was armed, its level now) -- a NaN or
        Inf loss as (lowest, the loss) -- else None (also when not armed, or the loss has no scale).
        """
        if self.since is None:
            return None
        loss = record.scalars.get("loss")
        if loss is not None and not math.isfinite(loss):
            return self.lowest, loss
        levels = causes.loss_levels()
        if levels is None or levels[2] < self.since:
            return None
        start, level = levels[0], levels[1]
        self.lowest = min(self.lowest, level)
        # a rise that matters on the loss's own scale: back at least ``SHARE`` of the way from its lowest to where
        # it started (a loss of 0.006 that a noisy batch lifts to 0.017 has not followed anything)
        if level >= self.rise * self.lowest and level > 0 and level - self.lowest >= SHARE * (start - self.lowest):
            return self.lowest, level
        return None
