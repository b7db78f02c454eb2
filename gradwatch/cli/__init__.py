"""CLI: the ``gradwatch`` command; every expected error becomes one line on stderr and exit 2."""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from collections.abc import Sequence
from typing import Any

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
    "ls": "gradwatch.cli.ls",
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

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                             list[str]]:
        """The command named first in ``args``; an unknown name is refused with the closest command's."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            name = args[0] if args else ""
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1, cutoff=0.6)
            if not close or not exc.format_message().startswith("No such command"):
                raise
            raise click.UsageError(f"No such command {name!r}. Did you mean {close[0]!r}?", ctx) from None

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Run the command; in standalone mode every error is one ``gradwatch: error: ...`` line and exit 2.

        Click's own usage errors (a bad option value, a missing argument, an unknown command) would
        print a usage block and an ``Error:`` line; they become the same one line as gradwatch's.
        """
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            click.echo(one_line(exc), err=True)
            sys.exit(USAGE_ERROR if isinstance(exc, click.UsageError) else exc.exit_code)
        except click.Abort:  # Ctrl-C, or the end of input at a prompt
            click.echo("gradwatch: aborted", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)

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


def one_line(exc: click.ClickException) -> str:
    """A click error (a bad option, a missing argument ...) as the one line gradwatch prints for every error."""
    message = " ".join(exc.format_message().split())
    message = re.sub(r"\. Did you mean (.+)\?$", r" (did you mean \1?)", message)  # then "; see ..."
    message = re.sub(r" is not a valid (integer|float) range\b",  # click's name of its IntRange, FloatRange
                     lambda m: " is not a whole number" if m.group(1) == "integer" else " is not a number", message)
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        message = f"{message.rstrip('.')}; see '{ctx.command_path} --help'"
    return f"gradwatch: error: {message}"


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: the command's exit status."""
    from gradwatch.cli import shadowed

    shadowed.warn()  # a folder named gradwatch here, which scripts run here would import instead of gradwatch
    try:
        cli.main(args=argv, prog_name="gradwatch", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    return 0

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
