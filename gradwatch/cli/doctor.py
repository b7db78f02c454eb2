"""CLI ``gradwatch doctor TARGET``: pre-flight checks on a model and one batch, before training."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from gradwatch import encoding
from gradwatch.cli import cli
from gradwatch.cli.formats import log_console
from gradwatch.doctor import CHECKS, FAIL, FAIL_ON, PASS, WARN, CheckResult, DoctorOptions, diagnose, exit_code

FORMATS = ("text", "json")
_DEFAULTS = DoctorOptions()
_STYLES = {PASS: "green", WARN: "yellow", FAIL: "bold red"}
_POSITIVE = click.FloatRange(min=0, min_open=True)
_FRACTION = click.FloatRange(min=0, max=1, min_open=True, max_open=True)


def render_text(results: Sequence[CheckResult], target: str, fail_on: str, seconds: float, file: Any) -> None:
    """A table of the checks (check, status, evidence, suggestion), then the verdict."""
    console = log_console(file)
    table = Table(title=f"gradwatch doctor {escape(target)}", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("evidence", overflow="fold", ratio=3)
    table.add_column("suggestion", overflow="fold", ratio=2)
    for r in results:
        status = f"[{_STYLES[r.status]}]{r.status}[/]"
        table.add_row(r.name, status, escape(r.evidence), escape(r.suggestion) or "-")
    console.print(table)
    counts = {s: sum(r.status == s for r in results) for s in (PASS, WARN, FAIL)}
    summary = f"{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail in {seconds:.1f} s"
    if exit_code(results, fail_on):
        console.print(f"[bold red]FAIL[/]: {summary} (--fail-on {fail_on})")
    else:
        console.print(f"[bold green]PASS[/]: {summary} (--fail-on {fail_on})")


def render_json(results: Sequence[CheckResult]) -> str:
    """A JSON array of ``{check, status, evidence, suggestion}``."""
    return encoding.dumps([r.to_json() for r in results], indent=2) + "\n"


@cli.command()
@click.argument("target")
@click.option("--steps", default=_DEFAULTS.steps, show_default=True, type=click.IntRange(min=1),
              help="Most Adam steps of the overfit-one-batch check.")
@click.option("--lr", default=_DEFAULTS.lr, show_default=True, type=click.FloatRange(min=0),
              help="Adam learning rate of the overfit-one-batch check.")
@click.option("--device", default=None, help="Run the checks on this device (default: the model's device).")
@click.option("--seed", default=_DEFAULTS.seed, show_default=True, type=int, help="Seed of the checks.")
@click.option("--fail-on", type=click.Choice(FAIL_ON), default="error", show_default=True,
              help="Exit 1 when a check ends at least here: warning (warn or fail) or error (fail).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="Output: a table, or a JSON array.")
@click.option("--skip", multiple=True, type=click.Choice(CHECKS), help="Do not run this check (repeatable).")
@click.option("--overfit-target", default=_DEFAULTS.overfit_target, show_default=True, type=_FRACTION,
              help="Overfit passes when the loss falls to this fraction of its initial value.")
@click.option("--overfit-floor", default=_DEFAULTS.overfit_floor, show_default=True, type=_POSITIVE,
              help="... or when it falls below this absolute value.")
@click.option("--vanishing-ratio", default=_DEFAULTS.vanishing_ratio, show_default=True, type=_POSITIVE,
              help="Layer gradient RMS below this times the median layer's is vanishing.")
@click.option("--vanishing-norm", default=_DEFAULTS.vanishing_norm, show_default=True, type=_POSITIVE,
              help="Global gradient norm below this is no learning signal (fail).")
@click.option("--exploding-norm", default=_DEFAULTS.exploding_norm, show_default=True, type=_POSITIVE,
              help="Global gradient norm above this is exploding.")
@click.option("--spread-ratio", default=_DEFAULTS.spread_ratio, show_default=True, type=_POSITIVE,
              help="Largest/smallest layer gradient RMS above this is vanishing (shrinks towards the input) "
                   "or exploding (grows towards it).")
@click.option("--dead-fraction", default=_DEFAULTS.dead_fraction, show_default=True, type=_FRACTION,
              help="Report a ReLU layer with more than this fraction of dead units.")
@click.option("--saturation-fraction", default=_DEFAULTS.saturation_fraction, show_default=True, type=_FRACTION,
              help="Report a sigmoid/tanh layer with more than this fraction of saturated outputs.")
def doctor(target: str, fail_on: str, fmt: str, **options: Any) -> None:
    """Pre-flight checks on the model and batch that TARGET's factory returns.

    TARGET is path/to/script.py:factory or package.module:factory; the factory takes no arguments
    and returns (model, batch, loss_fn). Exit 0 when no check ends at or above --fail-on, 1
    otherwise, 2 when TARGET cannot be loaded.
    """
    from gradwatch.doctor import load_target

    start = time.perf_counter()
    model, batch, loss_fn = load_target(target)
    results = diagnose(model, batch, loss_fn, **options)
    if fmt == "json":
        click.echo(render_json(results), nl=False)
    else:
        render_text(results, target, fail_on, time.perf_counter() - start, sys.stdout)
    click.get_current_context().exit(exit_code(results, fail_on))


__all__ = ["doctor", "render_json", "render_text"]
