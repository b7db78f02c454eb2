"""gradwatch: gradient observability and debugging for PyTorch.

Attach with one line, train as usual, then read the run::

    import gradwatch as gw
    model = gw.watch(model, run="runs/exp1")
    ...  # an ordinary training loop
    run = gw.open_run("runs/exp1")
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from gradwatch.errors import (
    ConfigError,
    DiskFullWarning,
    GradwatchError,
    GradwatchWarning,
    InternalWarning,
    PluginWarning,
    RunError,
    SchemaError,
    TrainingHalted,
)
from gradwatch.version import __version__

if _TYPE_CHECKING:
    from gradwatch.rules import Rule
    from gradwatch.store.findings import Finding
    from gradwatch.store.reader import Run, open_run
    from gradwatch.watching.registry import unwatch, watch, watcher
    from gradwatch.watching.watcher import Watcher

#: public names imported on first use, so that ``import gradwatch`` (the pytest plugin, the CLI)
#: does not pay for torch until something needs it
_LAZY = {
    "Finding": "gradwatch.store.findings",
    "Rule": "gradwatch.rules",
    "Run": "gradwatch.store.reader",
    "open_run": "gradwatch.store.reader",
    "unwatch": "gradwatch.watching.registry",
    "watch": "gradwatch.watching.registry",
    "watcher": "gradwatch.watching.registry",
    "Watcher": "gradwatch.watching.watcher",
}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradwatch' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API (``__all__``): what ``dir(gradwatch)`` and tab completion offer."""
    return sorted(__all__)


__all__ = [
    "ConfigError",
    "DiskFullWarning",
    "Finding",
    "GradwatchError",
    "GradwatchWarning",
    "InternalWarning",
    "PluginWarning",
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
