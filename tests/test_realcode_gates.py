"""A second trust trial: architectures whose near-zero-initialised parameters scale a branch's gradients.

DiT's adaLN-Zero blocks and zero-initialised final layer (``tests/realcode/dit.py``), PEFT-shaped LoRA
fine-tuning of a frozen transformer with ``lora_B`` at zero (``tests/realcode/lora.py``), a DeiT III-style
ViT with timm ``LayerScale`` leaves at 1e-5 and a ``cls_token`` at std 1e-6 (``tests/realcode/deit3.py``)
and ControlNet's zero convolutions beside a locked denoiser (``tests/realcode/controlnet.py``), each
trained the way its public recipe does. Read the way a user reads them (``gw.open_run``, ``gradwatch
check --format json --fail-on warning``): healthy runs are quiet and watching changes no loss; each
planted failure is found at its kind, step and layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import pool
from .realcode import PAST_THE_HALT, check, controlnet, deit3, dit, figures, lora, loud, summary, train, unwatched_aside

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPTS = {"dit": dit, "lora": lora, "deit3": deit3, "controlnet": controlnet}


# ------------------------------------------------------------------------------------ healthy
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_short_healthy_run_is_quiet_and_bit_identical(name: str, tmp_path: Path) -> None:
    script = SCRIPTS[name]
    plain = unwatched_aside(script, steps=40)
    watched = train(script, tmp_path / "run", steps=40)
    assert watched.losses == pool.result(plain).losses
    assert loud(watched) == []
    code, report = check(tmp_path / "run", "--fail-on", "warning")
    assert (code, report["steps"], report["findings"]) == (0, 40, [])


#: one seed per script, not the same for all: the healthy sweep (``test_healthy_sweep``) is where seeds vary
HEALTHY = {f"{name}-seed{seed}": (SCRIPTS[name], {"steps": 250, "seed": seed})
           for name, seed in (("dit", 0), ("lora", 1), ("deit3", 0), ("controlnet", 1))}


@pytest.mark.parametrize("name", list(HEALTHY))
@pytest.mark.slow  # 250 steps, trained twice
def test_healthy_runs_of_250_steps_are_quiet_and_bit_identical(name: str, tmp_path: Path) -> None:
    script, config = HEALTHY[name]
    aside = unwatched_aside(script, **config)
    watched = train(script, tmp_path / "run", **config)
    plain = pool.result(aside)
    assert watched.losses == plain.losses
    assert loud(watched) == []
    assert sum(plain.losses[-10:]) < 0.9 * sum(plain.losses[:10]), "the script learns"
    code, report = check(tmp_path / "run", "--fail-on", "warning")
    assert (code, report["steps"], report["findings"]) == (0, 250, [])


# ------------------------------------------------------------------------------------- plants
def test_dit_lr_1000x_diverges_and_is_failed_as_a_too_high_learning_rate(tmp_path: Path) -> None:
    """At 100x (1e-2) this small DiT still learns; at 1000x its loss climbs from step 4."""
    found = loud(train(dit, tmp_path / "run", steps=32, lr_scale=1000, watch=PAST_THE_HALT))
    # the steps at which a climbing loss is seen depend on the trajectory (CPUs, threads, library versions):
    # a warning within the first 10 steps, and the learning rate failed as an error on a later sampled step
    assert found and found[0]["severity"] == "warning" and found[0]["step"] <= 10, summary(found)
    (error,) = [f for f in found if f["severity"] == "error"]
    assert (error["kind"], error["layer"]) == ("learning_rate", None) and error["step"] in (10, 20, 30), summary(found)
    assert "the run has diverged since" in error["message"]
    assert check(tmp_path / "run")[0] == 1


def test_dit_reweighted_loss_at_t_zero_is_an_inf_loss_born_in_the_loss_function(tmp_path: Path) -> None:
    """1 / (1 - alpha_bar) on a schedule whose first beta is 0: sample 3's t = 0 divides by zero."""
    found = loud(train(dit, tmp_path / "run", steps=32, t_zero_at=30))
    assert summary(found[:1]) == [("nonfinite", 30, None, "error")]
    assert "born in the loss function) at step 30; samples to blame: sample 3;" in found[0]["message"]
    assert check(tmp_path / "run")[0] == 1


def test_lora_b_left_out_of_the_optimizer_is_named_at_step_0(tmp_path: Path) -> None:
    """A name filter "lora_A" where "lora_" was meant: the zero lora_B get gradients and never move."""
    found = loud(train(lora, tmp_path / "run", steps=12, b_left_out=True))
    assert summary(found) == [("unoptimized_parameter", 0, "layers.0.attention.q_proj.lora_B.default", "warning")]
    assert found[0]["data"]["parameters"] == [f"layers.{i}.attention.{p}_proj.lora_B.default.weight"
                                              for i in (0, 1) for p in ("q", "v")]


def test_lora_lr_1000x_is_named_at_step_10(tmp_path: Path) -> None:
    found = loud(train(lora, tmp_path / "run", steps=12, lr_scale=1000))
    assert summary(found) == [("learning_rate", 10, "classifier", "warning")]
    grew = figures(found[0]["message"], "its weights grew {n}x in 10 steps up to step 10", anywhere=True)
    assert grew and grew[0] >= 2, found[0]["message"]  # geometric growth: the detector's bar is 2x per 10 steps


def test_deit3_lr_100x_is_named_then_failed_as_a_run_that_never_learned(tmp_path: Path) -> None:
    found = loud(train(deit3, tmp_path / "run", steps=32, lr_scale=100, watch=PAST_THE_HALT))
    assert summary(found) == [("learning_rate", 10, "(root)", "warning"), ("learning_rate", 30, "(root)", "error")]
    assert found[1]["data"]["evidence"] == "no_progress"
    assert check(tmp_path / "run")[0] == 1


def test_deit3_log_of_a_hand_written_softmax_is_a_nan_loss_at_its_step(tmp_path: Path) -> None:
    found = loud(train(deit3, tmp_path / "run", steps=32, log_softmax_by_hand_at=30))
    assert summary(found) == [("nonfinite", 30, None, "error")]
    assert "born in the loss function" in found[0]["message"]


def test_controlnet_lr_1000x_is_named_at_step_10_in_the_trainable_copy(tmp_path: Path) -> None:
    found = loud(train(controlnet, tmp_path / "run", steps=12, lr_scale=1000))
    assert summary(found) == [("learning_rate", 10, "control_model.encoder.down2.2", "warning")]


def test_controlnet_hint_normalised_by_a_zero_max_is_nonfinite_input(tmp_path: Path) -> None:
    found = loud(train(controlnet, tmp_path / "run", steps=32, hint_by_zero_at=30))
    assert summary(found) == [("nonfinite", 30, None, "error")]
    assert found[0]["message"].startswith("The model's input batch holds NaN/Inf at step 30; cause: data")
    assert check(tmp_path / "run")[0] == 1


def test_lora_at_the_hf_trainers_default_lr_under_a_long_warmup_is_quiet_behind_lora_b(tmp_path: Path) -> None:
    """PEFT's layout puts ``lora_B`` in a ModuleDict of its own (``q_proj.lora_B["default"]``): its zero weight
    scales ``lora_A``'s gradient, a module up. At 5e-5 under a 2,000-step warmup ``lora_B`` stays below 1e-3
    for the whole run, and ``lora_A``'s gradients 5e-5 of the median layer's: small by design, said (info)."""
    result = train(lora, tmp_path / "run", steps=40, lr=5e-5, warmup_steps=2000)
    assert loud(result) == []
    small = [f for f in result.findings() if f["kind"] == "vanishing"]
    assert small and all(f["severity"] == "info" and ".lora_B.default." in f["data"]["gate"]
                         and all(".lora_A.default" in layer for layer in f["data"]["layers"]) for f in small)
    assert check(tmp_path / "run", "--fail-on", "warning")[0] == 0


def test_dit_under_a_long_warmup_from_0_is_quiet_behind_its_zero_initialised_final_layer(tmp_path: Path) -> None:
    """PixArt-style: a per-iteration linear warmup from 0 over 1,000 iterations. DiT's final Linear starts at
    zero and scales every gradient upstream of it: by step 12 the median layer's RMS is ~3e-12, below the
    absolute floor (1e-10), while the final layer's own gradient is ordinary. Small by design, said (info);
    before, every embedder and block layer was a vanishing warning and ``check`` failed."""
    result = train(dit, tmp_path / "run", steps=40, warmup_steps=1000)
    assert loud(result) == []
    outer = [f for f in result.findings()
             if f["kind"] == "vanishing" and f["data"]["gate"] == "final_layer.linear.weight"]
    assert [(f["severity"], f["step"]) for f in outer] == [("info", 12)]
    assert {"t_embedder.mlp.0", "t_embedder.mlp.2", "y_embedder"} <= set(outer[0]["data"]["layers"])
    assert "below the floor of 1e-10" in outer[0]["message"]
    assert check(tmp_path / "run", "--fail-on", "warning")[0] == 0
