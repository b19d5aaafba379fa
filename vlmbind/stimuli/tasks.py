"""The stimulus tasks by name: :func:`generate` runs a task's generator, :func:`task_kwargs` turns user options into
its keyword arguments (``vlmbind stimuli``, ``eval`` and ``ablate`` build their data sets through these), and
:func:`make_pairs` builds a registered condition's pairs. The answerable tasks (scene, query, search, count) are
registered here with their scorers (:func:`vlmbind.stimuli.register_task`), as a researcher's own are.

Design: one table maps each task to its generator and to the options it accepts; an option given for a task that does
not use it is bad input, never silently ignored. Canvas options (``image_size``, ``grid``, ``object_size``) build a
:class:`~vlmbind.stimuli.core.Canvas` for the generators that take one. Messages name options as command-line flags
(``--objects``), since that is where users give them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..core.choices import PAIR_CONDITIONS  # noqa: F401  (public here too)
from . import query, scenes, search
from .answers import answer_words, read_count, read_query, read_scene, read_yes_no
from .core import COLOURS, SHAPES, Canvas, Example, StimulusError
from .pairs import PairSet
from .points import pointing_spans
from .registry import TASKS as REGISTERED_TASKS
from .registry import PairContext, build_pair, condition, register_task

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


def default_canvas(task: str) -> Canvas:
    """The canvas the generator of the built-in ``task`` draws on when given none (``task`` takes a canvas)."""
    module, function, _ = TASKS[task]
    mod = importlib.import_module(f"vlmbind.stimuli.{module}")
    if task == "rsa":  # its generator chooses its canvas when called
        return mod.default_canvas()
    return inspect.signature(getattr(mod, function)).parameters["canvas"].default


def task_kwargs(task: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The generator keyword arguments of ``task`` from user ``options`` (names of :data:`OPTIONS`; missing or None
    means not given).

    Raises:
        StimulusError: an option the task does not accept, or a malformed ``positions``.
    """
    if task not in TASKS:  # a registered task of a researcher's: its generator's options are its own
        given = [k for k in OPTIONS if options.get(k) is not None]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise StimulusError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply to task {task!r} (a task "
                                "registered by a --plugin file makes its own stimuli); drop them")
        return {}
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
    """Run the generator of ``task`` (``pairs``: counterfactual pairs of that condition, scene only); a task a
    researcher registered gets those of ``kwargs`` its generator takes (the canvas a model was trained on, when it
    takes ``canvas`` or ``**options``).

    Raises:
        StimulusError: an unknown task, a bad ``n``, or an option (other than the canvas) the generator does not take.
    """
    if task not in TASKS and task in REGISTERED_TASKS:
        generator = REGISTERED_TASKS[task].generate
        parameters = inspect.signature(generator).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        refused = [k for k in kwargs if not takes_any and k not in parameters and k != "canvas"]
        if refused:
            raise StimulusError(f"task {task!r}'s generator takes no {', '.join(refused)}; drop the option")
        if n is None or n < 1:
            raise StimulusError(f"--n must be a positive number of examples, got {n}")
        return generator(n, seed, **{k: v for k, v in kwargs.items() if takes_any or k in parameters})
    if task not in TASKS:
        raise StimulusError(f"unknown task {task!r}; tasks: {', '.join([*TASKS, *REGISTERED_TASKS])}")
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


# ---- the answerable tasks and how an answer is read (the readers of .answers: case, punctuation, markdown,
# articles and pointing formats ignored) ------------------------------------------------------------------------------
def score_scene(example: Example, output: str) -> tuple[bool, Any]:
    """The first colour word followed by a shape word equals the expected ``colour shape``."""
    words = answer_words(example.answer)
    want = read_scene(example.answer, words[:1], words[1:2])
    parsed = read_scene(output, words[:1], words[1:2])
    return parsed is not None and parsed == want, parsed


def score_query(example: Example, output: str) -> tuple[bool, Any]:
    """The first word of the expected word's kind (colour, shape, letter) equals it."""
    parsed = read_query(output, example.answer)
    return parsed is not None and parsed == (answer_words(example.answer) or [None])[0], parsed


def score_search(example: Example, output: str) -> tuple[bool, Any]:
    """The first yes / no outside the points equals the expected one."""
    parsed = read_yes_no(output)
    return parsed is not None and parsed == read_yes_no(example.answer), parsed


def score_count(example: Example, output: str) -> tuple[bool, Any]:
    """The total (a number marked as the total, else the first number) equals the expected count; a reply that
    only lists points (no number) gives the number of its points."""
    parsed = read_count(output)
    if parsed is None:
        points = sum(len(span.points) for span in pointing_spans(output))
        parsed = points or None
    return parsed is not None and parsed == read_count(example.answer), parsed


register_task("scene", score=score_scene)(scenes.scene_description)
register_task("query", score=score_query)(query.binding_query)
register_task("search", score=score_search)(search.visual_search)
register_task("count", score=score_count)(search.counting)


def make_pairs(name: str, n: int, seed: int, **kwargs: Any) -> PairSet:
    """``n`` pairs of the registered condition ``name``: over scenes through :func:`~vlmbind.stimuli.scene_pairs`
    (the counterfactual drawn from each scene's own stream); over another task, the task's examples, each with a
    stream of its own for the condition (``np.random.default_rng([seed, i, 1])``).

    Raises:
        StimulusError: an unregistered condition, or what the generator or the condition refuses.
    """
    cond = condition(name)
    if cond.task == "scene":
        return scenes.scene_pairs(n, name, seed, **kwargs)
    if cond.task not in REGISTERED_TASKS:
        raise StimulusError(f"condition {name!r} is over task {cond.task!r}, which is not registered; register it "
                            "(vlmbind.stimuli.register_task) in the same --plugin file")
    data = REGISTERED_TASKS[cond.task].generate(n, seed, **kwargs)
    context = PairContext(kwargs.get("canvas"), tuple(kwargs.get("colours") or COLOURS),
                          tuple(kwargs.get("shapes") or SHAPES), {})
    pairs = [build_pair(f"pair-{i:05d}", name, e, cond.make(e, np.random.default_rng([seed, i, 1]), context))
             for i, e in enumerate(data)]
    return PairSet(name, pairs, {"condition": name, **data.params}, seed, dict(data.summary))
