"""``python -m attngraph``: the command line (see `attngraph.cli`)."""

from .cli import main

raise SystemExit(main())
