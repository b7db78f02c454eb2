"""gradwatch.integrations.transformers: a real HF Trainer on a tiny GPT-2 built from a config, on CPU."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw

pytestmark = pytest.mark.slow  # real Hugging Face Trainer runs

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from gradwatch.integrations.transformers import GradWatchCallback  # noqa: E402

ACT = "transformer.h.1.mlp.act"


class Tokens(torch.utils.data.Dataset):
    """Random token ids, their own labels (causal LM)."""

    def __init__(self, n: int = 64, length: int = 16) -> None:
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Boost(torch.autograd.Function):
    """Identity forward, gradients x1000 backward: an explosion in backward only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1000.0


class Plant(transformers.TrainerCallback):
    """At optimizer step ``at``, ``transformer.h.1.mlp.act`` goes NaN (or its gradients explode);
    also keeps the model's weights around that step and the post-clip gradient norm of every step."""

    def __init__(self, model: nn.Module, at: int | None = None, what: str = "nan") -> None:
        self.at, self.what, self.active = at, what, False
        self.before: dict[str, torch.Tensor] | None = None
        self.after: dict[str, torch.Tensor] | None = None
        self.applied: list[float] = []
        self.starts: list[torch.Tensor] = []  # a weight when each step begins
        model.get_submodule(ACT).register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not self.active:
            return None
        return output * float("nan") if self.what == "nan" else _Boost.apply(output)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module, **kwargs: Any) -> None:
        self.active = state.global_step == self.at
        self.starts.append(model.transformer.h[0].attn.c_attn.weight.detach().clone())
        if self.active:
            self.before = copy.deepcopy(model.state_dict())

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module, **kwargs: Any) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.applied.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module, **kwargs: Any) -> None:
        if self.active:
            self.after = copy.deepcopy(model.state_dict())
        self.active = False


def tiny_gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def train(tmp_path: Path, callback: GradWatchCallback, *, at: int | None = None, what: str = "nan",
          max_steps: int = 8, **args: Any) -> tuple[Any, Plant]:
    model = tiny_gpt2()
    plant = Plant(model, at, what)
    defaults: dict[str, Any] = dict(output_dir=str(tmp_path / "out"), max_steps=max_steps,
                                    per_device_train_batch_size=4, logging_steps=1, report_to=[], save_strategy="no",
                                    use_cpu=True, max_grad_norm=1.0, disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**{**defaults, **args}),
                                   train_dataset=Tokens(), callbacks=[plant, callback])
    trainer.train()
    return trainer, plant


def logged(trainer: Any, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def same(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    assert a is not None and b is not None
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_healthy_run_records_applied_and_preclip_norms(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    trainer, plant = train(tmp_path, callback)
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == trainer.state.global_step == 8
    assert run.findings().empty, "no warning or error on healthy training"
    assert run.series("grad_norm_preclip")[1] == pytest.approx(logged(trainer, "grad_norm"), rel=1e-6), \
        "the norm before clipping is the one the Trainer logs"
    assert run.series("grad_norm")[1] == pytest.approx(plant.applied, rel=1e-5), "the applied (clipped) norm"
    assert max(plant.applied) <= 1.0 + 1e-5 < min(logged(trainer, "grad_norm")), "every step was clipped"
    assert run.series("loss")[1] == pytest.approx(logged(trainer, "loss"), rel=1e-5)
    assert run.series("lr")[1] == pytest.approx(logged(trainer, "learning_rate"), rel=1e-6)
    assert "transformer.h.0.attn.c_attn" in run.layers
    assert not any(m._forward_hooks for m in trainer.model.modules() if m is not trainer.model.get_submodule(ACT)), \
        "every hook is removed when training ends"


def test_gradient_accumulation_loss_and_norms_match_the_trainer(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    trainer, _ = train(tmp_path, callback, max_steps=4, gradient_accumulation_steps=2)
    run = gw.open_run(tmp_path / "run")
    assert run.steps == trainer.state.global_step == 4 and run.findings().empty
    assert run.series("loss")[1] == pytest.approx(logged(trainer, "loss"), rel=1e-5)
    assert run.series("grad_norm_preclip")[1] == pytest.approx(logged(trainer, "grad_norm"), rel=1e-6)


def test_without_clipping_the_global_norm_is_the_trainers(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    trainer, _ = train(tmp_path, callback, max_steps=4, max_grad_norm=0.0)
    run = gw.open_run(tmp_path / "run")
    assert "grad_norm_preclip" not in run.scalars().columns
    assert run.series("grad_norm")[1] == pytest.approx(logged(trainer, "grad_norm"), rel=1e-5)


def test_a_nan_is_found_at_its_step_and_layer_and_skipped(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False)  # default rules: nonfinite -> skip
    trainer, plant = train(tmp_path, callback, at=5)
    assert same(plant.before, plant.after), "the NaN step changed nothing"
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == trainer.state.global_step == 8
    found = run.findings()
    assert list(found.kind) == ["nonfinite"] and list(found.step) == [5] and list(found.action) == ["skip"]
    assert list(found.layer) == [ACT] and list(found.phase) == ["forward"]
    assert run.skipped_steps().tolist() == [5]


def test_a_halt_stops_training_without_an_exception(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", rules=[gw.Rule(when="nonfinite", do="halt")], console=False)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        trainer, plant = train(tmp_path, callback, at=3)  # returns normally
    assert trainer.control.should_training_stop and trainer.state.global_step == 4
    assert same(plant.before, plant.after), "the halted step applied nothing"
    assert "gradwatch halted training at step 3" in caplog.text
    run = gw.open_run(tmp_path / "run")
    assert run.status == "halted" and run.steps == 4
    assert run.verdict is not None and run.verdict["halted"]["step"] == 3
    assert list(run.findings().action) == ["halt"]


def test_a_rollback_restores_model_optimizer_and_scheduler(tmp_path: Path) -> None:
    rules = [gw.Rule(when="nonfinite", do="rollback", skip_batches=1)]
    callback = GradWatchCallback(run=tmp_path / "run", rules=rules, snapshot_every=2, console=False)
    trainer, plant = train(tmp_path, callback, at=5)
    assert torch.equal(plant.starts[6], plant.starts[4]), "back to the snapshot taken before step 4's update"
    assert torch.equal(plant.starts[7], plant.starts[6]), "the next step is left out"
    run = gw.open_run(tmp_path / "run")
    assert run.status == "finished" and run.steps == trainer.state.global_step == 8
    found = run.findings()
    assert list(found.kind) == ["nonfinite"] and list(found.action) == ["rollback"] and list(found.step) == [5]
    assert run.skipped_steps().tolist() == [5, 6]
    steps, lrs = run.series("lr")
    assert steps.tolist() == list(range(8))
    assert lrs[6] == pytest.approx(lrs[5]), "the LR scheduler went back to step 4 and stepped once"


def test_an_explosion_the_trainer_clips_is_still_found(tmp_path: Path) -> None:
    callback = GradWatchCallback(run=tmp_path / "run", console=False, detectors={"exploding": {"warmup": 5}})
    trainer, plant = train(tmp_path, callback, at=9, what="boost", max_steps=10)
    run = gw.open_run(tmp_path / "run")
    assert plant.applied[9] <= 1.0 + 1e-5, "the Trainer clipped it"
    found = run.findings()
    assert list(found.kind) == ["exploding"] and list(found.step) == [9]
    assert "before clipping" in found.message.iloc[0]
    assert run.series("grad_norm_preclip")[1][9] > 100 * run.series("grad_norm_preclip")[1][:9].max()


def test_bad_settings_fail_when_the_callback_is_built(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match="log_every"):
        GradWatchCallback(run=tmp_path / "run", log_every=-1)
    with pytest.raises(gw.ConfigError, match="no_such_option"):
        GradWatchCallback(no_such_option=1)
    assert not (tmp_path / "run").exists()


def test_a_learning_rate_too_high_from_step_0_advises_no_restart_from_before_it(tmp_path: Path) -> None:
    """Issue 35, item 10: no warmup (the Trainer's default), the learning rate too high from the first step:
    the wrecked-run error said "restart from before step 0", a step no run has."""
    callback = GradWatchCallback(run=tmp_path / "run", console=False)
    train(tmp_path, callback, max_steps=40, learning_rate=1.0)
    with gw.open_run(tmp_path / "run") as run:
        found = run.findings()
    lost = found[(found.kind == "learning_rate") & (found.severity == "error")]
    assert len(lost) == 1 and lost.iloc[0].data["named_at"] == 0, found[["step", "kind", "message"]]
    message = lost.iloc[0].message
    assert "named at step 0" in message and "before step 0" not in message, message
    assert message.endswith("The weights are wrecked: lower the learning rate and train again from the initial "
                            "weights."), message
