"""CLI ``gradwatch ls``: the runs under a folder, with steps, status and verdict."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from gradwatch import encoding
from gradwatch.cli import cli
from gradwatch.cli.formats import log_console
from gradwatch.store.listing import describe_run, find_runs


@cli.command(name="ls")
@click.argument("root", default="runs", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True,
              help="A table, or JSON (one object per run).")
def ls(root: Path, fmt: str) -> None:
    """List the runs under ROOT with steps, status and verdict."""
    if not root.exists():
        raise click.UsageError(f"no such folder: {str(root)!r}")
    rows = [describe_run(d, root) for d in find_runs(root)]
    if fmt == "json":
        click.echo(encoding.dumps(rows, indent=2))
        return
    console = log_console(sys.stdout)
    if not rows:
        console.print(f"no runs under {escape(str(root))}")
        return
    table = Table()
    for col, justify in (("run", "left"), ("steps", "right"), ("status", "left"), ("verdict", "left"),
                         ("findings (error/warning/info)", "right"), ("updated", "left")):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in rows:
        counts = row["findings"]
        verdict = ("unreadable: " + row["error"]) if row.get("error") else (
            "clean" if not row["worst"] else f"worst: {row['worst']}")
        table.add_row(escape(row["run"]), "-" if row["steps"] is None else str(row["steps"]),
                      escape(row.get("status_detail", row["status"])),
                      escape(verdict),
                      "-" if counts is None else f"{counts['error']}/{counts['warning']}/{counts['info']}",
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["updated"])))
    console.print(table)


__all__ = ["ls"]
