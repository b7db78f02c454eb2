"""gradwatch is not on the package index: every install command the docs, the README and the examples
give for an extra is the checkout or git-URL form of the install page, never ``pip install 'gradwatch[x]'``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: ``pip install 'gradwatch[wandb]'`` or ``"gradwatch[wandb]"``: a name the package index does not hold
FROM_THE_INDEX = re.compile(r"""pip install (?:-U )?['"]?gradwatch\[[\w,]+\]['"]?(?!\s*@)""")
#: where a page quotes one of gradwatch's own error messages word for word (those say what the code prints)
QUOTED_MESSAGE = re.compile(r"(not installed|package): *\n?$")


def _texts() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]


def test_no_install_command_names_gradwatch_on_the_index() -> None:
    found = []
    for path in _texts():
        text = path.read_text(encoding="utf-8")
        for match in FROM_THE_INDEX.finditer(text):
            if QUOTED_MESSAGE.search(text[max(0, match.start() - 40):match.start()]):
                continue
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert found == []


def test_the_integrations_page_gives_both_forms_for_each_extra() -> None:
    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    for extra in ("lightning", "hf", "wandb", "mlflow", "prometheus"):
        assert f'pip install -e ".[{extra}]"' in text
        assert f'pip install "gradwatch[{extra}] @ git+https://github.com/OWNER/gradwatch.git"' in text
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    assert 'pip install "gradwatch[hf] @ git+https://github.com/OWNER/gradwatch.git"' in install
