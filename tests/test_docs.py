"""The documentation runs as written and stays true: the README's two commands and its quickstart
(verbatim, twice), every docs code block marked to run, every config example, and every finding kind,
detector setting, option, action and command-line option documented on its page.

The scripts (the quickstart twice, the runnable blocks, the tutorial) are started as the module begins,
two at a time beside the test process; their tests check what they printed and wrote.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import gradwatch as gw

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def blocks(path: Path) -> list[tuple[str, str, str]]:
    """(language, marker, code) of every fenced block; the marker is the ``<!-- test: ... -->`` line before it."""
    text = path.read_text(encoding="utf-8")
    out = []
    for found in FENCE.finditer(text):
        before = text[:found.start()].rstrip().splitlines()
        marker = re.fullmatch(r"<!-- test: ([\w-]+) -->", before[-1].strip()) if before else None
        out.append((found.group(1), marker.group(1) if marker else "", found.group(2)))
    return out


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def marked(kind: str) -> list[tuple[str, str]]:
    """(id, code) of the docs blocks marked ``<!-- test: kind -->``."""
    out = []
    for page in pages():
        for n, (_, _, code) in enumerate(b for b in blocks(page) if b[1] == kind):
            out.append((f"{page.stem}-{n}", code))
    return out


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            "PYTHONDONTWRITEBYTECODE": "1"}


# ------------------------------------------------------------------ README
def quickstart() -> str:
    text = README.read_text(encoding="utf-8")
    found = re.search(r"\[start:quickstart\] -->\n```python\n(.*?)```\n<!-- --8<-- \[end:quickstart\]", text, re.S)
    assert found, "README.md: the quickstart's python block between its snippet markers"
    return found.group(1)


def _quickstart_twice(where: Path) -> list[subprocess.CompletedProcess[str]]:
    """The README's quickstart run twice in ``where``, one after the other: the processes."""
    script = where / "quickstart.py"
    script.write_text(quickstart(), encoding="utf-8")
    return [subprocess.run([sys.executable, str(script)], cwd=where, env=env(), capture_output=True, text=True,
                           timeout=600) for _ in (1, 2)]


def _block(name: str, code: str) -> Callable[[Path], subprocess.CompletedProcess[str]]:
    """A docs block run as a script in the folder given: its process."""

    def run(where: Path) -> subprocess.CompletedProcess[str]:
        script = where / f"{name}.py"
        script.write_text(code, encoding="utf-8")
        return subprocess.run([sys.executable, str(script)], cwd=where, env=env(), capture_output=True, text=True,
                              timeout=600)

    return run


def _tutorial(where: Path) -> dict[str, str]:
    """The tutorial's outputs as it prints them, run in ``where``."""
    outputs: dict[str, str] = _hook().run_tutorial(where)
    return outputs


#: what ``started`` gives: by script, its outcome to come and its folder
Started = dict[str, tuple[Future[Any], Path]]


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """The scripts of the tests this session runs, started as the module begins, two at a time beside the test
    process, each in a folder of its own: their outcomes to come."""
    scripts: dict[str, Callable[[Path], Any]] = {}
    for item in request.session.items:
        name = getattr(item, "originalname", None)
        if getattr(item, "module", None) is not request.module:
            continue
        if name == "test_readme_quickstart_runs_verbatim_twice":
            scripts["quickstart"] = _quickstart_twice
        elif name == "test_docs_block_runs":
            block = item.callspec.params["name"]  # type: ignore[attr-defined]
            scripts[f"block-{block}"] = _block(block, item.callspec.params["code"])  # type: ignore[attr-defined]
        elif name == "test_the_tutorials_outputs_in_its_source_are_what_it_prints":
            scripts["tutorial"] = _tutorial
    with ThreadPoolExecutor(2) as runner:
        futures: Started = {}
        for key in sorted(scripts, key=lambda key: key != "tutorial"):  # the longest first
            script = scripts[key]
            where = tmp_path_factory.mktemp(key)
            futures[key] = (runner.submit(script, where), where)
        yield futures
        for future, _ in futures.values():
            future.cancel()  # a session stopped early (-x) runs no script it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _started_as_the_module_begins(started: Started) -> None:
    """Start the scripts with the module's first test."""


@pytest.mark.slow  # the quickstart twice, each in its own interpreter
def test_readme_quickstart_runs_verbatim_twice(started: Started) -> None:
    future, tmp_path = started["quickstart"]
    for attempt, done in zip((1, 2), future.result()):  # the second run replaces the first one's (overwrite=True)
        assert done.returncode == 0, f"attempt {attempt}:\n{done.stdout}\n{done.stderr}"
        lines = done.stdout.splitlines()
        assert lines[0] == "Run('runs/exp1', steps=192, status='finished')", done.stdout  # as its comments say
        assert lines[1] == "['0', '1', '2']"
        assert lines[-1] == "0 findings"
        assert "step layer     metric     value" in done.stdout.replace("  ", " ") or "metric" in lines[2]
        assert "Traceback" not in done.stderr and "gradwatch" not in done.stderr, done.stderr
    run = gw.open_run(tmp_path / "runs" / "exp1")
    assert (run.steps, run.status, run.live) == (192, "finished", False)
    assert run.scalars()["loss"].iloc[-10:].mean() < run.scalars()["loss"].iloc[:10].mean() / 2, "it learns"


def test_readme_quickstart_is_the_docs_quickstart() -> None:
    assert '--8<-- "README.md:quickstart"' in (DOCS / "quickstart.md").read_text(encoding="utf-8")
    compile(quickstart(), "README.md quickstart", "exec")


def test_readme_has_the_two_commands_first_and_ci_runs_the_test_command_exactly() -> None:
    text = README.read_text(encoding="utf-8")
    first = next(code for lang, _, code in blocks(README) if lang == "bash")
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert commands == ['pip install -e . && gradwatch demo', 'pip install -e ".[test]" && python -m pytest']
    advice = text.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert advice < text.index(first), "the CPU-only PyTorch advice comes before the command it protects"
    assert "pip install gradwatch" not in text.replace("pip install gradwatch[", "")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"\n{commands[1]}\n" in ci, ".ci/run calls the README's test command exactly"
    assert "mkdocs build --strict" in ci


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"])
def test_top_level_links_point_at_files_that_exist(name: str) -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / name).read_text(encoding="utf-8")):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"{name}: {target}"


def test_contributing_commands_are_the_development_pages() -> None:
    guide = (DOCS / "development.md").read_text(encoding="utf-8")
    for line in next(code for lang, _, code in blocks(ROOT / "CONTRIBUTING.md") if lang == "bash").splitlines():
        command = line.split("#")[0].strip()
        assert command.split(" && ")[0] in guide, f"CONTRIBUTING.md: {command!r} is not in docs/development.md"


# ------------------------------------------------------------------ docs code blocks
RUN = marked("run")


def test_there_are_runnable_blocks() -> None:
    assert len(RUN) >= 1 and marked("config") and marked("pyproject")


@pytest.mark.slow  # each block trains a small model in its own interpreter
@pytest.mark.parametrize(("name", "code"), RUN, ids=[n for n, _ in RUN])
def test_docs_block_runs(name: str, code: str, started: Started) -> None:
    future, _ = started[f"block-{name}"]
    done = future.result()
    assert done.returncode == 0, f"docs block {name}:\n{code}\n{done.stdout}\n{done.stderr}"


def _validate(path: Path) -> None:
    """Watch a small model with the file: every option, rule and detector setting in it is checked."""
    model = gw.watch(nn.Linear(2, 1), run=path.parent / "run", rules=str(path), console=False, tensorboard=False)
    gw.unwatch(model)


@pytest.mark.parametrize(("name", "code"), marked("config"), ids=[n for n, _ in marked("config")])
def test_docs_rules_file_is_valid(name: str, code: str, tmp_path: Path) -> None:
    path = tmp_path / "gradwatch.toml"
    path.write_text(code, encoding="utf-8")
    _validate(path)


@pytest.mark.parametrize(("name", "code"), marked("pyproject"), ids=[n for n, _ in marked("pyproject")])
def test_docs_pyproject_table_is_valid(name: str, code: str, tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(code, encoding="utf-8")
    _validate(path)


def _python_blocks() -> list[tuple[str, str]]:
    out = []
    for page in [*pages(), README]:
        for n, (_, _, code) in enumerate(b for b in blocks(page) if b[0] == "python"):
            out.append((f"{page.stem}-{n}", code))
    return out


@pytest.mark.parametrize(("name", "code"), _python_blocks(), ids=[n for n, _ in _python_blocks()])
def test_every_python_block_is_valid_python(name: str, code: str) -> None:
    """Fragments are not run, but each one parses: no pseudo-code passes for Python."""
    included = re.fullmatch(r'--8<-- "([^"]+)"\n', code)
    compile((ROOT / included.group(1)).read_text(encoding="utf-8") if included else code, name, "exec")


def test_docs_markers_are_known() -> None:
    for page in pages():
        for lang, marker, _ in blocks(page):
            assert marker in ("", "run", "config", "pyproject"), f"{page.name}: unknown marker {marker!r}"
            assert not marker or (marker == "run") == (lang == "python"), f"{page.name}: {marker} on {lang}"


# ------------------------------------------------------------------ the reference is complete
def _rows(page: str) -> dict[str, str]:
    """First cell (a `name`) -> the whole row, for every table row of a docs page."""
    rows = {}
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        found = re.match(r"\| `([^`]+)`[^|]*\|", line)
        if found:
            rows.setdefault(found.group(1), line)
    return rows


def test_every_finding_kind_and_detector_setting_is_documented() -> None:
    from gradwatch import detectors
    from gradwatch.store.findings import KINDS

    rows = _rows("findings.md")
    for kind in KINDS:
        assert kind in rows, f"docs/findings.md: no row for the finding kind {kind!r}"
    for kind, cls in detectors.REGISTRY.items():
        settings = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
        for name in settings:
            assert name == "enabled" or f"`{name}`" in rows[kind], f"docs/findings.md: {kind}'s setting {name!r}"


def test_every_option_and_action_is_documented() -> None:
    from gradwatch import actions
    from gradwatch.options import Options

    rows = _rows("configuration.md")
    for field in dataclasses.fields(Options):
        assert field.name in rows, f"docs/configuration.md: no row for the option {field.name!r}"
    for name in actions.REGISTRY:
        assert name in rows, f"docs/configuration.md: no row for the action {name!r}"


def test_every_command_and_command_line_option_is_documented() -> None:
    import click

    from gradwatch.cli import COMMANDS, cli

    for module in set(COMMANDS.values()):
        importlib.import_module(module)
    table = (DOCS / "cli.md").read_text(encoding="utf-8")
    own = {"report": "report.md", "dashboard": "dashboard.md", "doctor": "doctor.md"}  # commands with a page
    for name, command in cli.commands.items():
        assert f"`gradwatch {name}" in table, f"docs/cli.md: the command {name!r} is not in the table"
        text = table + (DOCS / own[name]).read_text(encoding="utf-8") if name in own else table
        for param in command.params:
            if isinstance(param, click.Option):
                longest = max(param.opts, key=len)
                if longest != "--help":
                    assert f"`{longest}" in text, f"docs: gradwatch {name}'s option {longest} is not documented"


def _hook():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gradwatch_docs_hook", DOCS / "_hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_the_docs_build_refuses_pages_that_fetch_from_the_network(tmp_path: Path) -> None:
    hook = _hook()
    (tmp_path / "ok.html").write_text('<a href="https://pytorch.org">PyTorch</a><script src="assets/app.js"></script>')
    assert hook.external_loads(tmp_path) == []
    (tmp_path / "page.html").write_text(
        '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
        '<script src="//cdn.example.com/x.js"></script><img alt="" src="https://example.com/a.png">')
    (tmp_path / "style.css").write_text("@font-face { src: url('https://fonts.gstatic.com/r.woff2') }")
    assert len(hook.external_loads(tmp_path)) == 4


def test_the_docs_hook_writes_every_kinds_remedies() -> None:
    hook = _hook()
    from gradwatch.report.remedies import KINDS

    text = hook.remedies()
    for kind, explained in KINDS.items():
        assert f"### `{kind}`: {explained.title}" in text and explained.remedies[0] in text
    assert "<!-- gradwatch:remedies -->" in (DOCS / "findings.md").read_text(encoding="utf-8")


def test_the_tutorials_source_shows_its_outputs_and_pictures() -> None:
    """docs/tutorial.md read in the repository (as on GitHub) shows real outputs and pictures, not placeholders."""
    hook = _hook()
    text = (DOCS / "tutorial.md").read_text(encoding="utf-8")
    shown = hook.shown_outputs(text)
    assert set(shown) == {*hook.COMMANDS, "read"}, "every command's output is in the page, once"
    assert text.count("<!-- gradwatch:output ") == len(shown) and hook.BARE.search(text) is None
    for name, output in shown.items():
        assert output.strip() and "gradwatch:" not in output, name
        if name in hook.COMMANDS:
            assert output.startswith(f"$ {hook.COMMANDS[name][0]}\n"), name
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(pictures) == sorted(f"img/tutorial/{name}" for name in hook.SCREENSHOTS)
    for picture in pictures:
        assert (DOCS / picture).read_bytes().startswith(b"\x89PNG"), picture
    with pytest.raises(Exception, match="no ```text block"):
        hook.with_outputs("<!-- gradwatch:output train -->\n", shown)


@pytest.mark.slow  # runs the tutorial's script and commands
def test_the_tutorials_outputs_in_its_source_are_what_it_prints(started: Started) -> None:
    """What the page shows is what the tutorial prints now (`python docs/_hooks/generated.py` writes it)."""
    hook = _hook()
    shown = hook.shown_outputs((DOCS / "tutorial.md").read_text(encoding="utf-8"))
    future, _ = started["tutorial"]
    printed = future.result()
    assert set(printed) == set(shown)
    for name, text in shown.items():  # a decimal's last digits vary with the CPU's threads (hook.agrees)
        assert hook.agrees(text, printed[name]), f"{name}:\n{text}\n--- printed now ---\n{printed[name]}"


def test_the_tutorials_outputs_agree_up_to_a_decimals_last_digits_and_no_further() -> None:
    hook = _hook()
    source = "step   0  loss 0.6580\nstep  40  loss 0.3168\nmin 1.20e-05 at step 60 in '2' (Linear)"
    assert hook.agrees(source, source)
    # the float noise of a run with more threads than cores (seen in CI)
    assert hook.agrees(source, source.replace("0.3168", "0.3167").replace("1.20e-05", "1.22e-05"))
    for changed in (source.replace("0.3168", "0.3268"),  # a loss that moved
                    source.replace("1.20e-05", "1.30e-05"),
                    source.replace("step  40", "step  41"),  # an integer: a step, a layer
                    source.replace("'2'", "'3'"),
                    source.replace("0.6580", "0.658"),  # printed to other digits
                    source.replace("loss", "Loss"),
                    source + "\nstep  80  loss 0.2291"):
        assert not hook.agrees(source, changed), changed
