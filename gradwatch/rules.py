"""Rules: which action each finding gets — ``gw.Rule(when=kind, do=action, ...)``, validated as data.

A rule matches a finding by kind (or ``"*"``), optionally narrowed by minimum severity, a layer
glob and a threshold on the finding's value; rules are tried in order and the first match
decides the finding's action. A finding that no rule matches is recorded and printed (``warn``).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradwatch import plugins
from gradwatch.errors import ConfigError
from gradwatch.store.findings import KINDS, SEVERITIES, Finding, rank

#: action -> {parameter: (type, default; REQUIRED if it has none)}
REQUIRED = object()
ACTIONS: dict[str, dict[str, tuple[type, Any]]] = {
    "warn": {},
    "clip": {"max_norm": (float, None), "max_clips": (int, 0), "within": (int, 100)},
    "skip": {"max_consecutive": (int, 20), "skip_samples": (bool, False)},
    "rollback": {"skip_batches": (int, 0), "lr_scale": (float, 1.0), "max_rollbacks": (int, 3),
                 "skip_samples": (bool, False)},
    "scale_lr": {"factor": (float, REQUIRED)},
    "halt": {},
}
#: when one step's findings call for several actions, the strongest one runs (clip and
#: scale_lr run together when nothing stronger is called for)
PRECEDENCE = ("halt", "rollback", "skip", "clip", "scale_lr", "warn")
MATCH_FIELDS = ("when", "do", "severity", "layer", "above", "below")


@dataclass(frozen=True)
class Rule:
    """A finding kind (optionally narrowed) -> an action with its parameters.

    Args:
        when: a finding kind (a detector plugin's too), or ``"*"`` for every kind.
        do: ``warn``, ``clip``, ``skip``, ``rollback``, ``scale_lr``, ``halt``, or the name of
            an installed action plugin (see :mod:`gradwatch.plugins`).
        severity: only findings at least this severe (``info``, ``warning``, ``error``).
        layer: only findings whose layer matches this glob (e.g. ``"encoder.*"``).
        above: only findings whose value is above this number.
        below: only findings whose value is below this number.
        **params: the action's parameters: ``clip``: ``max_norm`` (omit for adaptive), ``max_clips``
            and ``within`` (halt when the rule has clipped more than ``max_clips`` steps among the last
            ``within``: clipping bounds each update, not the cause; 0 never);
            ``skip``: ``max_consecutive`` (halt after that many skipped steps in a row, 0 never);
            ``rollback``: ``skip_batches``, ``lr_scale``, ``max_rollbacks``; ``skip`` and
            ``rollback``: ``skip_samples`` (leave the samples the finding blames out of the batches
            drawn afterwards, and add them to the run's ``skip_samples.txt``); ``scale_lr``: ``factor``;
            a plugin: those its ``params`` declare.

    Raises:
        ConfigError: an unknown kind, action, severity or parameter, or a wrong type.
    """

    when: str
    do: str
    severity: str | None = None
    layer: str | None = None
    above: float | None = None
    below: float | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, when: str, do: str, *, severity: str | None = None, layer: str | None = None,
                 above: float | None = None, below: float | None = None, **params: Any) -> None:
        table = {"when": when, "do": do, "severity": severity, "layer": layer, "above": above, "below": below}
        checked = _validate({k: v for k, v in table.items() if v is not None} | params, "gw.Rule")
        for name in MATCH_FIELDS:
            object.__setattr__(self, name, checked.pop(name, None))
        object.__setattr__(self, "params", checked)

    def matches(self, finding: Finding) -> bool:
        """Whether this rule applies to ``finding``."""
        if self.when not in ("*", finding.kind):
            return False
        if self.severity is not None and rank(finding.severity) < rank(self.severity):
            return False
        if self.layer is not None and (finding.layer is None or not fnmatch.fnmatchcase(finding.layer, self.layer)):
            return False
        value = finding.value
        if self.above is not None and not (value is not None and value > self.above):
            return False
        return not (self.below is not None and not (value is not None and value < self.below))

    def param(self, name: str) -> Any:
        """An action parameter, or its default."""
        if name in self.params:
            return self.params[name]
        return action_params(self.do)[name][1]

    def __repr__(self) -> str:
        fields = [f"when={self.when!r}", f"do={self.do!r}"]
        fields += [f"{k}={getattr(self, k)!r}" for k in MATCH_FIELDS[2:] if getattr(self, k) is not None]
        fields += [f"{k}={v!r}" for k, v in self.params.items()]
        return f"Rule({', '.join(fields)})"


def _choices(values: Iterable[str]) -> str:
    return ", ".join(values)


def action_params(do: str, where: str = "rules") -> dict[str, tuple[type, Any]]:
    """The parameters of an action, ``{name: (type, default or REQUIRED)}``: a built-in one's, or
    an installed action plugin's ``params`` (the plugin is loaded now).

    Raises:
        ConfigError: no such action, or a plugin that fails to load or declares bad parameters.
    """
    if isinstance(do, str) and do in ACTIONS:
        return ACTIONS[do]
    if not isinstance(do, str) or not plugins.exists("action", do):
        valid = [*ACTIONS, *plugins.names("action")]
        raise ConfigError(f"{where}: field 'do': unknown action {do!r}; valid actions are: {_choices(valid)}")
    from gradwatch.actions.base import Action

    try:
        cls = plugins.load("action", do, Action)
    except ConfigError as exc:
        raise ConfigError(f"{where}: field 'do': {exc}") from exc
    params = getattr(cls, "params", {})
    ok = cls.name == do and isinstance(params, Mapping) and all(
        isinstance(k, str) and k not in MATCH_FIELDS and isinstance(v, tuple) and len(v) == 2
        and v[0] in (int, float, str, bool) for k, v in params.items())
    if not ok:
        raise ConfigError(f"action plugin {do!r} must have name = {do!r} and params = {{name: (type, default)}} "
                          f"with types int, float, str or bool; got name {cls.name!r}, params {params!r}")
    return dict(params)


def finding_kinds() -> list[str]:
    """Every finding kind a rule may name: gradwatch's own and those of installed detector plugins."""
    return [*KINDS, *(k for k in plugins.names("detector") if k not in KINDS)]


def _validate(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check one rule given as data; returns it with numbers normalised."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: a rule must be a table with 'when' and 'do', got {table!r}")
    for key in ("when", "do"):
        if key not in table:
            raise ConfigError(
                f"{where}: missing field {key!r}; a rule needs 'when' (a finding kind) and 'do' (an action)")
    out: dict[str, Any] = {}
    when, do = table["when"], table["do"]
    if not isinstance(when, str) or (when not in (*KINDS, "*") and not plugins.exists("detector", when)):
        raise ConfigError(
            f"{where}: field 'when': unknown finding kind {when!r}; valid kinds are: {_choices(finding_kinds())}, *")
    params = action_params(do, where)
    out["when"], out["do"] = when, do
    for key, value in table.items():
        if key in ("when", "do"):
            continue
        if key == "severity":
            if not isinstance(value, str) or value not in SEVERITIES:
                raise ConfigError(f"{where}: field 'severity': {value!r} is not a severity; "
                                  f"valid severities are: {_choices(SEVERITIES)}")
        elif key == "layer":
            if not isinstance(value, str) or not value:
                raise ConfigError(
                    f"{where}: field 'layer' must be a non-empty glob string such as 'encoder.*', got {value!r}")
        elif key in ("above", "below"):
            value = _number(where, key, value, float)
        elif key in params:
            value = _value(where, key, value, params[key][0])
            if key in ("factor", "lr_scale", "max_norm") and value <= 0:
                raise ConfigError(f"{where}: field {key!r} must be greater than 0, got {value!r}")
        else:
            valid = [*MATCH_FIELDS, *params]
            raise ConfigError(f"{where}: unknown field {key!r} for action {do!r}; valid fields are: {_choices(valid)}")
        out[key] = value
    for key, (_, default) in params.items():
        if default is REQUIRED and key not in out:
            raise ConfigError(f"{where}: action {do!r} needs field {key!r}")
    if out.get("above") is not None and out.get("below") is not None and out["above"] >= out["below"]:
        raise ConfigError(f"{where}: field 'above' ({out['above']!r}) must be less than 'below' ({out['below']!r}): "
                          "no value is both above and below")
    return out


def _value(where: str, key: str, value: Any, kind: type) -> Any:
    if kind in (int, float):
        return _number(where, key, value, kind)
    if not isinstance(value, kind) or (kind is str and not value):
        expected = "true or false" if kind is bool else "a non-empty string"
        raise ConfigError(f"{where}: field {key!r} must be {expected}, got {value!r}")
    return value


def _number(where: str, key: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    elif ok:
        try:
            ok = math.isfinite(value)
        except OverflowError:  # an integer too large for a float
            ok = False
    if not ok:
        expected = "a non-negative integer" if kind is int else "a finite number"
        raise ConfigError(f"{where}: field {key!r} must be {expected}, got {value!r}")
    return kind(value)


def parse(rules: Sequence[Any], where: str) -> list[Rule]:
    """Rules from data (tables from a config file) or Rule objects, validated."""
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        raise ConfigError(f"{where}: 'rules' must be a list of rule tables, got {type(rules).__name__}")
    out = []
    for i, item in enumerate(rules):
        if isinstance(item, Rule):
            out.append(item)
            continue
        checked = _validate(item, f"{where}: rules[{i}]")
        match = {k: checked.pop(k) for k in MATCH_FIELDS if k in checked}
        out.append(Rule(**match, **checked))
    return out


#: the default rules' escalation of a clip: more than this many clipped steps among the last ``CLIP_WINDOW`` halt
MAX_CLIPS, CLIP_WINDOW = 20, 100

DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(when="nonfinite", do="skip", severity="error"),  # a NaN that reached no update is a warning
    # the run the learning rate wrecked (diverged or never learned since it was named): its weights, and any
    # snapshot of them, are lost; training on burns the budget, so stop, naming the step to restart from
    Rule(when="learning_rate", do="halt", severity="error"),
    # an explosion clipped again and again is systematic: clipping bounds each update, not the cause
    Rule(when="exploding", do="clip", max_clips=MAX_CLIPS, within=CLIP_WINDOW),
)


@dataclass
class Decision:
    """What one step's findings call for: one main action and the findings behind each action."""

    actions: dict[str, list[tuple[Finding, Rule | None]]] = field(default_factory=dict)

    @property
    def main(self) -> str:
        """The strongest action called for (``warn`` when none)."""
        return next((a for a in PRECEDENCE if a in self.actions), "warn")

    def runs(self, action: str) -> bool:
        """Whether ``action`` runs this step (clip/scale_lr yield to skip, rollback and halt)."""
        if action not in self.actions:
            return False
        if action not in PRECEDENCE:  # a plugin action runs beside the built-in one
            return True
        if action in ("clip", "scale_lr"):
            return self.main in ("clip", "scale_lr", "warn")
        return action == self.main

    def label(self, *, record_only: bool = False) -> None:
        """Set each finding's ``action``: the action that ran (or runs next step) because of it."""
        for action, pairs in self.actions.items():
            for finding, _ in pairs:
                if record_only:
                    finding.action = "warn"
                else:
                    finding.action = action if action == "warn" or self.runs(action) else self.main


def decide(rules: Sequence[Rule], findings: Sequence[Finding]) -> Decision:
    """Match each finding with the first rule that applies."""
    decision = Decision()
    for finding in findings:
        rule = next((r for r in rules if r.matches(finding)), None)
        action = rule.do if rule is not None else "warn"
        decision.actions.setdefault(action, []).append((finding, rule))
    return decision
