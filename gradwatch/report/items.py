"""Report findings: each finding with its outcome, evidence and the series that shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gradwatch.encoding import whole
from gradwatch.report.remedies import explain
from gradwatch.report.text import fmt
from gradwatch.rootcause import words
from gradwatch.store.findings import rank
from gradwatch.store.reader import Run
from gradwatch.store.records import layer_scalar
from gradwatch.wording import place

#: findings explained one by one (all are listed in the table)
MAX_CARDS = 200
#: steps of history shown before (and after) a finding in its sparkline
SPARK_BEFORE, SPARK_AFTER = 32, 8
#: keys of a finding's data shown elsewhere (or not worth showing) in its evidence
_NOT_EVIDENCE = {"hint", "repeats", "last_step", "outcome", "layers", "parameters", "origin", "type", "replay_ms"}


@dataclass
class Spark:
    """A finding's evidence series: a metric around its step."""

    label: str
    steps: np.ndarray
    values: np.ndarray
    step: int
    log: bool


@dataclass
class Item:
    """One finding, ready to show."""

    index: int
    step: int
    kind: str
    severity: str
    layer: str | None
    phase: str | None
    message: str
    action: str | None
    hint: str | None
    repeats: int
    last_step: int | None
    outcome: str | None
    evidence: list[tuple[str, str]]
    related: list[str]
    restored_step: int | None
    spark: Spark | None = None
    #: the op, line, fact, cause and samples of its root cause (:func:`gradwatch.rootcause.words.rows`)
    root_cause: list[tuple[str, str]] = field(default_factory=list)

    #: where a NaN/Inf was born outside the model's layers (origin tracking's ``source``: input, loss)
    source: str | None = None

    @property
    def where(self) -> str:
        """The layer (and phase); for a NaN/Inf born outside the layers, the input batch or the loss;
        else "global".
        """
        return place(self.layer, self.phase, self.source)


def _outcome(action: str | None, outcome: Any) -> tuple[str | None, int | None]:
    if not isinstance(outcome, dict) or not outcome:
        return None, None
    restored = outcome.get("restored_step")
    if action == "clip" and outcome.get("clipped"):
        text = f"gradients clipped to norm {fmt(outcome.get('max_norm'))}"
        if outcome.get("coef") is not None:
            text += f" (scaled by {fmt(outcome.get('coef'))})"
    elif action == "clip":
        text = f"no clipping needed (norm already below {fmt(outcome.get('max_norm'))})"
    elif action == "skip" or outcome.get("skipped"):
        kept = "weights, buffers" if "buffers_restored" in outcome else "weights"
        text = f"the step was skipped: {kept} and optimizer state unchanged"
        if outcome.get("buffers_changed"):
            text += f" (but not buffer {', '.join(map(str, outcome['buffers_changed'][:8]))}: first changed here)"
        if (outcome.get("consecutive") or 1) > 1:
            text += f" ({outcome['consecutive']} in a row)"
    elif action == "rollback" and outcome.get("rolled_back"):
        text = f"rolled back to the snapshot of step {restored}"
        if outcome.get("skip_batches"):
            text += f", skipping {outcome['skip_batches']} batch(es)"
        if outcome.get("lr_scale") not in (None, 1, 1.0):
            text += f", learning rate x{fmt(outcome['lr_scale'])}"
    elif action == "rollback":
        text = str(outcome.get("reason") or "not rolled back")
    elif action == "scale_lr":
        text = f"learning rate x{fmt(outcome.get('factor'))} (now {fmt(outcome.get('lr'))})"
    else:
        text = ", ".join(f"{k} {fmt(v)}" for k, v in outcome.items() if not isinstance(v, dict | list))
    if outcome.get("samples_skipped"):
        text += f"; sample{'s' if len(outcome['samples_skipped']) > 1 else ''} "
        text += f"{', '.join(map(repr, outcome['samples_skipped'][:8]))} left out of the batches after it"
    return text, whole(restored)


def items(run: Run, findings: pd.DataFrame, scalars: pd.DataFrame | None = None) -> list[Item]:
    """The run's findings (``run.findings()``) ready to show.

    With ``scalars`` (``run.scalars()``), the first ``MAX_CARDS`` explained also get their
    evidence series (a spark); without, no series is read.
    """
    out = []
    for i, row in enumerate(findings.itertuples(index=False)):
        data = row.data if isinstance(row.data, dict) else {}
        layer = row.layer if isinstance(row.layer, str) else None
        action = row.action if isinstance(row.action, str) else None
        outcome, restored = _outcome(action, data.get("outcome"))
        evidence = [(str(k).replace("_", " "), fmt(v)) for k, v in data.items()
                    if k not in _NOT_EVIDENCE and isinstance(v, int | float) and not isinstance(v, bool)]
        if data.get("origin"):
            evidence.append(("origin", str(data["origin"]) + (f" ({data['type']})" if data.get("type") else "")))
        named = [v for v in (data.get("layers"), data.get("parameters")) if isinstance(v, list) and v]
        related = [str(x) for x in (named[0] if named else [])][:8]  # names (a count, as zero_gradient's, is none)
        out.append(Item(
            index=i, step=int(row.step), kind=str(row.kind), severity=str(row.severity), layer=layer,
            phase=row.phase if isinstance(row.phase, str) else None, message=str(row.message), action=action,
            hint=data.get("hint") if isinstance(data.get("hint"), str) else None,
            repeats=whole(data.get("repeats"), 1) or 1,
            last_step=whole(data.get("last_step")),
            outcome=outcome, evidence=evidence, related=related, restored_step=restored, root_cause=words.rows(data),
            source=data.get("source") if isinstance(data.get("source"), str) else None,
        ))
    if scalars is not None:
        for item in card_order(out)[:MAX_CARDS]:
            item.spark = spark(run, item, scalars)
    return out


def card_order(items: list[Item]) -> list[Item]:
    """Findings in the order they are explained: most severe first, then by step."""
    return sorted(items, key=lambda i: (-rank(i.severity) if i.severity in ("info", "warning", "error") else 0,
                                        i.step, i.index))


def spark(run: Run, item: Item, scalars: pd.DataFrame) -> Spark | None:
    """The series that shows a finding: its kind's metric for its layer around its step (the flight
    recorder keeps those steps at full resolution; a scalar ``<metric>/<layer>`` where the statistic is one per
    layer that is no layer of the run, as an attention module's logits), else the layer's gradient norm, else the global
    gradient norm (or the loss, for a loss spike); None when nothing was recorded there.
    """
    kind = explain(item.kind)
    lo, hi = max(0, item.step - SPARK_BEFORE), item.step + SPARK_AFTER + 1
    own = layer_scalar(kind.metric, item.layer) if item.layer is not None else None
    if own is not None and own in scalars:  # a statistic recorded as a scalar per layer (attention logits)
        window = scalars[own].loc[lo:hi - 1].dropna()
        if len(window) and np.isfinite(window.to_numpy(dtype=np.float64)).any():
            return Spark(f"{kind.metric} of {item.layer}", window.index.to_numpy(), window.to_numpy(dtype=np.float64),
                         item.step, kind.log)
    if item.layer is not None and kind.metric != "loss":
        for metric in dict.fromkeys((kind.metric, "grad_norm")):
            try:
                frame = run.metrics(metric, layers=[item.layer], steps=slice(lo, hi), include_global=False)
            except ValueError:  # a layer the run has no series of (a plugin's finding, a damaged store)
                break
            if len(frame) and np.isfinite(frame["value"]).any():
                log = kind.log if metric == kind.metric else True
                return Spark(f"{metric} of {item.layer}", frame["step"].to_numpy(), frame["value"].to_numpy(),
                             item.step, log)
    name = "loss" if kind.metric == "loss" else "grad_norm"
    if name not in scalars:
        return None
    window = scalars[name].loc[lo:hi - 1].dropna(how="all")
    if not len(window):
        return None
    label = "loss" if name == "loss" else "global gradient norm"
    return Spark(label, window.index.to_numpy(), window.to_numpy(dtype=np.float64), item.step, name != "loss")
