"""Packaging: one install provides gradwatch, gradwatch.integrations and gradwatch.dashboards."""

from __future__ import annotations

import shutil
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
    # build from a copy without build/ and *.egg-info: a stale build/lib would hide a missing package
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".git", ".*_cache", "runs", "node_modules"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("gradwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every module and asset of the source tree is in the wheel (a subpackage left out of
    # [tool.setuptools] packages works in an editable install and breaks every real one)
    expected = set()
    for source, installed in (("gradwatch", "gradwatch"), ("integrations", "gradwatch/integrations"),
                              ("dashboards", "gradwatch/dashboards")):
        for path in (ROOT / source).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc",):
                expected.add(f"{installed}/{path.relative_to(ROOT / source).as_posix()}")
    assert expected - names == set()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gradwatch = gradwatch.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
