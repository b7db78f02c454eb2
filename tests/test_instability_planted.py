"""Issue 36, end to end: attention logit growth planted in the benchmark's small pre-LN decoder (a high learning
rate after a warmup, no qk-layernorm) is found at kind ``attention_logits`` and the attention layer while the loss
is still low, for each way attention is written; the twin with qk-layernorm at the same learning rate, and the
same model at a healthy one, are quiet (``gradwatch check --fail-on warning`` passes).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gradwatch as gw

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # ~6 s a run

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    name = "gradwatch_instability_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "instability.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def train(run: Path, *, lr: float, qk_layernorm: bool = False, attention: str = "sdpa", steps: int = 120,
          warmup: int = 100) -> list[float]:
    """The proxy trained as its users write a loop: AdamW, a linear warmup, the loss observed each step."""
    bench = _bench()
    torch.manual_seed(0)
    config = bench.Config(qk_layernorm=qk_layernorm, attention=attention)
    model = bench.Decoder(config.vocab, config.d_model, config.n_layer, config.n_head, config.seq_len,
                          config.qk_layernorm, config.attention)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    gw.watch(model, run=run, console=False)
    losses = []
    for _ in range(steps):
        x, y, mask = bench.induction_batch(gen, config.batch, config.seq_len, config.vocab)
        loss = bench.loss_fn(model(x), y, mask)
        gw.watcher(model).observe(loss=loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    gw.watcher(model).close()
    return losses


def check(run: Path) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(run), "--format", "json", "--fail-on",
                           "warning"], capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)["findings"]


@pytest.mark.parametrize("attention", ["sdpa", "manual", "mha"])
def test_attention_logit_growth_is_named_at_its_layer_while_the_loss_is_low(attention: str, tmp_path: Path) -> None:
    losses = train(tmp_path / "run", lr=3e-2, attention=attention)
    code, findings = check(tmp_path / "run")
    found = [f for f in findings if f["kind"] == "attention_logits"]
    assert code == 1 and found, findings
    first = found[0]
    layer = "blocks.0.attn.mha" if attention == "mha" else "blocks.0.attn"
    assert first["severity"] == "warning" and first["layer"] in (layer, layer.replace("0", "1"))
    assert 40 <= first["step"] <= 110
    assert losses[first["step"]] < 0.25 * losses[0]  # the model has learned; its loss has not moved back
    assert not [f for f in findings if f["severity"] == "error"]
    data = gw.open_run(tmp_path / "run").findings().query("kind == 'attention_logits'").iloc[0]["data"]
    assert data["logit"] >= 50 and data["growth"] >= 4 and data["head"] in range(4)
    assert "qk-layernorm" in first["message"] and "head" in first["message"]


@pytest.mark.parametrize(("lr", "qk_layernorm"), [(3e-2, True), (3e-3, False)], ids=["qk_layernorm", "healthy_lr"])
def test_the_mitigated_twin_and_a_healthy_learning_rate_are_quiet(lr: float, qk_layernorm: bool,
                                                                  tmp_path: Path) -> None:
    losses = train(tmp_path / "run", lr=lr, qk_layernorm=qk_layernorm, steps=160)
    code, findings = check(tmp_path / "run")
    assert code == 0 and not [f for f in findings if f["severity"] != "info"], findings
    assert min(losses[-10:]) < 0.5 * losses[0]  # and it learns
