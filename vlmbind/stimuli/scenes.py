"""Scene description (VSM), its counterfactual pairs for the three CMA conditions, and the binding query task.

Design: a scene is 2-4 objects with distinct colour-shape conjunctions, one per cell of a :class:`~.core.Canvas`
grid. Every generator draws example ``i`` from ``example_rng(seed, i)`` and builds its counterfactual from the *same*
stream after the clean scene, so ``scene_pairs(n, condition, seed)`` has exactly the clean scenes of
``scene_description(n, seed)`` under all three conditions, and a larger ``n`` keeps the first pairs. Counterfactuals
change the image only: clean and counterfactual prompts are the same string, so they tokenise alike, and
:func:`check_alignment` proves it on a given model's processor (sequence length, image-token count and grid, text
tokens) before any patching, and returns the patch positions. The binding query task is built so that the answer is
not fixed by the colour and shape multisets: the multisets are drawn first, then paired by a uniformly random
permutation (rejecting repeated conjunctions), so the Bayes-optimal strategy that sees only the multisets and the
query answers with accuracy ``max_v P(v | multisets, query)``, which is computed exactly by enumerating permutations
and stored per example and for the data set.

Text conventions: lower-case words separated by single spaces, punctuation as separate words
(``in this image there is a red square , a blue circle and a``); the article is always ``a`` (``an`` before the
answer would leak the answer's first letter).
"""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import close_matches
from ..core.images import read_image
from .core import (
    COLOURS,
    SHAPES,
    Canvas,
    Dataset,
    Example,
    PairAlignmentError,
    SceneObject,
    StimulusError,
    check_colours,
    check_shapes,
    example_rng,
    place,
    random_cells,
    raster,
    read_records,
    render,
    save_records,
)

ENTROPIES = ("high", "low")
CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval")
QUERIES = ("shape", "colour")
MAX_QUERY_OBJECTS = 6  # exact ceilings enumerate n! pairings

_DEFAULT_CANVAS = Canvas(image_size=224, grid=3)


# ------------------------------------------------------------------------------------------------------------------
# Parameter checks
# ------------------------------------------------------------------------------------------------------------------
def _check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise StimulusError(f"n must be a non-negative int (the number of examples), got {n!r}")
    return int(n)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise StimulusError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


def _check_canvas(canvas: Any) -> Canvas:
    if not isinstance(canvas, Canvas):
        raise StimulusError(f"canvas must be a vlmbind.stimuli.Canvas, got {type(canvas).__name__}")
    return canvas


def _object_range(n_objects: Any, canvas: Canvas, low: int = 2, high: int | None = None) -> tuple[int, int]:
    """``(lo, hi)`` from an int or an inclusive pair, checked against ``[low, high]`` and the canvas."""
    if isinstance(n_objects, (int, np.integer)) and not isinstance(n_objects, bool):
        lo = hi = int(n_objects)
    elif (isinstance(n_objects, (tuple, list)) and len(n_objects) == 2
          and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in n_objects)):
        lo, hi = (int(v) for v in n_objects)
    else:
        raise StimulusError(f"n_objects must be an int or an inclusive (lo, hi) pair of ints, got {n_objects!r}")
    if lo > hi:
        raise StimulusError(f"n_objects range {n_objects!r} is empty: use (lo, hi) with lo <= hi")
    if lo < low:
        raise StimulusError(
            f"n_objects {n_objects!r} allows scenes of {lo} object(s); these tasks need at least {low} objects "
            f"(a described object and a target): use n_objects >= {low}"
        )
    if high is not None and hi > high:
        raise StimulusError(f"n_objects {n_objects!r} exceeds {high}, the most this task supports: use n_objects <= "
                            f"{high}")
    canvas.check_fits(hi)
    return lo, hi


def _check_entropy(entropy: Any) -> str:
    if entropy not in ENTROPIES:
        raise StimulusError(f"entropy {entropy!r} is not one of {ENTROPIES}.{close_matches(str(entropy), ENTROPIES)}")
    return entropy


def _pools(colours: Sequence[str] | None, shapes: Sequence[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    cs = tuple(COLOURS) if colours is None else check_colours(list(colours))
    ss = SHAPES if shapes is None else check_shapes(list(shapes))
    if not cs or not ss:
        raise StimulusError("colours and shapes must each name at least one value (or be None for all)")
    return cs, ss


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


def _count_summary(examples: Sequence[Example]) -> dict[str, Any]:
    counts = Counter(len(e.objects) for e in examples)
    return {"n_objects_counts": {str(k): counts[k] for k in sorted(counts)}}


def scene_description(
    n: int,
    seed: int = 0,
    *,
    n_objects: int | tuple[int, int] = (2, 4),
    entropy: str = "high",
    canvas: Canvas = _DEFAULT_CANVAS,
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
    n, seed, canvas = _check_n(n), _check_seed(seed), _check_canvas(canvas)
    entropy = _check_entropy(entropy)
    lo, hi = _object_range(n_objects, canvas)
    cs, ss = _pools(colours, shapes)
    _check_scene_pools(lo, hi, entropy, cs, ss)
    examples = [_scene_example(example_rng(seed, i), f"scene-{i:05d}", canvas, lo, hi, entropy, cs, ss)
                for i in range(n)]
    return Dataset("scene", examples, _scene_params(lo, hi, entropy, canvas, cs, ss), seed, _count_summary(examples))


# ------------------------------------------------------------------------------------------------------------------
# Counterfactual pairs
# ------------------------------------------------------------------------------------------------------------------
def _example_record(e: Example, image: str) -> dict[str, Any]:
    r = e.to_record()
    r["image"] = image
    return r


def _example_from_record(root: Path, r: dict[str, Any]) -> Example:
    image = read_image(root / r["image"], StimulusError)
    extra = {k: v for k, v in r.items() if k not in ("id", "image", "task", "prompt", "answer", "objects")}
    return Example(r["id"], image, [SceneObject.from_dict(o) for o in r.get("objects", [])], r["prompt"],
                   r["answer"], r.get("task", ""), extra)


@dataclass
class CounterfactualPair:
    """A clean scene and its counterfactual for one CMA condition.

    Attributes:
        id: pair id (the examples are ``{id}-clean`` and ``{id}-cf``).
        condition: ``id_retrieval``, ``id_selection`` or ``feature_retrieval``.
        clean: the clean example (``answer`` = a).
        counterfactual: the counterfactual example; same prompt, objects in the same list order. Its own ``answer``
            is what a model should say on the counterfactual image itself (the target for the swap conditions,
            the recoloured target for feature retrieval).
        patch: where to patch: ``{"kind": "span", "text": "blue circle", "occurrence": -1, "object": j}``
            (``occurrence`` counts matches of ``text`` in the prompt from its end, for :meth:`TokenIndex.span`) or
            ``{"kind": "last"}``.
        answer: a, the clean answer (the target's ``colour shape``).
        answer_counterfactual: a*, the answer patching the counterfactual into the clean run implies.
        first_difference: the first word where ``answer`` and ``answer_counterfactual`` differ: 0 colour, 1 shape.
    """

    id: str
    condition: str
    clean: Example
    counterfactual: Example
    patch: dict[str, Any]
    answer: str
    answer_counterfactual: str
    first_difference: int

    def to_record(self) -> dict[str, Any]:
        return {
            "id": self.id, "condition": self.condition,
            "clean": _example_record(self.clean, f"images/{self.id}-clean.png"),
            "counterfactual": _example_record(self.counterfactual, f"images/{self.id}-cf.png"),
            "patch": self.patch, "answer": self.answer, "answer_counterfactual": self.answer_counterfactual,
            "first_difference": self.first_difference,
        }

    @classmethod
    def from_record(cls, root: Path, r: dict[str, Any]) -> CounterfactualPair:
        return cls(r["id"], r["condition"], _example_from_record(root, r["clean"]),
                   _example_from_record(root, r["counterfactual"]), r["patch"], r["answer"],
                   r["answer_counterfactual"], int(r["first_difference"]))


@dataclass
class PairSet:
    """Counterfactual pairs of one condition plus the parameters that made them.

    Attributes:
        condition: the CMA condition.
        pairs: the pairs.
        params: generator parameters (JSON-serialisable; canvas via ``Canvas.to_dict``).
        seed: the seed.
        summary: data-set level facts (object counts, how many pairs first differ at the colour / shape word).
    """

    condition: str
    pairs: list[CounterfactualPair]
    params: dict[str, Any]
    seed: int
    summary: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self) -> Iterator[CounterfactualPair]:
        return iter(self.pairs)

    def __getitem__(self, i: int) -> CounterfactualPair:
        return self.pairs[i]

    @property
    def clean(self) -> Dataset:
        """The clean examples as a scene-description Dataset."""
        return Dataset("scene", [p.clean for p in self.pairs], self.params, self.seed, dict(self.summary))

    @property
    def counterfactual(self) -> Dataset:
        """The counterfactual examples as a Dataset (task ``scene``, fields name what changed)."""
        return Dataset("scene", [p.counterfactual for p in self.pairs], self.params, self.seed, dict(self.summary))

    def describe(self) -> dict[str, Any]:
        return {"task": "scene_pairs", "condition": self.condition, "n": len(self), "seed": self.seed,
                "params": self.params, **self.summary}

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``images/{id}-clean.png``, ``images/{id}-cf.png``, ``meta.jsonl`` (one record per pair) and
        ``dataset.json`` into ``out`` atomically (through ``core.save_records``)."""
        images = [(f"{p.id}-{side}", img) for p in self.pairs
                  for side, img in (("clean", p.clean.image), ("cf", p.counterfactual.image))]
        return save_records(out, images, [p.to_record() for p in self.pairs], self.describe())

    @classmethod
    def load(cls, path: str | os.PathLike) -> PairSet:
        """Read a pair set written by :meth:`save` (images are loaded into memory).

        Raises:
            StimulusError: ``path`` is not a saved pair set.
        """
        path = Path(path)
        info, records = read_records(path)
        if info.get("task") != "scene_pairs":
            raise StimulusError(f"{str(path)!r} holds task {info.get('task')!r}, not scene_pairs; use Dataset.load")
        pairs = [CounterfactualPair.from_record(path, r) for r in records]
        summary = {k: v for k, v in info.items() if k not in ("task", "condition", "n", "seed", "params")}
        return cls(info["condition"], pairs, info.get("params", {}), int(info.get("seed", 0)), summary)


def _check_condition(condition: Any) -> str:
    if condition not in CONDITIONS:
        raise StimulusError(
            f"condition {condition!r} is not one of {CONDITIONS}.{close_matches(str(condition), CONDITIONS)}"
        )
    return condition


SWAPS = ("last", "random")
RECOLOURS = ("unused", "any")


def _listing_start(objects: Sequence[SceneObject], described: Sequence[int], k: int) -> int:
    """Character offset in the scene prompt where the ``k``-th described object's name starts (the layout of
    :func:`_describe_prompt`)."""
    before = sum(len(f"a {objects[i].name} , ") for i in described[:k])
    return len("in this image there is ") + before + len("a ")


def _make_pair(rng: np.random.Generator, pid: str, condition: str, clean: Example, canvas: Canvas,
               colours: tuple[str, ...], shapes: tuple[str, ...], swap: str, recolour: str) -> CounterfactualPair:
    objects = clean.objects
    described, target = clean.fields["described"], clean.fields["target"]
    fields = dict(clean.fields)
    if condition == "feature_retrieval":
        t = objects[target]
        if recolour == "unused":
            used = {o.colour for o in objects}
            unused = [c for c in colours if c not in used]
            new_colour, new_shape = unused[int(rng.integers(len(unused)))], t.shape
        else:
            taken = {(o.colour, o.shape) for o in objects}
            options = [(c, s) for c in colours for s in shapes if (c, s) not in taken]
            new_colour, new_shape = options[int(rng.integers(len(options)))]
        cf_objects = [replace(o, colour=new_colour, shape=new_shape) if k == target else o
                      for k, o in enumerate(objects)]
        fields["recoloured"] = {"object": target, "from": t.colour, "to": new_colour}
        if new_shape != t.shape:
            fields["reshaped"] = {"object": target, "from": t.shape, "to": new_shape}
        a_star, first, patch = f"{new_colour} {new_shape}", (0 if new_colour != t.colour else 1), {"kind": "last"}
    else:
        # j: the second-to-last described object (VSM's pairs), or any described object
        k = len(described) - 1 if swap == "last" else int(rng.integers(len(described)))
        j = described[k]
        oj, ot = objects[j], objects[target]
        moved = {j: place(canvas, oj.colour, oj.shape, ot.row, ot.col),
                 target: place(canvas, ot.colour, ot.shape, oj.row, oj.col)}
        cf_objects = [moved.get(i, o) for i, o in enumerate(objects)]
        fields["swapped"] = [j, target]
        a_star, first = oj.name, (0 if oj.colour != ot.colour else 1)
        if condition == "id_retrieval":
            start = _listing_start(objects, described, k)
            occurrence = -clean.prompt[start:].count(oj.name)
            patch = {"kind": "span", "text": oj.name, "occurrence": occurrence, "object": j}
        else:
            patch = {"kind": "last"}
    cf = Example(id=f"{pid}-cf", image=render(canvas, cf_objects), objects=cf_objects, prompt=clean.prompt,
                 answer=cf_objects[target].name, task="scene", fields=fields)
    return CounterfactualPair(pid, condition, replace(clean, id=f"{pid}-clean"), cf, patch, clean.answer, a_star,
                              first)


def scene_pairs(
    n: int,
    condition: str,
    seed: int = 0,
    *,
    n_objects: int | tuple[int, int] = (3, 4),
    entropy: str = "high",
    canvas: Canvas = _DEFAULT_CANVAS,
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
    n, seed, canvas = _check_n(n), _check_seed(seed), _check_canvas(canvas)
    condition, entropy = _check_condition(condition), _check_entropy(entropy)
    lo, hi = _object_range(n_objects, canvas)
    cs, ss = _pools(colours, shapes)
    if swap not in SWAPS:
        raise StimulusError(f"swap must be one of {SWAPS}, got {swap!r}")
    if recolour not in RECOLOURS:
        raise StimulusError(f"recolour must be one of {RECOLOURS}, got {recolour!r}")
    spare = condition == "feature_retrieval" and recolour == "unused"
    _check_scene_pools(lo, hi, entropy, cs, ss, spare_colour=spare)
    pairs = []
    for i in range(n):
        rng = example_rng(seed, i)
        pid = f"pair-{i:05d}"
        clean = _scene_example(rng, f"scene-{i:05d}", canvas, lo, hi, entropy, cs, ss)
        pairs.append(_make_pair(rng, pid, condition, clean, canvas, cs, ss, swap, recolour))
    params = {"condition": condition, **_scene_params(lo, hi, entropy, canvas, cs, ss)}
    if swap != "last" or recolour != "unused":  # VSM's pairs keep the parameters they always had
        params.update(swap=swap, recolour=recolour)
    firsts = Counter(p.first_difference for p in pairs)
    summary = {**_count_summary([p.clean for p in pairs]),
               "first_difference_counts": {"colour": firsts[0], "shape": firsts[1]}}
    return PairSet(condition, pairs, params, seed, summary)


@dataclass
class AlignedPairs:
    """Clean and counterfactual batches that line up token for token, and where to patch.

    Attributes:
        pairs: the pairs, in batch row order.
        clean: the clean batch (row r = pair r).
        counterfactual: the counterfactual batch, same shape and same positions.
        positions: per pair, the sorted patch positions in the batch rows (a text span's tokens, or the last
            position), identical on both sides.
    """

    pairs: list[CounterfactualPair]
    clean: Any
    counterfactual: Any
    positions: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.pairs)


def _differences(a: Any, b: Any, tokenizer: Any) -> list[str]:
    """What differs between two TokenIndex rows that must line up (padding ignored: if every row of the batch lines
    up, both batches pad each row alike)."""
    out = []
    ra, rb = a.roles[a.roles != "pad"], b.roles[b.roles != "pad"]
    la, lb = len(ra), len(rb)
    if la != lb:
        out.append(f"sequence length {la} (clean) vs {lb} (counterfactual)")
    ia, ib = int((a.roles == "image").sum()), int((b.roles == "image").sum())
    if ia != ib:
        out.append(f"image-token count {ia} (clean) vs {ib} (counterfactual)")
    ga, gb = [(g.name, g.shape) for g in a.grids], [(g.name, g.shape) for g in b.grids]
    if ga != gb:
        out.append(f"image grids {ga} (clean) vs {gb} (counterfactual)")
    if not out and not np.array_equal(ra, rb):
        k = int(np.flatnonzero(ra != rb)[0])
        out.append(f"token roles differ at real position {k}: {ra[k]!r} (clean) vs {rb[k]!r} (counterfactual)")
    ta = a.input_ids[(a.roles != "pad") & (a.roles != "image")]
    tb = b.input_ids[(b.roles != "pad") & (b.roles != "image")]
    if not np.array_equal(ta, tb):
        m = min(len(ta), len(tb))
        k = int(np.flatnonzero(ta[:m] != tb[:m])[0]) if (ta[:m] != tb[:m]).any() else m
        da = tokenizer.decode(ta[k:k + 4].tolist()) if k < len(ta) else "<end>"
        db = tokenizer.decode(tb[k:k + 4].tolist()) if k < len(tb) else "<end>"
        out.append(f"text tokens differ from text token {k}: {da!r} (clean) vs {db!r} (counterfactual)")
    return out


def _patch_positions(index: Any, pair: CounterfactualPair) -> np.ndarray:
    patch = pair.patch
    if patch.get("kind") == "last":
        return np.array([index.last_position])
    if patch.get("kind") == "span":
        return index.span(patch["text"], occurrence=int(patch.get("occurrence", -1)))
    raise StimulusError(f"pair {pair.id!r} has patch {patch!r}; kind must be 'span' or 'last'")


def check_alignment(vlm: Any, pairs: PairSet | Sequence[CounterfactualPair], *, chat: bool = False) -> AlignedPairs:
    """Prepare both sides of every pair with ``vlm``'s processor and check that they line up token for token.

    Patching position p of the counterfactual run into position p of the clean run is only meaningful when both
    sequences have the same length, the same image tokens at the same places (same grids) and the same text tokens.
    Identical prompts guarantee the text; the image-token count can still differ on families whose count depends on
    the image size or aspect ratio (Qwen2-VL's dynamic resolution, LLaVA-OneVision's any-res tiles).

    Args:
        vlm: a loaded :class:`~vlmbind.engine.vlm.VLM`.
        pairs: the pairs, prepared as one batch (slice a large PairSet).
        chat: wrap prompts in the processor's chat template.

    Returns:
        AlignedPairs with both batches and, per pair, the patch positions (``TokenIndex.span`` on the pair's text
        span and occurrence, or the last position).

    Raises:
        PairAlignmentError: a pair whose sides differ; the message names the pair id and what differs.
        StimulusError: no pairs.
    """
    pairs = list(pairs)
    if not pairs:
        raise StimulusError("check_alignment needs at least one pair")
    clean = vlm.prepare([p.clean.image for p in pairs], [p.clean.prompt for p in pairs], chat=chat)
    cf = vlm.prepare([p.counterfactual.image for p in pairs], [p.counterfactual.prompt for p in pairs], chat=chat)
    tokenizer = vlm.adapter.tokenizer
    # every row first: one misaligned row changes the other rows' left padding, so their positions differ too
    for r, p in enumerate(pairs):
        problems = _differences(clean.index[r], cf.index[r], tokenizer)
        if problems:
            raise PairAlignmentError(
                f"pair {p.id!r} ({p.condition}) does not line up on {getattr(vlm, 'name', 'this model')}: "
                f"{'; '.join(problems)}. Use the same prompt and images of the same size on both sides."
            )
    if clean.seq_len != cf.seq_len:  # unreachable when every row lines up; kept as the guard positions rely on
        raise PairAlignmentError(f"batches padded to {clean.seq_len} (clean) vs {cf.seq_len} (counterfactual)")
    positions = []
    for r, p in enumerate(pairs):
        pos_clean = _patch_positions(clean.index[r], p)
        pos_cf = _patch_positions(cf.index[r], p)
        if not np.array_equal(pos_clean, pos_cf):
            raise PairAlignmentError(f"pair {p.id!r}: patch positions {pos_clean.tolist()} (clean) vs "
                                     f"{pos_cf.tolist()} (counterfactual)")
        positions.append(pos_clean)
    return AlignedPairs(pairs, clean, cf, positions)


# ------------------------------------------------------------------------------------------------------------------
# Binding query
# ------------------------------------------------------------------------------------------------------------------
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
    canvas: Canvas = _DEFAULT_CANVAS,
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
    n, seed, canvas = _check_n(n), _check_seed(seed), _check_canvas(canvas)
    lo, hi = _object_range(n_objects, canvas, high=MAX_QUERY_OBJECTS)
    cs, ss = _pools(colours, shapes)
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
    summary = {**_count_summary(examples), "query_counts": {k: kinds_count[k] for k in kinds},
               "counting_ceiling": float(mean), "counting_ceiling_fraction": f"{mean.numerator}/{mean.denominator}",
               "counting_ceiling_max": float(max(ceilings)) if ceilings else 0.0}
    params = {"n_objects": [lo, hi], "query": list(kinds), "canvas": canvas.to_dict(), "colours": list(cs),
              "shapes": list(ss), "answer_values": list(values)}
    return Dataset("query", examples, params, seed, summary)


__all__ = [
    "CONDITIONS", "ENTROPIES", "QUERIES", "AlignedPairs", "CounterfactualPair", "PairSet", "answer_distribution",
    "binding_query", "check_alignment", "pair_features", "scene_description", "scene_pairs",
]
