"""Docs build hook: the parts of the site that the build makes from gradwatch itself.

- ``<!-- gradwatch:remedies -->`` in a page becomes what each finding kind means and what to try,
  from ``gradwatch.report.remedies`` (the text the report and the dashboard show);
- the ```` ```text ```` block after ``<!-- gradwatch:output NAME -->`` in the tutorial is the
  output of one of its commands (``COMMANDS``; ``read``: the Python block after
  ``<!-- gradwatch:run read -->``). The page's source holds the real output, so that it reads
  whole in the repository too; the build runs the commands again in a fresh folder, puts what
  they print in the site, and warns (which fails ``mkdocs build --strict``) where the source
  says something else (a decimal's last digits aside: ``agrees``);
- ``img/tutorial/*.png`` are screenshots of that run's HTML report and of the live dashboard,
  taken in Debian's chromium through Playwright (no browser is downloaded). They are committed
  in ``docs/img/tutorial/`` and the build takes them again for the site.

``python docs/_hooks/generated.py`` runs the tutorial and writes both into the source: the
outputs into ``docs/tutorial.md``, the screenshots into ``docs/img/tutorial/``. Run it when a
change alters what the tutorial prints or shows.

Nothing here is fetched from the network, and the built pages load nothing from it. While
writing, ``GRADWATCH_DOCS_CACHE=/some/folder mkdocs serve`` makes the tutorial's run once and
reuses it (delete the folder to make it again); CI never sets it.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
IMAGES = ROOT / "docs" / "img" / "tutorial"  # the screenshots, as committed
CHROMIUM = os.environ.get("GRADWATCH_CHROMIUM", "/usr/bin/chromium")
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]
#: the tutorial's commands, run one after the other in one fresh folder: name -> (shown, argv, exit status)
COMMANDS: dict[str, tuple[str, list[str], int]] = {
    "train": ("python examples/tutorial.py", [sys.executable, str(ROOT / "examples" / "tutorial.py")], 1),
    "check": ("gradwatch check runs/tutorial", [sys.executable, "-m", "gradwatch", "check", "runs/tutorial"], 1),
    "report": ("gradwatch report runs/tutorial", [sys.executable, "-m", "gradwatch", "report", "runs/tutorial"], 0),
    "fixed": ("python examples/tutorial.py --fixed",
              [sys.executable, str(ROOT / "examples" / "tutorial.py"), "--fixed"], 0),
    "check-fixed": ("gradwatch check runs/tutorial-fixed",
                    [sys.executable, "-m", "gradwatch", "check", "runs/tutorial-fixed"], 0),
}
SCREENSHOTS = ("report-top.png", "report-finding.png", "dashboard-run.png", "dashboard-flow.png")

log = logging.getLogger("mkdocs.plugins.gradwatch")
_made: dict[str, Any] = {}  # what this build made: outputs by name, the screenshots' folder


# ------------------------------------------------------------------ remedies
def remedies() -> str:
    """Every finding kind the report explains: its title, what it means, and what to try."""
    from gradwatch.report.remedies import KINDS, UNKNOWN

    out = []
    for kind, spec in KINDS.items():
        out.append(f"### `{kind}`: {spec.title}\n\n{spec.meaning}\n\nWhat to try, most likely first:\n")
        out += [f"1. {remedy}" for remedy in spec.remedies]
        out.append("")
    out.append(f"### Plugin kinds\n\nA finding of a [detector plugin](plugins.md)'s kind: {UNKNOWN.meaning} "
               "The report titles it after its kind and shows the finding's own `hint`.\n")
    return "\n".join(out)


# ------------------------------------------------------------------ the tutorial's run
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
               COLUMNS="100", NO_COLOR="1", TERM="dumb", PYTHONDONTWRITEBYTECODE="1")
    return env


def _shown(text: str, where: Path) -> str:
    """Output as the reader would see it: paths relative, a traceback shortened to its last line."""
    text = text.replace(str(where) + os.sep, "").replace(str(ROOT) + os.sep, "")
    lines = text.rstrip().splitlines()
    if "Traceback (most recent call last):" in lines:
        start = lines.index("Traceback (most recent call last):")
        lines = [*lines[:start], lines[start], "  ...", lines[-1]]
    return "\n".join(line.rstrip() for line in lines)


def _python_block(marker: str) -> str:
    """The fenced Python block right after ``marker`` in the tutorial."""
    found = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", TUTORIAL.read_text(encoding="utf-8"), re.S)
    if found is None:
        raise PluginError(f"docs/tutorial.md has no ```python block after {marker}")
    return found.group(1)


def run_tutorial(where: Path) -> dict[str, str]:
    """Run the tutorial's commands in ``where``; their outputs (command line included) by name."""
    commands = dict(COMMANDS)
    read = _python_block("<!-- gradwatch:run read -->")
    commands = {**{k: v for k, v in commands.items() if k in ("train", "check", "report")},
                "read": ("python", [sys.executable, "-c", read], 0),
                **{k: v for k, v in commands.items() if k in ("fixed", "check-fixed")}}
    outputs = {}
    for name, (shown, argv, status) in commands.items():
        done = subprocess.run(argv, cwd=where, env=_env(), capture_output=True, text=True, timeout=600)
        if done.returncode != status:
            raise PluginError(f"the tutorial's `{shown}` exited {done.returncode}, not {status}:\n"
                              f"{done.stdout}\n{done.stderr}")
        body = _shown(done.stdout + done.stderr, where)
        outputs[name] = body if name == "read" else f"$ {shown}\n{body}"
    return outputs


#: an output in the tutorial's source: its marker, then the fenced text block that holds it
OUTPUT = re.compile(r"<!-- gradwatch:output ([\w-]+) -->\n```text\n(.*?)\n```$", re.S | re.M)
#: a marker with no text block after it (the block is the output; the marker alone shows nothing)
BARE = re.compile(r"<!-- gradwatch:output ([\w-]+) -->(?!\n```text\n)")


def shown_outputs(markdown: str) -> dict[str, str]:
    """The outputs a page's source shows, by name."""
    return {found.group(1): found.group(2) for found in OUTPUT.finditer(markdown)}


#: a number as a command prints it: an integer (a step, a count) or a decimal (a loss, a norm)
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.(\d+))?(?:[eE]([-+]?\d+))?(?![\w.])")


def agrees(source: str, printed: str) -> bool:
    """Whether ``printed`` says what ``source`` says, up to the float noise of a CPU's threads.

    A training run's decimals vary in their last printed digits from one run of the same code to
    the next: with more threads than cores, the math library splits a matrix product's sums
    differently (the tutorial's script without gradwatch printed ``loss 0.3167`` for ``0.3168`` in
    2 of 10 runs with ``OMP_NUM_THREADS=4`` on 2 cores), and Adam carries the difference on. So a
    decimal agrees within 2%, or two units of its last printed digit; every word, every integer (a
    step, a layer's index, a count) and every decimal's number of digits must be the same.
    """
    if NUMBER.sub("#", source) != NUMBER.sub("#", printed):
        return False
    for was, now in zip(NUMBER.finditer(source), NUMBER.finditer(printed), strict=True):
        digits = was.group(1)
        if digits is None or now.group(1) is None or len(digits) != len(now.group(1)):
            if was.group(0) != now.group(0):  # an integer, or a decimal printed to other digits
                return False
            continue
        last = 10.0 ** (int(was.group(2) or 0) - len(digits))  # a unit of the last printed digit
        if not math.isclose(float(was.group(0)), float(now.group(0)), rel_tol=0.02, abs_tol=2 * last):
            return False
    return True


def with_outputs(markdown: str, outputs: dict[str, str]) -> str:
    """``markdown`` with each output's text block holding ``outputs[name]``."""
    bare = BARE.search(markdown)
    if bare is not None:
        raise PluginError(f"<!-- gradwatch:output {bare.group(1)} --> has no ```text block after it")

    def output(found: re.Match[str]) -> str:
        name = found.group(1)
        if name not in outputs:
            raise PluginError(f"no tutorial output named {name!r}")
        return f"<!-- gradwatch:output {name} -->\n```text\n{outputs[name]}\n```"

    return OUTPUT.sub(output, markdown)


def screenshots(where: Path, out: Path) -> None:
    """The tutorial run's report, and the dashboard's page of it, in a real browser."""
    if not Path(CHROMIUM).exists():
        raise PluginError(f"the docs build takes the tutorial's screenshots with Chromium at {CHROMIUM}: "
                          "install Debian's chromium (apt-get install chromium) or set GRADWATCH_CHROMIUM")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise PluginError("the docs build needs Playwright for the tutorial's screenshots: "
                          "pip install -e '.[docs]'") from None
    from gradwatch.dashboards.server import start

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto((where / "runs" / "tutorial" / "report.html").as_uri())
            page.wait_for_selector("#fig-timeline .main-svg")
            page.wait_for_selector("#fig-flow .main-svg")
            page.wait_for_timeout(500)
            page.screenshot(path=str(out / "report-top.png"))
            page.locator("#finding-0").scroll_into_view_if_needed()
            page.locator("#finding-0").screenshot(path=str(out / "report-finding.png"))
            here = Path.cwd()
            os.chdir(where)  # the dashboard shows its root as given: "runs", as the reader would type it
            try:
                dash = start("runs")
            finally:
                os.chdir(here)
            with dash:
                page.set_viewport_size({"width": 1280, "height": 1000})
                page.goto(f"{dash.url}run?run=tutorial")
                page.wait_for_selector("#timeline .main-svg")
                page.wait_for_selector("#flow .main-svg")
                page.wait_for_timeout(1000)
                page.screenshot(path=str(out / "dashboard-run.png"))
                page.locator("#flow").scroll_into_view_if_needed()
                page.locator("#flow").screenshot(path=str(out / "dashboard-flow.png"))
        finally:
            browser.close()


# ------------------------------------------------------------------ mkdocs events
def on_files(files: Files, config: Any) -> Files:
    """Run the tutorial, take its screenshots, and add them to the site's files."""
    if not _made:
        cache = os.environ.get("GRADWATCH_DOCS_CACHE")  # while writing: reuse the last run's outputs and pictures
        folder = Path(cache) if cache else Path(tempfile.mkdtemp(prefix="gradwatch-docs-"))
        where, images, saved = folder / "tutorial", folder / "img", folder / "outputs.json"
        if cache and saved.is_file() and all((images / name).is_file() for name in SCREENSHOTS):
            log.info("gradwatch: reusing the tutorial's outputs and screenshots in %s", folder)
            _made["outputs"] = json.loads(saved.read_text(encoding="utf-8"))
        else:
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            images.mkdir(exist_ok=True)
            log.info("gradwatch: running the tutorial and taking its screenshots in %s", folder)
            _made["outputs"] = run_tutorial(where)
            screenshots(where, images)
            saved.write_text(json.dumps(_made["outputs"]), encoding="utf-8")
        _made["images"] = images
    for name in SCREENSHOTS:  # this build's pictures, in place of the committed ones
        committed = files.get_file_from_path(f"img/tutorial/{name}")
        if committed is not None:
            files.remove(committed)
        files.append(File.generated(config, f"img/tutorial/{name}", abs_src_path=str(_made["images"] / name)))
    return files


#: what makes a browser fetch something by itself: scripts, stylesheets, images, frames, fonts in CSS
EXTERNAL = re.compile(r"""<(?:script|img|iframe|source|audio|video)\b[^>]*\ssrc=["']?(?:https?:)?//"""
                      r"""|<link\b[^>]*\shref=["']?(?:https?:)?//[^>]*>|url\(["']?(?:https?:)?//|@import\s+["']?(?:https?:)?//""",
                      re.I)


def external_loads(site: Path) -> list[str]:
    """Files of the built site that would make a browser fetch something from the network."""
    found = []
    for path in sorted(site.rglob("*")):
        if path.suffix in (".html", ".css", ".js") and path.is_file():
            for hit in EXTERNAL.finditer(path.read_text(encoding="utf-8", errors="replace")):
                found.append(f"{path.relative_to(site)}: {hit.group(0)[:120]}")
    return found


def on_post_build(config: Any) -> None:
    """Refuse a site whose pages load anything from the network (a web font, a CDN script)."""
    found = external_loads(Path(config["site_dir"]))
    if found:
        raise PluginError("the built pages would fetch from the network:\n" + "\n".join(found[:20]))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Put the generated parts into the pages that ask for them."""
    if "<!-- gradwatch:remedies -->" in markdown:
        markdown = markdown.replace("<!-- gradwatch:remedies -->", remedies())

    if "<!-- gradwatch:output " not in markdown:
        return markdown
    outputs = _made.get("outputs", {})
    for name, text in shown_outputs(markdown).items():
        if name in outputs and not agrees(text, outputs[name]):
            diff = "\n".join(difflib.unified_diff(text.splitlines(), outputs[name].splitlines(), "in the source",
                                                   "printed now", lineterm="", n=1))
            log.warning("%s: the output of %r in the source is not what the tutorial prints now; "
                        "run `python docs/_hooks/generated.py` to write it there:\n%s", page.file.src_uri, name, diff)
    try:
        return with_outputs(markdown, outputs)
    except PluginError as error:
        raise PluginError(f"{page.file.src_uri}: {error}") from None


# ------------------------------------------------------------------ the source's outputs and pictures
def update() -> None:
    """Run the tutorial; write its outputs into docs/tutorial.md and its screenshots into docs/img/tutorial/."""
    with tempfile.TemporaryDirectory(prefix="gradwatch-docs-") as folder:
        where = Path(folder) / "tutorial"
        where.mkdir()
        outputs = run_tutorial(where)
        IMAGES.mkdir(parents=True, exist_ok=True)
        screenshots(where, IMAGES)
    TUTORIAL.write_text(with_outputs(TUTORIAL.read_text(encoding="utf-8"), outputs), encoding="utf-8")
    print(f"wrote {len(outputs)} outputs into {TUTORIAL.relative_to(ROOT)} and {len(SCREENSHOTS)} screenshots "
          f"into {IMAGES.relative_to(ROOT)}/")


if __name__ == "__main__":
    update()
