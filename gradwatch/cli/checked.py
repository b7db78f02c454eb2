"""A checked run: one run read and judged against the CI gate's threshold (``gradwatch check``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradwatch.errors import GradwatchError
from gradwatch.judging import gate
from gradwatch.store import verdict
from gradwatch.store.findings import rank
from gradwatch.store.listing import find_runs
from gradwatch.store.reader import Run, open_run
from gradwatch.store.schema import DB_NAME

#: what ``check --format json`` says of each restart of a resumed run
RESTART_KEYS = ("step", "superseded", "previous_status", "layout_changed")


@dataclass
class Checked:
    """One run judged against a threshold (or the reason it could not be read)."""

    run: str
    fail_on: str
    steps: int = 0
    status: str = "unreadable"
    findings: list[gate.Item] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    halted: str = ""  # where and why a halted run stopped (its verdict's ``halted``), for the text output
    #: the steps its store lacks for good (``Run.incomplete``): reported, never a failure by itself
    incomplete: dict[str, Any] | None = None
    ended: dict[str, Any] = field(default_factory=dict)  # how it ended (``Run.ended``)
    accept: tuple[str, ...] = ()  # the statuses of runs that did not finish that pass (``--accept``)
    #: where a resumed run's later processes took over (``Run.restarts``): reported, never a failure
    restarts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failing(self) -> list[gate.Item]:
        """The findings at or above the threshold."""
        return [f for f in self.findings if rank(f.severity) >= rank(self.fail_on)]

    @property
    def unfinished(self) -> bool:
        """The run did not finish (terminated, exited, crashed, still running), and that is not accepted."""
        return self.error is None and self.status in verdict.UNFINISHED and self.status not in self.accept

    @property
    def verdict(self) -> str:
        """``pass`` or ``fail`` (a failing finding, or a run that did not finish: PRODUCT.md's two values), or
        ``error`` (the run cannot be read).
        """
        return "error" if self.error is not None else "fail" if self.failing or self.unfinished else "pass"

    @property
    def how(self) -> str:
        """The run's status for people: ``terminated (signal 15, SIGTERM)`` ..."""
        return verdict.describe(self.ended or {"status": self.status})

    def to_json(self) -> dict[str, Any]:
        """PRODUCT.md's object for one run (plus ``status``, ``unfinished``, ``incomplete``, ``restarts``,
        ``fail_on``, ``error``).
        """
        out: dict[str, Any] = {"run": self.run, "verdict": self.verdict, "steps": self.steps,
                               "status": self.status, "unfinished": self.unfinished,
                               "incomplete": self.incomplete, "fail_on": self.fail_on,
                               "restarts": [{k: r[k] for k in RESTART_KEYS} for r in self.restarts],
                               "findings": [f.to_json() for f in self.findings]}
        if self.status in verdict.UNFINISHED and self.error is None:
            out["ended"] = self.ended or {"status": self.status}
        if self.error is not None:
            out["error"] = self.error
        return out


def judge_run(path: str, fail_on: str, rules: Path | None, accept: tuple[str, ...] = ()) -> Checked:
    """Read one run and judge it; a run that cannot be read is returned with its ``error``."""
    start = time.perf_counter()
    checked = Checked(run=path, fail_on=fail_on, accept=accept)
    if Path(path).is_dir() and not find_runs(Path(path)):
        checked.error = f"{path!r} is not a gradwatch run and holds none: no {DB_NAME} in it or in its folders"
        return checked
    try:
        with open_run(path) as run:
            checked.steps, checked.status, checked.incomplete = run.steps, run.status, run.incomplete
            run.check_vectors()  # one verdict for one store: a vector that report or open_run call damaged
            checked.ended = run.ended
            checked.restarts = run.restarts
            halted = verdict.halted(run.path) if checked.status == "halted" else None
            checked.halted = f" at step {halted.get('step')}: {halted['reason']}" if halted else ""
            checked.findings = gate.items(_findings(run, rules))
    except GradwatchError as exc:
        checked.error = str(exc)
    checked.seconds = time.perf_counter() - start
    return checked


def expand(paths: tuple[str, ...]) -> list[str]:
    """The runs to check: a run as given, a folder holding runs as every run under it (as ``ls`` finds them).

    A path that is neither (missing, or a folder without runs) is kept, to be reported as unreadable.
    """
    out: list[str] = []
    for path in paths:
        p = Path(path)
        if p.is_dir() and not (p / DB_NAME).exists():
            found = find_runs(p)
            out += [str(run) for run in found] if found else [path]
        else:
            out.append(path)
    return list(dict.fromkeys(out))


def _findings(run: Run, rules: Path | None) -> Any:
    if rules is None:
        return run.findings()
    from gradwatch.cli.rejudge import rejudge

    return rejudge(run, rules)
