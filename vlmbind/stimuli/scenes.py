"""Scene description (VSM) and its counterfactual pairs for the three CMA conditions.

Design: a scene is 2-4 objects with distinct colour-shape conjunctions, one per cell of a :class:`~.core.Canvas`
grid. Every generator draws example ``i`` from ``example_rng(seed, i)`` and builds its counterfactual from the *same*
stream after the clean scene, so ``scene_pairs(n, condition, seed)`` has exactly the clean scenes of
``scene_description(n, seed)`` under all three conditions, and a larger ``n`` keeps the first pairs. Counterfactuals
change the image only: clean and counterfactual prompts are the same string, so they tokenise alike, and
:func:`vlmbind.engine.alignment.check_alignment` proves it on a given model's processor (sequence length,
image-token count and grid, text tokens) before any patching, and returns the patch positions. The binding query
task is in :mod:`.query`.

Text conventions: lower-case words separated by single spaces, punctuation as separate words
(``in this image there is a red square , a blue circle and a``); the article is always ``a`` (``an`` before the
answer would leak the answer's first letter).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..core.errors import close_matches
from .pairs import CounterfactualPair, PairSet
from .registry import CONDITIONS as REGISTERED_CONDITIONS
from .registry import Counterfactual, PairContext, build_pair, register_condition
from .core import (
    Canvas,
    Dataset,
    Example,
    SceneObject,
    StimulusError,
    check_canvas,
    check_n,
    check_seed,
    feature_pools,
    object_count_summary,
    object_range,
    example_rng,
    place,
    random_cells,
    raster,
    render,
)

ENTROPIES = ("high", "low")
CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval")

DEFAULT_CANVAS = Canvas(image_size=224, grid=3)


# ------------------------------------------------------------------------------------------------------------------
# Parameter checks
# ------------------------------------------------------------------------------------------------------------------
def _check_entropy(entropy: Any) -> str:
    if entropy not in ENTROPIES:
        raise StimulusError(f"entropy {entropy!r} is not one of {ENTROPIES}.{close_matches(str(entropy), ENTROPIES)}")
    return entropy


def _low_grids(n: int) -> list[tuple[int, int]]:
    """The two orientations of the low-entropy feature grid for ``n`` objects: ``(n_colours, n_shapes)``."""
    a = math.ceil(math.sqrt(n))
    b = math.ceil(n / a)
    return [(a, b)] if a == b else [(a, b), (b, a)]


def _check_scene_pools(lo: int, hi: int, entropy: str, colours: tuple[str, ...], shapes: tuple[str, ...],
                       spare_colour: bool = False) -> None:
    """Raise when some scene size in ``[lo, hi]`` cannot be drawn from the pools (plus one unused colour)."""
    extra = 1 if spare_colour else 0
    why = " plus one unused colour for the feature-retrieval counterfactual" if spare_colour else ""
    for n in range(lo, hi + 1):
        if entropy == "high":
            if len(colours) < n + extra or len(shapes) < n:
                raise StimulusError(
                    f"high-entropy scenes of {n} objects need {n + extra} distinct colours{why} and {n} distinct "
                    f"shapes; got {len(colours)} colours and {len(shapes)} shapes: add colours/shapes or lower "
                    f"n_objects"
                )
        else:
            # the scene may use any orientation that fits the pools; each must leave the spare colour
            grids = [(c, s) for c, s in _low_grids(n) if c <= len(colours) and s <= len(shapes)]
            if not grids or any(c + extra > len(colours) for c, _ in grids):
                need = " or ".join(f"{c + extra} colours and {s} shapes" for c, s in _low_grids(n))
                raise StimulusError(
                    f"low-entropy scenes of {n} objects need {need}{why}; got {len(colours)} colours and "
                    f"{len(shapes)} shapes: add colours/shapes or lower n_objects"
                )


# ------------------------------------------------------------------------------------------------------------------
# Scene description
# ------------------------------------------------------------------------------------------------------------------
def _draw_conjunctions(rng: np.random.Generator, n: int, entropy: str, colours: tuple[str, ...],
                       shapes: tuple[str, ...]) -> list[tuple[str, str]]:
    """``n`` distinct (colour, shape) pairs in random order.

    High entropy: n distinct colours and n distinct shapes. Low entropy: the features come from a small
    ``a x b`` grid (``a = ceil(sqrt n)``, ``b = ceil(n / a)``, orientation random: 2 objects -> 2x1 or 1x2, 3-4 -> 2x2,
    5-6 -> 3x2), every chosen colour and shape used at least once, so some feature always repeats (4 objects are
    red square + red circle + blue square + blue circle, the scene richest in illusory conjunctions).
    """
    if entropy == "high":
        cs = rng.choice(len(colours), size=n, replace=False)
        ss = rng.choice(len(shapes), size=n, replace=False)
        return [(colours[int(c)], shapes[int(s)]) for c, s in zip(cs, ss)]
    grids = [(c, s) for c, s in _low_grids(n) if c <= len(colours) and s <= len(shapes)]
    nc, ns = grids[int(rng.integers(len(grids)))]
    cs = [colours[int(i)] for i in rng.choice(len(colours), size=nc, replace=False)]
    ss = [shapes[int(i)] for i in rng.choice(len(shapes), size=ns, replace=False)]
    while True:  # uniform over n-subsets of the grid that use every chosen colour and shape
        cells = rng.choice(nc * ns, size=n, replace=False)
        if len({int(k) // ns for k in cells}) == nc and len({int(k) % ns for k in cells}) == ns:
            return [(cs[int(k) // ns], ss[int(k) % ns]) for k in cells]


def _describe_prompt(objects: Sequence[SceneObject], described: Sequence[int]) -> str:
    listed = " , ".join(f"a {objects[i].name}" for i in described)
    return f"in this image there is {listed} and a"


def _scene_example(rng: np.random.Generator, eid: str, canvas: Canvas, lo: int, hi: int, entropy: str,
                   colours: tuple[str, ...], shapes: tuple[str, ...]) -> Example:
    n = int(rng.integers(lo, hi + 1))
    conj = _draw_conjunctions(rng, n, entropy, colours, shapes)
    cells = random_cells(rng, canvas, n)
    objects = raster([place(canvas, c, s, r, k) for (c, s), (r, k) in zip(conj, cells)])
    order = [int(i) for i in rng.permutation(n)]
    described, target = order[:-1], order[-1]
    return Example(
        id=eid, image=render(canvas, objects), objects=objects, prompt=_describe_prompt(objects, described),
        answer=objects[target].name, task="scene",
        fields={"described": described, "target": target, "entropy": entropy, "n_objects": n},
    )


def _scene_params(lo: int, hi: int, entropy: str, canvas: Canvas, colours: tuple[str, ...],
                  shapes: tuple[str, ...]) -> dict[str, Any]:
    return {"n_objects": [lo, hi], "entropy": entropy, "canvas": canvas.to_dict(), "colours": list(colours),
            "shapes": list(shapes)}


def scene_description(
    n: int,
    seed: int = 0,
    *,
    n_objects: int | tuple[int, int] = (2, 4),
    entropy: str = "high",
    canvas: Canvas = DEFAULT_CANVAS,
    colours: Sequence[str] | None = None,
    shapes: Sequence[str] | None = None,
) -> Dataset:
    """VSM's scene description task: the prompt lists all objects but one; the answer is the missing one.

    ``in this image there is a red square , a blue circle and a`` -> ``green triangle``. The described order is a
    uniformly random permutation of the objects; its last element is the target.

    Args:
        n: number of examples.
        seed: data-set seed; example ``i`` uses ``example_rng(seed, i)``.
        n_objects: objects per scene, an int or an inclusive ``(lo, hi)`` range (at least 2).
        entropy: ``"high"``: all colours distinct and all shapes distinct; ``"low"``: features shared (see
            ``_draw_conjunctions``), conjunctions still distinct.
        canvas: image size and grid (one object per cell).
        colours: colour pool (default: all of ``COLOURS``).
        shapes: shape pool (default: ``SHAPES``).

    Returns:
        Dataset of task ``"scene"``; ``Example.fields``: ``described`` (object indices in prompt order), ``target``
        (object index), ``entropy``, ``n_objects``.

    Raises:
        StimulusError: bad ``n``, ``seed``, ``n_objects``, ``entropy``, colour or shape, or a grid / pool too small.
    """
    n, seed, canvas = check_n(n), check_seed(seed), check_canvas(canvas)
    entropy = _check_entropy(entropy)
    lo, hi = object_range(n_objects, canvas)
    cs, ss = feature_pools(colours, shapes)
    _check_scene_pools(lo, hi, entropy, cs, ss)
    examples = [_scene_example(example_rng(seed, i), f"scene-{i:05d}", canvas, lo, hi, entropy, cs, ss)
                for i in range(n)]
    return Dataset("scene", examples, _scene_params(lo, hi, entropy, canvas, cs, ss), seed,
                   object_count_summary(examples))


# ------------------------------------------------------------------------------------------------------------------
# Counterfactual pairs
# ------------------------------------------------------------------------------------------------------------------
def _check_condition(condition: Any) -> str:
    """VSM's three conditions, or another registered over scenes (:func:`vlmbind.stimuli.register_condition`)."""
    scene = [name for name, c in REGISTERED_CONDITIONS.items() if c.task == "scene"]
    if condition not in scene:
        raise StimulusError(f"condition {condition!r} is not one of {tuple(scene)}.{close_matches(str(condition), scene)}")
    return condition


SWAPS = ("last", "random")
RECOLOURS = ("unused", "any")


def _listing_start(objects: Sequence[SceneObject], described: Sequence[int], k: int) -> int:
    """Character offset in the scene prompt where the ``k``-th described object's name starts (the layout of
    :func:`_describe_prompt`)."""
    before = sum(len(f"a {objects[i].name} , ") for i in described[:k])
    return len("in this image there is ") + before + len("a ")


def _swap_target(example: Example, rng: np.random.Generator, context: PairContext,
                 id_retrieval: bool) -> Counterfactual:
    """j (the second-to-last described object, or any described one with ``swap="random"``) and the target t trade
    cells: a* = j's name."""
    objects, canvas = example.objects, context.canvas
    described, target = example.fields["described"], example.fields["target"]
    fields = dict(example.fields)
    k = len(described) - 1 if context.options.get("swap", "last") == "last" else int(rng.integers(len(described)))
    j = described[k]
    oj, ot = objects[j], objects[target]
    moved = {j: place(canvas, oj.colour, oj.shape, ot.row, ot.col),
             target: place(canvas, ot.colour, ot.shape, oj.row, oj.col)}
    cf_objects = [moved.get(i, o) for i, o in enumerate(objects)]
    fields["swapped"] = [j, target]
    patch: Any = "last"
    if id_retrieval:
        start = _listing_start(objects, described, k)
        patch = {"text": oj.name, "occurrence": -example.prompt[start:].count(oj.name), "object": j}
    return Counterfactual(image=render(canvas, cf_objects), answer=oj.name, patch=patch,
                          answer_on_counterfactual=cf_objects[target].name, objects=cf_objects, fields=fields)


@register_condition("id_retrieval", task="scene")
def id_retrieval(example: Example, rng: np.random.Generator, context: PairContext) -> Counterfactual:
    """Swap j's and the target's cells; patch j's name in the prompt (see :func:`scene_pairs`)."""
    return _swap_target(example, rng, context, id_retrieval=True)


@register_condition("id_selection", task="scene")
def id_selection(example: Example, rng: np.random.Generator, context: PairContext) -> Counterfactual:
    """Swap j's and the target's cells; patch the last token (see :func:`scene_pairs`)."""
    return _swap_target(example, rng, context, id_retrieval=False)


@register_condition("feature_retrieval", task="scene")
def feature_retrieval(example: Example, rng: np.random.Generator, context: PairContext) -> Counterfactual:
    """Recolour the target (``recolour="unused"``: a colour no object has; ``"any"``: any conjunction no object has);
    patch the last token (see :func:`scene_pairs`)."""
    objects, target = example.objects, example.fields["target"]
    fields = dict(example.fields)
    t = objects[target]
    if context.options.get("recolour", "unused") == "unused":
        used = {o.colour for o in objects}
        unused = [c for c in context.colours if c not in used]
        new_colour, new_shape = unused[int(rng.integers(len(unused)))], t.shape
    else:
        taken = {(o.colour, o.shape) for o in objects}
        options = [(c, s) for c in context.colours for s in context.shapes if (c, s) not in taken]
        new_colour, new_shape = options[int(rng.integers(len(options)))]
    cf_objects = [replace(o, colour=new_colour, shape=new_shape) if k == target else o
                  for k, o in enumerate(objects)]
    fields["recoloured"] = {"object": target, "from": t.colour, "to": new_colour}
    if new_shape != t.shape:
        fields["reshaped"] = {"object": target, "from": t.shape, "to": new_shape}
    return Counterfactual(image=render(context.canvas, cf_objects), answer=f"{new_colour} {new_shape}",
                          objects=cf_objects, fields=fields)


def scene_pairs(
    n: int,
    condition: str,
    seed: int = 0,
    *,
    n_objects: int | tuple[int, int] = (3, 4),
    entropy: str = "high",
    canvas: Canvas = DEFAULT_CANVAS,
    colours: Sequence[str] | None = None,
    shapes: Sequence[str] | None = None,
    swap: str = "last",
    recolour: str = "unused",
) -> PairSet:
    """Counterfactual pairs of scene-description examples for VSM's three CMA conditions.

    The clean scenes are exactly ``scene_description(n, seed, ...)``'s with the same parameters. Prompts are
    identical on both sides; only the image changes. Let j be the second-to-last described object and t the target
    (the last, unmentioned one); a = t's ``colour shape``.

    - ``id_retrieval``: the counterfactual swaps the cells of j and t. Patch the prompt tokens of j's text span.
      In the counterfactual run those tokens retrieve the position ID of j's counterfactual cell, which is t's clean
      cell. Patched into the clean run, the model believes j sits where t is; the object positions it has seen
      described are then all but j's clean cell, so the unmentioned position it selects is j's clean cell, and the
      feature it retrieves there is j's: a* = j's ``colour shape``.
    - ``id_selection``: same swap; patch at the last token. In the counterfactual run the last token selects the
      position ID of the unmentioned object, t's counterfactual cell = j's clean cell; patched into the clean run
      the model retrieves the features at j's clean cell: a* = j's ``colour shape``.
    - ``feature_retrieval``: the counterfactual recolours t with a colour no object uses; patch at the last token,
      which carries the retrieved features: a* = the recoloured t.

    Because conjunctions are distinct, a != a* always; ``first_difference`` is 0 when the colour words differ and 1
    when only the shapes do (possible for the swap conditions in low-entropy scenes, where j and t can share a
    colour). Score the first token of that word.

    Args:
        n: number of pairs.
        condition: one of ``CONDITIONS``.
        seed: data-set seed; pair ``i`` uses ``example_rng(seed, i)`` (clean scene first, then the recolouring).
        n_objects: objects per scene, an int or an inclusive ``(lo, hi)`` range (at least 2).
        entropy: ``"high"`` or ``"low"`` (see :func:`scene_description`).
        canvas: image size and grid.
        colours: colour pool (default all); feature retrieval draws the new colour from it.
        shapes: shape pool (default ``SHAPES``).
        swap: which described object the swap conditions exchange with the target: ``"last"`` (VSM's j, the
            second-to-last described object) or ``"random"`` (any described object, drawn per pair; then a* cannot be
            guessed from the prompt's order, which training on such pairs needs).
        recolour: feature retrieval's new features: ``"unused"`` (VSM's: a colour no object uses, same shape) or
            ``"any"`` (any colour-shape conjunction no object of the scene has; then a* cannot be guessed from the
            clean scene alone).

    Returns:
        PairSet of ``n`` :class:`CounterfactualPair`.

    Raises:
        StimulusError: bad condition or scene parameters, or no unused colour is left for feature retrieval.
    """
    n, seed, canvas = check_n(n), check_seed(seed), check_canvas(canvas)
    condition, entropy = _check_condition(condition), _check_entropy(entropy)
    lo, hi = object_range(n_objects, canvas)
    cs, ss = feature_pools(colours, shapes)
    if swap not in SWAPS:
        raise StimulusError(f"swap must be one of {SWAPS}, got {swap!r}")
    if recolour not in RECOLOURS:
        raise StimulusError(f"recolour must be one of {RECOLOURS}, got {recolour!r}")
    spare = condition == "feature_retrieval" and recolour == "unused"
    _check_scene_pools(lo, hi, entropy, cs, ss, spare_colour=spare)
    make = REGISTERED_CONDITIONS[condition].make
    context = PairContext(canvas, cs, ss, {"swap": swap, "recolour": recolour})
    pairs = []
    for i in range(n):
        # the counterfactual draws from the clean scene's own stream, after the scene
        rng = example_rng(seed, i)
        clean = _scene_example(rng, f"scene-{i:05d}", canvas, lo, hi, entropy, cs, ss)
        pairs.append(build_pair(f"pair-{i:05d}", condition, clean, make(clean, rng, context)))
    params = {"condition": condition, **_scene_params(lo, hi, entropy, canvas, cs, ss)}
    if swap != "last" or recolour != "unused":  # VSM's pairs keep the parameters they always had
        params.update(swap=swap, recolour=recolour)
    firsts = Counter(p.first_difference for p in pairs)
    summary = {**object_count_summary([p.clean for p in pairs]),
               "first_difference_counts": {"colour": firsts[0], "shape": firsts[1]}}
    return PairSet(condition, pairs, params, seed, summary)


__all__ = [
    "CONDITIONS", "ENTROPIES", "CounterfactualPair", "PairSet", "scene_description", "scene_pairs",
]
