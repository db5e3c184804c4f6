"""``python -m redroll.cli``: the ``redroll`` command line."""

import sys

from redroll.cli.main import main

sys.exit(main())
