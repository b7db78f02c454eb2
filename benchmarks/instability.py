"""Small-scale proxies of transformer training instability, and how early each detector sees them.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities"),
Dehghani et al. 2023 and Zhai et al. 2023 ("attention entropy collapse"): at a too-high learning rate the
largest attention logit ``q.k / sqrt(d)`` of a small pre-LN transformer grows step after step, attention
entropy collapses towards one-hot, then the loss diverges; LayerNorm on q and k (qk-layernorm) removes it at
the same learning rate, and a z-loss (``1e-4 * logsumexp(logits)^2``) keeps the output logits from drifting.

The proxy: a small pre-LN causal decoder (:class:`Decoder`: token and learned position embeddings, blocks of
``x + attn(ln1(x))`` and ``x + mlp(ln2(x))``, a final LayerNorm, an LM head; nanoGPT-like module names) on a
synthetic task that needs an induction head (:func:`induction_batch`: random tokens, then the same tokens
again; the loss only on the repeat; :func:`noisy_induction_batch`: each repeated token replaced by a random one
with probability ``noise``, so that the loss cannot reach 0 and the gradients never vanish), trained with AdamW
(betas 0.9/0.95, weight decay 0.1, batch 32). The sweep's schedule (:func:`lr_factor`) is the one under which
a proxy first learns and then meets a too-high learning rate, as a long run whose schedule outgrows its
stability does: a linear warm-up to 3e-3, held 150 steps (the model learns the task there), then a linear
ramp over 50 steps to the peak learning rate, constant after (no decay: the instability should not be rescued
by a schedule that shrinks the step). At a constant high learning rate from the start the proxy never learns
at all (its logits explode while its loss stays at ln(vocab)); on the plain copy task it learns to ~0 and then
nothing can diverge.

Each step the harness itself records the ground truth (:func:`attention_stats`, under ``torch.no_grad``, from
the q and k the model's forward pass actually used): per layer the largest attention logit ``q.k * scale``
over batch, heads and causally visible (query, key) pairs, the mean attention entropy in nats (over heads,
queries and batch) and the smallest per-head mean entropy; and the mean log-partition ``log Z =
logsumexp(output logits)`` over all positions.

Loss-only baselines, reimplemented here (no Lightning or OLMo at run time):

- :func:`spike_detection_step`: Lightning's ``SpikeDetection`` (window 10, rtol 2, atol None);
- :func:`sigma_step`: a 6-sigma detector over the last 128 losses, after OLMo-core's StabilityMonitor;
- :func:`divergence_step`: the reference, when the run has diverged for good.

``main()`` sweeps peak learning rates x {plain, qk-layernorm, z-loss, qk-layernorm + z-loss} x seeds (and one
``--attention`` kind: ``sdpa``, ``manual`` or ``mha``), each run watched by gradwatch (``rules=None``: detect
and record only, so a finding never stops the run) unless ``--no-watch``, and prints one row per run: its
outcome (``diverged``, ``never learned``, ``learned``: :func:`outcome`), the divergence step, each baseline's
first flag, gradwatch's first warning (any kind, and of the mechanism kinds: attention logits, output growth,
Adam's epsilon), the lead time (divergence - gradwatch's first warning), the warnings, and of a healthy or
mitigated run (peak learning rate up to ``--healthy``, or qk-layernorm) that learned and did not diverge the
false alarms -- the mechanisms' warnings -- and the kinds of its other warnings. ``--trajectory`` prints the
per-layer attention statistics and log Z every 10 steps; ``--bf16`` trains under ``torch.autocast("cpu",
bfloat16)``; ``--json FILE`` writes every result.

Run: ``python benchmarks/instability.py --quick`` (seconds), or the default sweep (minutes, single thread).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CONFIGS = {  # name -> (qk_layernorm, z_loss)
    "plain": (False, 0.0),
    "qk_ln": (True, 0.0),
    "zloss": (False, 1e-4),
    "qk_ln+zloss": (True, 1e-4),
}
ATTENTION_KINDS = ("attention_logits", "output_growth", "adam_epsilon")  # the detectors of issue 36


# ----------------------------------------------------------------------------------------------- the model
class Attention(nn.Module):
    """Causal multi-head self-attention; ``kind`` "sdpa" (fused), "manual" (explicit softmax) or "mha".

    The q and k of the latest forward pass (after qk-layernorm) are kept, detached, in ``last_qk`` when
    ``record`` is set, for :func:`attention_stats`; for "mha" they are recomputed from its input projection.
    """

    def __init__(self, d_model: int, n_head: int, seq_len: int, qk_layernorm: bool, kind: str) -> None:
        super().__init__()
        if kind not in ("sdpa", "manual", "mha"):
            raise ValueError(f"attention must be 'sdpa', 'manual' or 'mha', got {kind!r}")
        if kind == "mha" and qk_layernorm:
            raise ValueError("nn.MultiheadAttention has no place for qk-layernorm; use attention='sdpa' or 'manual'")
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not a multiple of n_head {n_head}")
        self.kind, self.n_head, self.head_dim = kind, n_head, d_model // n_head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.record = False
        self.last_qk: tuple[torch.Tensor, torch.Tensor] | None = None
        mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)  # True: a future key
        self.register_buffer("mask", mask, persistent=False)
        if kind == "mha":
            self.mha = nn.MultiheadAttention(d_model, n_head, batch_first=True)
            return
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.q_ln = nn.LayerNorm(self.head_dim) if qk_layernorm else None
        self.k_ln = nn.LayerNorm(self.head_dim) if qk_layernorm else None

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over ``x`` (B, T, d_model)."""
        b, n, d = x.shape
        mask = self.mask[:n, :n]
        if self.kind == "mha":
            if self.record:
                with torch.no_grad():
                    q, k, _ = F.linear(x.detach(), self.mha.in_proj_weight, self.mha.in_proj_bias).chunk(3, dim=-1)
                    self.last_qk = (self._heads(q), self._heads(k))
            out, _ = self.mha(x, x, x, attn_mask=mask, need_weights=False)
            return out
        q, k, v = (self._heads(t) for t in self.c_attn(x).split(d, dim=2))
        if self.q_ln is not None and self.k_ln is not None:
            q, k = self.q_ln(q), self.k_ln(k)
        if self.record:
            self.last_qk = (q.detach(), k.detach())
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * self.scale
            att = att.masked_fill(mask, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, n, d))


class MLP(nn.Module):
    """``c_proj(GELU(c_fc(x)))`` with a 4x hidden width."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of ``x``."""
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """A pre-LN block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_head: int, seq_len: int, qk_layernorm: bool, attention: str) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, seq_len, qk_layernorm, attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One residual block."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """A small pre-LN causal decoder: ``wte`` + ``wpe``, ``blocks.{i}``, ``ln_f``, ``lm_head`` (untied).

    Args:
        vocab: vocabulary size.
        d_model: width.
        n_layer: number of blocks.
        n_head: attention heads per block.
        seq_len: the longest input.
        qk_layernorm: LayerNorm (over the head dimension) on q and k of every head.
        attention: "sdpa" (``F.scaled_dot_product_attention(is_causal=True)``, fused ``c_attn``, ``c_proj``),
            "manual" (``softmax(q k^T * scale)`` with a causal ``-inf`` mask) or "mha"
            (``nn.MultiheadAttention`` with a causal ``attn_mask``; no qk-layernorm).

    Raises:
        ValueError: an unknown attention kind, or qk-layernorm with "mha".
    """

    def __init__(self, vocab: int, d_model: int = 64, n_layer: int = 2, n_head: int = 4, seq_len: int = 64,
                 qk_layernorm: bool = False, attention: str = "sdpa") -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, seq_len, qk_layernorm, attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) of token ids ``idx`` (B, T)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):  # GPT-2's N(0, 0.02)
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


# ------------------------------------------------------------------------------------------------ the task
def induction_batch(generator: torch.Generator, batch: int, seq_len: int,
                    vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of the induction task: ``seq_len // 2`` random tokens, then the same tokens again.

    The sequence (``seq_len + 1`` tokens, period ``seq_len // 2``) gives inputs ``tokens[:, :-1]`` and
    next-token targets ``tokens[:, 1:]``; the mask (bool, like the targets) is True where the target lies in
    the repeat and its previous occurrence can be found by copying (target position ``>= seq_len // 2``).

    Returns:
        inputs (B, T) and targets (B, T), int64, and the loss mask (B, T).
    """
    half = seq_len // 2
    prefix = torch.randint(0, vocab, (batch, half), generator=generator)
    tokens = prefix.repeat(1, seq_len // half + 1)[:, : seq_len + 1]
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    mask[:, half:] = True
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over the masked positions, plus ``z_loss * mean(logsumexp(logits)^2)`` over them."""
    picked = logits[mask].float()
    loss = F.cross_entropy(picked, targets[mask])
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(picked, dim=-1).pow(2).mean()
    return loss


# ------------------------------------------------------------------------------------ the ground truth
@torch.no_grad()
def attention_stats(model: Decoder) -> list[tuple[float, float, float]]:
    """Per layer (max logit, mean entropy, min-over-heads mean entropy) of the latest recorded forward pass.

    The logit is ``q.k * scale`` over batch, heads and the (query, key) pairs the causal mask lets through;
    the entropy (nats) is the softmax's over the visible keys of each query, averaged over batch and queries
    (per head), then over heads (mean) or its smallest head (min).
    """
    out = []
    for block in model.blocks:
        attn = block.attn
        assert attn.last_qk is not None, "set attn.record before the forward pass"
        q, k = (t.float() for t in attn.last_qk)
        n = q.shape[2]
        logits = (q @ k.transpose(-2, -1)) * attn.scale
        logits = logits.masked_fill(attn.mask[:n, :n], float("-inf"))
        p = F.softmax(logits, dim=-1)
        logp = F.log_softmax(logits, dim=-1)
        ent = -(p * logp.nan_to_num(neginf=0.0)).sum(-1)  # (B, H, T); masked p is 0
        head_ent = ent.mean(dim=(0, 2))  # (H,)
        out.append((logits.max().item(), head_ent.mean().item(), head_ent.min().item()))
    return out


# ------------------------------------------------------------------------------------------- training
@dataclass
class Config:
    """One training configuration of the proxy."""

    qk_layernorm: bool = False
    z_loss: float = 0.0
    attention: str = "sdpa"
    vocab: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    seq_len: int = 64
    batch: int = 32
    weight_decay: float = 0.1
    bf16: bool = False  # train under torch.autocast("cpu", dtype=torch.bfloat16)
    noise: float = 0.0  # each repeated token is replaced by a random one with this probability (irreducible loss)
    lr_start: float | None = None  # if set: warm up to this learning rate, hold it, then ramp to the peak lr
    hold: int = 0  # steps at lr_start after the warm-up
    ramp: int = 0  # steps of the linear ramp from lr_start to the peak lr


def noisy_induction_batch(generator: torch.Generator, batch: int, seq_len: int, vocab: int,
                          noise: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`induction_batch` whose repeated tokens are each replaced, with probability ``noise``, by a random
    token (those the loss scores), so that the loss on the repeat cannot reach 0 and the gradients
    do not vanish once the task is learned; ``noise`` 0 is :func:`induction_batch` itself."""
    x, y, mask = induction_batch(generator, batch, seq_len, vocab)
    if not noise:
        return x, y, mask
    tokens = torch.cat([x, y[:, -1:]], dim=1)
    swap = torch.rand(tokens.shape, generator=generator) < noise
    swap[:, : seq_len // 2 + 1] = False
    tokens = torch.where(swap, torch.randint(0, vocab, tokens.shape, generator=generator), tokens)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def lr_factor(config: Config, lr: float, warmup: int, step: int) -> float:
    """The learning rate of ``step`` over the peak ``lr``: a linear warm-up over ``warmup`` steps to ``lr``, or,
    with ``config.lr_start``, to ``lr_start``, held ``config.hold`` steps, then ramped linearly over
    ``config.ramp`` steps to ``lr`` (the model learns at the low rate, then meets the high one); then constant."""
    if config.lr_start is None:
        return min(1.0, (step + 1) / max(1, warmup))
    low = config.lr_start / lr
    if step < warmup:
        return low * (step + 1) / warmup
    step -= warmup + config.hold
    if step < 0:
        return low
    return low + (1.0 - low) * min(1.0, (step + 1) / max(1, config.ramp))


@dataclass
class Result:
    """One run: per-step losses, per-step per-layer attention statistics, log Z and gradwatch's findings."""

    config: dict[str, Any]
    lr: float
    seed: int
    steps: int
    seconds: float
    losses: list[float]
    max_logit: list[list[float]]  # [layer][step]
    entropy_mean: list[list[float]]  # [layer][step]
    entropy_min_head: list[list[float]]  # [layer][step]
    log_z: list[float]  # mean logsumexp of the output logits, per step
    findings: list[dict[str, Any]] | None = None
    halted: str | None = None  # the exception that stopped training early, if any
    summary: dict[str, Any] = field(default_factory=dict)


def train(config: Config, steps: int, lr: float, warmup: int = 10, seed: int = 0, watch: dict[str, Any] | None = None,
          on_step: Callable[[int, float], None] | None = None) -> Result:
    """Train the proxy ``steps`` steps; linear warm-up over ``warmup`` steps, then the constant ``lr``.

    Args:
        config: the model, task and optimizer settings.
        steps: optimizer steps.
        lr: peak learning rate.
        warmup: steps of linear warm-up (step ``s`` uses ``lr * min(1, (s + 1) / warmup)``).
        seed: seeds the model and the data.
        watch: if a dict, ``gradwatch.watch(model, run=<temp dir>, **watch)``; the loop calls
            ``gw.watcher(model).observe(loss=...)`` every step before backward, and the findings are read back.
        on_step: called with (step, loss) after every step.

    Returns:
        the :class:`Result`; training stops early only on an exception of gradwatch's (``halted``).
    """
    torch.manual_seed(seed)
    model = Decoder(config.vocab, config.d_model, config.n_layer, config.n_head, config.seq_len,
                    config.qk_layernorm, config.attention)
    for block in model.blocks:
        block.attn.record = True
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(config, lr, warmup, s))
    gw, run_dir, tmp = None, None, None
    if watch is not None:
        import gradwatch as gw  # noqa: PLC0415 -- only when watched

        tmp = tempfile.TemporaryDirectory(prefix="gw-instability-")
        run_dir = Path(tmp.name) / "run"
        options = {"console": False, **watch}
        model = gw.watch(model, run=str(run_dir), **options)
    n_layer = config.n_layer
    losses: list[float] = []
    log_z: list[float] = []
    max_logit: list[list[float]] = [[] for _ in range(n_layer)]
    ent_mean: list[list[float]] = [[] for _ in range(n_layer)]
    ent_min: list[list[float]] = [[] for _ in range(n_layer)]
    halted = None
    start = time.perf_counter()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if config.bf16 else contextlib.nullcontext()
    try:
        for step in range(steps):
            x, y, mask = noisy_induction_batch(gen, config.batch, config.seq_len, config.vocab, config.noise)
            with amp:
                logits = model(x)
                loss = loss_fn(logits, y, mask, config.z_loss)
            with torch.no_grad():
                log_z.append(torch.logsumexp(logits.detach().float(), dim=-1).mean().item())
                for i, (m, e, emin) in enumerate(attention_stats(model)):
                    max_logit[i].append(m)
                    ent_mean[i].append(e)
                    ent_min[i].append(emin)
            value = loss.item()
            losses.append(value)
            if gw is not None:
                gw.watcher(model).observe(loss=value)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if on_step is not None:
                on_step(step, value)
    except Exception as exc:  # noqa: BLE001 -- e.g. gradwatch.TrainingHalted under a rule that stops
        if gw is None:
            raise
        halted = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    findings = None
    if gw is not None and run_dir is not None and tmp is not None:
        gw.unwatch(model)
        frame = gw.open_run(str(run_dir)).findings()
        keep = [c for c in ("step", "kind", "severity", "layer", "message", "action") if c in frame.columns]
        findings = [{c: _plain(row[c]) for c in keep} for _, row in frame.iterrows()]
        tmp.cleanup()
    return Result(asdict(config), lr, seed, len(losses), seconds, losses, max_logit, ent_mean, ent_min, log_z,
                  findings, halted)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


# ------------------------------------------------------------------------------------ loss-only detectors
def spike_detection_step(losses: Sequence[float], window: int = 10, atol: float | None = None,
                         rtol: float | None = 2.0, warmup: int = 1) -> int | None:
    """The first step Lightning's ``SpikeDetection`` (mode "min", ``finite_only=True``) flags, or None.

    The rule of ``lightning.fabric.utilities.spike.SpikeDetection`` (Lightning 2.x), step by step: from step
    ``warmup`` on, a loss is a spike if it is non-finite; otherwise, if it is not above the previous accepted
    loss (``loss - last <= 0``: an improvement) it is not; otherwise it is a spike when ``|loss - mean| >=
    |atol|`` (skipped when atol is None) AND ``|loss - mean| >= |rtol * mean|`` (skipped when rtol is None),
    ``mean`` being the running mean of the last ``window`` accepted losses (torchmetrics ``Running(MeanMetric,
    window)``). A loss that is not a spike is accepted (updates the mean and ``last``); the first spike raises
    ``TrainingSpikeException``, so this returns that step. With rtol 2 and positive losses, a spike is a loss
    at least 3x the running mean. Before anything was accepted, ``last`` is 0 and the mean is NaN.
    """
    history: list[float] = []
    last = 0.0
    for step, loss in enumerate(losses):
        if step >= warmup:
            if not math.isfinite(loss):
                return step
            mean = sum(history[-window:]) / len(history[-window:]) if history else math.nan
            if loss - last > 0:
                diff = abs(loss - mean)
                ok_atol = atol is None or diff >= abs(atol)
                ok_rtol = rtol is None or diff >= abs(rtol * mean)
                if ok_atol and ok_rtol:
                    return step
        if math.isfinite(loss):
            history.append(loss)
            last = loss
    return None


def sigma_step(losses: Sequence[float], window: int = 128, sigmas: float = 6.0, min_history: int = 16) -> int | None:
    """The first step whose loss is more than ``sigmas`` standard deviations above the mean of the previous
    ``window`` finite losses (at least ``min_history`` of them), or is non-finite after that; None if none.

    After OLMo-core's StabilityMonitor (a z-score of the loss against its recent history). The standard
    deviation is the population one; a history of identical losses (std 0) flags any loss above them.
    """
    history: list[float] = []
    for step, loss in enumerate(losses):
        if len(history) >= min_history:
            if not math.isfinite(loss):
                return step
            recent = history[-window:]
            mean = sum(recent) / len(recent)
            std = math.sqrt(sum((v - mean) ** 2 for v in recent) / len(recent))
            if loss > mean + sigmas * std and loss > mean:
                return step
        if math.isfinite(loss):
            history.append(loss)
    return None


def divergence_step(losses: Sequence[float], factor: float = 2.0) -> int | None:
    """The first step from which the run has diverged for good, or None.

    Step ``s`` is the divergence step if the loss there is non-finite, or above ``threshold(s) = factor x
    min(loss[0..s])`` (over twice the best so far), and every later loss is also non-finite or above
    ``threshold(s)``: the run never comes back. A run that learned and fell back to an untrained model's loss
    (its attention collapsed: the uniform prediction's ln(vocab)) has diverged; a run that never learned has
    not (its best is its start). A run whose last few losses rise is, by this rule, diverged from there (a
    rise at the very end cannot be told from a divergence); a temporary spike that recovers is not.
    """
    if not losses:
        return None
    first = losses[0]
    best = math.inf
    thresholds = []
    for loss in losses:
        if math.isfinite(loss):
            best = min(best, loss)
        thresholds.append(factor * best if math.isfinite(first) else -math.inf)
    # walking backwards: the smallest finite loss from each step to the end
    tail_min = math.inf
    tail = [math.inf] * len(losses)
    for i in range(len(losses) - 1, -1, -1):
        if math.isfinite(losses[i]):
            tail_min = min(tail_min, losses[i])
        tail[i] = tail_min
    for step, loss in enumerate(losses):
        if not math.isfinite(loss) or (loss > thresholds[step] and tail[step] > thresholds[step]):
            return step
    return None


# ------------------------------------------------------------------------------------------- reporting
def first_warning(findings: list[dict[str, Any]] | None, kinds: Sequence[str] | None = None) -> int | None:
    """The step of the first warning- or error-severity finding (of ``kinds`` if given), or None."""
    if findings is None:
        return None
    steps = [f["step"] for f in findings if f.get("severity") in ("warning", "error")
             and (kinds is None or f.get("kind") in kinds)]
    return min(steps) if steps else None


#: a run whose best loss is at least this share of its first never learned
NEVER_LEARNED = 0.9


def outcome(losses: Sequence[float]) -> str:
    """``diverged`` (:func:`divergence_step`), ``never learned`` (its best loss at least ``NEVER_LEARNED`` of its
    first) or ``learned``."""
    finite = [v for v in losses if math.isfinite(v)]
    if divergence_step(losses) is not None:
        return "diverged"
    if not finite or min(finite) >= NEVER_LEARNED * losses[0]:
        return "never learned"
    return "learned"


def summarize(result: Result, judged: bool = False) -> dict[str, Any]:
    """The table row of one run (also stored in ``result.summary``). ``judged``: a healthy or mitigated run
    (a healthy learning rate, or qk-layernorm), whose warnings, if it learned and did not diverge, are false
    alarms."""
    div = divergence_step(result.losses)
    warn = first_warning(result.findings)
    warn_attn = first_warning(result.findings, ATTENTION_KINDS)
    ended = outcome(result.losses)
    loud = [f for f in result.findings or [] if f.get("severity") in ("warning", "error")]
    warnings = None if result.findings is None else len(loud)
    judge = judged and ended == "learned" and result.findings is not None
    alarms = sum(f["kind"] in ATTENTION_KINDS for f in loud) if judge else None
    finite = [v for v in result.losses if math.isfinite(v)]
    row = {
        "outcome": ended,
        "warnings": warnings,
        "divergence": div,
        "spike_detection": spike_detection_step(result.losses),
        "sigma6": sigma_step(result.losses),
        "gw_first_warning": warn,
        "gw_first_attn_warning": warn_attn,
        "lead": (div - warn) if div is not None and warn is not None else None,
        "lead_attn": (div - warn_attn) if div is not None and warn_attn is not None else None,
        "false_alarms": alarms,  # the mechanisms' warnings on a healthy or mitigated run that learned
        "other_warnings": sorted({f["kind"] for f in loud if f["kind"] not in ATTENTION_KINDS}) if judge else None,
        "first_kind": next((f["kind"] for f in sorted(loud, key=lambda f: f["step"])), None),
        "kinds": sorted({f["kind"] for f in result.findings or [] if f.get("severity") in ("warning", "error")}),
        "final_loss": result.losses[-1] if result.losses else None,
        "best_loss": min(finite) if finite else None,
        "peak_max_logit": max(max(v for v in layer if math.isfinite(v)) for layer in result.max_logit),
        "low_min_entropy": min(min(v for v in layer if math.isfinite(v)) for layer in result.entropy_min_head),
        "seconds": round(result.seconds, 2),
    }
    result.summary = row
    return row


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def trajectory_lines(name: str, result: Result, every: int = 10) -> list[str]:
    """The per-layer max logit / min-head entropy and log Z every ``every`` steps, as text lines."""
    lines = [f"{name}  lr={result.lr:g} seed={result.seed}  (per step s: loss | per layer max logit/min-head "
             f"entropy (nats) | log Z)"]
    for s in range(0, result.steps, every):
        layers = "  ".join(f"L{i} {result.max_logit[i][s]:7.1f}/{result.entropy_min_head[i][s]:.2f}"
                           for i in range(len(result.max_logit)))
        lines.append(f"  s={s:4d} loss {result.losses[s]:8.4g} | {layers} | logZ {result.log_z[s]:8.3g}")
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweep, print the table, return (and with ``--json`` write) every result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", default="1e-2,3e-2,1e-1,3e-1", help="comma-separated peak learning rates")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "manual", "mha"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50, help="steps of linear warm-up (to --lr-start, if given)")
    parser.add_argument("--noise", type=float, default=0.2,
                        help="share of the repeated tokens replaced by random ones (0: the plain copy task)")
    parser.add_argument("--lr-start", type=float, default=3e-3,
                        help="the learning rate the model learns at before the ramp to the peak (0: none)")
    parser.add_argument("--hold", type=int, default=150, help="steps at --lr-start after the warm-up")
    parser.add_argument("--ramp", type=int, default=50, help="steps of the linear ramp to the peak")
    parser.add_argument("--healthy", type=float, default=1e-2,
                        help="peak learning rates up to this are healthy ones: their warnings are false alarms")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--bf16", action="store_true", help='train under torch.autocast("cpu", dtype=bfloat16)')
    parser.add_argument("--no-watch", action="store_true", help="train without gradwatch")
    parser.add_argument("--trajectory", action="store_true", help="print per-layer statistics every 10 steps")
    parser.add_argument("--quick", action="store_true", help="the lowest and highest learning rate, plain and "
                        "qk_ln, seed 0, 60 steps, no ramp (seconds)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lrs = [float(v) for v in args.lrs.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    seeds = [int(v) for v in args.seeds.split(",") if v]
    steps, lr_start = args.steps, args.lr_start or None
    if args.quick:
        lrs, configs, seeds, steps, lr_start = [lrs[0], lrs[-1]], ["plain", "qk_ln"], [0], 60, None
    if args.attention == "mha":
        skipped = [c for c in configs if CONFIGS[c][0]]
        configs = [c for c in configs if not CONFIGS[c][0]]
        if skipped:
            print(f"(mha: no qk-layernorm; skipping {', '.join(skipped)})")
    header = ["config", "lr", "seed", "outcome", "diverge", "spike10", "6sigma", "gw_first", "gw_mech", "lead",
              "lead_mech", "warnings", "false_mech", "best", "final", "peak_logit", "s", "first_kind", "other"]
    schedule = (f"warmup {args.warmup} to {lr_start:g}, held {args.hold}, ramp {args.ramp} to the peak"
                if lr_start else f"warmup {args.warmup} to the peak")
    print(f"attention={args.attention} steps={steps} noise={args.noise} {schedule} bf16={args.bf16} "
          f"watch={not args.no_watch}")
    print(" ".join(f"{h:>10}" for h in header))
    results = []
    for lr in lrs:
        for name in configs:
            qk, z = CONFIGS[name]
            for seed in seeds:
                config = Config(qk_layernorm=qk, z_loss=z, attention=args.attention, vocab=args.vocab,
                                seq_len=args.seq_len, batch=args.batch, weight_decay=args.weight_decay,
                                bf16=args.bf16, noise=args.noise, lr_start=lr_start, hold=args.hold,
                                ramp=args.ramp)
                result = train(config, steps, lr, warmup=args.warmup, seed=seed,
                               watch=None if args.no_watch else {"rules": None})
                row = summarize(result, judged=qk or lr <= args.healthy)
                cells = [name, lr, seed, row["outcome"], row["divergence"], row["spike_detection"], row["sigma6"],
                         row["gw_first_warning"], row["gw_first_attn_warning"], row["lead"], row["lead_attn"],
                         row["warnings"], row["false_alarms"], row["best_loss"], row["final_loss"],
                         row["peak_max_logit"], row["seconds"], row["first_kind"],
                         ",".join(row["other_warnings"] or []) or None]
                print(" ".join(f"{_fmt(c):>10}" for c in cells), flush=True)
                if args.trajectory:
                    print("\n".join(trajectory_lines(name, result)), flush=True)
                results.append(({"name": name}, result))
    out = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "runs": [{**tag, **asdict(r)} for tag, r in results]}
    if args.json:
        args.json.write_text(json.dumps(out, default=str, allow_nan=True))
    return out


if __name__ == "__main__":
    main()
