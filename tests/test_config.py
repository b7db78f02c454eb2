"""Rules and config files: validated as data, with errors naming file, rule and field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradwatch as gw
from gradwatch import config
from gradwatch.rules import ACTIONS, DEFAULT_RULES, Rule, parse
from gradwatch.store.findings import KINDS, SEVERITIES

VALID_PARAMS = {
    "clip": {"max_norm": st.floats(0.001, 1e6)},
    "skip": {"max_consecutive": st.integers(0, 100)},
    "rollback": {"skip_batches": st.integers(0, 10), "lr_scale": st.floats(0.01, 1.0),
                 "max_rollbacks": st.integers(0, 9)},
    "scale_lr": {"factor": st.floats(0.01, 10.0)},
}


@st.composite
def rule_tables(draw: st.DrawFn) -> dict:
    do = draw(st.sampled_from(list(ACTIONS)))
    table: dict = {"when": draw(st.sampled_from([*KINDS, "*"])), "do": do}
    if draw(st.booleans()):
        table["severity"] = draw(st.sampled_from(SEVERITIES))
    if draw(st.booleans()):
        table["layer"] = draw(st.sampled_from(["encoder.*", "0", "blocks.?.attn"]))
    if draw(st.booleans()):
        table["above"] = draw(st.floats(-1e6, 1e6))
    for name, strategy in VALID_PARAMS.get(do, {}).items():
        if name == "factor" or draw(st.booleans()):
            table[name] = draw(strategy)
    return table


@settings(derandomize=True, max_examples=200, deadline=None)
@given(rule_tables())
def test_valid_rules_parse_and_round_trip(table: dict) -> None:
    rule = parse([table], "gradwatch.toml")[0]
    assert rule.when == table["when"] and rule.do == table["do"]
    for key in ("severity", "layer", "above"):
        assert getattr(rule, key) == table.get(key)
    for key, value in table.items():
        if key in ACTIONS[rule.do]:
            assert rule.param(key) == value


BAD_VALUES = st.one_of(st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2), st.just(-3))


@settings(derandomize=True, max_examples=300, deadline=None)
@given(rule_tables(), st.sampled_from(["when", "do", "severity", "extra", "param"]), BAD_VALUES)
@pytest.mark.slow  # many corrupted files, each watched
def test_corrupted_rules_give_one_precise_config_error(table: dict, field: str, bad: object) -> None:
    table = dict(table)
    if field == "param":
        params = ACTIONS[table["do"]]
        if not params:
            return
        field = next(iter(params))
        if isinstance(bad, int) and not isinstance(bad, bool) and bad >= 0 and params[field][0] in (int, float):
            return
    elif field == "extra":
        field = "colour"
    elif field == "severity" and bad in SEVERITIES:
        return
    elif field in ("when", "do") and bad in (*KINDS, "*", *ACTIONS):
        return
    table[field] = bad
    with pytest.raises(gw.ConfigError) as info:
        parse([{"when": "nonfinite", "do": "warn"}, table], "gradwatch.toml")
    message = str(info.value)
    assert message.startswith("gradwatch.toml: rules[1]: ") and repr(field) in message
    if field == "when":
        assert "valid kinds are: nonfinite" in message
    if field == "do":
        assert "valid actions are: warn, clip" in message


TOML_VALUES = st.one_of(st.integers(-5, 5), st.booleans(), st.text(max_size=8), st.floats(allow_nan=False),
                        st.just("__import__('os').system('touch /tmp/gradwatch-pwned')"))


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').encode("unicode_escape").decode() + '"'
    return repr(value)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["log_every", "rules", "cooldown", "x", "console"]), TOML_VALUES, max_size=3),
       st.lists(st.dictionaries(st.sampled_from(["when", "do", "max_norm", "factor", "layer"]), TOML_VALUES,
                                max_size=3), max_size=2),
       st.text(max_size=20))
def test_any_toml_loads_or_raises_config_error(tmp_path_factory: pytest.TempPathFactory, top: dict, rules: list,
                                              garbage: str) -> None:
    path = tmp_path_factory.mktemp("cfg") / "gradwatch.toml"
    lines = [f"{k} = {_toml(v)}" for k, v in top.items()]
    for table in rules:
        lines += ["[[rules]]", *(f"{k} = {_toml(v)}" for k, v in table.items())]
    for text in ("\n".join(lines), "\n".join(lines) + "\n" + garbage):
        path.write_text(text)
        try:
            cfg = config.load(path)
            gw.watch(nn.Linear(2, 1), run=path.parent / "run", rules=str(path), overwrite=True,
                     console=False, tensorboard=False)
        except gw.ConfigError:
            pass
        else:
            assert cfg.rules is None or all(isinstance(r, Rule) for r in cfg.rules)
        finally:
            from gradwatch.watching import registry

            for w in list(registry._live):
                w.close()
    assert not Path("/tmp/gradwatch-pwned").exists()


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def test_rules_file_options_and_detectors(tmp_path: Path) -> None:
    path = tmp_path / "gradwatch.toml"
    path.write_text('log_every = 10\n[[rules]]\nwhen = "exploding"\ndo = "clip"\nmax_norm = 1.0\n'
                    "[detectors.vanishing]\npatience = 5\n")
    m = gw.watch(model(), run=tmp_path / "a", rules=str(path), console=False)
    w = gw.watcher(m)
    assert w.options.log_every == 10 and w.options.detectors == {"vanishing": {"patience": 5}}
    assert w.rules == [Rule(when="exploding", do="clip", max_norm=1.0)]
    gw.unwatch(m)
    m = gw.watch(model(), run=tmp_path / "b", rules=str(path), log_every=2, console=False)
    assert gw.watcher(m).options.log_every == 2, "keyword arguments override the file"
    gw.unwatch(m)


def test_pyproject_is_discovered_from_a_subfolder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[tool.gradwatch]\nlog_every = 5\n'
        '[[tool.gradwatch.rules]]\nwhen = "nonfinite"\ndo = "halt"\n')
    (tmp_path / "src" / "deep").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "src" / "deep")
    m = gw.watch(model(), run=tmp_path / "r", console=False)
    assert gw.watcher(m).rules == [Rule(when="nonfinite", do="halt")] and gw.watcher(m).options.log_every == 5
    gw.unwatch(m)
    (tmp_path / "src" / "pyproject.toml").write_text('[project]\nname = "inner"\n')  # nearest, no table
    m = gw.watch(model(), run=tmp_path / "r2", console=False)
    assert gw.watcher(m).rules == list(DEFAULT_RULES)
    gw.unwatch(m)


@pytest.mark.parametrize(("text", "expected"), [
    ("log_every = [", "invalid TOML"),
    ("log_every = 0", "log_every must be a positive integer"),
    ('[[rules]]\nwhen = "exploding"\ndo = "clipp"', "rules[0]: field 'do': unknown action 'clipp'; valid actions are"),
    ('[[rules]]\nwhen = "exploding"\ndo = "scale_lr"', "rules[0]: action 'scale_lr' needs field 'factor'"),
    ("[detectors.vanish]\npatience = 3", "unknown detector 'vanish'; valid detectors are: nonfinite"),
    ("[detectors.vanishing]\npatience = -1", "setting 'patience' must be a non-negative int"),
    ('rules = "lots"', "'rules' must be a list of rule tables"),
    # values that once escaped validation as other exceptions, or were silently accepted
    ('[[rules]]\nwhen = "exploding"\ndo = "warn"\nabove = ' + "9" * 400, "field 'above' must be a finite number"),
    ("[detectors.exploding]\nz = " + "9" * 400, "setting 'z' must be a non-negative float"),
    ("[detectors]\nvanishing = 0", "detectors.vanishing must be a table of settings"),
    ("[detectors]\nvanishing = false", "detectors.vanishing must be a table of settings"),
    ("[detectors]\nvanishing = []", "detectors.vanishing must be a table of settings"),
    ("flush_seconds = inf", "flush_seconds must be a finite positive number"),
    ("x = " + "[" * 5000 + "]" * 5000, "invalid TOML"),
], ids=lambda value: value[:40])
def test_config_errors_name_the_file_and_field(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "gradwatch.toml"
    path.write_text(text)
    with pytest.raises(gw.ConfigError) as info:
        gw.watch(model(), run=tmp_path / "run", rules=str(path), console=False)
    assert str(path) in str(info.value) and expected in str(info.value)
    assert not (tmp_path / "run").exists(), "nothing is written before the config is valid"


def test_a_binary_config_file_is_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "gradwatch.toml"
    path.write_bytes(b"log_every = 1\n# \xff\xfe\n")
    with pytest.raises(gw.ConfigError, match="invalid TOML: not UTF-8"):
        gw.watch(model(), run=tmp_path / "run", rules=str(path))


def test_options_with_awkward_names_or_values(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match="unknown option 'cls'"):
        gw.watch(model(), run=tmp_path / "a", cls=1)
    for bad in (float("inf"), float("nan"), True, 0):
        with pytest.raises(gw.ConfigError, match="flush_seconds must be a finite positive number"):
            gw.watch(model(), run=tmp_path / "a", flush_seconds=bad)
    assert not (tmp_path / "a").exists()


def test_other_rules_arguments(tmp_path: Path) -> None:
    with pytest.raises(gw.ConfigError, match="not found"):
        gw.watch(model(), run=tmp_path / "a", rules=str(tmp_path / "missing.toml"))
    with pytest.raises(gw.ConfigError, match="is not valid"):
        gw.watch(model(), run=tmp_path / "a", rules=42)
    m = gw.watch(model(), run=tmp_path / "b", rules=None, console=False)
    assert gw.watcher(m).rules is None
    gw.unwatch(m)
    m = gw.watch(model(), run=tmp_path / "c", rules=gw.Rule(when="loss_spike", do="halt"), console=False)
    assert gw.watcher(m).rules == [Rule(when="loss_spike", do="halt")]
    gw.unwatch(m)
    torch.manual_seed(0)
