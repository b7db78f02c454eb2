"""Detector ``attention_logits``: a layer's attention logits growing step after step (Dehghani et al. 2023, Wortsman
et al. 2023), its attention collapsing to one-hot (Zhai et al. 2023), while the loss still falls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import LR_HIGH
from gradwatch.detectors.following import Following
from gradwatch.store.findings import Finding
from gradwatch.store.records import (
    ATTN_ENTROPY,
    ATTN_ENTROPY_HEAD,
    ATTN_LOGIT_HEAD,
    ATTN_LOGIT_MAX,
    StepRecord,
    layer_scalar,
)

HINT = (
    "add qk-layernorm (a LayerNorm on the queries and the keys of each head: it removes attention logit growth at "
    "the same learning rate), lower the learning rate or lengthen its warmup, or cap the logits (QK-clip: rescale "
    "W_q and W_k when the largest logit passes a bound such as 100, as Kimi K2 does; or a soft cap, "
    "c*tanh(logits/c))"
)
PREFIX = layer_scalar(ATTN_LOGIT_MAX, "")


@dataclass
class _Layer:
    """One attention layer's measurements on sampled steps."""

    recent: list[tuple[int, float]] = field(default_factory=list)  # (step, largest logit) over the last ``span``
    warned: bool = False
    following: Following = field(default_factory=Following)
    failed: bool = False  # the error was said


@dataclass
class AttentionLogits(Detector):
    """A layer's largest attention logit ``q·k/√d`` grows step after step (measured on sampled steps, from the
    logits of the first sequence of the batch: see :mod:`gradwatch.step.attention`).

    A warning on a sampled step where a layer's largest logit is at least ``high``, at least ``growth``
    times what it was ``span`` steps before (its first measured value in a younger run), and rose on each
    of the last ``patience`` sampled steps: it grows fast and is still growing (a pretrained model whose
    logits sit high but steady is not judged, nor a logit that grew and stopped, nor the slow growth of a
    long healthy run; nor within 100 steps of a learning rate named too high, which explains it). It names
    the head, how far the logit moved (from its value ``span`` steps before, by how
    much per step over the latest sampled steps), and the head with the lowest mean attention entropy
    (nats; near 0 is one-hot attention). Layers that cross at one step are one finding, at the first of
    them. An error, once per layer, when the loss then follows (its level ``Following``'s 1.5x above its
    lowest since the warning, or NaN/Inf).

    Attributes:
        high: the largest attention logit, at least, to warn (healthy small transformers stay under ~20;
            Kimi K2 clips logits at 100).
        growth: how many times its value ``span`` steps before the largest logit must have grown.
        span: the steps over which ``growth`` is judged.
        patience: sampled steps in a row on which the largest logit rose.
    """

    kind = "attention_logits"
    bounds = {"high": Bound(0, open_low=True), "growth": Bound(1), "span": Bound(1), "patience": Bound(1)}
    high: float = 50.0
    growth: float = 4.0
    span: int = 100
    patience: int = 2
    _layers: dict[str, _Layer] = field(default_factory=dict, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge the attention layers measured on a sampled step; on every step, whether the loss follows."""
        if not record.sampled:
            return self._follow(record)
        crossed = []
        for name, value in record.scalars.items():
            if not name.startswith(PREFIX) or not math.isfinite(value):
                continue
            layer = name[len(PREFIX):]
            state = self._layers.get(layer)
            if state is None:
                self._layers[layer] = _Layer(recent=[(record.step, value)])
                continue
            state.recent = [(s, v) for s, v in state.recent if s >= record.step - self.span] + [(record.step, value)]
            if not state.warned and self._growing(state) and not self.causes.named(LR_HIGH, record.step):
                crossed.append(layer)
        out = self._follow(record)
        if crossed:
            out.append(self._warning(record, crossed))
        return out

    def _growing(self, state: _Layer) -> bool:
        values = [v for _, v in state.recent]
        last = values[-(self.patience + 1):]
        rising = len(last) == self.patience + 1 and all(b > a for a, b in zip(last, last[1:]))
        now = values[-1]
        return rising and now >= self.high and now >= self.growth * max(values[0], 1e-12)

    def _warning(self, record: StepRecord, layers: list[str]) -> Finding:
        layer = layers[0]
        state = self._layers[layer]
        step0, first = state.recent[0]
        (earlier, before), (now_step, now) = state.recent[-(self.patience + 1)], state.recent[-1]
        per_step = (now / before) ** (1 / max(1, now_step - earlier)) if before > 0 else math.inf
        head = record.scalars.get(layer_scalar(ATTN_LOGIT_HEAD, layer))
        entropy = record.scalars.get(layer_scalar(ATTN_ENTROPY, layer))
        low_head = record.scalars.get(layer_scalar(ATTN_ENTROPY_HEAD, layer))
        where = f"`{layer}`" + (f", head {int(head)}" if head is not None else "")
        collapse = ""
        if entropy is not None and math.isfinite(entropy):
            collapse = (f"; its lowest attention entropy is {entropy:.2g} nats"
                        + (f" (head {int(low_head)})" if low_head is not None else "")
                        + (", near one-hot" if entropy < 0.5 else ""))
        others = f" (and {len(layers) - 1} more: {', '.join(f'`{x}`' for x in layers[1:])})" if len(layers) > 1 else ""
        message = (f"attention logits growing in {where}{others}: the largest logit q·k/√d is {now:.3g} at step "
                   f"{now_step}, {now / first:.3g}x its {first:.3g} at step {step0}, rising {per_step:.3g}x per "
                   f"step since step {earlier}{collapse}. This is attention logit growth, which precedes "
                   f"divergence (Dehghani et al. 2023, Wortsman et al. 2023); the loss has not followed yet: {HINT}.")
        for name in layers:
            st = self._layers[name]
            st.warned = True
            st.following.arm(record.step)
        data = {"mechanism": "attention_logit_growth", "layers": layers, "count": len(layers),
                "logit": now, "first": first, "first_step": step0, "growth": now / first, "per_step": per_step,
                "head": None if head is None else int(head), "entropy": entropy,
                "entropy_head": None if low_head is None else int(low_head),
                "measured": "logits of the first sequence of the batch", "hint": HINT}
        return self.finding(record, "warning", layer, message, value=now, data=data)

    def _follow(self, record: StepRecord) -> list[Finding]:
        out = []
        for layer, state in self._layers.items():
            if not state.warned or state.failed:
                continue
            follows = state.following.follows(record, self.causes)
            if follows is None:
                continue
            state.failed = True
            lowest, level = follows
            _, now = state.recent[-1]
            loss = (f"the loss is {level:.4g}" if not math.isfinite(level) else
                    f"the loss's level rose to {level:.4g}, {level / lowest:.3g}x its lowest since then ({lowest:.4g})")
            message = (f"attention logits of `{layer}` kept growing (largest {now:.3g}, named at step "
                       f"{state.following.since}) and the loss now follows: {loss}. Restart from a checkpoint "
                       f"before step {state.following.since} with the remedy: {HINT}.")
            out.append(self.finding(record, "error", layer, message, value=now, data={
                "mechanism": "attention_logit_growth", "named_at": state.following.since, "logit": now,
                "loss_level": level, "loss_lowest": lowest, "hint": HINT}))
        return out
