"""Moved to :mod:`vlmbind.shipped`; this name stays for code that imports it from here."""

from ..shipped import ORGANISM_NAMES, WEIGHTS_DIR, organism_dir, shipped_organisms  # noqa: F401
