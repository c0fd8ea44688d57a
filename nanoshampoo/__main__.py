"""``python -m nanoshampoo ...`` runs the ``nanoshampoo`` command (see :mod:`nanoshampoo.cli`)."""

import sys

from nanoshampoo.cli import main

if __name__ == "__main__":
    sys.exit(main())
