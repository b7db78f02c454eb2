"""Judge: per step, detectors -> rules -> (persist, print) -> actions, plus the flight recorder.

The watcher hands each step's record to :meth:`Judge.step` from inside the optimizer's step
pre-hook, before the update is applied. Findings are written to the store (and TensorBoard,
and the console) and flushed before any action runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from gradwatch import actions, detectors
from gradwatch.actions import Control
from gradwatch.detectors.exploding import Exploding
from gradwatch.errors import PluginWarning, TrainingHalted
from gradwatch.judging.escalate import Clips
from gradwatch.rules import PRECEDENCE, Decision, decide
from gradwatch.store.findings import SEVERITIES, Cooldown, Finding, rank
from gradwatch.store.records import StepRecord
from gradwatch.store.thread import Writer
from gradwatch.store.writer import finding_json

if TYPE_CHECKING:  # the settings are built by the public face (gradwatch.options)
    from gradwatch.config import Config
    from gradwatch.options import Options

_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}


class Judge:
    """Runs the detectors on every record and the rules' actions on what they find."""

    def __init__(self, config: Config, options: Options, writer: Writer,
                 plugin_actions: dict[str, actions.Action]) -> None:
        self.rules = config.rules
        all_detectors = [d for d in detectors.build(options.detectors) if d.enabled]
        #: plugins run guarded: one that raises (or returns something else than findings of its
        #: kind) is disabled with a PluginWarning and the run goes on
        self._guarded = {id(d) for d in all_detectors if detectors.plugin(d)}
        #: the action plugins the rules name, built by the caller before the run was created
        #: (:func:`build_plugin_actions`); one that raises is removed
        self._plugin_actions = plugin_actions
        self._now = [d for d in all_detectors if not d.late]
        self._late = [d for d in all_detectors if d.late]
        self.exploding = next((d for d in all_detectors if isinstance(d, Exploding)), None)
        #: what the detectors built together share; every step's loss goes into it (``Causes.loss_of``)
        self._causes = all_detectors[0].causes if all_detectors else None
        self._writer = writer
        self._fold = Cooldown(options.cooldown)
        self._flight: deque[StepRecord] = deque(maxlen=options.flight_recorder)
        self._ids = itertools.count(1)
        self._console = Console(stderr=True, highlight=False) if options.console else None
        self._deferred: list[Finding] = []
        self.counts: dict[str, int] = {"info": 0, "warning": 0, "error": 0}
        #: the occurrences among ``counts`` folded into an earlier finding (no row of their own), by severity
        self.repeats: dict[str, int] = {"info": 0, "warning": 0, "error": 0}
        self.worst: str | None = None
        self.rolls_back = config.rules is not None and any(r.do == "rollback" for r in config.rules)
        self._clips = Clips()  # a clip needed again and again halts (the rule's max_clips)

    # ---------------------------------------------------------------- checks
    def check(self, record: StepRecord) -> list[Finding]:
        """Run the per-step detectors on a record."""
        if self._causes is not None:
            self._causes.loss_of(record)
        return self._run(self._now, record)

    def check_late(self, record: StepRecord) -> list[Finding]:
        """Run the detectors that judge a step's applied update (one step later)."""
        return self._run(self._late, record)

    def check_loss(self, record: StepRecord) -> list[Finding]:
        """Judge a loss that reached its step after the step's moment (observed after
        ``optimizer.step()``: :mod:`gradwatch.step.openstep`): the loss detector, and the non-finite one
        when the loss is not finite while the gradients were (else the step's finding said so).
        """
        bad = not math.isfinite(record.scalars["loss"]) and record.gradients_finite()
        if self._causes is not None:
            self._causes.loss_of(record)
        return self._run([d for d in self._now if d.kind == "loss_spike" or (bad and d.kind == "nonfinite")], record)

    def _run(self, running: list[detectors.Detector], record: StepRecord) -> list[Finding]:
        if not self._guarded:
            return [f for d in running for f in d.check(record)]
        out = []
        for d in list(running):
            if id(d) not in self._guarded:
                out += d.check(record)
                continue
            try:
                found = d.check(record)
                well_formed(d, record, found)
            except Exception as exc:
                running.remove(d)
                _disabled(f"detector plugin {d.kind!r}", record.step, exc)
                continue
            out += found
        return out

    def resume(self, records: Iterable[StepRecord], next_id: int, counts: dict[str, int], worst: str | None,
               repeats: dict[str, int] | None = None) -> int:
        """Go on judging a resumed run: the detectors' baselines are primed with the stored steps before
        the restart (``records``, in step order; what they find is dropped: the stored run holds the
        findings of those steps), finding ids go on from ``next_id``, and the kept findings count (``repeats``:
        their folded occurrences).

        Returns:
            how many records primed the detectors.
        """
        self._ids = itertools.count(next_id)
        self.counts, self.worst = {**self.counts, **counts}, worst
        self.repeats = {**self.repeats, **(repeats or {})}
        primed = 0
        for record in records:
            record.skipped = record.skipped and "grad_norm" not in record.scalars  # as the detectors saw it then
            if self._causes is not None:
                self._causes.loss_of(record)
            self._run(self._now, record)
            self._run(self._late, record)
            primed += 1
        return primed

    def remember(self, record: StepRecord) -> None:
        """Keep a record in the flight recorder (records written without their per-layer rows)."""
        if not record.logged:
            self._flight.append(record)

    # ------------------------------------------------------------- decisions
    def defer(self, findings: Sequence[Finding], *, skipped: bool = False) -> None:
        """Persist findings made outside an optimizer step; their actions run at the next step.

        With ``skipped`` (a step a GradScaler skipped), the actions on that step's own update are
        done already: skip (nothing was applied) and clip (nothing to clip) do not carry over to
        the next, healthy step; rollback, scale_lr and halt do.
        """
        decide(self.rules or [], findings).label(record_only=self.rules is None)
        self.record(findings)
        void = ("skip", "clip") if skipped else ()
        self._deferred.extend(f for f in findings if self.rules and f.action not in void)

    def step(self, record: StepRecord, findings: list[Finding], control: Control) -> str:
        """Persist the step's findings, run the actions the rules decide, persist their outcomes,
        then print the findings: a line on the console is always on disk first.

        Returns:
            the main action that ran (``warn`` when training was not touched).
        """
        deferred, self._deferred = self._deferred, []  # recorded already, acted on now
        if not findings and not deferred:
            return "warn"
        decision = decide(self.rules or [], [*deferred, *findings])
        if self.rules is None:  # record only: nothing may change training
            decision.actions = {"warn": [(f, None) for f in [*deferred, *findings]]}
        decision.label()
        record.logged = record.detail = True  # the step itself is kept at full resolution
        fresh = self.record(findings, show=False)
        relabelled = [f for f in deferred if f.id is not None]  # written before their action was known
        if relabelled:
            self._writer.submit_findings(relabelled)
        self._writer.flush()  # a finding is on disk before its action runs
        acted: list[Finding] = []
        try:
            self._plugins_act(decision, record.step, control, acted)
            for action in ("clip", "scale_lr", "skip", "rollback", "halt"):
                if decision.runs(action):
                    finding, rule = decision.actions[action][0]
                    outcome = actions.REGISTRY[action].apply(rule, finding, control)
                    if action == "clip" and outcome.get("clipped") is False:
                        self._unapplied(decision, "clip")  # nothing was clipped: no finding says "clip"
                    if outcome and finding.id is not None:  # a folded repeat has no row of its own
                        finding.data.setdefault("outcome", {}).update(outcome)
                        acted.append(finding)
                    if action == "clip" and outcome.get("clipped"):
                        self._clips.clipped(rule, finding, control, acted)
        finally:  # also when an action halts training: its outcome is kept and the findings printed
            if acted:
                self._writer.submit_findings(acted)
                self._writer.flush()  # the outcome (a rollback's restored step ...) is on disk too
            for f in fresh:
                self._print(f)
        return decision.main

    def _plugins_act(self, decision: Decision, step: int, control: Control, acted: list[Finding]) -> None:
        """Run the action plugins the rules chose, each once, with the first finding that chose it."""
        for name in [a for a in decision.actions if a in self._plugin_actions]:
            finding, rule = decision.actions[name][0]
            try:
                outcome = self._plugin_actions[name].apply(rule, finding, control)
                if outcome is not None and not isinstance(outcome, dict):
                    raise TypeError(f"apply() must return a dict or None, got {type(outcome).__name__}")
                finding_json(outcome or {})
            except TrainingHalted:  # the plugin halted training through the control: meant
                raise
            except Exception as exc:
                del self._plugin_actions[name]
                _disabled(f"action plugin {name!r}", step, exc)
                continue
            if outcome and finding.id is not None:
                finding.data.setdefault("outcome", {}).update(outcome)
                acted.append(finding)

    @staticmethod
    def _unapplied(decision: Decision, action: str) -> None:
        """An action decided on did nothing (a clip below its bound): its findings say warn instead."""
        for finding, _ in decision.actions.get(action, []):
            if finding.action == action:
                finding.action = "warn"

    def record(self, findings: Sequence[Finding], *, show: bool = True) -> list[Finding]:
        """Write findings (and the flight recorder's lead-up); fold repeats.

        With ``show``, wait until they are on disk, then print them. Returns the new (unfolded) ones.
        """
        fresh = []
        for f in findings:
            self.counts[f.severity] += 1
            if self.worst is None or rank(f.severity) > rank(self.worst):
                self.worst = f.severity
            if self._fold.admit(f):
                f.id = next(self._ids)
                fresh.append(f)
            else:
                self.repeats[f.severity] += 1
        if not fresh:
            return fresh
        for old in self._flight:
            self._writer.submit(dataclasses.replace(old, logged=True, detail=True, flight=True))
        self._flight.clear()
        self._writer.submit_findings([*fresh, *self._fold.take_updated()])
        if show:
            if self._console is not None:
                self._writer.flush()  # persist, then print
            for f in fresh:
                self._print(f)
        return fresh

    def close(self) -> None:
        """Write the final repeat counts of folded findings."""
        updated = self._fold.take_updated()
        if updated:
            self._writer.submit_findings(updated)

    def _print(self, f: Finding) -> None:
        if self._console is None:
            return
        where = f" [bold]{escape(f.layer)}[/bold]" if f.layer else ""
        action = f" -> {f.action}" if f.action and f.action != "warn" else ""
        head = f"[{_STYLE[f.severity]}]gradwatch {f.severity}[/] step {f.step} {f.kind}{where}"
        unstored = self._writer.unstored()  # persist, then print: or say that it is not on disk
        note = f" [bold](not stored: {escape(unstored)})[/bold]" if unstored else ""
        # a terminal wraps at its width; a file or pipe gets the whole finding on one line, unpadded
        self._console.print(f"{head}: {escape(f.message)}{action}{note}", soft_wrap=not self._console.is_terminal)

    def clip_bound(self) -> float:
        """The adaptive clipping bound: the largest global norm the run's own healthy history calls
        normal (the ``exploding`` detector's baseline), its typical norm while that history is too
        short, nan without either.
        """
        bound = self.exploding.upper() if self.exploding is not None else math.inf
        if not math.isfinite(bound):  # no history yet: the baseline's typical norm, if any
            bound = self.exploding.typical() if self.exploding is not None else math.nan
        return bound

    def summary(self) -> dict[str, Any]:
        """Counts of findings by severity (every occurrence), the worst severity seen, and the ``repeats``
        among the counts: occurrences folded into an earlier finding (``counts - repeats`` is what ``check`` counts).
        """
        return {"counts": dict(self.counts), "worst": self.worst, "repeats": dict(self.repeats)}


def build_plugin_actions(config: Config) -> dict[str, actions.Action]:
    """An instance of each action plugin the rules name.

    Raises:
        ConfigError: a plugin that fails to load or to build.
    """
    return {r.do: actions.build(r.do) for r in config.rules or [] if r.do not in PRECEDENCE}


def well_formed(detector: detectors.Detector, record: StepRecord, found: object) -> None:
    """Raise TypeError unless a detector returned a list of findings of its kind for the step,
    each with a number or None as ``value`` and ``data`` the store can keep (JSON).
    """
    if not isinstance(found, list):
        raise TypeError(f"check() must return a list of findings, got {type(found).__name__}")
    for f in found:
        ok = (isinstance(f, Finding) and f.kind == detector.kind and f.severity in SEVERITIES
              and f.step == record.step and (f.layer is None or isinstance(f.layer, str))
              and isinstance(f.message, str) and isinstance(f.data, dict)
              and (f.value is None or (isinstance(f.value, numbers.Real) and not isinstance(f.value, bool))))
        if not ok:
            raise TypeError(f"check() returned {f!r}; a finding must be made with self.finding(record, severity, "
                            f"layer, message, value=<number or None>, data=<dict>) (kind {detector.kind!r}, "
                            f"step {record.step})")
        finding_json(f.data)


def _disabled(what: str, step: int, exc: Exception) -> None:
    warnings.warn(f"gradwatch: {what} failed at step {step} ({type(exc).__name__}: {exc}) and is disabled "
                  "for the rest of the run; training and the other detectors and actions go on",
                  PluginWarning, stacklevel=2)
