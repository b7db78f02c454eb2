"""Every built-in detector, action and sink against the shared contracts (gradwatch.testing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import gradwatch as gw
from gradwatch.actions import clip, halt, rollback, scale_lr, skip, warn
from gradwatch.detectors import (
    adam_epsilon,
    amp_overflow,
    attention_logits,
    dead_units,
    exploding,
    loss_spike,
    nonfinite,
    output_growth,
    saturation,
    stale_gradient,
    unused_parameter,
    update_ratio,
    vanishing,
)
from gradwatch.sinks.store import Store
from gradwatch.sinks.tensorboard import TensorBoard
from gradwatch.store.writer import create_store, default_meta
from gradwatch.testing import ActionContract, DetectorContract, SinkContract


class TestNonFinite(DetectorContract):
    detector = nonfinite.NonFinite


class TestVanishing(DetectorContract):
    detector = vanishing.Vanishing


class TestExploding(DetectorContract):
    detector = exploding.Exploding


class TestLossSpike(DetectorContract):
    detector = loss_spike.LossSpike


class TestDeadUnits(DetectorContract):
    detector = dead_units.DeadUnits


class TestSaturation(DetectorContract):
    detector = saturation.Saturation


class TestUpdateRatio(DetectorContract):
    detector = update_ratio.UpdateRatio


class TestUnusedParameter(DetectorContract):
    detector = unused_parameter.UnusedParameter


class TestStaleGradient(DetectorContract):
    detector = stale_gradient.StaleGradient


class TestOutputGrowth(DetectorContract):
    detector = output_growth.OutputGrowth


class TestAmpOverflow(DetectorContract):
    detector = amp_overflow.AmpOverflow


class TestAdamEpsilon(DetectorContract):
    detector = adam_epsilon.AdamEpsilon


class TestAttentionLogits(DetectorContract):
    detector = attention_logits.AttentionLogits


class TestWarn(ActionContract):
    action = warn.Warn


class TestClip(ActionContract):
    action = clip.Clip
    params = {"max_norm": 1.0}
    acts_on_nan = False


class TestSkip(ActionContract):
    action = skip.Skip
    protects = True


class TestRollback(ActionContract):
    action = rollback.Rollback
    params = {"skip_batches": 0, "max_rollbacks": 3}
    protects = True


class TestScaleLr(ActionContract):
    action = scale_lr.ScaleLr
    params = {"factor": 0.5}


class TestHalt(ActionContract):
    action = halt.Halt
    protects = True
    halts = True


class TestStoreSink(SinkContract):
    def make(self, run_dir: Path) -> Any:
        return Store(create_store(run_dir, default_meta(), overwrite=False))

    def steps(self, run_dir: Path) -> list[int]:
        with gw.open_run(run_dir) as run:
            return list(run.step_info()["step"])


class TestTensorBoardSink(SinkContract):
    def make(self, run_dir: Path) -> Any:
        run_dir.mkdir(parents=True)
        return TensorBoard(run_dir)

    def steps(self, run_dir: Path) -> list[int]:
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        return [e.step for e in events.Scalars("global/grad_norm")]
