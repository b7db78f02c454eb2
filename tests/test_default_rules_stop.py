"""The default rules stop a run gradwatch calls wrecked, and escalate a clip needed again and again (issue 35,
item 7); a healthy run, and one whose explosions are rare, are never stopped.

Before: a CNN at AdamW lr 10 got a ``learning_rate`` error ("the weights are wrecked ... restart") and trained
on to chance accuracy; an explosion that came back every step was clipped every step, to the end.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.judging.escalate import Clips
from gradwatch.rules import CLIP_WINDOW, DEFAULT_RULES, MAX_CLIPS
from gradwatch.store.findings import Finding

from .realcode import cnn, loud, train


def _raised_at(info: pytest.ExceptionInfo[BaseException]) -> str:
    """The line of the user's code the exception came out of (the last frame outside gradwatch and torch)."""
    frames = [f for f in traceback.extract_tb(info.tb) if "/gradwatch/" not in f.filename
              and "/torch/" not in f.filename]
    return (frames[-1].line or "").strip()


def test_the_default_rules_name_their_stops() -> None:
    rules = {r.when: r for r in DEFAULT_RULES}
    assert rules["learning_rate"].do == "halt" and rules["learning_rate"].severity == "error"
    assert rules["exploding"].do == "clip" and rules["exploding"].param("max_clips") == MAX_CLIPS
    assert rules["exploding"].param("within") == CLIP_WINDOW
    assert gw.Rule(when="exploding", do="clip").param("max_clips") == 0, "a rule of the user's never escalates"


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_cnn_wrecked_by_lr_10_is_halted_well_before_its_300_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(gw.TrainingHalted) as info:
        train(cnn, run, lr=10.0, steps=300)
    assert _raised_at(info) == "optimizer.step()"
    halted_at = info.value.step
    assert halted_at is not None and halted_at < 60, halted_at
    message = str(info.value)
    assert message.startswith(f"gradwatch halted training at step {halted_at}: learning rate too high")
    assert "The weights are wrecked" in message, message
    # too high from step 0: the step to restart from is the start, with the initial weights
    assert "restart from before step 0" in message or "train again from the initial weights" in message, message
    with gw.open_run(run) as opened:
        assert opened.status == "halted" and opened.steps <= halted_at + 2  # a finding judges its step later
        errors = opened.findings().query("severity == 'error'")
    assert list(errors["kind"]) == ["learning_rate"] and list(errors["action"]) == ["halt"]
    assert errors.iloc[0]["data"]["evidence"] in ("diverged", "no_progress")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_healthy_cnn_trains_all_its_steps_untouched(tmp_path: Path) -> None:
    watched = train(cnn, tmp_path / "run")
    plain = train(cnn, None)
    assert watched.losses == plain.losses and len(watched.losses) == 60
    assert loud(watched) == []
    with gw.open_run(tmp_path / "run") as opened:
        assert opened.status == "finished"


def _loop(run: Path, scale: dict[int, float] | float, from_step: int = 0, steps: int = 200) -> list[float]:
    """SGD on a small MLP; the batches of ``scale``'s steps (a dict), or of every step from ``from_step`` on
    (a number), are scaled up: their gradients explode."""
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)), run=run, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    try:
        for step in range(steps):
            factor = scale.get(step, 1.0) if isinstance(scale, dict) else (scale if step >= from_step else 1.0)
            x = torch.randn(32, 16) * factor
            loss = (model(x) - x[:, :1]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            gw.watcher(model).observe(loss=loss)
            opt.step()
            losses.append(loss.item())
    finally:
        gw.unwatch(model)
    return losses


def test_an_explosion_clipped_again_and_again_escalates_to_a_halt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(gw.TrainingHalted) as info:
        _loop(run, 100.0, from_step=30)
    assert _raised_at(info) == "opt.step()"
    step = info.value.step
    assert step is not None and 30 + MAX_CLIPS <= step < 30 + 2 * MAX_CLIPS, step
    message = str(info.value)
    assert f"the exploding finding had to be clipped on {MAX_CLIPS + 1} of the last {CLIP_WINDOW} steps" in message
    assert "clipping bounds each update, not the cause" in message and "restart from before step 3" in message
    with gw.open_run(run) as opened:
        assert opened.status == "halted"
        found = opened.findings()
    explosions = found[found["kind"] == "exploding"]
    assert len(explosions) >= 1 and explosions["step"].min() >= 30
    halted = found[found["action"] == "halt"]
    assert list(halted["kind"]) == ["exploding"] or halted.empty  # a folded repeat has no row of its own


def test_rare_explosions_are_clipped_and_the_run_goes_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    losses = _loop(run, dict.fromkeys((40, 80, 120, 160), 100.0))
    assert len(losses) == 200
    with gw.open_run(run) as opened:
        assert opened.status == "finished"
        found = opened.findings()
    clipped = found[(found["kind"] == "exploding") & (found["action"] == "clip")]
    assert set(clipped["step"]) <= {40, 80, 120, 160} and len(clipped) >= 1


class _Control:
    """What the escalation halts through: the plain loop's control raises ``TrainingHalted``."""

    def halt(self, finding: Finding | None, reason: str | None = None) -> None:
        raise gw.TrainingHalted(f"halted: {reason}", step=finding.step if finding else None, finding=finding)


def _explosion(step: int, **data: object) -> Finding:
    return Finding("exploding", "warning", step, None, f"global gradient norm 44.5 at step {step}.", data=dict(data))


def test_a_clip_escalation_counts_the_steps_within_its_window_and_restarts_before_a_raise_it_named() -> None:
    rule, clips = gw.Rule(when="exploding", do="clip", max_clips=2, within=10), Clips()
    acted: list[Finding] = []
    for step in (5, 20, 21):  # step 5 left the window before step 21
        clips.clipped(rule, _explosion(step, lr_raised_at=4 if step == 5 else None), _Control(), acted)
    clips.clipped(rule, _explosion(21), _Control(), acted)  # the same step counts once
    last = _explosion(22, lr_raised_at=19)
    last.id = 7
    with pytest.raises(gw.TrainingHalted) as info:
        clips.clipped(rule, last, _Control(), acted)
    assert "clipped on 3 of the last 10 steps (the first at step 20" in str(info.value)
    assert str(info.value).endswith("restart from before step 19.")
    assert last.action == "halt" and acted == [last]
    assert last.data["outcome"] == {"halted": True, "clipped_steps": 3, "within": 10, "restart_before": 19}
    clips.clipped(gw.Rule(when="exploding", do="clip"), _explosion(30), _Control(), acted)  # no max_clips: never


@pytest.mark.slow
def test_under_lightning_an_explosion_clipped_again_and_again_stops_the_trainer(tmp_path: Path) -> None:
    """The issue's Lightning run: the same ``exploding`` finding clipped 88 times, on to a loss of ~7e33."""
    pl = pytest.importorskip("lightning.pytorch")
    from gradwatch.integrations.lightning import GradWatchCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

        def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return (self.net(x) - x[:, :1]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    x = torch.randn(200 * 32, 16)
    x[30 * 32:] *= 100.0  # from step 30 on, every batch is out of scale: its gradients explode
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=32)
    fit = pl.Trainer(accelerator="cpu", devices=1, max_steps=200, enable_checkpointing=False, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[GradWatchCallback(run=tmp_path / "run", console=False)])
    fit.fit(Net(), data)  # returns normally: the trainer is stopped
    assert fit.should_stop and 30 + MAX_CLIPS < fit.global_step < 30 + 2 * MAX_CLIPS, fit.global_step
    with gw.open_run(tmp_path / "run") as run:
        assert run.status == "halted"
        halted = run.verdict["halted"]
    assert 30 + MAX_CLIPS <= halted["step"] < 30 + 2 * MAX_CLIPS
    assert f"had to be clipped on {MAX_CLIPS + 1} of the last {CLIP_WINDOW} steps" in halted["reason"]
