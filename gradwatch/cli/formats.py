"""The formats ``gradwatch check`` writes its checked runs in: a table, JSON, JUnit XML, GitHub annotations."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gradwatch import encoding
from gradwatch.cli.checked import Checked
from gradwatch.store.findings import KINDS, rank

#: the formats of ``--format``
FORMATS = ("text", "json", "junit", "github")


# ------------------------------------------------------------------ formats
def log_console(file: Any) -> Console:
    """A console for a CI log: colour only on a terminal (and never with NO_COLOR)."""
    terminal = hasattr(file, "isatty") and file.isatty()
    width = None if terminal else int(os.environ.get("COLUMNS", "160"))
    return Console(file=file, width=width, highlight=False, force_terminal=terminal or None,
                   no_color="NO_COLOR" in os.environ or not terminal)


def render_text(results: list[Checked], file: Any) -> None:
    """One table of findings per run, then its verdict."""
    console = log_console(file)
    for res in results:
        if res.error is not None:
            console.print(f"[bold]{escape(res.run)}[/bold]: [red]cannot be read[/red]: {escape(res.error)}")
            continue
        shown = [f for f in res.findings if f.severity != "info" or res.fail_on == "info"]
        title = f"{res.run}: {res.steps} steps, {res.how}{res.halted}{_incomplete(res)}{restarted(res.restarts)}"
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


def restarted(restarts: list[dict[str, Any]]) -> str:
    """``, resumed at step 5000 (400 steps of the earlier process superseded)`` for a run that resumed, else
    nothing.
    """
    if not restarts:
        return ""
    parts = []
    for r in restarts:
        notes = [f"{r['superseded']} step{'s' * (r['superseded'] != 1)} of the earlier process superseded"
                 ] if r["superseded"] else []
        if r.get("layout_changed"):
            notes.append("another model layout")
        parts.append(f"step {r['step']}" + (f" ({'; '.join(notes)})" if notes else ""))
    return f", resumed at {', '.join(parts)}"


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
