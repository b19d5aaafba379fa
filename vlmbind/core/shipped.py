"""Where the shipped organisms' weights live: ``vlmbind/organisms/weights/<name>/`` (a ``save_pretrained`` directory
with a model card), loaded through the same ``from_pretrained`` path as any checkpoint. The names are core because
the command line's choices, loading and the organisms' own code all need them."""

from __future__ import annotations

from pathlib import Path

ORGANISM_NAMES = ("organism-p2a", "organism-direct", "organism-vsm", "organism-vsm-natural")
WEIGHTS_DIR = Path(__file__).parents[1] / "organisms" / "weights"


def organism_dir(name: str) -> Path:
    return WEIGHTS_DIR / name


def shipped_organisms() -> list[str]:
    """The organisms whose weights are in this installation."""
    return [n for n in ORGANISM_NAMES if (organism_dir(n) / "config.json").is_file()]
