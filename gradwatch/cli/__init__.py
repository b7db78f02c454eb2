"""CLI: the ``gradwatch`` command; every expected error becomes one line on stderr and exit 2."""

from __future__ import annotations

import importlib
import sys

import click

from gradwatch import __version__
from gradwatch.errors import GradwatchError

USAGE_ERROR = 2


#: command name -> the module that defines it, imported when the command is used (so that
#: ``gradwatch check`` or ``ls`` does not pay for torch, which only ``doctor`` and ``demo`` need)
COMMANDS = {
    "check": "gradwatch.cli.check",
    "dashboard": "gradwatch.cli.dashboard",
    "demo": "gradwatch.cli.demo",
    "doctor": "gradwatch.cli.doctor",
    "ls": "gradwatch.cli.check",
    "report": "gradwatch.cli.report",
}


class _Group(click.Group):
    """A click group that loads its commands on use and reports gradwatch errors as one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            importlib.import_module(COMMANDS[cmd_name])
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except GradwatchError as exc:
            click.echo(f"gradwatch: error: {exc}", err=True)
            ctx.exit(USAGE_ERROR)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gradwatch")
def cli() -> None:
    """Gradient observability and debugging for PyTorch."""


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="gradwatch", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
