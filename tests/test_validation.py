"""Validation gaps: every bad value is one ConfigError naming the field and its valid range (issue 16, item 11)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradwatch as gw
from gradwatch import config, detectors, options


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# ------------------------------------------------------------------ detector settings
@pytest.mark.parametrize(
    ("kind", "setting", "value", "expected"),
    [
        ("loss_spike", "warmup", 0, "'warmup' must be "),
        ("dead_units", "threshold", 7, "'threshold' must be from 0 to 1 (0 excluded), got 7"),
        ("dead_units", "threshold", 0, "'threshold' must be from 0 to 1 (0 excluded), got 0"),
        ("saturation", "threshold", 1.5, "'threshold' must be from 0 to 1 (0 excluded), got 1.5"),
        ("exploding", "window", 0, "'window' must be from 1 to 10000, got 0"),
        ("exploding", "window", 2**63 - 1, "'window' must be from 1 to 10000, got 9223372036854775807"),
        ("exploding", "warmup", 60, "'warmup' must be from 1 to 'window' (50), got 60"),
        ("exploding", "ratio", 0.5, "'ratio' must be at least 1, got 0.5"),
        ("vanishing", "relative", 2, "'relative' must be from 0 to 1, got 2"),
        ("vanishing", "patience", 0, "'patience' must be at least 1, got 0"),
        ("update_ratio", "low", 5, "'low' must be from 0 to 'high' (1.0) ('high' excluded), got 5"),
        ("update_ratio", "high", 0, "'high' must be greater than 0, got 0"),
        ("amp_overflow", "error_after", 3, "'error_after' must be at least 'warn_after' (20), got 3"),
        ("unused_parameter", "patience", 0, "'patience' must be at least 1, got 0"),
    ],
)
def test_out_of_range_detector_settings_are_one_config_error(kind: str, setting: str, value: object,
                                                             expected: str, tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError) as err:
        detectors.build({kind: {setting: value}})
    message = str(err.value)
    assert message.startswith(f"detectors.{kind}: setting ") and expected in message, message
    assert ", got " in message
    assert "plugin" not in message and "\n" not in message
    with pytest.raises(gw.ConfigError, match=f"detectors.{kind}: setting '{setting}'"):
        gw.watch(mlp(), run=tmp_path / "r", detectors={kind: {setting: value}}, console=False)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("beta", [5, 1.0, -0.5])
def test_a_loss_spike_beta_outside_0_to_1_is_refused(beta: float) -> None:
    with pytest.raises(gw.ConfigError, match="detectors.loss_spike: .*'beta'"):  # out of range, or no such setting
        detectors.build({"loss_spike": {"beta": beta}})


def test_a_window_too_large_for_memory_is_not_called_a_plugin_failure(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError) as err:
        gw.watch(mlp(), run=tmp_path / "r", detectors={"exploding": {"window": 2**63 - 1}})
    assert "plugin" not in str(err.value) and "'window' must be from 1 to 10000" in str(err.value)
    assert not (tmp_path / "r").exists()


def test_a_related_setting_moves_the_range(tmp_path: Path) -> None:
    built = {type(d).__name__: d for d in detectors.build({"exploding": {"window": 200, "warmup": 150},
                                                           "update_ratio": {"high": 10.0, "low": 5.0}})}
    assert built["Exploding"].warmup == 150 and built["UpdateRatio"].low == 5.0
    with pytest.raises(gw.ConfigError) as err:  # the default warmup (20) no longer fits: the message names window
        detectors.build({"exploding": {"window": 10}})
    assert str(err.value) == ("detectors.exploding: setting 'window' = 10 leaves 'warmup' = 20 out of range: "
                              "'warmup' must be from 1 to 'window' (10); set both")
    with pytest.raises(gw.ConfigError, match="setting 'high' = 1e-09 leaves 'low' = 1e-08 out of range"):
        detectors.build({"update_ratio": {"high": 1e-9}})


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.sampled_from(sorted(detectors.REGISTRY)), st.data())
def test_any_setting_value_builds_or_is_one_config_error(kind: str, data: st.DataObject) -> None:
    names = [n for n in detectors.settings(kind) if n != "enabled"]
    if not names:
        return
    name = data.draw(st.sampled_from(names))
    value = data.draw(st.one_of(st.integers(-5, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                                st.booleans(), st.text(max_size=3)))
    try:
        built = detectors.build({kind: {name: value}})
    except gw.ConfigError as exc:
        assert f"'{name}'" in str(exc) and "plugin" not in str(exc)
    else:
        assert any(getattr(d, name, None) == value for d in built)


# ------------------------------------------------------------------ options
def test_empty_snapshot_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match="option snapshot_dir must be a non-empty directory path, got ''"):
        gw.watch(mlp(), run=tmp_path / "r", snapshot_dir="", rules=[gw.Rule(when="nonfinite", do="rollback")])
    assert not (tmp_path / "r").exists()


def test_a_huge_flight_recorder_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match=r"option flight_recorder must be an integer from 0 to 100000"):
        gw.watch(mlp(), run=tmp_path / "r", flight_recorder=2**63)


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        ("", "run must be a non-empty directory path"),
        ("x" * 5000, "run: the name 'xxxxxxxxxxxxxxxx..."),
        ("a/" + "y" * 300 + "/b", "is longer than 255 bytes"),
        ("bad\x00name", "run must not contain a NUL character"),
        (42, "run must be a directory path (str or os.PathLike)"),
    ],
    ids=["empty", "too-long", "long-component", "nul", "not-a-path"],
)
def test_run_paths_are_checked(run: object, expected: str) -> None:
    with pytest.raises(gw.ConfigError) as err:
        options.run_path(run)
    assert expected in str(err.value), str(err.value)
    assert len(str(err.value)) < 400


def test_good_run_paths_pass(tmp_path: Path) -> None:
    assert options.run_path(tmp_path / "r") == tmp_path / "r"
    assert options.run_path("runs/exp1") == Path("runs/exp1")
    assert options.run_path(".") == Path(".")


@pytest.mark.parametrize("run", ["", "x" * 5000])
def test_watch_refuses_a_bad_run_path(run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(gw.ConfigError, match="run"):
        gw.watch(mlp(), run=run)
    assert list(tmp_path.iterdir()) == [], "nothing written into the working directory"


def test_a_rule_band_whose_above_exceeds_its_below_is_refused() -> None:
    with pytest.raises(gw.ConfigError, match="'above' .* must be less than 'below'"):
        gw.Rule(when="exploding", do="clip", above=10.0, below=1.0)


# ------------------------------------------------------------------ config files
def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "gradwatch.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'log_every = 5\n\n[[rules]]\nwhen = "exploding"\ndo = "clip"\nmax_norm = 1.0\n')
    loaded = config.load(path)
    assert loaded.options == {"log_every": 5} and loaded.rules is not None and loaded.rules[0].do == "clip"
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_bytes(b"\xef\xbb\xbf[tool.gradwatch]\nlog_every = 3\n")
    assert config.find_pyproject(project) == project / "pyproject.toml"
    assert config.load(project / "pyproject.toml").options == {"log_every": 3}


def test_a_byte_order_mark_in_the_middle_is_still_invalid(tmp_path: Path) -> None:
    path = tmp_path / "gradwatch.toml"
    path.write_bytes(b"log_every = 5\n\xef\xbb\xbfcooldown = 3\n")
    with pytest.raises(gw.ConfigError, match="invalid TOML"):
        config.load(path)


def test_a_config_file_that_cannot_be_decoded_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gradwatch.toml"
    path.write_bytes(b"\xef\xbb\xbflog_every = \xff\n")
    with pytest.raises(gw.ConfigError, match="not UTF-8"):
        config.load(path)
    assert os.path.exists(path)
