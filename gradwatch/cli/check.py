"""CLI ``gradwatch check``: the CI gate."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gradwatch.cli import USAGE_ERROR, cli
from gradwatch.cli.checked import Checked, expand, judge_run
from gradwatch.cli.formats import FORMATS, render_github, render_json, render_junit, render_text
from gradwatch.files import write_text_atomic
from gradwatch.judging import gate
from gradwatch.store import owned, verdict

__all__ = ["USAGE_ERROR", "Checked", "check", "judge_run", "render_github", "render_json", "render_junit",
           "render_text"]


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
        if output is None:  # an unreadable run is said once, on stderr (below), not in the table too
            render_text([r for r in results if r.error is None], sys.stdout)
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

