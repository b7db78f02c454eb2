"""The plotly.js bundle a report carries: LZMA-compressed and base64-encoded, decoded by the page itself."""

from __future__ import annotations

import base64
import functools
import hashlib
import lzma
import os
from dataclasses import dataclass
from pathlib import Path

#: raw LZMA1 settings the page's decoder reads (lc 4, lp 0, pb 0: text; properties byte 4)
FILTERS = [{"id": lzma.FILTER_LZMA1, "preset": 6, "lc": 4, "lp": 0, "pb": 0}]
PROPERTIES = (0 * 5 + 0) * 9 + 4


@dataclass(frozen=True)
class Bundle:
    """plotly.js as a report embeds it."""

    #: the raw LZMA1 stream of plotly.min.js, base64-encoded (about a third of the library's size)
    data: str
    #: the library's size in bytes, decoded
    size: int
    #: the LZMA properties byte (lc, lp, pb) of the stream
    properties: int = PROPERTIES


@functools.cache  # the 4.8 MB library, compressed once per process (and cached on disk across processes)
def plotly_bundle() -> Bundle:
    """plotly.js, compressed for a report: at most a third of the library's size, nothing fetched."""
    from plotly.offline import get_plotlyjs

    source = get_plotlyjs().encode("utf-8")
    digest = hashlib.sha256(source).hexdigest()[:20]
    cache = _cache_dir() / f"plotly-{digest}.lzma"
    packed = _read(cache)
    if packed is None or _unpacked_size(packed) != len(source):
        packed = lzma.compress(source, format=lzma.FORMAT_RAW, filters=FILTERS)  # seconds: kept for next time
        _write(cache, packed)
    return Bundle(data=base64.b64encode(packed).decode("ascii"), size=len(source))


def _unpacked_size(packed: bytes) -> int:
    try:
        return len(lzma.decompress(packed, format=lzma.FORMAT_RAW, filters=FILTERS))
    except lzma.LZMAError:  # a damaged cache file: compressed again
        return -1


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "gradwatch"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _write(path: Path, packed: bytes) -> None:
    """Keep the compressed library for the next process; a cache that cannot be written is no error."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(packed)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
