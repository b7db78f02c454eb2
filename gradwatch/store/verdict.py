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


#: the statuses of a run that did not finish (``gradwatch check`` fails them unless accepted)
UNFINISHED = ("terminated", "exited", "crashed", "running")


def ended(status: str, found: dict[str, Any] | None) -> dict[str, Any]:
    """How the run ended: ``status``, with the verdict's ``signal``, ``code``, ``message`` or ``exception``."""
    out: dict[str, Any] = {"status": status}
    if isinstance(found, dict) and found.get("status") == status:
        for key in ("signal", "code", "message", "exception"):
            value = found.get(key)
            if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
                out[key] = value
    return out


def describe(ended_: dict[str, Any]) -> str:
    """One line for people: ``terminated (signal 15, SIGTERM)``, ``exited (code 1: out of data)``,
    ``crashed (ValueError: bad batch)``, or the bare status.
    """
    status = str(ended_.get("status"))
    parts = []
    if "signal" in ended_:
        parts.append(f"signal {ended_['signal']}{_signal_name(ended_['signal'])}")
    if "code" in ended_:
        parts.append(f"code {ended_['code']}" + (f": {ended_['message']}" if "message" in ended_ else ""))
    if "exception" in ended_:
        parts.append(str(ended_["exception"]))
    return f"{status} ({'; '.join(parts)})" if parts else status


def _signal_name(number: int) -> str:
    import signal

    try:
        return f", {signal.Signals(number).name}"
    except ValueError:
        return ""
