"""Snapshots: known-good training state (model, optimizers, schedulers, scaler, RNG) for rollback.

Kept in memory on the CPU by default: each snapshot costs one copy of the parameters, buffers
and optimizer state (about 3x the parameter bytes with Adam), times ``snapshot_keep``. With
``snapshot_dir`` they go to disk instead: written to a temporary file, fsynced, renamed, and
checksummed (SHA-256), and the checksum is verified before a restore.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradwatch.errors import RunError


def to_cpu(obj: Any) -> Any:
    """A deep copy of a state dict with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def rng_state() -> dict[str, Any]:
    """The RNG state of torch (CPU and every CUDA device), numpy and Python's random."""
    np_state: Any = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    random.setstate(state["python"])


@dataclass
class Snapshot:
    """One consistent copy of the training state, taken before ``step`` was applied."""

    step: int
    state: dict[str, Any] | None  # None when it lives on disk
    path: Path | None = None
    digest: str | None = None
    nbytes: int = 0
    targets: tuple[list[Any], list[Any], list[Any]] = ([], [], [])  # the optimizers, schedulers, scalers


class Snapshots:
    """Takes, keeps (the newest ``keep``) and restores snapshots."""

    def __init__(self, keep: int, directory: Path | None = None) -> None:
        self.keep = max(1, keep)
        self.directory = directory
        self.items: list[Snapshot] = []
        if directory is not None:
            remove_leftovers(directory)

    @torch.no_grad()
    def take(self, step: int, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
             schedulers: Sequence[Any], scalers: Sequence[Any], rng: dict[str, Any]) -> Snapshot:
        """Copy the state now (before ``step`` is applied) and drop the oldest beyond ``keep``."""
        state = {
            "model": to_cpu(model.state_dict()),
            "optimizers": [to_cpu(o.state_dict()) for o in optimizers],
            "schedulers": [to_cpu(s.state_dict()) for s in schedulers],
            "scalers": [to_cpu(s.state_dict()) for s in scalers],
            "rng": to_cpu(rng),
        }
        snap = Snapshot(step, state, nbytes=_nbytes(state), targets=(list(optimizers), list(schedulers), list(scalers)))
        if self.directory is not None:
            snap.path, snap.digest = self._write(step, state)
            snap.state = None
        self.items.append(snap)
        while len(self.items) > self.keep:
            old = self.items.pop(0)
            if old.path is not None:
                old.path.unlink(missing_ok=True)
        return snap

    def _write(self, step: int, state: dict[str, Any]) -> tuple[Path, str]:
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"snapshot-{step:09d}.pt"
        tmp = final.with_suffix(TMP_SUFFIX)
        try:
            with tmp.open("wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            digest = _sha256(tmp)
            os.replace(tmp, final)
        except BaseException as exc:  # a full disk, Ctrl-C, a signal handler's exit: no half-written file stays
            tmp.unlink(missing_ok=True)
            interrupt = _interrupt(exc)
            if interrupt is not None and interrupt is not exc:
                raise interrupt from None  # the user's loop gets it, as if torch had let it through
            raise
        return final, digest

    def load(self, snap: Snapshot) -> dict[str, Any]:
        """The snapshot's state; a snapshot on disk is verified against its checksum first.

        Raises:
            RunError: the file is missing or its checksum does not match.
        """
        if snap.state is not None:
            return snap.state
        assert snap.path is not None
        if not snap.path.is_file() or _sha256(snap.path) != snap.digest:
            raise RunError(f"snapshot {str(snap.path)!r} is missing or corrupted (checksum mismatch)")
        return torch.load(snap.path, map_location="cpu", weights_only=False)

    @property
    def nbytes(self) -> int:
        """Bytes held by the snapshots (in memory or on disk)."""
        return sum(s.nbytes for s in self.items)


#: a snapshot being written; renamed to ``snapshot-<step>.pt`` once complete
TMP_SUFFIX = ".pt.tmp"


def remove_leftovers(directory: Path) -> None:
    """Remove the temporary snapshot files an earlier run left in ``directory`` (killed, or out of disk)."""
    try:
        leftovers = list(directory.glob(f"snapshot-*{TMP_SUFFIX}"))
    except OSError:  # not a folder (yet): nothing to clean
        return
    for path in leftovers:
        try:
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove: writing will say what is wrong
            pass


def _interrupt(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit behind ``exc``, if one is: torch turns one raised in the Python
    ``write`` its C++ writer calls (Ctrl-C, a signal handler's ``sys.exit``) into a RuntimeError
    ("enforce fail at inline_container.cc"), with the interrupt as its context.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if not isinstance(cause, Exception):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@torch.no_grad()
def restore(state: dict[str, Any], model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
            schedulers: Sequence[Any], scalers: Sequence[Any]) -> None:
    """Put a snapshot's state back into the live objects (parameters are updated in place)."""
    model.load_state_dict(state["model"])
    for obj, saved in ((o, s) for group in (("optimizers", optimizers), ("schedulers", schedulers),
                                            ("scalers", scalers)) for o, s in zip(group[1], state[group[0]])):
        obj.load_state_dict(saved)
    set_rng_state(state["rng"])
