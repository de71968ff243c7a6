"""``python -m dynemb``: the command line (see :mod:`dynemb.cli`)."""

import sys

from dynemb.cli import main

sys.exit(main())
