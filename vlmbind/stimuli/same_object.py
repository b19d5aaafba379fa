"""Scenes for IsSameObject probes: objects that cover several image tokens, with classes that repeat.

Design: a pairwise IsSameObject probe is only informative where knowing each token's class does not already answer
it, so every scene holds two objects of the same colour and shape (a duplicate) beside objects drawn freely from the
world's palette (which often share a colour or a shape with another). Objects sit one per cell of a coarse grid
whose cells are ``token_span x token_span`` cells of the world's token grid (the organisms' world: 56 px cells on
168 px, 2 x 2 language-model tokens, 4 x 4 vision patches), so each object covers several tokens and same-object
pairs exist at every site. Splits are disjoint streams of the same generator (``split`` picks the stream).
"""

from __future__ import annotations

import numpy as np

from .colorshape import PROMPT, SPLITS, ColorShapeWorld, world_named
from .core import Canvas, Dataset, Example, SceneObject, StimulusError, example_rng, random_cells, raster, render

TASK = "same_object"
_SPLIT_STREAM = {split: k for k, split in enumerate(SPLITS)}


def same_object_scenes(n: int, seed: int = 0, *, split: str = "train", world: ColorShapeWorld | str = "organism",
                       token_span: int = 2, n_objects: int = 4) -> Dataset:
    """``n`` scenes whose objects each cover ``token_span x token_span`` token cells, one pair of them identical.

    Args:
        n: number of images.
        seed: the seed; example ``i`` of ``split`` draws from ``example_rng(seed * 3 + stream, i)``.
        split: ``train``, ``val`` or ``test`` (independent streams).
        world: the palette, canvas and token grid (``organism``: 4 colours x 4 shapes, 168 px, 6 x 6 tokens).
        token_span: an object's cell side in token cells (the coarse grid is ``world.grid // token_span``).
        n_objects: objects per scene (at least 2: the duplicated pair).

    Returns:
        A :class:`Dataset` (task ``same_object``); each example's fields name its ``duplicate`` class.

    Raises:
        StimulusError: a split, span or object count that does not fit the world.
    """
    w = world_named(world)
    if split not in SPLITS:
        raise StimulusError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise StimulusError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(token_span, (int, np.integer)) or token_span < 1 or w.grid % token_span:
        raise StimulusError(f"token_span must divide the world's {w.grid} x {w.grid} token grid, got {token_span!r}")
    grid = w.grid // token_span
    if not isinstance(n_objects, (int, np.integer)) or not 2 <= n_objects <= grid * grid:
        raise StimulusError(f"n_objects must be in [2, {grid * grid}] (one object per {token_span} x {token_span} "
                            f"token cell), got {n_objects!r}")
    canvas = Canvas(image_size=w.image_size, grid=grid)
    examples = []
    for i in range(int(n)):
        rng = example_rng(int(seed) * 3 + _SPLIT_STREAM[split], i)
        duplicate = (w.colours[int(rng.integers(len(w.colours)))], w.shapes[int(rng.integers(len(w.shapes)))])
        classes = [duplicate, duplicate] + [(w.colours[int(rng.integers(len(w.colours)))],
                                             w.shapes[int(rng.integers(len(w.shapes)))]) for _ in range(n_objects - 2)]
        objects = [SceneObject(c, s, r, col, *canvas.cell_centre(r, col), canvas.size)
                   for (c, s), (r, col) in zip(classes, random_cells(rng, canvas, n_objects))]
        objects = raster(objects)
        answer = " , ".join(o.name for o in objects)
        fields = {"split": split, "duplicate": f"{duplicate[0]} {duplicate[1]}", "token_span": int(token_span)}
        examples.append(Example(f"{TASK}_{w.name}_{split}_{i:06d}", render(canvas, objects), objects, PROMPT, answer,
                                TASK, fields))
    params = {"n": int(n), "split": split, "world": w.name, "canvas": canvas.to_dict(), "token_span": int(token_span),
              "n_objects": int(n_objects)}
    return Dataset(TASK, examples, params, int(seed), {})


__all__ = ["same_object_scenes"]
