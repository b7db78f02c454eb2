"""Store decoding: every value read back from a run store is checked before it is used.

SQLite keeps whatever a damaged file, a bit flip or a hand edit left in a column: text where a
number belongs, JSON that does not parse, a blob that is not a packed vector. The reader decodes
through these functions, and a value the writer could not have written is a
:class:`~gradwatch.errors.DamagedStoreError` that names the run and what is wrong, never a
``JSONDecodeError`` or ``zlib.error`` from deep inside a reader.
"""

from __future__ import annotations

import json
import math
import sqlite3
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from gradwatch.errors import DamagedStoreError, RunError
from gradwatch.store.schema import RAW, ZLIB

#: words in SQLite's messages for a store that cannot be read now, though nothing is wrong with it
_PASSING = ("database is locked", "database table is locked", "busy", "unable to open", "disk i/o error",
            "readonly", "interrupted")
#: metadata the writer records, with the JSON types their values have (None is allowed too)
META_TYPES: dict[str, tuple[type, ...]] = {
    "schema_version": (int,), "status": (str,), "model": (str,), "host": (str,), "pid": (int,),
    "created": (int, float), "finished": (int, float), "parameters": (int,), "trainable": (int,),
    "options": (dict,), "world_size": (int,), "gradwatch_version": (str,), "torch_version": (str,),
    "python_version": (str,),
}
SEVERITIES = ("info", "warning", "error")


def damaged(db: Path, what: str) -> DamagedStoreError:
    """The error for a store holding something its writer could not have written."""
    return DamagedStoreError(f"the run store {str(db)!r} is damaged: {what}")


def sqlite_error(db: Path, exc: sqlite3.Error | UnicodeDecodeError) -> RunError:
    """SQLite's error as gradwatch's: a store that cannot be read now, or a damaged one."""
    text = _short(" ".join(str(exc).split()), 200)  # one line: SQLite quotes schema text, newlines and all
    if any(word in text.lower() for word in _PASSING):
        return RunError(f"the run store {str(db)!r} cannot be read: {text}")
    return DamagedStoreError(f"the run store {str(db)!r} is damaged (corrupted, truncated or not a database): {text}")


@contextmanager
def decoding(db: Path, what: str) -> Iterator[None]:
    """Turn a failure to decode stored values into a DamagedStoreError saying what was being read.

    Such failures are a number stored as text, an array of the wrong shape, and the like.
    """
    try:
        yield
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, zlib.error) as exc:
        raise damaged(db, f"{what}: {type(exc).__name__}: {_short(str(exc))}") from None


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = text.replace("\n", "\\n").replace("\r", "\\r")  # messages are one line
    return text if len(text) <= limit else text[:limit] + "..."


def json_text(db: Path, what: str, value: Any) -> Any:
    """Decode a JSON text column."""
    if not isinstance(value, str):
        raise damaged(db, f"{what} is not JSON text (it holds {type(value).__name__} {_short(value)})")
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise damaged(db, f"{what} is not valid JSON ({_short(value)!r})") from None


def meta(db: Path, rows: Sequence[tuple[Any, Any]]) -> dict[str, Any]:
    """The run's metadata, each value decoded and the writer's own keys of their types."""
    out: dict[str, Any] = {}
    for key, text in rows:
        if not isinstance(key, str):
            raise damaged(db, f"a metadata key is not text ({_short(key)})")
        value = json_text(db, f"metadata {key!r}", text)
        kinds = META_TYPES.get(key)
        if kinds is not None and value is not None:
            number = float in kinds
            ok = isinstance(value, kinds) and not isinstance(value, bool)
            if not ok or (number and not math.isfinite(value)):
                raise damaged(db, f"metadata {key!r} holds {_short(value)}, not a "
                                  f"{'finite number' if number else kinds[0].__name__}")
        out[key] = value
    return out


def incomplete(db: Path, value: Any) -> dict[str, Any] | None:
    """The run's ``incomplete`` metadata (``reason``, ``missing_steps``, ``steps`` ranges), checked; None if absent."""
    if value is None:
        return None
    ok = (isinstance(value, dict) and isinstance(value.get("reason"), str)
          and isinstance(value.get("missing_steps"), int) and isinstance(value.get("steps"), list)
          and all(isinstance(r, list) and len(r) == 2 and all(type(s) is int and s >= 0 for s in r) and r[0] <= r[1]
                  for r in value["steps"]))
    if not ok:
        raise damaged(db, f"metadata 'incomplete' holds {_short(value)}, not the steps a run lacks")
    return value


def integer(db: Path, what: str, value: Any) -> int:
    """A whole number >= 0 the writer stored: a step, a size, a version.

    SQLite would also hand back text, a blob or anything else a damage left.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise damaged(db, f"{what} is not a whole number >= 0 ({_short(value)})")
    return value


def findings(db: Path, rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Finding rows (step, kind, severity, layer, phase, message, action, data), checked, data decoded."""
    out = []
    for step, kind, severity, layer, phase, message, action, data in rows:
        where = f"a finding at step {_short(step)}"
        integer(db, f"the step of {where}", step)
        if not isinstance(kind, str) or not kind:
            raise damaged(db, f"the kind of {where} is not a name ({_short(kind)})")
        if severity not in SEVERITIES:
            raise damaged(db, f"the severity of {where} is {_short(severity)}, not one of {', '.join(SEVERITIES)}")
        for name, value in (("layer", layer), ("phase", phase), ("action", action)):
            if value is not None and not isinstance(value, str):
                raise damaged(db, f"the {name} of {where} is not text ({_short(value)})")
        if not isinstance(message, str):
            raise damaged(db, f"the message of {where} is not text ({_short(message)})")
        decoded = {} if data is None or data == "" else json_text(db, f"the data of {where}", data)
        if not isinstance(decoded, dict):
            raise damaged(db, f"the data of {where} is not a JSON object ({_short(data)})")
        out.append((step, kind, severity, layer, phase, message, action, decoded))
    return out


def layout_info(db: Path, version: int, text: Any, layers: int, params: int) -> tuple[Any, Any, Any, Any, Any]:
    """(owners, saturating, trainable, eps, renewed) of a layout, checked against its numbers of layers and
    parameters (``eps`` and ``renewed`` empty for a run stored before they were kept).
    """
    what = f"the layout {version}"
    info = json_text(db, what, text)
    if not isinstance(info, dict):
        raise damaged(db, f"{what} is not a JSON object")
    with decoding(db, what):
        owners = tuple((int(a), int(b)) for a, b in info["owners"])
        saturating = tuple(int(i) for i in info["saturating"])
        trainable = tuple(bool(t) for t in info["trainable"])
        eps = tuple(float(e) for e in info.get("eps", ()))
        renewed = tuple(int(i) for i in info.get("renewed", ()))
    if any(not (0 <= a < layers and 0 <= b < params) for a, b in owners) or \
            any(not 0 <= i < layers for i in (*saturating, *renewed)) or len(trainable) not in (0, params) or \
            len(eps) not in (0, params):
        raise damaged(db, f"{what} refers to layers or parameters it does not have")
    return owners, saturating, trainable, eps, renewed


def vector(db: Path, codec: Any, data: Any, mask: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`gradwatch.store.schema.pack`, checking codec, sizes and presence mask."""
    if codec not in (RAW, ZLIB) or not isinstance(data, bytes) or not (mask is None or isinstance(mask, bytes)):
        raise damaged(db, f"a stored vector is not a packed vector (codec {_short(codec)}, "
                          f"data of type {type(data).__name__})")
    try:
        raw = zlib.decompress(data) if codec == ZLIB else data
    except zlib.error:
        raise damaged(db, "a compressed vector does not decompress") from None
    if len(raw) != 4 * n:
        raise damaged(db, f"a vector holds {len(raw)} bytes where its layout has {n} entries ({4 * n} bytes)")
    if mask is not None and len(mask) != (n + 7) // 8:
        raise damaged(db, f"a vector's presence mask holds {len(mask)} bytes where its layout needs {(n + 7) // 8}")
    values = np.frombuffer(raw, dtype="<f4")
    if mask is None:
        return values, np.ones(n, dtype=bool)
    return values, np.unpackbits(np.frombuffer(mask, dtype=np.uint8), count=n).astype(bool)


#: the first stored vector that is not a packed vector of its layout (codec, types, sizes: SQLite reads
#: the blobs' types and lengths without their bytes), with its layout's size: one table scan
MISPACKED = """
WITH sizes AS (SELECT layout, scope, COUNT(*) AS n FROM entries GROUP BY layout, scope)
SELECT v.codec, v.data, v.mask, COALESCE(s.n, 0) FROM vectors v
LEFT JOIN sizes s ON s.layout = v.layout AND s.scope = v.scope
WHERE v.codec NOT IN (0, 1) OR typeof(v.data) != 'blob' OR (v.codec = 0 AND length(v.data) != 4 * COALESCE(s.n, 0))
   OR (v.mask IS NOT NULL AND (typeof(v.mask) != 'blob' OR length(v.mask) != (COALESCE(s.n, 0) + 7) / 8))
LIMIT 1
"""


def packed(db: Path, rows: Sequence[tuple[Any, ...]]) -> None:
    """Raise the error a read of it would raise for a vector :data:`MISPACKED` found (rows: none, or that one)."""
    for codec, data, mask, n in rows:
        vector(db, codec, data, mask, n)


def entries(db: Path, rows: Sequence[tuple[Any, ...]], what: str) -> None:
    """Check the entry rows of one layout and scope: (name[, type[, numel]]), names text and unique."""
    for row in rows:
        if not isinstance(row[0], str) or (len(row) > 1 and not isinstance(row[1], str)):
            raise damaged(db, f"{what}: an entry name or type is not text ({_short(row[0])})")
        if len(row) > 2:
            integer(db, f"{what}: the size of {row[0]!r}", row[2])
    if len({row[0] for row in rows}) != len(rows):
        raise damaged(db, f"{what}: a name appears twice")


def checked(db: Path, what: str, values: Mapping[str, Any]) -> None:
    """Check that each named value is a whole number (step numbers, counts, row ids)."""
    for name, value in values.items():
        if value is not None:
            integer(db, f"{what}: {name}", value)
