"""Packaging: one install provides gradwatch, gradwatch.integrations and gradwatch.dashboards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .venvs import fresh_venv

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


@pytest.mark.slow  # builds a wheel
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


@pytest.mark.slow  # builds a wheel and a virtual environment
def test_a_built_wheel_installs_into_a_fresh_venv_and_runs(tmp_path: Path) -> None:
    """docs/install.md's wheel path: `pip wheel --no-deps -w dist .`, then `pip install` it elsewhere.

    The venv sees the packages the tests run with (torch, pandas ...: gradwatch's dependencies; see
    tests/venvs.py) but not this checkout; pip uses no index, so nothing is downloaded. gradwatch
    then runs from the venv.
    """
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".git", ".*_cache", "runs", "node_modules", "site"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("gradwatch-*-py3-none-any.whl")
    venv = tmp_path / "venv"
    bin_dir = fresh_venv(venv).parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    installed = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--no-index", "--no-deps",
                                str(wheel)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    code = ("import gradwatch, gradwatch.dashboards, gradwatch.integrations, gradwatch.report; "
            "from importlib.resources import files; "
            "print(gradwatch.__file__); print(files('gradwatch.dashboards') / 'grafana' / 'gradwatch.json')")
    where = subprocess.run([str(bin_dir / "python"), "-c", code], env=env, cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert all(Path(p).is_relative_to(venv) for p in where), where  # the wheel's files, not the checkout's
    assert Path(where[1]).is_file()
    helped = subprocess.run([str(bin_dir / "gradwatch"), "--help"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "Usage: gradwatch" in helped.stdout
    # past the demo's planted NaN at step 100: its replay (gradwatch.rootcause) runs from the wheel too
    demo = subprocess.run([str(bin_dir / "gradwatch"), "demo", "--steps", "110", "--run", "runs/demo"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert (tmp_path / "runs" / "demo" / "report.html").is_file()  # the templates and plotly.js came with it
    found = subprocess.run([str(bin_dir / "python"), "-c", "import gradwatch as gw; f = gw.open_run('runs/demo')"
                            ".findings(); print(f.loc[f.kind == 'nonfinite', 'data'].iloc[0]['origin'])"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert found.stdout.strip() == "replayed", found.stdout + found.stderr


#: what the repository's top level holds: the required layout, the project's files and the CI entry point
KNOWN_TOP_LEVEL = {
    ".ci", ".gitignore", "CHANGELOG.md", "CONTRIBUTING.md", "LICENSE", "README.md", "benchmarks", "dashboards",
    "docs", "examples", "gradwatch", "integrations", "mkdocs.yml", "pyproject.toml", "tests",
}


def test_repository_top_level_holds_only_the_projects_entries() -> None:
    """Scratch output (console logs such as out1.txt, err1.txt) is written to a temp dir, never committed."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an installed copy)")
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {line.split("/", 1)[0] for line in listed.splitlines() if line}
    unexpected = sorted(top - KNOWN_TOP_LEVEL)
    assert unexpected == [], f"unexpected files at the repository's top level: {unexpected}"
    assert {"pyproject.toml", "README.md", "gradwatch", "integrations", "dashboards", "tests", "examples"} <= top


def test_every_package_folder_is_in_pyprojects_package_list() -> None:
    """The fast check of what the wheel test finds: a sub-package missing from [tool.setuptools] packages
    works in an editable install and is absent from every real one.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {"gradwatch": "gradwatch", **{v: k for k, v in config["package-dir"].items()}}
    found = set()
    for folder, package in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
