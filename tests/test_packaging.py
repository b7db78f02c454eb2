"""Packaging: one install provides gradwatch, gradwatch.integrations and gradwatch.dashboards."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("transformers", "lightning", "pytorch_lightning", "prometheus_client", "uvicorn", "tensorboard")


def test_import_gradwatch_stays_light() -> None:
    code = f"import sys, gradwatch; print([m for m in {HEAVY!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_subpackages_import_from_their_directories() -> None:
    import gradwatch.dashboards
    import gradwatch.integrations

    assert Path(gradwatch.integrations.__file__).parent == ROOT / "integrations"
    assert Path(gradwatch.dashboards.__file__).parent == ROOT / "dashboards"


def test_wheel_contains_all_three_packages(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("gradwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("gradwatch/__init__.py", "gradwatch/integrations/__init__.py", "gradwatch/dashboards/__init__.py",
                 "gradwatch/store/reader.py", "gradwatch/sinks/tensorboard.py", "gradwatch/cli/demo.py"):
        assert path in names, path
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gradwatch = gradwatch.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
