"""Where the shipped organisms' weights live: ``vlmbind/organisms/weights/<name>/`` (a ``save_pretrained`` directory
with a model card), loaded through the same ``from_pretrained`` path as any checkpoint. The names are core because
the command line's choices, loading and the organisms' own code all need them."""

from __future__ import annotations

from pathlib import Path

ORGANISM_NAMES = ("organism-p2a", "organism-direct", "organism-vsm", "organism-vsm-natural", "organism-search",
                  "organism-search-natural")
# each organism with a planted mechanism -> its twin: the same recipe without the SIIT losses (the negative control)
PLANTED_TWINS = {"organism-vsm": "organism-vsm-natural", "organism-search": "organism-search-natural"}
WEIGHTS_DIR = Path(__file__).parents[1] / "organisms" / "weights"


def organism_dir(name: str) -> Path:
    return WEIGHTS_DIR / name


def shipped_organisms() -> list[str]:
    """The organisms whose weights are in this installation."""
    return [n for n in ORGANISM_NAMES if (organism_dir(n) / "config.json").is_file()]


def planted_organisms() -> dict[str, str | None]:
    """The shipped organisms with a planted mechanism, each with its twin (None where the twin is not shipped)."""
    shipped = set(shipped_organisms())
    return {name: (twin if twin in shipped else None) for name, twin in PLANTED_TWINS.items() if name in shipped}
