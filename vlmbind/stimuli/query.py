"""The binding query task: which colour (or shape) goes with a given shape (or colour) in the image, built so that
the colour and shape multisets alone do not fix the answer. The multisets are drawn first, then paired by a uniformly
random permutation (rejecting repeated conjunctions), so the Bayes-optimal strategy that sees only the multisets and
the query answers with accuracy ``max_v P(v | multisets, query)``, computed exactly by enumerating permutations and
stored per example and for the data set.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from ..core.errors import close_matches
from .core import (
    Canvas,
    Dataset,
    Example,
    StimulusError,
    check_canvas,
    check_n,
    check_seed,
    example_rng,
    feature_pools,
    object_count_summary,
    object_range,
    place,
    random_cells,
    raster,
    render,
)

QUERIES = ("shape", "colour")
MAX_QUERY_OBJECTS = 6  # exact ceilings enumerate n! pairings
DEFAULT_CANVAS = Canvas(image_size=224, grid=3)


def pair_features(rng: np.random.Generator, colours: Sequence[str], shapes: Sequence[str],
                  max_tries: int = 10_000) -> list[int]:
    """The generator's pairing step: a uniformly random permutation ``perm`` (object k = ``(colours[k],
    shapes[perm[k]])``), redrawn while two objects would have the same conjunction.

    Raises:
        StimulusError: no valid permutation found in ``max_tries`` draws (the multisets admit none).
    """
    n = len(colours)
    for _ in range(max_tries):
        perm = [int(i) for i in rng.permutation(n)]
        if len({(colours[k], shapes[perm[k]]) for k in range(n)}) == n:
            return perm
    raise StimulusError(f"no pairing of colours {list(colours)} with shapes {list(shapes)} gives distinct objects")


def answer_distribution(colours: Sequence[str], shapes: Sequence[str], query: str, given: str) -> dict[str, Fraction]:
    """Exact ``P(answer | multisets, query)`` under the uniform distribution over valid pairings.

    Enumerates every permutation of ``shapes`` against ``colours`` (``n!``, n <= 6) and keeps those with distinct
    conjunctions, exactly the pairings :func:`pair_features` can return, each equally likely.

    Args:
        colours: the scene's colour list (any order).
        shapes: the scene's shape list.
        query: ``"shape"`` (answer the shape of the object whose colour is ``given``) or ``"colour"``.
        given: the value named in the prompt (unique in the scene).

    Returns:
        answer value -> probability, values with probability > 0 only, sorted by value.

    Raises:
        StimulusError: more than ``MAX_QUERY_OBJECTS`` objects, or the multisets admit no valid pairing.
    """
    n = len(colours)
    if n > MAX_QUERY_OBJECTS:
        raise StimulusError(f"exact enumeration supports up to {MAX_QUERY_OBJECTS} objects, got {n}")
    counts: Counter[str] = Counter()
    total = 0
    for perm in itertools.permutations(range(n)):
        objs = [(colours[k], shapes[perm[k]]) for k in range(n)]
        if len(set(objs)) < n:
            continue
        total += 1
        for c, s in objs:
            if query == "shape" and c == given:
                counts[s] += 1
            elif query == "colour" and s == given:
                counts[c] += 1
    if total == 0:
        raise StimulusError(f"colours {list(colours)} and shapes {list(shapes)} admit no distinct pairing")
    return {v: Fraction(counts[v], total) for v in sorted(counts)}


def _query_prompt(query: str, given: str) -> str:
    return f"the {given} object is a" if query == "shape" else f"what colour is the {given} ? it is"


def _draw_query_scene(rng: np.random.Generator, lo: int, hi: int, kinds: tuple[str, ...],
                      colours: tuple[str, ...], shapes: tuple[str, ...], answer_values: tuple[int, ...]
                      ) -> tuple[list[str], list[str], str, str, dict[str, Fraction]]:
    """Multisets first, then the query; rejection until the answer is not fixed by the multisets."""
    while True:
        n = int(rng.integers(lo, hi + 1))
        kind = kinds[int(rng.integers(len(kinds)))]
        # the attribute named in the prompt has n distinct values (so any of them is unique); the answered
        # attribute repeats: n i.i.d. draws among m values, m from answer_values
        given_pool, answer_pool = (colours, shapes) if kind == "shape" else (shapes, colours)
        given_vals = [given_pool[int(i)] for i in rng.choice(len(given_pool), size=n, replace=False)]
        m = int(answer_values[int(rng.integers(len(answer_values)))])
        support = [answer_pool[int(i)] for i in rng.choice(len(answer_pool), size=m, replace=False)]
        answer_vals = [support[int(i)] for i in rng.integers(m, size=n)]
        cs, ss = (given_vals, answer_vals) if kind == "shape" else (answer_vals, given_vals)
        attr = cs if kind == "shape" else ss
        unique = [v for v in attr if attr.count(v) == 1]
        given = unique[int(rng.integers(len(unique)))]
        dist = answer_distribution(cs, ss, kind, given)
        if len(dist) >= 2:
            return cs, ss, kind, given, dist


def binding_query(
    n: int,
    seed: int = 0,
    *,
    n_objects: int | tuple[int, int] = (3, 4),
    query: str | Sequence[str] = ("shape", "colour"),
    canvas: Canvas = DEFAULT_CANVAS,
    colours: Sequence[str] | None = None,
    shapes: Sequence[str] | None = None,
    answer_values: int | Sequence[int] = (2, 3),
) -> Dataset:
    """The binding query task: ``the red object is a`` -> ``square``; ``what colour is the circle ? it is`` -> ``blue``.

    Generation, per example: draw the query kind (uniform among ``query``); draw the attribute the prompt names with
    ``n`` distinct values and the answered attribute as ``n`` i.i.d. draws among ``m`` values (``m`` uniform in
    ``answer_values``; repeats make the answer ambiguous from counts); pick the named value uniformly (it is unique);
    reject the scene if the answer is determined by the multisets (fewer than two answers with non-zero probability);
    then pair colours with shapes by :func:`pair_features` (uniform permutation, distinct conjunctions) and place the
    objects in random cells.

    The counting-only strategy sees both multisets and the query but not the binding; its Bayes-optimal answer is the
    most probable value under the uniform distribution over valid pairings, with per-example accuracy
    ``max_v P(v | multisets, query)`` (:func:`answer_distribution`, exact). The defaults put the data-set mean near
    0.6 (about 0.62 expected: 2/3 for 3 objects over 2 values, 3/4 or 1/2 for 4 objects over 2 values, ...), and no
    example's ceiling reaches 1 by construction.

    Args:
        n: number of examples.
        seed: data-set seed.
        n_objects: objects per scene, an int or inclusive ``(lo, hi)``, between 2 and 6.
        query: ``"shape"``, ``"colour"`` or both (asked with equal probability).
        canvas: image size and grid.
        colours: colour pool (default all).
        shapes: shape pool (default ``SHAPES``).
        answer_values: how many distinct values the answered attribute is drawn from (an int or a choice), >= 2.

    Returns:
        Dataset of task ``"query"``; fields ``query`` (the asked attribute), ``given`` (the value in the prompt),
        ``target`` (object index), ``n_objects``, ``counting_distribution`` (value -> probability),
        ``counting_ceiling`` (float) and ``counting_ceiling_fraction`` (``"p/q"``); ``summary["counting_ceiling"]``
        (mean, float) and ``summary["counting_ceiling_fraction"]`` (exact ``"p/q"``).

    Raises:
        StimulusError: bad parameters, pools too small, or an unknown query kind.
    """
    n, seed, canvas = check_n(n), check_seed(seed), check_canvas(canvas)
    lo, hi = object_range(n_objects, canvas, high=MAX_QUERY_OBJECTS)
    cs, ss = feature_pools(colours, shapes)
    kinds = (query,) if isinstance(query, str) else tuple(query)
    for k in kinds:
        if k not in QUERIES:
            raise StimulusError(f"query {k!r} is not one of {QUERIES}.{close_matches(str(k), QUERIES)}")
    if not kinds or len(set(kinds)) != len(kinds):
        raise StimulusError(f"query must name 'shape', 'colour' or both once each, got {query!r}")
    values = (answer_values,) if isinstance(answer_values, (int, np.integer)) else tuple(answer_values)
    if not values or any(isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 2 for m in values):
        raise StimulusError(f"answer_values must be ints >= 2 (an answer needs two candidates), got {answer_values!r}")
    values = tuple(int(m) for m in values)
    for k in kinds:
        given_pool, answer_pool = (cs, ss) if k == "shape" else (ss, cs)
        given_name, answer_name = ("colours", "shapes") if k == "shape" else ("shapes", "colours")
        if len(given_pool) < hi:
            raise StimulusError(f"{k} queries on {hi} objects need {hi} distinct {given_name}, got "
                                f"{len(given_pool)}: add {given_name} or lower n_objects")
        if len(answer_pool) < max(values):
            raise StimulusError(f"answer_values {max(values)} needs {max(values)} {answer_name}, got "
                                f"{len(answer_pool)}: add {answer_name} or lower answer_values")
    examples, ceilings = [], []
    for i in range(n):
        rng = example_rng(seed, i)
        c_list, s_list, kind, given, dist = _draw_query_scene(rng, lo, hi, kinds, cs, ss, values)
        perm = pair_features(rng, c_list, s_list)
        conj = [(c_list[k], s_list[perm[k]]) for k in range(len(c_list))]
        cells = random_cells(rng, canvas, len(conj))
        objects = raster([place(canvas, c, s, r, col) for (c, s), (r, col) in zip(conj, cells)])
        target = next(k for k, o in enumerate(objects) if (o.colour if kind == "shape" else o.shape) == given)
        answer = objects[target].shape if kind == "shape" else objects[target].colour
        ceiling = max(dist.values())
        ceilings.append(ceiling)
        fraction = f"{ceiling.numerator}/{ceiling.denominator}"
        examples.append(Example(
            id=f"query-{i:05d}", image=render(canvas, objects), objects=objects, prompt=_query_prompt(kind, given),
            answer=answer, task="query",
            fields={"query": kind, "given": given, "target": target, "n_objects": len(objects),
                    "counting_distribution": {v: float(p) for v, p in dist.items()},
                    "counting_ceiling": float(ceiling), "counting_ceiling_fraction": fraction},
        ))
    mean = sum(ceilings, Fraction(0)) / len(ceilings) if ceilings else Fraction(0)
    kinds_count = Counter(e.fields["query"] for e in examples)
    summary = {**object_count_summary(examples), "query_counts": {k: kinds_count[k] for k in kinds},
               "counting_ceiling": float(mean), "counting_ceiling_fraction": f"{mean.numerator}/{mean.denominator}",
               "counting_ceiling_max": float(max(ceilings)) if ceilings else 0.0}
    params = {"n_objects": [lo, hi], "query": list(kinds), "canvas": canvas.to_dict(), "colours": list(cs),
              "shapes": list(ss), "answer_values": list(values)}
    return Dataset("query", examples, params, seed, summary)


__all__ = ["MAX_QUERY_OBJECTS", "QUERIES", "answer_distribution", "binding_query", "pair_features"]
