"""``python -m jaxrl.cli``: the ``jaxrl`` command."""

import sys

from jaxrl.cli import main

sys.exit(main())
