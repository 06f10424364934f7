"""`python -m duality.cli`: the command line, every command in this process (no batch server
hand-off before it is imported, unlike `python -m duality`)."""

import sys

from duality.cli import main

sys.exit(main())
