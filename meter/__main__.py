"""``python -m meter`` is the ``meter`` command."""

import sys

from meter.cli import main

sys.exit(main())
