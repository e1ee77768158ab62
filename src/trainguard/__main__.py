"""``python -m trainguard`` is the ``trainguard`` command."""

import sys

from trainguard.cli.main import main

sys.exit(main())
