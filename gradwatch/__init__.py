"""gradwatch: gradient observability and debugging for PyTorch.

Attach with one line, train as usual, then read the run::

    import gradwatch as gw
    model = gw.watch(model, run="runs/exp1")
    ...  # an ordinary training loop
    run = gw.open_run("runs/exp1")
"""

from __future__ import annotations

__version__ = "0.1.0"

from gradwatch.errors import (
    ConfigError,
    GradwatchError,
    GradwatchWarning,
    InternalWarning,
    RunError,
    SchemaError,
    TrainingHalted,
)
from gradwatch.findings import Finding
from gradwatch.registry import unwatch, watch, watcher
from gradwatch.rules import Rule
from gradwatch.store.reader import Run, open_run
from gradwatch.watcher import Watcher

__all__ = [
    "ConfigError",
    "Finding",
    "GradwatchError",
    "GradwatchWarning",
    "InternalWarning",
    "Rule",
    "Run",
    "RunError",
    "SchemaError",
    "TrainingHalted",
    "Watcher",
    "__version__",
    "open_run",
    "unwatch",
    "watch",
    "watcher",
]
