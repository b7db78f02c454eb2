"""``python -m gradwatch``: the same as the ``gradwatch`` command."""

import sys

from gradwatch.cli import main

sys.exit(main())
