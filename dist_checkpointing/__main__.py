"""``python -m dist_checkpointing``: the command line (see :mod:`dist_checkpointing.cli`)."""

import sys

from .cli import main

sys.exit(main())
