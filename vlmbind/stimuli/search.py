"""Visual search and counting (CAM, PbP), with Direct-Answer and Point-to-Answer targets.

Design: both tasks put objects in distinct cells of a canvas grid (so they never overlap and each has a grid
coordinate), list them in raster order (row, then column) and answer either directly (``yes`` / ``no``, ``7``) or
Point-to-Answer style: the points first, on the object grid (``x`` = column, ``y`` = row, 0-based, in raster order),
then the same answer (``(2, 5) yes``, ``(0, 0) (3, 1) 2``). When there is nothing to point at, the P2A trace says
``none`` before the answer (``none no``), so the first generated token always commits to "a point" or "no point".
Both answers are also stored in every example's fields (``answer_direct``, ``answer_p2a``), so one image set serves
both fine-tuning regimes. Object counts are given as an int, a ``(lo, hi)`` tuple (inclusive) or an explicit list /
``range`` of allowed values, and each example draws its count uniformly from them; :data:`COUNT_SPLITS` and
:data:`SEARCH_SPLITS` name the PbP in-distribution / out-of-distribution ranges. Every example draws from its own
stream (:func:`~vlmbind.stimuli.core.example_rng`), so a larger ``n`` keeps the first examples byte-identical.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from ..core.errors import close_matches
from .core import (
    COLOURS, SHAPES, Canvas, Dataset, Example, SceneObject, StimulusError, check_colours, check_shapes, example_rng,
    place, random_cells, raster, render,
)
from .points import format_points, p2a_text

__all__ = ["COUNT_SPLITS", "SEARCH_SPLITS", "MAX_SEARCH_OBJECTS", "counting", "visual_search"]

KINDS = ("disjunctive", "conjunctive")
REGIMES = ("direct", "p2a")
DIVERSITIES = ("low", "high")
# An object count: one value, an inclusive ``(lo, hi)`` range, or an explicit list / range of allowed values.
Counts = int | tuple[int, int] | list[int] | range
MAX_SEARCH_OBJECTS = 50

# (target, distractors) as (colour, shape): CAM's disjunctive and conjunctive displays.
_SEARCH_ITEMS: dict[str, tuple[tuple[str, str], tuple[tuple[str, str], ...]]] = {
    "disjunctive": (("green", "circle"), (("red", "circle"),)),
    "conjunctive": (("green", "L"), (("red", "L"), ("green", "T"))),
}

# PbP's splits, as values of ``counting(objects=...)`` and ``visual_search(n_objects=...)``: counting trains on 5-10
# objects and tests on 11-15; search fine-tunes on single-object displays (the target alone, or one distractor when
# absent) and tests on 2-50 objects (docs/methods.md section 7). Read as target counts ("1 target" vs "2-50
# targets"), the same ranges are ``visual_search(n_targets=...)``.
COUNT_SPLITS: dict[str, tuple[int, int]] = {"train": (5, 10), "ood": (11, 15)}
SEARCH_SPLITS: dict[str, tuple[int, int]] = {"train": (1, 1), "ood": (2, 50)}


def _choice(value: str, choices: Sequence[str], name: str) -> str:
    if value not in choices:
        raise StimulusError(f"unknown {name} {value!r}.{close_matches(str(value), choices)} "
                            f"Choose one of: {', '.join(choices)}")
    return value


def _counts(value: Counts, name: str, lo: int, hi: int | None = None) -> list[int]:
    """Allowed object counts: an int, a ``(lo, hi)`` tuple (inclusive) or an explicit list / range of values.

    Raises:
        StimulusError: not a count specification, empty, or a value outside ``[lo, hi]``.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        values = [int(value)]
    elif isinstance(value, tuple):
        if len(value) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            raise StimulusError(f"{name}={value!r}: a tuple is an inclusive (lo, hi) range of two ints; "
                                f"pass a list or range for explicit values")
        if value[0] > value[1]:
            raise StimulusError(f"{name}={value!r}: lo > hi; write ({value[1]}, {value[0]})")
        values = list(range(int(value[0]), int(value[1]) + 1))
    elif isinstance(value, (list, range)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            raise StimulusError(f"{name}={value!r}: every value must be an int")
        values = sorted({int(v) for v in value})
    else:
        raise StimulusError(f"{name}={value!r}: give an int, a (lo, hi) tuple or a list / range of ints")
    if not values:
        raise StimulusError(f"{name}={value!r} allows no count; give at least one value")
    bad = [v for v in values if v < lo or (hi is not None and v > hi)]
    if bad:
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise StimulusError(f"{name}={value!r} has {bad[0]} outside {bound}; keep every count in {bound}")
    return values


def _check_common(n: int, seed: int, regime: str, canvas: Canvas) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise StimulusError(f"n must be an int >= 0 (the number of examples), got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise StimulusError(f"seed must be an int >= 0, got {seed!r}")
    _choice(regime, REGIMES, "regime")
    if not isinstance(canvas, Canvas):
        raise StimulusError(f"canvas must be a stimuli.core.Canvas, got {type(canvas).__name__}")


def _grid_point(o: SceneObject) -> tuple[int, int]:
    """An object's point on the object grid: ``(x, y) = (column, row)``."""
    return o.col, o.row


def visual_search(n: int, seed: int = 0, *, kind: str = "disjunctive", n_objects: Counts = (1, MAX_SEARCH_OBJECTS),
                  present: float = 0.5, regime: str = "direct", n_targets: Counts = 1,
                  canvas: Canvas = Canvas(image_size=448, grid=8)) -> Dataset:
    """Visual search displays (task ``"search"``): is the target among the distractors?

    Disjunctive: a green circle among red circles (colour alone finds it). Conjunctive: a green ``L`` among red ``L``
    and green ``T`` distractors, each distractor drawn as either kind with probability 1/2, so every distractor shares
    exactly one feature with the target. Each example draws its total object count from ``n_objects``, then the
    target is present with probability ``present``; when present, ``n_targets`` of the objects are targets (drawn from
    the allowed values not above the object count), the rest distractors.

    Prompt ``is there a green circle ?`` / ``is there a green L ?``. Direct answer ``yes`` / ``no``; Point-to-Answer
    the targets' grid points in raster order then the answer (``(4, 2) yes``), or ``none no`` when absent.

    Args:
        n: number of examples.
        seed: the data set's seed.
        kind: ``"disjunctive"`` or ``"conjunctive"``.
        n_objects: total objects per image (targets + distractors), 1..50: an int, a ``(lo, hi)`` tuple (inclusive)
            or a list / range of allowed values. The largest must fit the grid (50 needs an 8x8 grid).
        present: probability that the target is present.
        regime: ``"direct"`` or ``"p2a"``: which answer goes into ``Example.answer``.
        n_targets: targets per image when present (default 1), same forms as ``n_objects``; its smallest value must
            not exceed the smallest ``n_objects``.
        canvas: the image and its object grid.

    Returns:
        A :class:`Dataset` whose examples' fields hold ``kind``, ``n_objects``, ``present``, ``target`` (index of the
        first target in ``objects``, or None), ``targets`` (all target indices), ``n_targets``, ``regime``,
        ``points`` (the targets' ``[x, y]`` grid points), ``n_colour_distractors`` / ``n_shape_distractors``
        (distractors sharing the target's shape / colour), ``answer_direct`` and ``answer_p2a``.

    Raises:
        StimulusError: unknown kind or regime, counts outside 1..50, more objects than grid cells, ``present``
            outside [0, 1], or target counts that cannot fit the object counts.
    """
    _check_common(n, seed, regime, canvas)
    _choice(kind, KINDS, "kind")
    counts = _counts(n_objects, "n_objects", 1, MAX_SEARCH_OBJECTS)
    canvas.check_fits(max(counts))
    target_counts = _counts(n_targets, "n_targets", 1, MAX_SEARCH_OBJECTS)
    if min(target_counts) > min(counts):
        raise StimulusError(f"n_targets={n_targets!r} needs at least {min(target_counts)} objects but n_objects "
                            f"allows {min(counts)}; lower n_targets or raise the smallest n_objects")
    if isinstance(present, bool) or not isinstance(present, (int, float)) or not 0.0 <= float(present) <= 1.0:
        raise StimulusError(f"present is a probability in [0, 1], got {present!r}")

    (t_colour, t_shape), distractors = _SEARCH_ITEMS[kind]
    prompt = f"is there a {t_colour} {t_shape} ?"
    examples = []
    for i in range(n):
        rng = example_rng(seed, i)
        total = int(rng.choice(counts))
        is_present = bool(rng.random() < present)
        k = int(rng.choice([t for t in target_counts if t <= total])) if is_present else 0
        cells = random_cells(rng, canvas, total)
        # the first k drawn cells hold targets: cells are a uniform random sample, so targets are too
        kinds = [(t_colour, t_shape)] * k + [distractors[int(j)] for j in rng.integers(len(distractors),
                                                                                       size=total - k)]
        drawn = [place(canvas, c, s, r, col) for (c, s), (r, col) in zip(kinds, cells)]
        objects = raster(drawn)
        targets = [j for j, o in enumerate(objects) if (o.colour, o.shape) == (t_colour, t_shape)]
        points = [list(_grid_point(objects[j])) for j in targets]
        direct = "yes" if is_present else "no"
        p2a = p2a_text(points, direct)
        fields = {
            "kind": kind, "n_objects": total, "present": is_present, "target": targets[0] if targets else None,
            "targets": targets, "n_targets": k, "regime": regime, "points": points,
            "n_colour_distractors": sum(o.shape == t_shape and o.colour != t_colour for o in objects),
            "n_shape_distractors": sum(o.colour == t_colour and o.shape != t_shape for o in objects),
            "answer_direct": direct, "answer_p2a": p2a,
        }
        examples.append(Example(f"search_{i:06d}", render(canvas, objects), objects, prompt,
                                p2a if regime == "p2a" else direct, "search", fields))

    params = {"kind": kind, "n_objects": counts, "present": float(present), "regime": regime,
              "n_targets": target_counts, "canvas": canvas.to_dict()}
    summary = {
        "n_present": sum(e.fields["present"] for e in examples),
        "object_counts": {str(k): v for k, v in sorted(Counter(e.fields["n_objects"] for e in examples).items())},
        "target": {"colour": t_colour, "shape": t_shape},
        "distractors": [{"colour": c, "shape": s} for c, s in distractors],
        "point_frame": "object grid: x = column, y = row, 0-based",
    }
    return Dataset("search", examples, params, int(seed), summary)


def counting(n: int, seed: int = 0, *, objects: Counts = (1, 20), diversity: str = "low", regime: str = "direct",
             colours: Sequence[str] | None = None, shapes: Sequence[str] | None = None,
             canvas: Canvas = Canvas(image_size=448, grid=5)) -> Dataset:
    """Counting displays (task ``"count"``): how many objects are there?

    Low diversity: every object of an image has the same colour and shape (drawn per image from the pools); high
    diversity: each object's colour and shape are drawn independently from the pools.

    Prompt ``how many objects are there ?``. Direct answer the number (``7``); Point-to-Answer every object's grid
    point in raster order, then the number (``(0, 0) (3, 0) (1, 2) 3``).

    Args:
        n: number of examples.
        seed: the data set's seed.
        objects: objects per image: an int, a ``(lo, hi)`` tuple (inclusive) or a list / range of allowed values
            (``COUNT_SPLITS["ood"]`` or ``range(11, 16)`` for the OOD test set). Each must fit the grid.
        diversity: ``"low"`` or ``"high"``.
        regime: ``"direct"`` or ``"p2a"``: which answer goes into ``Example.answer``.
        colours: the colour pool (default: the whole palette).
        shapes: the shape pool (default: the eight geometric shapes; letters are allowed).
        canvas: the image and its object grid.

    Returns:
        A :class:`Dataset` whose examples' fields hold ``n_objects``, ``diversity``, ``regime``, ``points`` (every
        object's ``[x, y]`` grid point, raster order), ``n_colours``, ``n_shapes``, ``answer_direct`` and
        ``answer_p2a``.

    Raises:
        StimulusError: unknown diversity, regime, colour or shape; a count below 1 or above the grid's cells.
    """
    _check_common(n, seed, regime, canvas)
    _choice(diversity, DIVERSITIES, "diversity")
    counts = _counts(objects, "objects", 1)
    canvas.check_fits(max(counts))
    colour_pool = check_colours(list(colours) if colours is not None else list(COLOURS))
    shape_pool = check_shapes(list(shapes) if shapes is not None else list(SHAPES))
    if not colour_pool or not shape_pool:
        raise StimulusError("colours and shapes must each name at least one value")

    prompt = "how many objects are there ?"
    examples = []
    for i in range(n):
        rng = example_rng(seed, i)
        total = int(rng.choice(counts))
        cells = random_cells(rng, canvas, total)
        draws = 1 if diversity == "low" else total  # low: one colour and shape for the whole image
        cs = [colour_pool[int(j)] for j in rng.integers(len(colour_pool), size=draws)] * (total // draws)
        ss = [shape_pool[int(j)] for j in rng.integers(len(shape_pool), size=draws)] * (total // draws)
        objs = raster([place(canvas, c, s, r, col) for c, s, (r, col) in zip(cs, ss, cells)])
        points = [list(_grid_point(o)) for o in objs]
        direct = str(total)
        p2a = f"{format_points(points)} {direct}"
        fields = {"n_objects": total, "diversity": diversity, "regime": regime, "points": points,
                  "n_colours": len({o.colour for o in objs}), "n_shapes": len({o.shape for o in objs}),
                  "answer_direct": direct, "answer_p2a": p2a}
        examples.append(Example(f"count_{i:06d}", render(canvas, objs), objs, prompt,
                                p2a if regime == "p2a" else direct, "count", fields))

    params = {"objects": counts, "diversity": diversity, "regime": regime, "colours": list(colour_pool),
              "shapes": list(shape_pool), "canvas": canvas.to_dict()}
    summary = {
        "object_counts": {str(k): v for k, v in sorted(Counter(e.fields["n_objects"] for e in examples).items())},
        "point_frame": "object grid: x = column, y = row, 0-based",
    }
    return Dataset("count", examples, params, int(seed), summary)
