"""Detector ``loss_spike``: the observed loss far above its own recent history, or diverging from its first values."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.baseline import Values
from gradwatch.detectors.causes import LR_HIGH, raised_lr
from gradwatch.findings import Finding
from gradwatch.records import StepRecord

HINT = (
    "look at the batch of this step (corrupted samples or labels), lower the learning rate, "
    "or clip gradients; a spike that recurs at the same data position points at the data"
)
HINT_DIVERGE = (
    "lower the learning rate (by 10x to start with) or add a warmup; if it diverges whatever the learning "
    "rate, check the loss and the labels (a sign error, targets on another scale)"
)

#: losses whose median is the current level of the loss (a single spike does not move it)
LEVEL = 3
#: the most that noisy first losses widen the divergence bound to (times the lowest of them)
NOISY = 6.0
#: consecutive steps the loss level stays above the bound before it is a divergence
CONFIRM = 2
#: a divergence's level is also at least ``RISE`` times its level ``RISE_STEPS`` steps before (once known)
RISE, RISE_STEPS = 1.25, 20


@dataclass
class LossSpike(Detector):
    """The loss (observed with ``watcher.observe(loss=...)``) against its own history.

    A spike: ``log(loss) - level > max(z * spread, log(1 + ratio))``, the level being the median
    of the logs of the last 10 healthy losses and the spread the larger of their MAD over the
    last 20 (x 1.4826) and their step-to-step noise over the last ``window`` (a loss falling by
    orders of magnitude does not widen it), once ``warmup`` losses are in (a loss that was ever
    zero or negative is judged as it is: ``loss - level > max(z * spread, ratio * |level|)``). A run of
    spike steps is one spike, reported at its first step; a loss that stays high for
    ``adapt_after`` steps is a new level, which the window then accepts.

    A divergence, judged from the fourth step on (no other history needed): the loss level, the
    median of the last 3 losses, above ``diverge`` times the lowest of the first ``start``
    losses (more when those first losses are noisy: ``1 + 2 x`` their range over the lowest,
    at most 6), on 2 steps in a row, and at least 1.25 times the level 20 steps before (once 20
    steps are in: a level that creeps up over tens of steps, as a GAN generator's loss does while
    its discriminator learns, is not running away); judged until the loss level first falls below
    the lowest first loss divided by ``diverge`` (training that made progress and then blows up is
    judged by the spike baseline).
    A high loss level within ``adapt_after`` steps of a reported spike is that spike's. Not
    judged for a loss that was ever zero or negative (a policy-gradient loss has no scale to
    diverge from). It names a learning rate that is too high, unless the ``learning_rate``
    detector already did.
    Losses of a spike or a divergence never enter a baseline.

    Attributes:
        z: robust z-score (of the log loss) beyond which a loss is a spike.
        ratio: a spike also exceeds the median by at least this fraction of it.
        window: healthy losses the step-to-step noise is measured over.
        warmup: losses in the window before spikes are judged.
        adapt_after: consecutive spike steps after which the window accepts the new level.
        diverge: loss level above this many times the first losses is a divergence.
        start: first losses that make the divergence baseline.
    """

    kind = "loss_spike"
    bounds = {"window": Bound(1, 10_000), "warmup": Bound(1, "window"), "diverge": Bound(1, open_low=True),
              "start": Bound(1)}
    z: float = 6.0
    ratio: float = 1.0
    window: int = 50
    warmup: int = 10
    adapt_after: int = 20
    diverge: float = 1.5
    start: int = 3
    _win: Values = field(init=False, repr=False)
    _first: list[float] = field(default_factory=list, init=False, repr=False)
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=LEVEL), init=False, repr=False)
    _levels: deque[float] = field(default_factory=lambda: deque(maxlen=RISE_STEPS + 1), init=False, repr=False)
    _run: int = field(default=0, init=False, repr=False)
    _diverged: bool = field(default=False, init=False, repr=False)
    _above: int = field(default=0, init=False, repr=False)  # consecutive steps with the level above the bound
    _progressed: bool = field(default=False, init=False, repr=False)  # the level fell well below the start
    _signed: bool = field(default=False, init=False, repr=False)
    _spiked: int = field(default=-(10**9), init=False, repr=False)  # step of the last reported spike

    def __post_init__(self) -> None:
        self._win = Values(self.window)

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge the step's loss, then fold it in if it was neither a spike nor a divergence."""
        self.causes.lr_of(record)
        loss = record.scalars.get("loss")
        if loss is None or not math.isfinite(loss):
            return []
        self._recent.append(loss)
        if loss <= 0 and not self._signed:  # no scale to diverge from; spikes are judged on the loss itself
            self._signed, self._win = True, Values(self.window)
        level, base = self._divergence()
        spike, median, spread = self._spike(loss)
        self._run = self._run + 1 if spike else 0
        # a divergence runs away: a level that crept up over tens of steps (a GAN generator's loss as
        # its discriminator learns) is not one; then a high level soon after a reported spike is that
        # spike's doing (a corrupted batch wrecked the model)
        current = _median(list(self._recent))
        rising = len(self._levels) <= RISE_STEPS or current >= RISE * self._levels[0]
        self._levels.append(current)
        above = level is not None and rising and not 0 <= record.step - self._spiked <= self.adapt_after
        self._above = self._above + 1 if above else 0
        if not above and (not spike or self._run > self.adapt_after):
            self._win.update(loss if self._signed else math.log(loss))
        if not (above or spike) and len(self._first) < self.start:
            self._first.append(loss)
        if not above:
            self._diverged = False
        if self._above >= CONFIRM and not self._diverged:  # a level that lasts, not three noisy batches
            self._diverged = True
            return self._report_divergence(record, loss, level, base)
        if not spike or self._run != 1 or above:
            return []
        self._spiked = record.step
        if self._signed:
            zscore = (loss - median) / max(spread, 1e-12)
            how = f"{zscore:.3g} std above its recent median {median:.4g}"
        else:
            how = f"{loss / median:.3g}x its recent median {median:.4g}"
        message = f"loss {loss:.4g} at step {record.step} is {how}."
        data = {"loss": loss, "median": median, "spread": spread, "hint": HINT}
        message += raised_lr(self.causes, record.step, data)
        return [self.finding(record, "warning", None, message, value=loss, data=data)]

    def _spike(self, loss: float) -> tuple[bool, float, float]:
        """Whether ``loss`` is a spike, and the window's median and spread (of the loss itself).

        A positive loss is judged in log space (a loss near its floor moves by factors, not by
        amounts): a spike is ``log(loss) - median > max(z * spread, log(1 + ratio))``.
        """
        win = self._win
        center, spread = win.center, win.spread
        if win.count < self.warmup:
            return False, math.nan, math.nan
        if self._signed:
            return loss - center > max(self.z * spread, self.ratio * abs(center)), center, spread
        spike = math.log(loss) - center > max(self.z * spread, math.log1p(self.ratio))
        return spike, math.exp(center), math.exp(center) * math.expm1(spread)

    def _divergence(self) -> tuple[float | None, float]:
        """The loss level when it has diverged from the first losses (else None), and the lowest of them."""
        first = self._first
        if len(first) < self.start or self._signed or len(self._recent) < LEVEL:
            return None, math.nan
        base = min(first)  # the start: a first loss that is already diverging does not count as one
        limit = base * max(self.diverge, min(1.0 + 2.0 * (max(first) - base) / base, NOISY))
        level = _median(list(self._recent))
        # training that got well below its start has left it: a later rise is a spike's (a corrupted batch)
        self._progressed = self._progressed or level < base / self.diverge
        return (level if level > limit and not self._progressed else None), base

    def _report_divergence(self, record: StepRecord, loss: float, level: float | None, base: float) -> list[Finding]:
        assert level is not None
        if self.causes.named(LR_HIGH, record.step):
            return []  # one cause, one finding: the learning rate was already named
        self.causes.note(LR_HIGH, record.step)
        message = (f"loss {level:.4g} at step {record.step} (median of the last {LEVEL}) is {level / base:.3g}x its "
                   f"first values ({base:.4g}): training is diverging; the learning rate is likely too high: lower "
                   "it or add warmup.")
        data = {"loss": loss, "level": level, "first": base, "divergence": True, "cause": "learning_rate",
                "hint": HINT_DIVERGE}
        return [self.finding(record, "warning", None, message, value=loss, data=data)]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
