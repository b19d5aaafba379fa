"""The table of tiny-model builders: ``@register_tiny(name)`` adds one; :mod:`vlmbind.tiny` imports every module of
its package, so a new family's tiny model is registered by its own file alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TINY_BUILDERS: dict[str, Callable[..., tuple[Any, Any]]] = {}
# name -> its place in `vlmbind models` (import order would be fragile: sorting imports would reorder the listing)
LISTING_RANK: dict[str, int] = {}


def register_tiny(name: str, rank: int) -> Callable:
    """Decorator: register ``fn(seed=..., **kwargs) -> (model, processor)`` under ``name`` (``tiny-<family>``);
    ``rank`` orders the listing. Write it as ``@register_tiny("tiny-<family>", rank=N)`` on one line: the command
    line reads the names from these lines without importing the builders
    (:data:`vlmbind.core.choices.TINY_NAMES`)."""
    def deco(fn: Callable) -> Callable:
        if name in TINY_BUILDERS:
            raise ValueError(f"tiny model {name!r} registered twice")
        if rank in LISTING_RANK.values():
            raise ValueError(f"tiny model {name!r}: rank {rank} is taken")
        TINY_BUILDERS[name] = fn
        LISTING_RANK[name] = int(rank)
        return fn

    return deco


def listed_names() -> tuple[str, ...]:
    """The registered names in listing order."""
    return tuple(sorted(TINY_BUILDERS, key=lambda n: LISTING_RANK[n]))
