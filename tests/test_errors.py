"""Bad input: each mistake gets one clear exception, raised before any training state is touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.watching import registry

from .conftest import train


def test_watch_something_that_is_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.Module .* got int"):
        gw.watch(42)
    with pytest.raises(TypeError, match="got function"):
        gw.watch(lambda x: x)


@pytest.mark.parametrize(
    "model",
    [nn.ReLU(), nn.Sequential(nn.Tanh(), nn.Dropout())],
    ids=["no-parameters", "parameterless-tree"],
)
def test_model_without_parameters(model: nn.Module, run_dir: Path) -> None:
    with pytest.raises(gw.ConfigError, match="has no parameters"):
        gw.watch(model, run=run_dir)
    assert not run_dir.exists(), "nothing is written for a refused model"


def test_model_with_only_frozen_parameters(run_dir: Path) -> None:
    model = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(gw.ConfigError, match="all are frozen"):
        gw.watch(model, run=run_dir)


def test_run_path_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    model = nn.Linear(2, 2)
    with pytest.raises(gw.RunError, match="cannot create run directory .*file.txt/run"):
        gw.watch(model, run=blocker / "run")
    assert not model._forward_pre_hooks and not registry._live


def test_run_directory_already_holding_a_run(run_dir: Path) -> None:
    first = gw.watch(nn.Linear(2, 2), run=run_dir)
    train(first, lambda: (torch.randn(4, 2), None), lambda out, y: out.sum(), steps=2)
    gw.unwatch(first)
    with pytest.raises(gw.RunError, match="already holds a run.*overwrite=True"):
        gw.watch(nn.Linear(2, 2), run=run_dir)
    assert gw.open_run(run_dir).steps == 2, "the old run is untouched"
    second = gw.watch(nn.Linear(2, 2), run=run_dir, overwrite=True)
    gw.unwatch(second)
    assert gw.open_run(run_dir).steps == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"log_every": 0}, "log_every must be a positive integer"),
        ({"log_every": "10"}, "log_every must be a positive integer"),
        ({"sample_every": 15, "log_every": 10}, "must be a multiple of log_every"),
        ({"tensorboard": "yes"}, "tensorboard must be True or False"),
        ({"log_evry": 3}, "unknown option 'log_evry'.*valid options are: .*log_every"),
        ({"rules": "nonsense"}, "rules="),
    ],
)
def test_invalid_options(options: dict, match: str, run_dir: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(gw.ConfigError, match=match):
        gw.watch(model, run=run_dir, **options)
    assert not run_dir.exists() and not model._forward_pre_hooks


def test_watcher_of_a_model_that_is_not_watched() -> None:
    with pytest.raises(gw.ConfigError, match=r"not watched; call gw\.watch"):
        gw.watcher(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("value", "error"),
    [(torch.ones(3), ValueError), ("0.5", TypeError), (None, TypeError)],
)
def test_observe_rejects_non_scalars(value: object, error: type[Exception], run_dir: Path) -> None:
    model = gw.watch(nn.Linear(2, 2), run=run_dir)
    with pytest.raises(error, match="observe"):
        gw.watcher(model).observe(loss=value)
