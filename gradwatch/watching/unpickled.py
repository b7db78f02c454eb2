"""Unpickled: a watched model's copies and saved files hold nothing of gradwatch.

``torch.save(model, f)`` pickles the module with its hook dicts, and PyTorch >= 2.6 loads it
weights-only by default: a global of gradwatch's in the file fails the load ("Unsupported global").
So the ordered dicts that hold gradwatch's hooks are pickled (and ``copy.deepcopy``-ed) without
them: a reducer for ``collections.OrderedDict`` in :data:`copyreg.dispatch_table` that leaves out
every :class:`Dropped` value (gradwatch's hooks) and the ``with_kwargs`` flags of those hooks. Any other ordered
dict pickles exactly as without it (the same reduce value, item for item). The copy is not
watched: watch it with ``gw.watch(copy)``.
"""

from __future__ import annotations

import copyreg
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

#: id(flag dict) -> (a weak reference to it, the keys of gradwatch's hooks in it)
_EXTRA: dict[int, tuple[weakref.ref[dict[int, bool]], set[int]]] = {}
_installed = False


class Dropped:
    """A value that ordered dicts pickle and copy without (gradwatch's hooks are)."""

    __slots__ = ()


def note_extra(flags: dict[int, bool], key: int) -> None:
    """``flags`` (a module's ``_forward_pre_hooks_with_kwargs``) holds the flag of gradwatch's hook ``key``."""
    install()
    ident = id(flags)
    entry = _EXTRA.get(ident)
    if entry is None or entry[0]() is not flags:
        entry = _EXTRA[ident] = (weakref.ref(flags, lambda _: _EXTRA.pop(ident, None)), set())
    entry[1].add(key)


def _reduce(od: OrderedDict[Any, Any]) -> Any:
    """``OrderedDict.__reduce__``, with gradwatch's hooks (and their flags) left out."""
    cls, args, state, listitems, items = od.__reduce__()  # type: ignore[misc,str-unpack]
    entry = _EXTRA.get(id(od))
    ours = entry[1] if entry is not None and entry[0]() is od else ()

    def kept(pairs: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        for key, value in pairs:
            if not isinstance(value, Dropped) and not (value is True and key in ours):
                yield key, value

    return cls, args, state, listitems, kept(items)  # type: ignore[arg-type]


def install() -> None:
    """Pickle and copy ordered dicts without gradwatch's hooks (idempotent; once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    copyreg.pickle(OrderedDict, _reduce)
