"""Smoke test of benchmarks/instability.py: its loss-only baselines, divergence rule and model (fast)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gradwatch_instability_bench", ROOT / "benchmarks" / "instability.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


FLAT_THEN_SPIKE = [2.0 + 0.01 * (i % 3) for i in range(40)] + [50.0] + [2.0] * 10
SMOOTH = [4.0 * math.exp(-i / 50) + 0.1 for i in range(300)]


def test_the_loss_baselines_flag_a_spike_at_its_step(bench) -> None:
    assert bench.spike_detection_step(FLAT_THEN_SPIKE) == 40
    assert bench.sigma_step(FLAT_THEN_SPIKE) == 40


def test_the_loss_baselines_are_quiet_on_a_smooth_decrease(bench) -> None:
    assert bench.spike_detection_step(SMOOTH) is None
    assert bench.sigma_step(SMOOTH) is None
    assert bench.divergence_step(SMOOTH) is None


def test_a_nan_is_a_spike_to_both(bench) -> None:
    losses = [2.0] * 30 + [float("nan")]
    assert bench.spike_detection_step(losses) == 30
    assert bench.sigma_step(losses) == 30


def test_the_divergence_step(bench) -> None:
    assert bench.divergence_step([4.0, 3.0, 1.0, 0.5, float("nan"), float("nan")]) == 4
    assert bench.divergence_step([4.0, 3.0, 1.0, 0.5, 3.0, 7.0, 9.0, 8.0]) == 4  # above 2 x 0.5 for good
    assert bench.divergence_step([4.2, 2.0, 1.3, 1.3, 4.2, 4.19, 4.21]) == 4  # learned, then back to the start
    assert bench.divergence_step([4.2, 4.19, 4.21, 4.2, 4.18]) is None  # never learned: no divergence
    assert bench.outcome([4.2, 4.19, 4.21, 4.2, 4.18]) == "never learned"
    assert bench.outcome([4.2, 2.0, 1.3, 1.3, 4.2, 4.19, 4.21]) == "diverged"
    assert bench.outcome([4.2, 2.0, 1.3, 1.2]) == "learned"
    assert bench.divergence_step([4.0, 3.0, 1.0, 0.5, 9.0, 0.6, 0.5, 0.4]) is None  # a spike that recovers
    assert bench.divergence_step([4.0, 3.0, 1.0, 0.5, 0.45, 0.4, 0.42]) is None


@pytest.mark.parametrize("attention", ["sdpa", "manual", "mha"])
def test_the_decoder_runs_each_attention_kind(bench, attention: str) -> None:
    torch.manual_seed(0)
    model = bench.Decoder(vocab=16, d_model=32, n_layer=2, n_head=4, seq_len=8, qk_layernorm=attention != "mha",
                          attention=attention)
    for block in model.blocks:
        block.attn.record = True
    x, y, mask = bench.induction_batch(torch.Generator().manual_seed(0), 2, 8, 16)
    assert x.shape == y.shape == mask.shape == (2, 8) and bool((x[:, 4:] == x[:, :4]).all())
    logits = model(x)
    assert logits.shape == (2, 8, 16)
    loss = bench.loss_fn(logits, y, mask, z_loss=1e-4)
    assert math.isfinite(loss.item())
    stats = bench.attention_stats(model)
    assert len(stats) == 2 and all(0 <= emin <= e <= math.log(8) + 1e-5 for _, e, emin in stats)
    names = {n for n, _ in model.named_modules()}
    assert "blocks.0.mlp.c_fc" in names
    assert ("blocks.0.attn.c_attn" in names) == (attention != "mha")


def test_mha_refuses_qk_layernorm(bench) -> None:
    with pytest.raises(ValueError, match="qk-layernorm"):
        bench.Decoder(vocab=16, seq_len=8, qk_layernorm=True, attention="mha")
