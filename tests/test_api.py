"""The public API: ``dir(gradwatch)`` offers exactly ``__all__``, and every name in it resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gradwatch


def test_dir_lists_only_the_public_api() -> None:
    assert dir(gradwatch) == sorted(gradwatch.__all__)
    for leaked in ("Any", "TYPE_CHECKING", "annotations", "importlib"):
        assert leaked not in dir(gradwatch)
        assert not hasattr(gradwatch, leaked), leaked


def test_every_public_name_resolves() -> None:
    for name in gradwatch.__all__:
        assert getattr(gradwatch, name) is not None, name
    assert isinstance(gradwatch.__version__, str)


@pytest.mark.slow  # a fresh interpreter that imports torch
def test_dir_stays_the_api_after_lazy_names_load_in_a_fresh_interpreter() -> None:
    code = "import gradwatch as gw; gw.watch; gw.open_run; print(dir(gw) == sorted(gw.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
