"""Loader (probe stage, per batch): the dataset indices of each batch a DataLoader draws, minus skipped samples.

``watcher.batches(loader)`` iterates a copy of a ``torch.utils.data.DataLoader`` (same dataset,
workers, collate function, generator...) whose batch sampler is wrapped: it records the indices
of every batch it hands out (the batch's sample ids) and leaves out the samples of the skip list.
Anything else (an iterable dataset, a loader without batches, a subclass of DataLoader, workers
that return batches out of order) is iterated as it is, without ids.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

from gradwatch.rootcause.skiplist import SkipList

#: copies of loaders with persistent workers, kept so that the workers persist across epochs
_COPIES: weakref.WeakKeyDictionary[Any, tuple[Any, Indexed]] = weakref.WeakKeyDictionary()


class Indexed:
    """A batch sampler that records the batches it yields and leaves out skipped samples."""

    def __init__(self, inner: Any, skip: SkipList) -> None:
        self.inner, self.skip = inner, skip
        self.taken: deque[list[Any]] = deque()

    def __iter__(self) -> Iterator[list[Any]]:
        self.taken.clear()
        for batch in self.inner:
            kept = [i for i in batch if i not in self.skip] if self.skip else list(batch)
            if kept:
                self.taken.append(kept)
                yield kept

    def __len__(self) -> int:
        return len(self.inner)


def _copy(loader: Any, skip: SkipList) -> tuple[Any, Indexed] | None:
    """A DataLoader like ``loader`` drawing through an :class:`Indexed` batch sampler, or None."""
    from torch.utils.data import DataLoader, IterableDataset

    if type(loader) is not DataLoader or loader.batch_sampler is None or isinstance(loader.dataset, IterableDataset):
        return None
    if loader.num_workers > 0 and not getattr(loader, "in_order", True):
        return None  # batches come back as workers finish them: indices and batches would not match
    known = _COPIES.get(loader)
    if known is not None and known[1].skip is skip:
        return known
    sampler = Indexed(loader.batch_sampler, skip)
    settings: dict[str, Any] = {
        "batch_sampler": sampler, "num_workers": loader.num_workers, "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory, "timeout": loader.timeout, "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context, "generator": loader.generator,
        "persistent_workers": loader.persistent_workers, "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    copy = DataLoader(loader.dataset, **settings)
    if loader.persistent_workers and loader.num_workers > 0:
        _COPIES[loader] = (copy, sampler)
    return copy, sampler


def indexed(iterable: Any, skip: SkipList) -> Iterator[tuple[Any, list[Any] | None]]:
    """Each batch of ``iterable`` with the dataset indices of its samples (None when they are not known)."""
    found = _copy(iterable, skip)
    if found is None:
        for item in iterable:
            yield item, None
        return
    copy, sampler = found
    for item in copy:
        yield item, (sampler.taken.popleft() if sampler.taken else None)
