"""CLI ``gradwatch dashboard``: serve the live web dashboard of the runs under a folder."""

from __future__ import annotations

from pathlib import Path

import click

from gradwatch.cli import cli


@cli.command()
@click.argument("root", default="runs", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. The default serves this machine only; the dashboard has no login, so "
                   "any other address lets whoever reaches it read the runs.")
@click.option("--port", default=6007, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0 picks a free one).")
def dashboard(root: Path, host: str, port: int) -> None:
    """Serve the live web dashboard of the runs under ROOT (default: runs) and print its URL."""
    if not root.is_dir():
        raise click.UsageError(f"no such folder: {str(root)!r}")
    from gradwatch.dashboards.server import bind, is_loopback, serve, url

    sock = bind(host, port)
    click.echo(f"gradwatch dashboard: the runs under {root} at {url(host, sock.getsockname()[1])}  (Ctrl-C to stop)")
    if not is_loopback(host):
        click.echo(f"gradwatch: warning: listening on {host}: the dashboard has no login, anyone who can reach this "
                   "address can read these runs", err=True)
    serve(root, sock, host=host)


__all__ = ["dashboard"]
