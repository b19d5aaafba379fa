"""``python -m vlmbind ...``: the ``vlmbind`` command (also what ``accelerate launch -m vlmbind`` and ``torchrun -m
vlmbind`` run on every rank)."""

import sys

from .cli import main

if __name__ == "__main__":  # a spawned rank imports this module without running the command again
    sys.exit(main())
