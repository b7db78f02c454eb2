"""CLI ``gradwatch demo``: train the built-in model, print a summary of its run and write its report."""

from __future__ import annotations

from pathlib import Path

import click
import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gradwatch import encoding
from gradwatch.cli import cli
from gradwatch.store.reader import open_run
from gradwatch.store.summary import Summary, summarize


@cli.command()
@click.option("--run", "run_dir", default="runs/demo", show_default=True, type=click.Path(path_type=Path),
              help="Run directory to write (replaced if it exists).")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1), help="Optimizer steps to train.")
def demo(run_dir: Path, steps: int) -> None:
    """Train a small built-in model with gradwatch attached, summarise its run and write its HTML report."""
    from gradwatch.demo import CORRUPTED_STEP, POISONED_STEP, run_demo

    console = Console()
    console.soft_wrap = not console.is_terminal  # a log file: no hard wraps (and no spaces they leave behind)
    console.print(intro(steps, POISONED_STEP, CORRUPTED_STEP), soft_wrap=True)
    with console.status(f"training the demo model for {steps} steps ..."):
        path = run_demo(run_dir, steps=steps, console=False)
    with open_run(path) as run:
        summary = summarize(run)
        render(console, path, summary)
        findings = run.findings()
        render_findings(console, findings)
        console.print(outro(findings, summary, POISONED_STEP, CORRUPTED_STEP), soft_wrap=True)
    from gradwatch.report import write

    report = write(path)
    console.print(f"\nReport:       {escape(str(report))}  (open it in a browser)", soft_wrap=True)
    console.print(f"Dashboard:    gradwatch dashboard {escape(str(path.parent))}  (then open http://127.0.0.1:6007/)",
                  soft_wrap=True)
    console.print(f"TensorBoard:  tensorboard --logdir {path.parent}")
    console.print(f"In Python:    gw.open_run({str(path)!r}).metrics()")


def intro(steps: int, poisoned: int, corrupted: int) -> str:
    """What the demo does, said before it starts: the two bad batches are planted on purpose."""
    planted = [(poisoned, "one point sits exactly at the origin: the polar features divide 0 by 0 (a NaN); "
                          "the default rules skip that step"),
               (corrupted, "the points are 1000x too large: the gradient explodes; the default rules clip it")]
    reached = [(step, what) for step, what in planted if step < steps]
    lines = [f"gradwatch demo: a small Tanh MLP learns three interleaved spirals for {steps} steps, watched by "
             "gradwatch with its default rules."]
    if reached:
        lines.append("Two batches are bad on purpose, to show what gradwatch finds and how its rules rescue training:"
                     if len(reached) == 2 else "One batch is bad on purpose, to show what gradwatch finds:")
        lines += [f"  step {step}: {what}" for step, what in reached]
    else:
        lines.append(f"(The batches made bad on purpose come at steps {poisoned} and {corrupted}: run with more "
                     "--steps to see them found and rescued.)")
    return "\n".join(lines) + "\n"


def outro(findings: pd.DataFrame, summary: Summary, poisoned: int, corrupted: int) -> str:
    """After the findings: which of them were planted, and whether training recovered."""
    planted = sorted({int(s) for s in findings["step"]} & {poisoned, corrupted}) if len(findings) else []
    if not planted:
        return ""
    steps = " and ".join(str(s) for s in planted)
    return (f"The findings at step{'s' * (len(planted) > 1)} {steps} come from the batches made bad on purpose; "
            f"the rules acted inside those steps and training went on (loss {_fmt(summary.loss_first)} -> "
            f"{_fmt(summary.loss_last)}).")


def render_findings(console: Console, findings: pd.DataFrame) -> None:
    """Print a run's findings: step, severity, kind, layer, action and message."""
    if findings.empty:
        console.print("[green]no findings[/green]")
        return
    table = Table(title="findings")
    for col in ("step", "severity", "kind", "layer", "action", "message"):
        table.add_column(col, overflow="fold")
    lines = []
    for row in findings.itertuples():
        layer = row.layer if isinstance(row.layer, str) else "-"
        repeats = encoding.whole(row.data.get("repeats"), 1) if isinstance(row.data, dict) else 1
        step = f"{row.step}" + (f" (x{repeats})" if repeats > 1 else "")
        table.add_row(step, row.severity, row.kind, layer, row.action or "-", escape(row.message))
        where = f" {layer}" if layer != "-" else ""
        action = f" -> {row.action}" if row.action and row.action != "warn" else ""
        lines.append(f"gradwatch {row.severity} step {step} {row.kind}{where}: {row.message}{action}")
    if console.is_terminal:
        console.print(table)
        return
    console.print("findings:")  # a log file: each finding whole on one line, as training printed it
    for line in lines:
        console.print(line, soft_wrap=True, markup=False)


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def render(console: Console, path: Path, summary: Summary) -> None:
    """Print a run summary as rich tables."""
    console.print(f"[bold]gradwatch run[/bold] {path}")
    head = Table(show_header=False)
    head.add_row("steps", str(summary.steps))
    head.add_row("status", summary.status)
    head.add_row("global grad norm", f"{_fmt(summary.grad_norm_min)} .. {_fmt(summary.grad_norm_max)}")
    head.add_row("loss (first -> last)", f"{_fmt(summary.loss_first)} -> {_fmt(summary.loss_last)}")
    console.print(head)
    for title, rows in (("smallest gradients", summary.smallest()), ("largest gradients", summary.largest())):
        console.print(f"[bold]layers with the {title}[/bold] (median gradient norm over the run)")
        table = Table()
        table.add_column("layer")
        table.add_column("type")
        table.add_column("grad norm", justify="right")
        for row in rows.itertuples():
            table.add_row(row.layer, row.type, _fmt(row.grad_norm))
        console.print(table)
