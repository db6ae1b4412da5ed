"""``python -m meter.cli`` is the ``meter`` command."""

import sys

from meter.cli.main import main

sys.exit(main())
