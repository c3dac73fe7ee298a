"""``python -m meshplan.cli``: the command line."""

import sys

from meshplan.cli.app import main

sys.exit(main())
