"""A folder named ``gradwatch`` in the current directory, which Python run there imports in place of gradwatch.

Python puts a script's folder (or, for ``python -c`` and ``python -m``, the current directory) first
on ``sys.path``. A folder named ``gradwatch`` there — an output folder, say — is then imported as the
package: with gradwatch installed in editable mode (``pip install -e``, whose finder comes after the
folders of ``sys.path``) as an empty namespace package, so that ``gw.open_run`` fails with
``AttributeError: module 'gradwatch' has no attribute 'open_run'`` and nothing of gradwatch's runs to
explain it. The ``gradwatch`` command itself is not affected (its script's folder comes first), so it
is where the folder can be named: :func:`hiding_folder` finds it, :func:`warn` says so on stderr.
"""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from pathlib import Path

import click


def hiding_folder(where: Path) -> Path | None:
    """The folder that ``import gradwatch`` in a script run from ``where`` would import in place of this gradwatch."""
    try:
        spec = PathFinder.find_spec("gradwatch", [str(where), *sys.path[1:]])
    except (ImportError, OSError, ValueError):
        return None
    if spec is None:
        return None
    ours = Path(__file__).resolve().parents[1]
    if spec.origin not in (None, "namespace"):  # a regular package: this one, or another one named gradwatch
        found = Path(spec.origin).resolve().parent
        return None if found == ours else found
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    return folders[0] if folders else None


def warn(where: Path | None = None) -> None:
    """One line on stderr when a folder in ``where`` (the current directory) hides gradwatch from scripts run there."""
    try:
        folder = hiding_folder(Path.cwd() if where is None else where)
    except OSError:  # the current directory was removed
        return
    if folder is not None:
        click.echo(f"gradwatch: warning: the folder '{folder}' hides the gradwatch package from Python run in "
                   "this directory: `import gradwatch` there imports that folder instead (AttributeError: module "
                   "'gradwatch' has no attribute ...); rename it, e.g. to runs/", err=True)
