"""Report summary: the run's facts and the one-sentence verdict at the top of the page."""

from __future__ import annotations

from typing import Any

import pandas as pd

from gradwatch.report.items import Item
from gradwatch.report.text import duration, fmt, stamp
from gradwatch.store import verdict
from gradwatch.store.reader import Run


def facts(run: Run, meta: dict[str, Any], status: str, steps_info: pd.DataFrame,
          scalars: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, value) pairs describing the run: model, size, steps, time, learning rate, rules ...

    Only what the run recorded is listed (an optimizer, for instance, only when its metadata names it).
    """
    out: list[tuple[str, str]] = [("model", str(meta.get("model", "—")))]
    params = meta.get("parameters")
    if params is not None:
        trainable = meta.get("trainable")
        extra = f" ({fmt(trainable)} trainable)" if trainable is not None and trainable != params else ""
        out.append(("parameters", fmt(params) + extra))
    out.append(("steps", fmt(run.steps)))
    created, end = meta.get("created"), meta.get("finished")
    if not isinstance(end, int | float) and len(steps_info):
        end = float(steps_info["time"].iloc[-1])  # still running, or killed: up to the last step
    if isinstance(created, int | float) and isinstance(end, int | float):
        out.append(("duration", duration(max(0.0, end - created))))
    started = stamp(created)
    if started:
        out.append(("started", started))
    for key in ("optimizer", "optimizers"):
        value = meta.get(key)
        if value:
            out.append(("optimizer", ", ".join(map(str, value)) if isinstance(value, list) else str(value)))
    lr = scalars["lr"].dropna() if "lr" in scalars else pd.Series(dtype=float)
    if len(lr):
        lo, hi = float(lr.min()), float(lr.max())
        first, last = fmt(float(lr.iloc[0])), fmt(float(lr.iloc[-1]))
        out.append(("learning rate", fmt(lo) if lo == hi else f"{fmt(lo)} – {fmt(hi)} (first {first}, last {last})"))
    out.append(("status", verdict.describe(verdict.ended(status, verdict.read(run.path)))))
    options = meta.get("options") or {}
    if isinstance(options, dict) and "log_every" in options:
        out.append(("logging", f"every {options.get('log_every')} step(s), detailed every "
                               f"{options.get('sample_every')}"))
    restarts = run.restarts
    if restarts:
        out.append(("resumed", ", ".join(f"at step {fmt(r['step'])}" + (f" ({fmt(r['superseded'])} earlier steps "
                                                                        "superseded)" if r["superseded"] else "")
                                         for r in restarts)))
    skipped = int(steps_info["skipped"].sum()) if len(steps_info) else 0
    if skipped:
        out.append(("skipped steps", fmt(skipped)))
    versions = [f"{k.split('_')[0]} {meta[k]}" for k in ("gradwatch_version", "torch_version") if meta.get(k)]
    if versions:
        out.append(("versions", ", ".join(versions)))
    rules = meta.get("rules")
    if isinstance(rules, dict):
        listed = rules.get("rules") or []
        out.append(("rules", str(rules.get("source", "—")) + (f": {'  ·  '.join(map(str, listed))}" if listed else "")))
    elif rules is not None:
        out.append(("rules", str(rules)))
    return out


def counts(findings: pd.DataFrame) -> dict[str, int]:
    """Findings (``run.findings()``) counted by severity."""
    return {s: int((findings["severity"] == s).sum()) for s in ("info", "warning", "error")}


def state(status: str, counts: dict[str, int]) -> str:
    """The run's verdict for people: ``halted``, ``errors``, ``warnings`` or ``healthy``."""
    return ("halted" if status == "halted" else "errors" if counts["error"] else
            "warnings" if counts["warning"] else "healthy")


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' * (n != 1)}"


def headline(state: str, status: str, counts: dict[str, int], items: list[Item], steps: int,
             live: bool = False, halted: dict[str, Any] | None = None, ended: dict[str, Any] | None = None) -> str:
    """One or two sentences: what happened to the run, and where to look first.

    ``live``: for a page that follows the run as it trains (no "snapshot" caveat, no step count).
    ``halted``: the verdict's ``halted`` (its step and reason), for a halt no rule's finding made
    (the skips or rollbacks that ran out). ``ended``: how the run ended (``Run.ended``).
    """
    if state == "halted":
        halt = next((i for i in items if i.action == "halt"), None)
        where = f" at step {halt.step}: {halt.kind} in {halt.where}" if halt else ""
        if halt is None and halted and halted.get("reason"):
            where = f" at step {halted.get('step')}: {halted['reason']}"
        head = f"Training was halted{where}."
    elif state == "errors":
        first = next(i for i in items if i.severity == "error")
        done = f" (action: {first.action})" if first.action else ""
        head = (f"{_plural(counts['error'], 'error')}; the first: {first.kind} in {first.where} "
                f"at step {first.step}{done}.")
    elif state == "warnings":
        kinds = sorted({i.kind for i in items if i.severity == "warning"})
        head = f"{_plural(counts['warning'], 'warning')} ({', '.join(kinds)}), no errors."
    elif live and status == "running":
        head = "No warnings or errors so far."
    else:
        head = f"No warnings or errors in {_plural(steps, 'step')}."
    if state in ("errors", "halted") and counts["warning"]:
        head += f" Also {_plural(counts['warning'], 'warning')}."
    if status == "running" and not live:
        head += " The run is still being written: this report is a snapshot."
    elif status in ("terminated", "exited") or status == "crashed" and ended and len(ended) > 1:
        head += f" The training process ended before the run finished: {verdict.describe(ended or {'status': status})}."
    elif status == "crashed":
        head += " The training process died before closing the run."
    return head
