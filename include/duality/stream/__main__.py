"""`python -m duality.stream PIPELINE [options]`: run a pipeline's stream until SIGTERM."""

from duality.stream.supervisor import main

raise SystemExit(main())
