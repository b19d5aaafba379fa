"""Conditions and tasks as code: a condition turns an example into its counterfactual, a task makes examples and
scores answers; both are registered by a decorator, the built-in ones (VSM's three conditions; the scene, query,
search and count tasks) through the same decorators as a researcher's own. The command line reads a researcher's
file only when asked (``--plugin FILE.py``, :func:`load_plugin`).

A condition::

    from vlmbind.stimuli import Counterfactual, register_condition, render

    @register_condition("shape_swap", task="scene")
    def shape_swap(example, rng, context):
        '''The target takes another shape; patch the last token.'''
        target = example.fields["target"]
        objects = list(example.objects)
        new = next(s for s in context.shapes if s != objects[target].shape)
        objects[target] = replace(objects[target], shape=new)
        return Counterfactual(image=render(context.canvas, objects), answer=objects[target].name, objects=objects)

``example`` is an example of the condition's task (its clean side, answer a), ``rng`` a ``numpy`` generator of its
own, ``context`` a :class:`PairContext` (the canvas, colour and shape pools and the generator's options). vlmbind
names the pair, keeps the clean example, and scores the logit difference of a and the returned ``answer`` (a*).

A task::

    from vlmbind.stimuli import Dataset, register_task

    def first_word(example, output):
        words = output.split()
        return bool(words) and words[0] == example.answer, words[:1]

    @register_task("my_task", score=first_word)
    def my_task(n, seed, **options):
        ...  # a Dataset of n examples, deterministic from the seed
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import InputError, close_matches
from .core import Canvas, Example, SceneObject, StimulusError
from .pairs import CounterfactualPair, PatchForm, patch_from_form


class PluginError(InputError):
    """A ``--plugin`` file that cannot be loaded, or a condition / task registered twice or wrongly."""


@dataclass(frozen=True)
class Counterfactual:
    """What a condition returns for one example.

    Attributes:
        image: the counterfactual image (same size as the example's, so both line up token for token).
        answer: a*, the answer patching the counterfactual into the clean run implies.
        patch: where to patch, in the pairs file's form (:mod:`vlmbind.stimuli.pairs`): ``"last"``,
            ``{"text": ..., "occurrence": -1}``, ``{"box": [...]}`` or ``{"positions": [...]}``.
        prompt: the counterfactual's prompt (None: the example's; another must have the same token count).
        answer_on_counterfactual: what a model should answer on the counterfactual itself (None: a*).
        objects: the counterfactual scene's objects, kept as metadata.
        fields: more metadata for the counterfactual example (what changed).
    """

    image: Any
    answer: str
    patch: PatchForm = "last"
    prompt: str | None = None
    answer_on_counterfactual: str | None = None
    objects: Sequence[SceneObject] = ()
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PairContext:
    """What a condition may need besides the example: the canvas it is drawn on (None for tasks without one), the
    colour and shape pools, and the generator's other options (e.g. ``swap``, ``recolour``)."""

    canvas: Canvas | None
    colours: tuple[str, ...]
    shapes: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Condition:
    """A registered condition: ``make(example, rng, context) -> Counterfactual`` over examples of ``task``."""

    name: str
    task: str
    make: Callable[[Example, np.random.Generator, PairContext], Counterfactual]
    doc: str
    source: str


@dataclass(frozen=True)
class Task:
    """A registered task: ``generate(n, seed, **options) -> Dataset`` and ``score(example, output) -> (correct,
    what was read)``."""

    name: str
    generate: Callable[..., Any]
    score: Callable[[Example, str], tuple[bool, Any]]
    doc: str
    source: str


CONDITIONS: dict[str, Condition] = {}
TASKS: dict[str, Task] = {}
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_")


def _source(fn: Callable) -> str:
    module = getattr(fn, "__module__", "") or ""
    return "built in" if module.startswith("vlmbind.") else (inspect.getsourcefile(fn) or module)


def _check_name(name: Any, kind: str, table: dict[str, Any], fn: Callable) -> str:
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
        raise PluginError(f"{kind} name {name!r} must be lower-case letters, digits and '_'")
    if name in table and table[name].source != _source(fn):
        raise PluginError(f"{kind} {name!r} is already registered ({table[name].source}); choose another name")
    return name


def _registrar(kind: str, table: dict[str, Any], entry: Callable[[Callable], Any]) -> Callable[[Callable], Callable]:
    """A decorator that checks the name ``entry`` builds its table entry under and registers it."""
    def decorate(fn: Callable) -> Callable:
        built = entry(fn)
        _check_name(built.name, kind, table, fn)
        table[built.name] = built
        return fn
    return decorate


def register_condition(name: str, *, task: str = "scene") -> Callable[[Callable], Callable]:
    """Register ``make(example, rng, context) -> Counterfactual`` as condition ``name`` over examples of ``task``
    (see the module docstring). Returns the function unchanged.

    Raises:
        PluginError: a bad name, or a name registered elsewhere.
    """
    return _registrar("condition", CONDITIONS,
                      lambda make: Condition(name, task, make, inspect.getdoc(make) or "", _source(make)))


def register_task(name: str, *, score: Callable[[Example, str], tuple[bool, Any]]) -> Callable[[Callable], Callable]:
    """Register ``generate(n, seed, **options) -> Dataset`` as task ``name``, scored by ``score(example, output)
    -> (correct, what was read)``. Returns the generator unchanged.

    Raises:
        PluginError: a bad name, or a name registered elsewhere.
    """
    return _registrar("task", TASKS,
                      lambda generate: Task(name, generate, score, inspect.getdoc(generate) or "", _source(generate)))


def condition(name: str) -> Condition:
    """The registered condition ``name``.

    Raises:
        StimulusError: no such condition (the message lists the registered ones).
    """
    if name not in CONDITIONS:
        raise StimulusError(f"condition {name!r} is not registered.{close_matches(name, CONDITIONS)} Registered: "
                            f"{', '.join(CONDITIONS)} (a condition of your own: --plugin FILE.py)")
    return CONDITIONS[name]


def build_pair(pid: str, condition_name: str, clean: Example, made: Any) -> CounterfactualPair:
    """The :class:`CounterfactualPair` ``pid`` from a clean example and what its condition made.

    Raises:
        StimulusError: the condition returned something else than a :class:`Counterfactual`, or answers that do not
            differ.
    """
    if not isinstance(made, Counterfactual):
        raise StimulusError(f"condition {condition_name!r} returned {type(made).__name__} for {clean.id}; return a "
                            "vlmbind.stimuli.Counterfactual")
    if made.answer.strip() == clean.answer.strip():
        raise StimulusError(f"condition {condition_name!r} gave {clean.id} the counterfactual answer {made.answer!r}, "
                            "its clean answer: a pair needs two different answers")
    if made.image.size != clean.image.size:
        raise StimulusError(f"condition {condition_name!r} drew {clean.id}'s counterfactual at {made.image.size}, "
                            f"not the example's {clean.image.size}: both sides must line up token for token")
    a, b = clean.answer.split(), made.answer.split()
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    counterfactual = Example(f"{pid}-cf", made.image, list(made.objects), made.prompt or clean.prompt,
                             made.answer_on_counterfactual or made.answer, clean.task, dict(made.fields))
    return CounterfactualPair(pid, condition_name, Example(f"{pid}-clean", clean.image, clean.objects, clean.prompt,
                                                           clean.answer, clean.task, clean.fields),
                              counterfactual, patch_from_form(made.patch, clean.image.size), clean.answer,
                              made.answer, first)


def load_plugin(path: str | os.PathLike) -> list[str]:
    """Run a researcher's Python file, whose decorators register conditions and tasks; returns what it registered
    (``condition <name>`` / ``task <name>``). Only a file the user names is run (``--plugin``).

    Raises:
        PluginError: no such file, not a ``.py`` file, or an exception while running it (the message names the file
            and the line).
    """
    path = Path(path)
    if not path.is_file() or path.suffix != ".py":
        raise PluginError(f"--plugin {str(path)!r} is not a Python file; pass the .py file that registers your "
                          "conditions or tasks")
    before = set(CONDITIONS), set(TASKS)
    name = f"vlmbind_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except PluginError as exc:
        raise PluginError(f"--plugin {path}: {exc}") from None
    except Exception as exc:
        sys.modules.pop(name, None)
        frames = [f for f in _traceback_frames(exc) if Path(f[0]).resolve() == path.resolve()]
        where = f" line {frames[-1][1]}" if frames else ""
        raise PluginError(f"--plugin {path}{where}: {type(exc).__name__}: {exc}") from None
    added = [f"condition {c}" for c in CONDITIONS if c not in before[0]]
    added += [f"task {t}" for t in TASKS if t not in before[1]]
    return added


def _traceback_frames(exc: BaseException) -> list[tuple[str, int]]:
    if isinstance(exc, SyntaxError) and exc.filename:
        return [(exc.filename, exc.lineno or 0)]
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return frames


__all__ = ["CONDITIONS", "TASKS", "Condition", "Counterfactual", "PairContext", "PluginError", "Task",
           "build_pair", "condition", "load_plugin", "register_condition", "register_task"]
