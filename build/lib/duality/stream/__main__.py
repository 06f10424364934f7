"""`python -m duality.stream PIPELINE [options]`: run a pipeline's stream until SIGTERM."""

import sys

from duality.stream.supervisor import main

sys.exit(main())
