"""``python -m nanoshampoo.train``: see ``nanoshampoo.train.cli``."""

import sys

from nanoshampoo.train.cli import run_entry_point

if __name__ == "__main__":
    sys.exit(run_entry_point(sys.argv[1:]))
