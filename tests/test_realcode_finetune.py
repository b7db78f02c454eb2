"""Fine-tuning failures named through the user-facing outputs (issue 26, item 5).

A BERT-style classifier fine-tuned the way the Hugging Face and peft examples do it
(``tests/realcode/bert_finetune.py``), and the PyTorch MNIST-style CNN with BatchNorm, AdamW,
OneCycleLR and ``clip_grad_norm_`` (``tests/realcode/cnn.py``): healthy runs are quiet; a
learning rate that rewrites the weights while the loss stops falling, LoRA adapters left out of
the optimizer, and a learning rate that wrecked the run are named, and fail ``gradwatch check``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .realcode import PAST_THE_HALT, Result, bert_finetune, cnn, figures, lstm_lm, train

# real models and training loops, a few seconds each (one thread: small models on a shared machine)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]




def loud(result: Result) -> list[dict[str, Any]]:
    return [f for f in result.findings() if f["severity"] != "info"]


def summary(found: list[dict[str, Any]]) -> list[tuple[str, int, str | None, str]]:
    return [(f["kind"], f["step"], f["layer"], f["severity"]) for f in found]


def check(run: Path) -> tuple[int, str]:
    """``gradwatch check RUN``: its exit code and output."""
    done = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(run)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}, timeout=120)
    return done.returncode, done.stdout + done.stderr


# ------------------------------------------------------------------------------------ healthy
@pytest.mark.parametrize("config", [
    {},  # full fine-tuning at the examples' 5e-5
    {"learning_rate": 1e-3},  # a high but working learning rate: updates of ~1e-2, the loss falls
    {"lora": True, "learning_rate": 1e-3},  # LoRA: lora_B grows from zero, its updates are large
], ids=["full-5e-5", "full-1e-3", "lora-1e-3"])
def test_healthy_fine_tuning_is_quiet(config: dict[str, Any], tmp_path: Path) -> None:
    result = train(bert_finetune, tmp_path / "run", **config)
    assert loud(result) == []
    assert result.extra["accuracy"] >= 0.75, "the fine-tuned classifier learned the task"
    assert check(tmp_path / "run")[0] == 0


def test_the_word_language_model_at_lr_20_with_clipping_is_quiet(tmp_path: Path) -> None:
    """Large SGD updates (lr 20, clip 0.25: what trains best there) with a loss that falls: not a too-high rate."""
    result = train(lstm_lm, tmp_path / "run")
    assert result.losses[-1] < result.losses[0]
    assert loud(result) == []


def test_healthy_cnn_with_onecycle_and_clipping_is_quiet(tmp_path: Path) -> None:
    result = train(cnn, tmp_path / "run")
    assert result.extra["accuracy"] > 0.9
    assert loud(result) == [] and check(tmp_path / "run")[0] == 0


# ------------------------------------------------------------- a learning rate that rewrites the weights
def test_full_fine_tuning_at_lr_1e_2_is_a_learning_rate_too_high_then_an_error(tmp_path: Path) -> None:
    """lr 1e-2 instead of 5e-5: half the weights move by 5e-2 a step (the healthy run: ~5e-4), the loss
    first falls, then the classifier collapses to one class and the loss sits near ln 2. Before:
    nothing but a saturated tanh at step 30, and ``check`` passed."""
    result = train(bert_finetune, tmp_path / "run", learning_rate=1e-2, watch=PAST_THE_HALT)
    assert result.extra["accuracy"] <= 0.6, "collapsed: one class"
    found = [f for f in loud(result) if f["kind"] == "learning_rate"]
    layer = "bert.encoder.layer.1.intermediate.dense"
    assert summary(found) == [("learning_rate", 20, layer, "warning"), ("learning_rate", 40, layer, "error")]
    moved = figures(found[0]["message"],
                    f"learning rate too high for {layer} (Linear): the updates rewrite the weights (half of them move "
                    f"by {{n}}x or more per step at step 10, {layer} by {{n}}x; healthy runs: ~1e-3) and the loss has "
                    "stopped falling: ")
    assert moved and 0.01 < moved[0] <= moved[1] < 1, found[0]["message"]  # ~50x a healthy run's 1e-3
    assert found[0]["data"]["evidence"] == "update_ratio_no_progress" and found[0]["data"]["median"] >= 0.05
    stuck = figures(found[1]["message"], f"learning rate too high for {layer}, named at step 20: the run has not "
                    "learned since: the loss is {n} at step 40")
    assert stuck and 0.5 < stuck[0] < 1.0, found[1]["message"]  # one class: near ln 2
    assert all(f["severity"] != "error" for f in loud(result) if f["kind"] != "learning_rate")
    code, out = check(tmp_path / "run")
    assert code == 1 and "FAIL: 1 finding at or above error" in out


# --------------------------------------------------------------- LoRA adapters in no optimizer
def test_lora_adapters_left_out_of_the_optimizer_are_named_at_step_0(tmp_path: Path) -> None:
    """The optimizer was built before peft.get_peft_model: it holds only the frozen base weights.
    Before: nothing about it, and 4 dead_units warnings blaming a functional ReLU that does not
    exist (lora_A's outputs reach a lora_B still at zero)."""
    result = train(bert_finetune, tmp_path / "run", lora=True, learning_rate=1e-3, optimizer_before_peft=True,
                   steps=30)
    found = loud(result)
    base = "base_model.model.bert.encoder.layer"
    assert summary(found) == [("unoptimized_parameter", 0, f"{base}.0.attention.self.query.lora_B.default", "error")]
    data = found[0]["data"]
    assert data["reason"] == "not_in_optimizer"
    assert data["parameters"] == [f"{base}.{i}.attention.self.{m}.lora_B.default.weight"
                                  for i in (0, 1) for m in ("query", "value")] + [
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias"]
    assert "get gradients but no optimizer updates them" in found[0]["message"]
    assert "the optimizers hold only parameters that require no gradient" in found[0]["message"]
    assert "peft.get_peft_model" in data["hint"]
    code, out = check(tmp_path / "run")
    assert code == 1 and "unoptimized_parameter" in out and "ReLU" not in out


# ---------------------------------------------------------------- a run the learning rate wrecked
def test_a_cnn_wrecked_by_lr_10_fails_the_default_gate(tmp_path: Path) -> None:
    """AdamW + OneCycleLR + clip_grad_norm_ at lr 10: named at step 0, then the loss climbs to the
    hundreds and the accuracy is chance. Before: every finding a warning, ``check`` exited 0."""
    result = train(cnn, tmp_path / "run", lr=10.0, watch=PAST_THE_HALT)
    assert max(result.losses) > 100 and result.extra["accuracy"] < 0.2
    found = [f for f in loud(result) if f["kind"] == "learning_rate"]
    assert summary(found) == [("learning_rate", 0, "fc1", "warning"), ("learning_rate", 10, "fc1", "error")]
    assert found[0]["message"].startswith("learning rate too high for fc1 (Linear): update is 11x the weights at "
                                          "step 0")
    wrecked = figures(found[1]["message"], "learning rate too high for fc1, named at step 0: the run has diverged "
                      "since: the loss is {n} at step 10 (median of the last 5), {n}x where it started")
    assert wrecked and wrecked[0] > 10 and wrecked[1] > 5, found[1]["message"]
    assert found[1]["data"]["evidence"] == "diverged"
    code, out = check(tmp_path / "run")
    assert code == 1 and "FAIL: 1 finding at or above error" in out
