"""The table of tiny-model builders: ``@register_tiny(name)`` adds one; :mod:`vlmbind.tiny` imports every module of
its package, so a new family's tiny model is registered by its own file alone."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..core.errors import InputError

TINY_BUILDERS: dict[str, Callable[..., tuple[Any, Any]]] = {}
# name -> its place in `vlmbind models` (import order would be fragile: sorting imports would reorder the listing)
LISTING_RANK: dict[str, int] = {}


# what every builder's docstring would otherwise repeat
BUILDER_DOC = """

    Args:
        seed: the weights are a deterministic function of it (same seed, identical weights).
        attn_implementation: ``"eager"`` (the default: attention patterns available) or ``"sdpa"``.
        tokenizer, chat_template: where the builder takes them, a real tokenizer and chat template instead of the
            tiny ones (:mod:`vlmbind.tiny.real`).

    Returns:
        ``(model, processor)``; the model is in eval mode.

    Raises:
        InputError: an option this builder does not take (the message lists those it takes).
    """


def register_tiny(name: str, rank: int) -> Callable:
    """Decorator: register ``fn(seed=0, *, attn_implementation="eager", ...) -> (model, processor)`` under ``name``
    (``tiny-<family>``); ``rank`` orders the listing. Write it as ``@register_tiny("tiny-<family>", rank=N)`` on one
    line: the command line reads the names from these lines without importing the builders
    (:data:`vlmbind.core.choices.TINY_NAMES`). The registered builder refuses an option ``fn`` does not take with a
    named error, and carries the arguments' documentation every builder shares."""
    def deco(fn: Callable) -> Callable:
        if name in TINY_BUILDERS:
            raise ValueError(f"tiny model {name!r} registered twice")
        if rank in LISTING_RANK.values():
            raise ValueError(f"tiny model {name!r}: rank {rank} is taken")
        takes = [p for p in inspect.signature(fn).parameters if p != "seed"]

        @functools.wraps(fn)
        def build(seed: int = 0, **options: Any) -> tuple[Any, Any]:
            unknown = sorted(set(options) - set(takes))
            if unknown:
                raise InputError(f"the tiny model {name} takes the options {', '.join(takes)}; not "
                                 f"{', '.join(unknown)} (it is built, not loaded: from_pretrained's options do not "
                                 f"apply)")
            return fn(seed, **options)

        build.__doc__ = (fn.__doc__ or f"Build {name}.").rstrip().removesuffix('"""') + BUILDER_DOC
        TINY_BUILDERS[name] = build
        LISTING_RANK[name] = int(rank)
        return build

    return deco


def listed_names() -> tuple[str, ...]:
    """The registered names in listing order."""
    return tuple(sorted(TINY_BUILDERS, key=lambda n: LISTING_RANK[n]))
