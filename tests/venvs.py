"""A fresh virtual environment that sees the packages of the interpreter running the tests.

``python -m venv --system-site-packages`` is not that: its "system" is the *base* Python, which,
when the tests run from a virtual environment (as the README's commands do in one), has none of
torch, pandas, setuptools >= 68 or wheel. Here the new environment gets no packages of its own
(no pip either) and one ``.pth`` file that adds the running interpreter's site-packages, with
their own ``.pth`` files, after its own: what is installed into it comes first, and everything
else (pip, setuptools, torch ...) is what the tests run with, from a venv or a system Python alike.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def fresh_venv(where: Path) -> Path:
    """Create a virtual environment at ``where`` that sees this interpreter's packages; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=300)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=120).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in _site_dirs()]
    (Path(purelib) / "_tests_parent_site.pth").write_text("\n".join(lines) + "\n")
    return python
