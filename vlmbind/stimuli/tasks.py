"""The stimulus tasks by name: :func:`generate` runs a task's generator, :func:`task_kwargs` turns user options into
its keyword arguments (``vlmbind stimuli``, ``eval`` and ``ablate`` build their data sets through these).

Design: one table maps each task to its generator and to the options it accepts; an option given for a task that does
not use it is bad input, never silently ignored. Canvas options (``image_size``, ``grid``, ``object_size``) build a
:class:`~vlmbind.stimuli.core.Canvas` for the generators that take one. Messages name options as command-line flags
(``--objects``), since that is where users give them.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from ..core.choices import PAIR_CONDITIONS  # noqa: F401  (public here too)
from .core import Canvas, StimulusError

# task -> (module, function, options it accepts besides n / seed / out)
TASKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "scene": ("scenes", "scene_description", ("objects", "entropy", "canvas", "pairs")),
    "query": ("query", "binding_query", ("objects", "canvas")),
    "search": ("search", "visual_search", ("objects", "kind", "present", "regime", "canvas")),
    "count": ("search", "counting", ("objects", "diversity", "regime", "canvas")),
    "rsa": ("rsa_set", "rsa_set", ("positions", "canvas")),
    "colorshape": ("colorshape", "balanced_color_shape", ("split",)),
}
_CANVAS_OPTIONS = ("image_size", "grid", "object_size")


OPTIONS = ("objects", "entropy", "kind", "present", "regime", "diversity", "split", "positions", "pairs",
           *_CANVAS_OPTIONS)


def task_kwargs(task: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The generator keyword arguments of ``task`` from user ``options`` (names of :data:`OPTIONS`; missing or None
    means not given).

    Raises:
        StimulusError: an option the task does not accept, or a malformed ``positions``.
    """
    module, function, accepted = TASKS[task]
    args = SimpleNamespace(**{k: options.get(k) for k in OPTIONS})
    given = {k for k in OPTIONS if getattr(args, k) is not None}
    allowed = set(accepted) | (set(_CANVAS_OPTIONS) if "canvas" in accepted else set())
    allowed.discard("canvas")
    stray = sorted(given - allowed)
    if stray:
        flags = ", ".join("--" + s.replace("_", "-") for s in stray)
        verb = "does" if len(stray) == 1 else "do"
        raise StimulusError(f"{flags} {verb} not apply to task {task!r}; it accepts "
                            f"{', '.join('--' + a.replace('_', '-') for a in sorted(allowed)) or 'no options'}")
    kw: dict[str, Any] = {}
    if args.objects is not None:
        kw["objects" if task == "count" else "n_objects"] = args.objects
    for name in ("entropy", "kind", "present", "regime", "diversity", "split"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.positions is not None:
        if args.positions == "all":
            kw["positions"] = "all"
        else:
            try:
                kw["positions_per_conjunction"] = int(args.positions)
            except ValueError:
                raise StimulusError(f"--positions {args.positions!r} must be a number or 'all'") from None
    if given & set(_CANVAS_OPTIONS):
        defaults = {"image_size": 224, "grid": 3, "object_size": None}
        canvas_kw = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k] for k in _CANVAS_OPTIONS}
        kw["canvas"] = Canvas(**canvas_kw)
    return kw


def generate(task: str, n: int | None, seed: int, kwargs: dict[str, Any], pairs: str | None = None) -> Any:
    """Run the generator of ``task`` (``pairs``: counterfactual pairs of that condition, scene only)."""
    if task not in TASKS:
        raise StimulusError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    module, function, _ = TASKS[task]
    if task == "rsa" and n is not None:
        raise StimulusError("rsa makes every conjunction at --positions positions; it takes no --n")
    if task != "rsa" and (n is None or n < 1):
        raise StimulusError(f"--n must be a positive number of examples, got {n}")
    mod = importlib.import_module(f"vlmbind.stimuli.{module}")
    if task == "rsa":
        return mod.rsa_set(seed, **kwargs)
    if pairs is not None:
        kwargs = {k: v for k, v in kwargs.items() if k != "pairs"}
        return mod.scene_pairs(n, pairs, seed, **kwargs)
    return getattr(mod, function)(n, seed, **kwargs)
