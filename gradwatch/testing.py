"""Contract tests: what every detector, action and sink must do, built in or plugin (needs pytest).

A test module checks one by subclassing the contract and naming the class under test; the
contract's tests then run for it under pytest::

    from gradwatch.testing import DetectorContract
    from mypkg import GradNoise

    class TestGradNoise(DetectorContract):
        detector = GradNoise

The ``gradwatch_healthy_records`` fixture (from gradwatch's pytest plugin) is the step records
of a healthy training run (:func:`healthy_records`), read back from its store.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw
from gradwatch import detectors, encoding
from gradwatch.actions import Action
from gradwatch.detectors import Detector
from gradwatch.judging.judge import well_formed
from gradwatch.rules import action_params
from gradwatch.store.findings import SEVERITIES
from gradwatch.store.records import StepRecord
from gradwatch.store.thread import Writer


def spirals(step: int, batch: int = 128, arms: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of points on ``arms`` noisy spiral arms, and their arm."""
    g = torch.Generator().manual_seed(8_000_024 + step)
    y = torch.randint(0, arms, (batch,), generator=g)
    r = torch.rand(batch, generator=g)
    theta = y * (2 * math.pi / arms) + 4.0 * r + 0.4 * torch.randn(batch, generator=g)
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], 1), y


def healthy_records(path: Path, steps: int = 300) -> list[StepRecord]:
    """Train a healthy model watched into ``path`` (a 5 x 64 Tanh MLP, Adam, spirals; no rules)
    and return its step records read back from the store.
    """
    torch.manual_seed(108)
    sizes = [2, 64, 64, 64, 64, 64, 3]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b), nn.Tanh()] if i < len(sizes) - 2 else [nn.Linear(a, b)]
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gw.watch(model, run=path, rules=None, console=False, tensorboard=False)
    observe: Callable[..., None] = gw.watcher(model).observe
    try:
        for step in range(steps):
            x, y = spirals(step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            observe(loss=loss)
            opt.step()
    finally:
        gw.unwatch(model)
    with gw.open_run(path) as run:
        return list(run.records())


def broken(record: StepRecord) -> list[StepRecord]:
    """Variants of a record that detectors must survive: non-finite everything, skipped, empty."""
    def filled(value: float) -> StepRecord:
        return dataclasses.replace(record, scalars={k: value for k in record.scalars},
                                   vectors={k: np.full_like(v, value) for k, v in record.vectors.items()})

    return [
        filled(math.nan),
        filled(math.inf),
        dataclasses.replace(record, skipped=True, vectors={}),
        dataclasses.replace(record, scalars={}, vectors={}),
    ]


class DetectorContract:
    """A detector: named, configurable by data, quiet on healthy training, robust to broken steps."""

    detector: ClassVar[type[Detector]]

    def test_its_kind_finds_it_and_its_settings_are_plain_documented_data(self) -> None:
        """Its kind looks it up; its settings have plain defaults, are documented and can turn it off."""
        cls = self.detector
        assert cls.kind and cls.kind.isidentifier()
        assert detectors.lookup(cls.kind) is cls
        assert dataclasses.is_dataclass(cls)
        settings = detectors.settings(cls.kind)
        assert settings["enabled"] is True
        for name, default in settings.items():
            assert isinstance(default, (bool, int, float, str)), f"{cls.kind}.{name} default {default!r} is not data"
            if name != "enabled":
                assert f"{name}:" in (cls.__doc__ or ""), f"setting {name!r} of {cls.kind} is not documented"
        built = detectors.build({cls.kind: {"enabled": False}})
        assert [d.enabled for d in built if d.kind == cls.kind] == [False]

    def test_healthy_training_gives_no_warning_or_error(self, gradwatch_healthy_records: list[StepRecord]) -> None:
        """A healthy run's steps give no finding above ``info``."""
        detector = self.detector()
        found = [f for record in gradwatch_healthy_records for f in detector.check(record)]
        assert [(f.step, f.severity, f.layer, f.message) for f in found if f.severity != "info"] == []

    def test_broken_steps_give_well_formed_findings_and_no_exception(
        self, gradwatch_healthy_records: list[StepRecord]
    ) -> None:
        """NaN, Inf, skipped and empty steps raise nothing and give findings of its kind for the step."""
        detector = self.detector()
        for record in gradwatch_healthy_records[:25]:
            detector.check(record)
        for record in [*broken(gradwatch_healthy_records[25]), *gradwatch_healthy_records[26:40]]:
            found = detector.check(record)
            well_formed(detector, record, found)
            assert all(f.severity in SEVERITIES for f in found)


def _regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(256, 8)
    return model, x, x @ torch.randn(8, 1)


class ActionContract:
    """An action: named, its parameters validated by rules, and applied inside a real step.

    The run plants a NaN gradient at step ``NAN_STEP``; a rule sends it to the action.
    """

    action: ClassVar[type[Action]]
    #: the rule's parameters for the action
    params: ClassVar[dict[str, Any]] = {}
    #: the action keeps the NaN out of the weights
    protects: ClassVar[bool] = False
    #: the action ends training with gw.TrainingHalted
    halts: ClassVar[bool] = False
    #: whether it changes a step whose gradients are NaN (clip cannot scale a NaN norm: such a step is
    #: recorded as ``warn``, with the clip's outcome)
    acts_on_nan: ClassVar[bool] = True
    NAN_STEP = 6

    def rule_params(self, tmp_path: Path) -> dict[str, Any]:
        """The rule parameters used by the tests (override to build them from ``tmp_path``)."""
        return dict(self.params)

    def test_its_name_and_parameters_make_a_valid_rule(self, tmp_path: Path) -> None:
        """A rule can name it with its parameters; an unknown parameter is refused."""
        name = self.action.name
        assert name and name.isidentifier()
        spec = action_params(name)
        assert set(self.rule_params(tmp_path)) <= set(spec)
        rule = gw.Rule(when="*", do=name, **self.rule_params(tmp_path))
        assert rule.do == name
        with pytest.raises(gw.ConfigError, match="unknown field"):
            gw.Rule(when="*", do=name, no_such_parameter=1)

    def test_applied_before_the_update_of_the_step_that_called_for_it(self, tmp_path: Path) -> None:
        """In a real run, the NaN step's finding is labelled with it; it protects or halts as declared."""
        model, x, y = _regression()
        rule = gw.Rule(when="nonfinite", do=self.action.name, **self.rule_params(tmp_path))
        run = tmp_path / "run"
        gw.watch(model, run=run, rules=[rule], console=False, snapshot_every=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        halted = None
        try:
            for step in range(12):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                grad = next(model.parameters()).grad
                if step == self.NAN_STEP and grad is not None:
                    grad[0, 0] = math.nan
                opt.step()
        except gw.TrainingHalted as exc:
            halted = exc
        gw.unwatch(model)
        assert (halted is not None) == self.halts
        if halted is not None:
            assert halted.step == self.NAN_STEP
        with gw.open_run(run) as stored:
            found = stored.findings()
        nan = found[found["kind"] == "nonfinite"]
        assert len(nan) and nan["step"].iloc[0] == self.NAN_STEP  # later ones too if the NaN got into the weights
        if self.acts_on_nan:
            assert nan["action"].iloc[0] == self.action.name
        else:  # it did nothing: not recorded as done, and its outcome says why
            assert nan["action"].iloc[0] == "warn" and nan["data"].iloc[0]["outcome"]
        encoding.dumps(list(nan["data"]))  # every output can write its data (strict JSON, NaN/Inf included)
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if self.protects:
            assert finite


class SinkContract:
    """A sink: fed from the writer thread, it keeps every step it was given, then closes."""

    def make(self, run_dir: Path) -> Any:
        """A new sink writing into ``run_dir``."""
        raise NotImplementedError

    def steps(self, run_dir: Path) -> list[int]:
        """The steps the closed sink kept, read back from what it wrote."""
        raise NotImplementedError

    def test_keeps_every_step_written_from_the_writer_thread(
        self, gradwatch_healthy_records: list[StepRecord], tmp_path: Path
    ) -> None:
        """Records fed through a real writer thread are all kept; a flight-recorder copy adds no step."""
        run_dir = tmp_path / "run"
        records = [dataclasses.replace(r, logged=True) for r in gradwatch_healthy_records[:60]]
        writer = Writer([self.make(run_dir)], queue_size=16, flush_seconds=0.05, name="contract")
        for record in records:
            writer.submit(record)
        writer.flush()
        writer.submit(dataclasses.replace(records[10], flight=True))  # a flight-recorder copy: no new step
        writer.close("finished")
        assert sorted(set(self.steps(run_dir))) == [r.step for r in records]
        assert not writer._failed
