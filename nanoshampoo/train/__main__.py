"""``python -m nanoshampoo.train``: see ``nanoshampoo.train.cli``."""

import sys

from nanoshampoo.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
