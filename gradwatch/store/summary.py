"""Summary: a run condensed for people — global ranges and the layers with extreme gradients."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from gradwatch.store.reader import Run


@dataclass
class Summary:
    """What a terminal summary of a run shows.

    Attributes:
        steps: steps recorded.
        status: the run's status.
        grad_norm_min: smallest finite global gradient norm.
        grad_norm_max: largest finite global gradient norm.
        loss_first: first observed loss (NaN if none).
        loss_last: last observed loss (NaN if none).
        layers: per-layer gradient norm medians, sorted ascending (``layer``, ``type``,
            ``grad_norm``).
    """

    steps: int
    status: str
    grad_norm_min: float
    grad_norm_max: float
    loss_first: float
    loss_last: float
    layers: pd.DataFrame

    def smallest(self, n: int = 5) -> pd.DataFrame:
        """The ``n`` layers with the smallest median gradient norm."""
        return self.layers.head(n)

    def largest(self, n: int = 5) -> pd.DataFrame:
        """The ``n`` layers with the largest median gradient norm, largest first."""
        return self.layers.tail(n).iloc[::-1]


def summarize(run: Run) -> Summary:
    """Compute the summary of a recorded run."""
    scalars = run.scalars()
    norm = scalars["grad_norm"] if "grad_norm" in scalars else pd.Series(dtype=float)
    finite = norm[np.isfinite(norm)]
    loss = scalars["loss"].dropna() if "loss" in scalars else pd.Series(dtype=float)
    grads = run.metrics("grad_norm", include_global=False)
    medians = grads.groupby("layer", sort=False)["value"].median().rename("grad_norm").reset_index()
    info = run.layer_info()[["layer", "type"]]
    layers = info.merge(medians, on="layer").sort_values("grad_norm", kind="stable", ignore_index=True)
    return Summary(
        steps=run.steps,
        status=run.status,
        grad_norm_min=float(finite.min()) if len(finite) else float("nan"),
        grad_norm_max=float(finite.max()) if len(finite) else float("nan"),
        loss_first=float(loss.iloc[0]) if len(loss) else float("nan"),
        loss_last=float(loss.iloc[-1]) if len(loss) else float("nan"),
        layers=layers,
    )
