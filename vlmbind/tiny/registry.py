"""The table of tiny-model builders: ``@register_tiny(name)`` adds one; :mod:`vlmbind.tiny` imports every family's
builder module, so a new family's tiny model is registered by its own file and one line there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TINY_BUILDERS: dict[str, Callable[..., tuple[Any, Any]]] = {}


def register_tiny(name: str) -> Callable:
    """Decorator: register ``fn(seed=..., **kwargs) -> (model, processor)`` under ``name`` (``tiny-<family>``)."""
    def deco(fn: Callable) -> Callable:
        if name in TINY_BUILDERS:
            raise ValueError(f"tiny model {name!r} registered twice")
        TINY_BUILDERS[name] = fn
        return fn

    return deco
