"""``python -m nanoshampoo.train``: see ``nanoshampoo.train.cli``."""

import sys

from nanoshampoo.train.allocator import exec_with_tuned_malloc

if __name__ == "__main__":
    # Re-execute (tuned malloc) before the trainer's imports: torch, imported first, would be
    # imported again by the new process (~1 s of CPU, several seconds on a loaded machine).
    exec_with_tuned_malloc("nanoshampoo.train", sys.argv[1:])
    from nanoshampoo.train.cli import run_entry_point

    sys.exit(run_entry_point(sys.argv[1:]))
