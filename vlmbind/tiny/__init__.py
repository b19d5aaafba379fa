"""Random-weight tiny models of every supported family, built offline and deterministic from a seed.

Each builder makes the real HF config, model class, tokenizer and processor of its family at a tiny size (about 1M
parameters), so tests and examples exercise exactly the code paths a real checkpoint uses. Tokenizers are byte-level
BPE vocabularies trained in-process on the stimuli's words (answer words with a leading space are single tokens),
plus each family's special and image tokens. Zero-initialised image paths (Gemma-3's projector, Molmo2's scaled
adapter) are re-initialised so that the image matters.

``build("tiny-<family>", seed=0)`` returns ``(model, processor)``; ``vlmbind.load`` wraps it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ..core.errors import UnsupportedModelError, close_matches
from .registry import TINY_BUILDERS, listed_names, register_tiny

# every module of this package is imported, so each builder module registers its tiny models by existing
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["TINY_BUILDERS", "TINY_NAMES", "build", "register_tiny", "tiny_family", "tiny_names_by_family"]

# in the order `vlmbind models` lists them (each builder's rank)
TINY_NAMES = listed_names()


def build(name: str, seed: int = 0, **kwargs: Any) -> tuple[Any, Any]:
    """Build the tiny model ``name`` with random weights from ``seed``; returns ``(model, processor)``."""
    if name not in TINY_BUILDERS:
        raise UnsupportedModelError(f"unknown tiny model {name!r}.{close_matches(name, TINY_BUILDERS)}")
    return TINY_BUILDERS[name](seed=seed, **kwargs)


def tiny_family(name: str) -> str:
    """The family a tiny model belongs to, by the naming convention ``tiny-<family>`` (``-`` and ``_`` alike); the
    tests check it against the built models."""
    return name.removeprefix("tiny-").replace("-", "_")


def tiny_names_by_family() -> dict[str, list[str]]:
    """family -> its tiny models, in listing order."""
    out: dict[str, list[str]] = {}
    for name in TINY_NAMES:
        out.setdefault(tiny_family(name), []).append(name)
    return out
