"""Report remedies: what each finding kind means and what to try, in plain words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """How the report explains one finding kind.

    Attributes:
        title: a short name for people.
        meaning: one sentence on what the finding says about training.
        remedies: concrete things to try, most likely first.
        metric: the per-layer metric that shows the evidence (for the sparkline).
        log: whether that metric is best read on a log scale.
    """

    title: str
    meaning: str
    remedies: tuple[str, ...]
    metric: str = "grad_norm"
    log: bool = True


KINDS: dict[str, Kind] = {
    "nonfinite": Kind(
        "NaN / Inf",
        "A NaN or Inf appeared in the loss, an activation or a gradient; one such update would poison every weight.",
        (
            "Look at the origin module named here first: the op inside it that can produce NaN/Inf is the culprit.",
            "The usual culprits: log(0) or log of a negative number, sqrt of a negative number, division by zero "
            "(normalising a zero vector), exp() overflow. Add an epsilon, clamp the argument, or use a stable form "
            "(log_softmax, logsumexp, F.normalize with eps).",
            "Check the input batch for NaN/Inf values (torch.isfinite(x).all()) and the labels for out-of-range "
            "values.",
            "In fp16, values above 65504 overflow to Inf: use bf16, or torch.amp.GradScaler for the loss.",
            "A learning rate that is too high drives weights to overflow after a few steps: lower it or add warmup.",
            "Let gradwatch protect the run meanwhile: gw.Rule(when='nonfinite', do='skip') or do='rollback'.",
        ),
        metric="grad_norm",
    ),
    "vanishing": Kind(
        "Vanishing gradient",
        "The layer's gradient is negligible, so it has (almost) stopped learning.",
        (
            "Add residual (skip) connections so the gradient has a short path to early layers.",
            "Add normalisation (BatchNorm, LayerNorm) between layers to keep activations in a useful range.",
            "Replace sigmoid/tanh in deep stacks with ReLU-family activations (ReLU, LeakyReLU, GELU, SiLU).",
            "Initialise weights for the activation: Kaiming (He) for ReLU-family, Xavier (Glorot) for tanh/sigmoid.",
            "If the layer is meant to be frozen, freeze it explicitly (requires_grad_(False)).",
        ),
    ),
    "exploding": Kind(
        "Exploding gradient",
        "The gradient norm jumped far above its own recent history; an update that large can wreck the weights.",
        (
            "Clip the gradient norm: torch.nn.utils.clip_grad_norm_ or gw.Rule(when='exploding', do='clip').",
            "Lower the learning rate, and add a warmup at the start of training.",
            "Check the batch of this step: unnormalised or corrupted inputs and targets cause sudden spikes.",
            "Check the initialisation scale of the layer named (weights too large), especially in RNNs.",
            "Add normalisation layers; for RNNs prefer LSTM/GRU and clip.",
            "Gradient elements beyond 1.8e19 (their squares overflow float32: Adam's update turns 0) come from an "
            "unbounded op: exp of a log-variance, a division by a tiny number, unnormalised inputs. Bound it (clamp, "
            "normalise); clipping rescales the gradient, but not the op that keeps producing it.",
        ),
    ),
    "loss_spike": Kind(
        "Loss spike",
        "The loss rose far above its recent level in one step, or it diverges: its level is well above its own "
        "first values.",
        (
            "Diverging from the first steps: the learning rate is too high; lower it or add warmup.",
            "Inspect the batch of this step: corrupted samples, wrong labels or a scaling bug in the data pipeline.",
            "Lower the learning rate, or add warmup if the spike comes early.",
            "Clip gradients so one bad batch cannot move the weights far.",
            "A spike that recurs at the same position in the data points at a specific sample.",
        ),
        metric="loss",
        log=False,
    ),
    "dead_units": Kind(
        "Dead units",
        "Nearly all outputs of the layer are exactly zero, so almost nothing flows back through it.",
        (
            "Lower the learning rate: a large step can push ReLU inputs permanently negative.",
            "Use LeakyReLU, GELU or ELU instead of ReLU so negative inputs still pass a gradient.",
            "Initialise biases at zero or a small positive value instead of a large negative one.",
            "A layer named with 'zeroed by the ReLU applied after it' feeds a functional F.relu: all of its outputs "
            "are negative (a BatchNorm or Linear bias driven far below zero).",
            "Add normalisation before the activation to keep its inputs centred.",
        ),
        metric="act_zero_frac",
        log=False,
    ),
    "saturation": Kind(
        "Saturated activation",
        "The bounded activation (sigmoid, tanh ...) is pinned at its limits, where its gradient is near zero.",
        (
            "Use a smaller initialisation (Xavier for tanh/sigmoid) so pre-activations start small.",
            "Normalise before the activation (LayerNorm/BatchNorm).",
            "Lower the learning rate.",
            "Use a non-saturating activation (ReLU family) where the bound is not needed.",
        ),
        metric="act_sat_frac",
        log=False,
    ),
    "update_ratio": Kind(
        "Update-to-weight ratio",
        "The size of the applied update relative to the weights is far from the healthy range (about 1e-3).",
        (
            "Too large: lower the learning rate (or this layer's parameter group's), and add warmup.",
            "Too small: raise the learning rate, and check that the optimizer actually holds this layer's parameters.",
            "Check weight decay and the scheduler: an LR that decays to zero freezes the layer.",
        ),
        metric="update_ratio",
    ),
    "unused_parameter": Kind(
        "Unused parameter",
        "Parameters that require grad received no gradient: they are not on the path to the loss.",
        (
            "Check that the submodule's forward is actually called in the model's forward.",
            "Look for a .detach(), .item(), .numpy() or torch.no_grad() that cuts the graph.",
            "A residual block whose forward replaced its output with the shortcut (out = shortcut(x) instead of "
            "out += shortcut(x)) leaves its whole branch without gradients: the finding names the block.",
            "A branch that is never taken leaves its parameters unused; if intended, freeze them "
            "(requires_grad_(False)) so DDP and optimizers do not wait for them.",
        ),
    ),
    "amp_overflow": Kind(
        "AMP overflow",
        "The GradScaler skipped steps because the scaled gradients overflowed.",
        (
            "A few skips while the scaler calibrates its scale are normal.",
            "A run of skips means gradients are non-finite at any scale: look for a nonfinite finding and its origin.",
            "Train in bf16 (wider range than fp16) if the hardware supports it.",
            "Lower the learning rate or clip gradients (after scaler.unscale_) if the overflow follows a spike.",
        ),
    ),
    "learning_rate": Kind(
        "Learning rate",
        "The learning rate does not fit the model: its updates rewrite a large fraction of the weights (or make "
        "them grow geometrically, or the loss diverge from its first values), or they barely move the weights at "
        "all. Healthy updates are about 1e-3 of the weights.",
        (
            "Too high: lower it (by 10x to start with) and add a warmup; with Adam-type optimizers the first steps "
            "move every weight by about lr, so lr must be well below the weights' typical size.",
            "Too high only for some layers: give them their own param group with a smaller lr (embeddings, "
            "layers initialised very small such as zero-init or 1/sqrt(depth)-scaled projections).",
            "Too low: raise it; check its units and the scheduler (a warmup that never ends, a lambda that "
            "multiplies by a tiny factor, an lr tuned for a summed loss used with an averaged one).",
            "Let gradwatch act meanwhile: gw.Rule(when='learning_rate', do='scale_lr', factor=0.1).",
        ),
        metric="update_ratio",
    ),
    "zero_gradient": Kind(
        "Zero gradient",
        "Every gradient of the step is exactly zero, so no parameter learns anything.",
        (
            "clip_grad_norm_(..., max_norm=0) scales every gradient to zero: 0 does not mean 'no clipping'. "
            "Skip the call to train unclipped, or pass a positive max_norm.",
            "A loss that does not depend on the parameters: a .detach() or torch.no_grad() around the model's "
            "output, or a loss multiplied by 0 (a weight schedule that starts at 0).",
            "Gradients zeroed (zero_grad, a hook) between backward() and optimizer.step().",
        ),
    ),
    "attention_logits": Kind(
        "Attention logits growing",
        "A layer's largest attention logit q·k/√d grows step after step and its attention collapses towards "
        "one-hot: the precursor of a transformer's divergence (Dehghani et al. 2023; Wortsman et al. 2023).",
        (
            "Add qk-layernorm: a LayerNorm on the queries and the keys of each head removes attention logit growth "
            "at the same learning rate.",
            "Lower the learning rate, or lengthen its warmup.",
            "Cap the logits: QK-clip (rescale W_q and W_k when the largest logit passes a bound such as 100, as "
            "Kimi K2 does) or a soft cap, c*tanh(logits/c).",
            "Restart from a checkpoint taken before the growth began once the loss has followed.",
        ),
        "attn_logit_max",
    ),
    "output_growth": Kind(
        "Linear outputs growing",
        "The outputs of linear layers (QKV projection, attention output projection, second MLP layer) grow on every "
        "measured step without slowing down: the precursor of divergence at a too-high learning rate "
        "(Rybakov et al. 2024).",
        (
            "Lower the learning rate, or lengthen its warmup.",
            "Normalise the outputs of the QKV projection, the attention output projection and the second MLP layer "
            "(qk-layernorm; Rybakov et al.'s QKV/Proj/FC2 norm), or cap the attention softmax's logits.",
            "Add weight decay. Gradient clipping does not fix it: the weights grow by many small steps.",
        ),
        "act_norm",
    ),
    "stale_gradient": Kind(
        "Gradients never cleared",
        "The gradients are not cleared between optimizer steps: backward adds to the previous steps' gradients, "
        "so each step applies their sum, a step size that grows with every step.",
        (
            "Call optimizer.zero_grad() (or model.zero_grad()) once per step: before backward(), or after "
            "optimizer.step().",
            "Accumulating over micro-batches on purpose: clear after each optimizer.step(), not never.",
        ),
    ),
    "adam_epsilon": Kind(
        "Adam's eps dominates the update",
        "The gradients are at the scale of the optimizer's eps or below, so Adam's update lr * m / (sqrt(v) + eps) is "
        "a small share of the learning rate: the model learns next to nothing (Wortsman et al. 2023).",
        (
            "Use a smaller eps: 1e-8 (the default), or 1e-10 and below when the optimizer's state is not held in "
            "bf16/fp16; Wortsman et al. found eps down to 1e-15 safe for small models.",
            "Rescale the loss so that the gradients are larger: check that it is not divided by a huge factor (a "
            "mean taken twice, a sum over tokens divided by the batch and the length again, a tiny loss weight).",
            "Raising the learning rate does not help: the update stays a fraction rms / (rms + eps) of it.",
        ),
    ),
    "unoptimized_parameter": Kind(
        "Parameter not optimized",
        "The parameter requires grad and gets gradients, but no optimizer changes it: it is in none of the "
        "optimizers' param groups, or its param group's learning rate is 0.",
        (
            "Build the optimizer from model.parameters(), or check the name filters that split parameters into "
            "groups (decay / no decay): a parameter that matches neither is silently dropped.",
            "Parameters added to the model after the optimizer was built must be added to it too "
            "(optimizer.add_param_group).",
            "A param group with lr=0 (often meant as weight_decay=0) freezes its parameters; if they are meant to "
            "be frozen, requires_grad_(False) says so and saves their gradients.",
        ),
        metric="update_ratio",
    ),
    "replica_divergence": Kind(
        "Replicas diverged",
        "The copies of the model on the ranks of a distributed run no longer hold the same weights, so each rank "
        "trains a different model and the averaged gradients stop meaning anything.",
        (
            "Wrap the model in DistributedDataParallel before the first step, and build it the same way on every "
            "rank (same seed, same initial weights: DDP broadcasts rank 0's parameters only at construction).",
            "Look for rank-dependent code between backward() and optimizer.step(): gradients modified on one rank, "
            "clipping with a rank-local norm, a learning rate or scheduler that differs per rank.",
            "Parameters updated outside autograd (buffers written in place, EMA weights) must be synchronised "
            "explicitly (broadcast or all_reduce).",
            "Non-deterministic kernels make replicas drift slowly; raise replica_tolerance if a tiny drift is "
            "expected, or enable torch.use_deterministic_algorithms.",
        ),
        metric="param_norm",
    ),
}

#: a kind the report does not know (a third-party detector): its title is made from the kind's name
UNKNOWN = Kind("Finding", "A detector plugin reported this step.", ("Read the finding's hint.",))


def explain(kind: str) -> Kind:
    """The explanation of ``kind``; a kind this report does not know (a detector plugin's) gets a
    generic one titled after its name (``loss_plateau`` -> "Loss plateau").
    """
    known = KINDS.get(kind)
    if known is not None:
        return known
    title = kind.replace("_", " ").strip().capitalize() or UNKNOWN.title
    return dataclasses.replace(UNKNOWN, title=title)
