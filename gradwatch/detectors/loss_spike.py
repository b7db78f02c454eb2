"""Detector ``loss_spike``: the observed loss far above its own recent history, or diverging from its first values."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import MISSING, dataclass, field, fields

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.baseline import Values
from gradwatch.detectors.causes import LR_HIGH, raised_lr
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord

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
#: a divergence runs away: its level is at least ``RUNAWAY`` times its lowest level of the last ``RUNAWAY_STEPS``
RUNAWAY, RUNAWAY_STEPS = 2.0, 10


#: a signed loss whose recent values were all alike (no spread) spikes only by this share of its largest |loss|
FLAT = 0.5


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

    A spike must also matter on the loss's own scale: once the loss has fallen from its early
    level (the median of its first ``warmup`` healthy values), it climbs back at least ``share``
    of the way from the recent level to that early level (a converged classifier's loss of 1e-3
    that one misclassified sample lifts to 1e-2 is no spike; one back to a tenth of where it
    started is).

    A divergence, judged from the fourth step on (no other history needed): the loss level, the
    median of the last 3 losses, above ``diverge`` times the lowest of the first ``start``
    losses on 2 steps in a row, the bound widened for a noisy loss (to ``1 + 2 x`` the first
    losses' range over the lowest, or to ``exp(2 x)`` the largest drop between two consecutive
    healthy losses so far: a small batch's loss that jumps by 2x either way; at most 6x), and
    running away: at least twice its lowest level of the last 10 steps (a level that creeps up
    over tens of steps, as a GAN generator's loss does while its discriminator learns, is not
    running away; a level above the bound for ``adapt_after`` steps without running away
    becomes the baseline's). Judged until the loss level first falls below the lowest first loss
    divided by ``diverge`` (training that made progress and then blows up is judged by the
    spike baseline).
    A high loss level within ``adapt_after`` steps of a reported spike is that spike's. Not
    judged for a loss that was ever zero or negative (a policy-gradient loss has no scale to
    diverge from). It names a learning rate that is too high, unless the ``learning_rate``
    detector already did.
    Losses of a spike or a divergence never enter a baseline. A layout that renews parameters (a head
    replaced, weights tied, ``load_state_dict(assign=True)``) restarts the judgement: the loss's history
    was another model's.

    Attributes:
        z: robust z-score (of the log loss) beyond which a loss is a spike.
        ratio: a spike also exceeds the median by at least this fraction of it.
        window: healthy losses the step-to-step noise is measured over.
        warmup: losses in the window before spikes are judged.
        adapt_after: consecutive spike steps after which the window accepts the new level.
        diverge: loss level above this many times the first losses is a divergence.
        start: first losses that make the divergence baseline.
        share: a spike climbs back at least this share of the way to the loss's early level.
    """

    kind = "loss_spike"
    bounds = {"window": Bound(1, 10_000), "warmup": Bound(1, "window"), "diverge": Bound(1, open_low=True),
              "start": Bound(1), "share": Bound(0, 1)}
    z: float = 6.0
    ratio: float = 1.0
    window: int = 50
    warmup: int = 10
    adapt_after: int = 20
    diverge: float = 1.5
    start: int = 3
    share: float = 0.1
    _win: Values = field(init=False, repr=False)
    _first: list[float] = field(default_factory=list, init=False, repr=False)
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=LEVEL), init=False, repr=False)
    _levels: deque[float] = field(default_factory=lambda: deque(maxlen=RUNAWAY_STEPS), init=False, repr=False)
    _early: float = field(default=math.nan, init=False, repr=False)  # the median of the first healthy losses
    _drop: float = field(default=0.0, init=False, repr=False)  # largest log drop between consecutive healthy losses
    _last: float = field(default=math.nan, init=False, repr=False)  # the last healthy loss
    _peak: float = field(default=0.0, init=False, repr=False)  # the largest |healthy loss|: the loss's own scale
    _kept: list[float] = field(default_factory=list, init=False, repr=False)  # losses of a level above the bound
    _run: int = field(default=0, init=False, repr=False)
    _diverged: bool = field(default=False, init=False, repr=False)
    _above: int = field(default=0, init=False, repr=False)  # consecutive steps with the level above the bound
    _progressed: bool = field(default=False, init=False, repr=False)  # the level fell well below the start
    _signed: bool = field(default=False, init=False, repr=False)
    _spiked: int = field(default=-(10**9), init=False, repr=False)  # step of the last reported spike
    _version: int = field(default=-1, init=False, repr=False)  # the layout version of the latest loss

    def __post_init__(self) -> None:
        self._win = Values(self.window)

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge the step's loss, then fold it in if it was neither a spike nor a divergence."""
        self.causes.lr_of(record)
        loss = record.scalars.get("loss")
        if loss is None or not math.isfinite(loss):
            return []
        if record.layout.version != self._version:
            if record.layout.renewed and self._version >= 0:
                self._restart()
            self._version = record.layout.version
        self._recent.append(loss)
        if loss <= 0 and not self._signed:  # no scale to diverge from; spikes are judged on the loss itself
            self._signed, self._win = True, Values(self.window)
        level, base = self._divergence()
        # a divergence runs away: a level that crept up over tens of steps (a GAN generator's loss as
        # its discriminator learns) is not one; then a high level soon after a reported spike is that
        # spike's doing (a corrupted batch wrecked the model)
        current = _median(list(self._recent))
        runaway = bool(self._levels) and current >= RUNAWAY * min(self._levels)
        self._levels.append(current)
        above = level is not None and not 0 <= record.step - self._spiked <= self.adapt_after
        self._above = self._above + 1 if above else 0
        held = above and self._above <= self.adapt_after
        if above and not held and self._kept:  # a high level that lasted without running away: the new baseline,
            self._progressed = True  # and the start is left behind (a later blow-up is judged as a spike)
            self._win, kept = Values(self.window), list(self._kept)
            self._kept.clear()
            for value in kept:
                self._accept(value)
        if held:
            self._kept.append(loss)
        else:
            self._kept.clear()
        spike, median, spread = self._spike(loss)
        self._run = self._run + 1 if spike else 0
        if not held and (not spike or self._run > self.adapt_after):
            self._accept(loss)
        if not (held or spike) and len(self._first) < self.start:
            self._first.append(loss)
        if not above:
            self._diverged = False
        # a level that lasts, not three noisy batches, and runs away
        if held and self._above >= CONFIRM and runaway and not self._diverged:
            self._diverged = True
            return self._report_divergence(record, loss, level, base)
        if not spike or self._run != 1 or held:
            return []
        self._spiked = record.step
        if self._signed and spread > 0:
            how = f"{(loss - median) / spread:.3g} std above its recent median {median:.4g}"
        elif self._signed:  # recent losses all alike: no spread to count in
            how = f"{loss - median:.4g} above its recent losses, all {median:.4g} (largest so far {self._peak:.4g})"
        else:
            how = f"{loss / median:.3g}x its recent median {median:.4g}"
        message = f"loss {loss:.4g} at step {record.step} is {how}."
        data = {"loss": loss, "median": median, "spread": spread, "hint": HINT}
        message += raised_lr(self.causes, record.step, data)
        return [self.finding(record, "warning", None, message, value=loss, data=data)]

    def _restart(self) -> None:
        """Judge as from the first loss (the settings, and the causes named, stay)."""
        for f in fields(self):
            if not f.init and f.name != "causes":
                setattr(self, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)
        self.__post_init__()

    def _accept(self, loss: float) -> None:
        """Fold a healthy loss into the spike baseline (and the early level, and the largest drop)."""
        win = self._win
        win.update(loss if self._signed else math.log(loss))
        if math.isnan(self._early) and win.count >= self.warmup:
            self._early = win.center if self._signed else math.exp(win.center)
        if not (self._signed or self._progressed) and self._last > loss:
            self._drop = max(self._drop, math.log(self._last / loss))
        self._last = loss
        self._peak = max(self._peak, abs(loss))

    def _spike(self, loss: float) -> tuple[bool, float, float]:
        """Whether ``loss`` is a spike, and the window's median and spread (of the loss itself).

        A positive loss is judged in log space (a loss near its floor moves by factors, not by
        amounts): a spike is ``log(loss) - median > max(z * spread, log(1 + ratio))``; and on the
        loss's own scale, ``loss - median >= share * (early - median)`` once it fell from its early level.
        """
        win = self._win
        center, spread = win.center, win.spread
        if win.count < self.warmup:
            return False, math.nan, math.nan
        if self._signed:
            # and by ``share`` of the largest loss seen: a loss that was exactly 0 for a while has no spread and
            # no level to spike from (a hinge loss at 0 that a sample lifts to 6e-5), and one never away from 0 none
            # recent losses all alike (a hinge loss at exactly 0 while every margin is met, lifted now and then
            # by a batch with a violation): only a jump to half the largest loss seen or more is a spike
            median = center
            spike = loss - center > max(self.z * spread, self.ratio * abs(center)) and \
                loss - center >= (self.share if spread > 0 else FLAT) * self._peak > 0
        else:
            median = math.exp(center)
            spike = math.log(loss) - center > max(self.z * spread, math.log1p(self.ratio))
        if spike and self._early > median:  # a jump that matters against how far the loss has come
            spike = loss - median >= self.share * (self._early - median)
        return spike, median, (spread if self._signed else median * math.expm1(spread))

    def _divergence(self) -> tuple[float | None, float]:
        """The loss level when it has diverged from the first losses (else None), and the lowest of them."""
        first = self._first
        if len(first) < self.start or self._signed or len(self._recent) < LEVEL:
            return None, math.nan
        base = min(first)  # the start: a first loss that is already diverging does not count as one
        noisy = max(1.0 + 2.0 * (max(first) - base) / base, math.exp(2.0 * self._drop))
        limit = base * max(self.diverge, min(noisy, NOISY))
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
