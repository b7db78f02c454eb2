"""``python -m gradwatch``: the same as the ``gradwatch`` command."""

import sys
from pathlib import Path

# With gradwatch installed in editable mode (``pip install -e``), a folder named ``gradwatch`` in the
# current directory or beside the script (an output folder, say) is imported in its place, as a
# namespace package with nothing in it; this file is still found, through the editable install.
# Say so in one line, rather than fail on the first name the folder does not have.
_package = sys.modules.get("gradwatch")
if _package is not None and getattr(_package, "__file__", None) is None:
    _folders = ", ".join(f"'{folder}'" for folder in getattr(_package, "__path__", []))
    sys.stderr.write(
        f"gradwatch: error: the folder {_folders} was imported as the gradwatch package, in place of gradwatch "
        f"installed at '{Path(__file__).resolve().parent}': a folder named gradwatch in the current directory "
        "(or beside your script) hides an editable install; rename that folder or run from another directory\n")
    sys.exit(2)

from gradwatch.cli import main  # noqa: E402

sys.exit(main())
