"""Source lines (judge stage, rare path): the user's line of code an op ran from, read off the stack."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from dataclasses import dataclass
from types import FrameType

import torch


def _folder(path: str) -> str:
    return os.path.normcase(os.path.realpath(path)) + os.sep


#: gradwatch's own folder (this file is in gradwatch/rootcause/)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: frames in these folders are not the user's: torch, gradwatch (its integrations included) and
#: Python's standard library
_THEIRS = tuple({_folder(os.path.dirname(torch.__file__)), _folder(_PACKAGE),
                 _folder(os.path.join(os.path.dirname(_PACKAGE), "integrations")),
                 _folder(sysconfig.get_paths()["stdlib"])})
_OURS = _folder(_PACKAGE)
_seen: dict[str, str] = {}


def _where(filename: str) -> str:
    where = _seen.get(filename)
    if where is None:
        real = _folder(filename)[:-1]
        where = "ours" if real.startswith(_OURS) else "theirs" if real.startswith(_THEIRS) else "user"
        _seen[filename] = where
    return where


@dataclass(frozen=True)
class Line:
    """A line of source code.

    Attributes:
        file: the file's path.
        line: 1-based line number.
        code: the line's text, stripped ("" when the source is not available).
        user: the line is in the user's code (False: inside torch, when no line of the user's
            ran the op, e.g. a built-in ``nn.Linear`` inside an ``nn.Sequential``).
    """

    file: str
    line: int
    code: str
    user: bool = True

    def short(self) -> str:
        """``file.py:12``."""
        return f"{os.path.basename(self.file)}:{self.line}"

    def to_json(self) -> dict[str, object]:
        """The line as plain data."""
        return {"file": self.file, "line": self.line, "code": self.code, "user_code": self.user}


def _line(frame: FrameType, user: bool) -> Line:
    code = frame.f_code
    text = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return Line(code.co_filename, frame.f_lineno, text, user)


def user_line(depth: int = 1) -> Line | None:
    """The line of the user's code that is running now, seen from inside a replay.

    Walks the stack outwards from the caller: the first frame outside torch, gradwatch and the
    standard library is the user's. The walk stops at the replay itself (the first gradwatch
    frame met after leaving gradwatch's own mode), so the line is always inside the model's
    forward pass; when no frame of the user's is there, the innermost ``forward`` of a torch
    module is given instead (``user`` False).
    """
    frame: FrameType | None = sys._getframe(depth)
    left_ours = False
    fallback: FrameType | None = None
    while frame is not None:
        where = _where(frame.f_code.co_filename)
        if where == "user":
            return _line(frame, True)
        if where == "ours":
            if left_ours:
                break
        else:
            left_ours = True
            if fallback is None and frame.f_code.co_name == "forward":
                fallback = frame
        frame = frame.f_back
    return _line(fallback, False) if fallback is not None else None
