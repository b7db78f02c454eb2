"""Store: the run's on-disk format, with its writer and its reader side by side."""

from gradwatch.store.reader import Run, open_run
from gradwatch.store.schema import DB_NAME, SCHEMA_VERSION
from gradwatch.store.writer import StoreWriter, create_store

__all__ = ["DB_NAME", "SCHEMA_VERSION", "Run", "StoreWriter", "create_store", "open_run"]
