"""Verdict: the run's outcome in one small JSON file (``verdict.json``), written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradwatch import encoding
from gradwatch.files import write_text_atomic

VERDICT = "verdict.json"


def write(run_dir: Path, verdict: dict[str, Any]) -> None:
    """Write ``verdict.json`` through a temporary file and a rename (never half-written)."""
    text = encoding.dumps(verdict, indent=2, default=str) + "\n"
    write_text_atomic(run_dir / VERDICT, text, "the verdict")


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's verdict, or None when it has none (still running, or killed)."""
    try:
        return json.loads((run_dir / VERDICT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def halted(run_dir: Path) -> dict[str, Any] | None:
    """The verdict's ``halted`` (``step``, ``reason``): None when the run was not halted or has no verdict."""
    found = read(run_dir)
    halt = found.get("halted") if isinstance(found, dict) else None
    return halt if isinstance(halt, dict) and halt.get("reason") else None
