"""CLI ``gradwatch check``: the CI gate."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gradwatch import encoding
from gradwatch.cli import USAGE_ERROR, cli
from gradwatch.errors import GradwatchError
from gradwatch.files import write_text_atomic
from gradwatch.judging import gate
from gradwatch.store import owned, verdict
from gradwatch.store.findings import KINDS, rank
from gradwatch.store.listing import find_runs
from gradwatch.store.reader import Run, open_run
from gradwatch.store.schema import DB_NAME

FORMATS = ("text", "json", "junit", "github")


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
        """PRODUCT.md's object for one run (plus ``status``, ``unfinished``, ``incomplete``, ``fail_on``, ``error``)."""
        out: dict[str, Any] = {"run": self.run, "verdict": self.verdict, "steps": self.steps,
                               "status": self.status, "unfinished": self.unfinished,
                               "incomplete": self.incomplete, "fail_on": self.fail_on,
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


# ------------------------------------------------------------------ formats
def _console(file: Any) -> Console:
    """A console for a CI log: colour only on a terminal (and never with NO_COLOR)."""
    terminal = hasattr(file, "isatty") and file.isatty()
    width = None if terminal else int(os.environ.get("COLUMNS", "160"))
    return Console(file=file, width=width, highlight=False, force_terminal=terminal or None,
                   no_color="NO_COLOR" in os.environ or not terminal)


def render_text(results: list[Checked], file: Any) -> None:
    """One table of findings per run, then its verdict."""
    console = _console(file)
    for res in results:
        if res.error is not None:
            console.print(f"[bold]{escape(res.run)}[/bold]: [red]cannot be read[/red]: {escape(res.error)}")
            continue
        shown = [f for f in res.findings if f.severity != "info" or res.fail_on == "info"]
        title = f"{res.run}: {res.steps} steps, {res.how}{res.halted}{_incomplete(res)}"
        if shown:
            table = Table(title=escape(title), title_justify="left")
            for col in ("step", "severity", "kind", "layer", "action", "message"):
                table.add_column(col, overflow="fold", no_wrap=col in ("step", "severity", "kind"))
            for f in shown:
                step = f"{f.step}" + (f" (x{f.repeats})" if f.repeats > 1 else "")
                text = escape(f.message) + (f"\n[dim]try: {escape(f.hint)}[/dim]" if f.hint else "")
                mark = "[bold red]" if rank(f.severity) >= rank(res.fail_on) else ""
                severity = f"{mark}{f.severity}[/]" if mark else f.severity
                table.add_row(step, severity, f.kind, escape(f.where()), f.action or "-", text)
            console.print(table)
        else:
            console.print(f"[bold]{escape(title)}[/bold]: no findings of warning or error severity")
        n = len(res.failing)
        if res.unfinished:
            console.print(f"[bold red]UNFINISHED[/]: {escape(res.run)} did not finish: {escape(res.how)} "
                          f"(--accept {res.status} passes it)")
        if n:
            plural = "s" * (n != 1)
            console.print(f"[bold red]FAIL[/]: {n} finding{plural} at or above {res.fail_on} in {escape(res.run)}")
        elif not res.unfinished:
            console.print(f"[bold green]PASS[/]: no finding at or above {res.fail_on} in {escape(res.run)}")


def _incomplete(res: Checked) -> str:
    """``, incomplete: N steps missing (disk full)`` for a run whose store lacks steps, else nothing."""
    gap = res.incomplete
    return "" if gap is None else f", incomplete: {gap['missing_steps']} steps missing ({gap['reason']})"


def render_json(results: list[Checked]) -> str:
    """One object for one run, an array for several; strict JSON (a non-finite number is ``null`` with
    its string form beside it: :mod:`gradwatch.encoding`).
    """
    objs = [r.to_json() for r in results]
    return encoding.dumps(objs[0] if len(objs) == 1 else objs, indent=2) + "\n"


def render_junit(results: list[Checked]) -> str:
    """JUnit XML: a test suite per run, a test case per finding kind (and one for reading the run)."""
    from xml.etree import ElementTree as ET

    root = ET.Element("testsuites", name="gradwatch")
    totals = {"tests": 0, "failures": 0, "errors": 0}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for res in results:
        suite = ET.SubElement(root, "testsuite", name=res.run, timestamp=stamp, time=f"{res.seconds:.3f}")
        cases = {"tests": 0, "failures": 0, "errors": 0}
        classname = "gradwatch." + (Path(res.run).name or "run")
        read = ET.SubElement(suite, "testcase", classname=classname, name="run is readable", time=f"{res.seconds:.3f}")
        cases["tests"] += 1
        if res.error is not None:
            ET.SubElement(read, "error", message=res.error, type="RunError").text = res.error
            cases["errors"] += 1
        else:
            ended = ET.SubElement(suite, "testcase", classname=classname, name="run finished", time="0")
            cases["tests"] += 1
            if res.unfinished:
                ET.SubElement(ended, "failure", message=f"the run did not finish: {res.how}", type="unfinished")
                cases["failures"] += 1
            for kind in [*KINDS, *sorted({f.kind for f in res.failing} - set(KINDS))]:  # plugin kinds too
                case = ET.SubElement(suite, "testcase", classname=classname, name=kind, time="0")
                cases["tests"] += 1
                bad = [f for f in res.failing if f.kind == kind]
                if bad:
                    first = bad[0]
                    message = f"step {first.step}, {first.where()}: {first.message}"
                    ET.SubElement(case, "failure", message=message, type=kind).text = "\n".join(f.line() for f in bad)
                    cases["failures"] += 1
        suite.set("tests", str(cases["tests"]))
        suite.set("failures", str(cases["failures"]))
        suite.set("errors", str(cases["errors"]))
        suite.set("skipped", "0")
        for key in totals:
            totals[key] += cases[key]
    for key, value in totals.items():
        root.set(key, str(value))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def render_github(results: list[Checked]) -> str:
    """GitHub Actions workflow commands: an annotation per finding (error at/above the threshold).

    The annotations name no ``file``: a finding is about the training, not about a line of the
    repository (the run store is no source file to annotate); GitHub lists them on the workflow
    run's summary and the pull request's checks, each titled with the kind, layer, step and run.
    """
    lines = []
    for res in results:
        if res.error is not None:
            lines.append(f"::error title={_escape_property(f'gradwatch: {res.run} cannot be read')}"
                         f"::{_escape_data(res.error)}")
            continue
        for f in res.findings:
            if f.severity == "info":
                continue
            level = "error" if rank(f.severity) >= rank(res.fail_on) else "warning"
            title = f"gradwatch {f.kind} at {f.where()}, step {f.step} of {res.run}"
            body = f"{res.run}: {f.message}" + (f" [action: {f.action}]" if f.action else "")
            body += f"\nTry: {f.hint}." if f.hint else ""
            lines.append(f"::{level} title={_escape_property(title)}::{_escape_data(body)}")
        if res.incomplete is not None:
            lines.append(f"::warning title={_escape_property(f'gradwatch: {res.run} is incomplete')}"
                         f"::{_escape_data(f'{res.run}: {res.steps} steps{_incomplete(res)}')}")
        if res.unfinished:
            lines.append(f"::error title={_escape_property(f'gradwatch: {res.run} did not finish')}::"
                         f"{_escape_data(f'{res.run}: {res.how}')}")
        outcome, n = "FAIL" if res.failing or res.unfinished else "PASS", len(res.failing)
        lines.append(f"{outcome}: {res.run}: {n} finding{'s' * (n != 1)} at or above {res.fail_on}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- commands
@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=str))  # runs, or folders of runs
@click.option("--fail-on", type=click.Choice(gate.FAIL_ON), default="error", show_default=True,
              help="Fail when a finding has at least this severity.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="Output: a table, JSON, JUnit XML, or GitHub Actions annotations.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the output to this file instead of standard output.")
@click.option("--rules", type=click.Path(dir_okay=False, path_type=Path),
              help="Re-judge the recorded runs with this rules file's detector settings (no retraining).")
@click.option("--accept", default="", metavar="STATUSES", callback=lambda ctx, param, value: _accepted(value),
              help="Pass runs that did not finish with these statuses (comma-separated: "
                   f"{', '.join(verdict.UNFINISHED)}; 'unfinished': all of them).")
def check(runs: tuple[str, ...], fail_on: str, fmt: str, output: Path | None, rules: Path | None,
          accept: tuple[str, ...]) -> None:
    """Judge recorded runs (a folder: every run under it).

    Exit 0 when none has a finding at or above --fail-on and each finished (or --accept accepts how it
    ended), else 1 (2: a run that cannot be read).
    A run whose store lacks steps (the disk was full) is reported as incomplete; that alone does not fail it.
    """
    if output is not None:  # never over a run's own files (its store ...)
        owned.refuse(output, "the check report", [*runs, *expand(runs)])
    if rules is not None:
        from gradwatch.cli.rejudge import validate

        validate(rules)  # a bad rules file is a usage error before any run is read
    results = [judge_run(path, fail_on, rules, accept) for path in expand(runs)]
    if fmt == "text":
        if output is None:
            render_text(results, sys.stdout)
        else:
            from io import StringIO

            buf = StringIO()
            render_text(results, buf)
            write_text_atomic(output, buf.getvalue(), "the check report")
    else:
        text = {"json": render_json, "junit": render_junit, "github": render_github}[fmt](results)
        if output is None:
            click.echo(text, nl=False)
        else:
            write_text_atomic(output, text, "the check report")
    for res in results:
        if res.error is not None:
            click.echo(f"gradwatch: error: {res.error}", err=True)
    ctx = click.get_current_context()
    if any(r.error is not None for r in results):
        ctx.exit(USAGE_ERROR)
    ctx.exit(1 if any(r.failing or r.unfinished for r in results) else 0)


def _accepted(value: str) -> tuple[str, ...]:
    """``--accept``'s statuses; an unknown one is a usage error."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in (*verdict.UNFINISHED, "unfinished")]
    if unknown:
        raise click.BadParameter(f"{unknown[0]!r} is not a status of a run that did not finish; "
                                 f"choose among {', '.join(verdict.UNFINISHED)} (or 'unfinished': all)",
                                 param_hint="'--accept'")
    return verdict.UNFINISHED if "unfinished" in names else tuple(names)


__all__ = ["USAGE_ERROR", "check"]
