"""Store: the run's on-disk format, with its writer and its reader side by side.

The names below are loaded on first use: a training process that only writes a run never imports
the reader, and with it pandas (a quarter of a second and tens of MiB).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Run": "gradwatch.store.reader",
    "open_run": "gradwatch.store.reader",
    "DB_NAME": "gradwatch.store.schema",
    "SCHEMA_VERSION": "gradwatch.store.schema",
    "StoreWriter": "gradwatch.store.writer",
    "create_store": "gradwatch.store.writer",
}

__all__ = ["DB_NAME", "SCHEMA_VERSION", "Run", "StoreWriter", "create_store", "open_run"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'gradwatch.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
