"""CLI ``gradwatch report``: write a run's self-contained HTML diagnostic report."""

from __future__ import annotations

import os
from pathlib import Path

import click

from gradwatch.cli import cli


@cli.command()
@click.argument("run", type=click.Path(path_type=str))
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report to this file (default: <run>/report.html).")
def report(run: str, output: Path | None) -> None:
    """Write a self-contained HTML diagnostic report of RUN and print its path."""
    from gradwatch.report import write

    path = write(run, output)
    # its bytes as the filesystem has them: a non-ASCII path prints whatever the locale's encoding (not '?')
    click.echo(os.fsencode(path) + b"\n", nl=False)


__all__ = ["report"]
