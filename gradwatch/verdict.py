"""Verdict: the run's outcome in one small JSON file (``verdict.json``), written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

VERDICT = "verdict.json"


def write(run_dir: Path, verdict: dict[str, Any]) -> None:
    """Write ``verdict.json`` through a temporary file and a rename (never half-written)."""
    tmp = run_dir / f".{VERDICT}.tmp"
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(verdict, fh, indent=2, allow_nan=False, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, run_dir / VERDICT)


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's verdict, or None when it has none (still running, or killed)."""
    try:
        return json.loads((run_dir / VERDICT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
