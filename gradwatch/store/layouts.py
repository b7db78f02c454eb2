"""Store reader, layouts: the layers and parameters a run's vectors follow, by layout version."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from gradwatch.errors import RunError
from gradwatch.store import decode
from gradwatch.store.names import owner_name
from gradwatch.store.records import LAYER, PARAM, Layout


class Layouts:
    """The layouts half of :class:`gradwatch.store.reader.Run`: a layout version is the model's layers and
    parameters in model order, with their ownership, as the steps written with it saw them.
    """

    _db: Path
    _conn: sqlite3.Connection
    path: Path

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # Run's

    def _latest_layout(self) -> int:
        row = self._query("SELECT MAX(layout) FROM layouts")[0][0]
        return decode.integer(self._db, "a layout version", row) if row is not None else 0

    def _entries(self, layout: int, scope: str) -> list[str]:
        rows = self._query(
            "SELECT name FROM entries WHERE layout = ? AND scope = ? ORDER BY idx", (layout, scope)
        )
        decode.entries(self._db, rows, f"the layout {layout}")
        return [r[0] for r in rows]

    @property
    def layers(self) -> list[str]:
        """Layer names (module paths) in model order."""
        return self._entries(self._latest_layout(), LAYER)

    @property
    def parameters(self) -> list[str]:
        """Parameter names in model order."""
        return self._entries(self._latest_layout(), PARAM)

    def layer_info(self) -> pd.DataFrame:
        """One row per layer: name, module type, parameter count, leaf flag (latest layout)."""
        rows = self._query(
            "SELECT name, type, numel, leaf FROM entries WHERE layout = ? AND scope = ? ORDER BY idx",
            (self._latest_layout(), LAYER),
        )
        decode.entries(self._db, rows, "the latest layout")
        frame = pd.DataFrame(rows, columns=["layer", "type", "params", "leaf"])
        frame["leaf"] = frame["leaf"].astype(bool)
        return frame

    def layout(self, version: int | None = None) -> Layout:
        """The layout (layers, parameters, ownership) that vectors of a layout version follow.

        Stores written before ``layout_info`` existed lack ownership and trainability: a
        parameter is then owned by the layer whose name prefixes it, every parameter counts as
        trainable and no layer as saturating.
        """
        version = self._latest_layout() if version is None else version
        rows = self._query("SELECT scope, name, type, numel, leaf FROM entries WHERE layout = ? ORDER BY idx",
                           (version,))
        layers = [r for r in rows if r[0] == LAYER]
        params = [r for r in rows if r[0] == PARAM]
        for scope in (layers, params):
            decode.entries(self._db, [r[1:] for r in scope], f"the layout {version}")
        if not layers:
            raise RunError(f"the run at {str(self.path)!r} has no layout {version}")
        try:
            info_rows = self._conn.execute("SELECT data FROM layout_info WHERE layout = ?", (version,)).fetchall()
        except sqlite3.OperationalError as exc:  # a store from before the table existed
            if "no such table" not in str(exc):
                raise decode.sqlite_error(self._db, exc) from None
            info_rows = []
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a damaged schema's message may not decode
            raise decode.sqlite_error(self._db, exc) from None
        names = [r[1] for r in layers]
        if info_rows:
            owners, saturating, trainable, eps, renewed = decode.layout_info(self._db, version, info_rows[0][0],
                                                                             len(layers), len(params))
        else:
            position = {n: i for i, n in enumerate(names)}
            owners = tuple((position[owner], j) for j, r in enumerate(params)
                           if (owner := owner_name(r[1], position)) is not None)
            saturating, trainable, eps, renewed = (), (True,) * len(params), (), ()
        return Layout(
            version=version,
            layers=tuple(names),
            layer_types=tuple(r[2] for r in layers),
            layer_numel=tuple(int(r[3]) for r in layers),
            params=tuple(r[1] for r in params),
            param_numel=tuple(int(r[3]) for r in params),
            owners=owners,
            leaves=tuple(i for i, r in enumerate(layers) if r[4]),
            saturating=saturating,
            trainable=trainable,
            eps=eps,
            renewed=renewed,
        )
