"""The ``vlmbind`` entry point (``[project.scripts]``); the command itself lives in :mod:`vlmbind.app.commands`."""

from __future__ import annotations

import sys

from .app.commands import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
