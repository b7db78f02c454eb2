"""CLI: the ``gradwatch`` command; every expected error becomes one line on stderr and exit 2."""

from __future__ import annotations

import sys

import click

from gradwatch import __version__
from gradwatch.errors import GradwatchError

USAGE_ERROR = 2


class _Group(click.Group):
    """A click group that reports gradwatch errors as one line, without a traceback."""

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
    from gradwatch.cli import check, demo  # noqa: F401  (registers the commands)

    try:
        cli.main(args=argv, prog_name="gradwatch", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
