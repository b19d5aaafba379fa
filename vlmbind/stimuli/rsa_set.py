"""The single-object RSA set (PbP): one coloured letter per image, every colour-letter conjunction at several cells.

Design: 4 colours (red, green, blue, purple) x 4 letters (L, T, H, E) give 16 conjunctions; each is drawn alone on a
9x9 grid at ``positions_per_conjunction`` distinct cells (or all 81). The default canvas is 252 px, so cells are 28 px
and coincide with 14 px and 28 px patch grids: an object's patch embeddings are then exactly the tokens of its cell.
Conjunction ``j`` (colour-major order) draws its cells from its own stream ``example_rng(seed, j)`` as a prefix of a
random permutation of the cells, so asking for more positions keeps the earlier ones. Examples are ordered
conjunction-major, positions in drawing order; the RSA code pools each object's tokens and compares similarity
matrices with the conjunctive, compositional and position model matrices (docs/methods.md section 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from .core import (
    LETTERS,
    Canvas,
    Dataset,
    Example,
    StimulusError,
    check_colours,
    check_shapes,
    example_rng,
    place,
    render,
)

TASK = "rsa"
PROMPT = "what is in this image ?"
RSA_COLOURS: tuple[str, ...] = ("red", "green", "blue", "purple")
RSA_SHAPES: tuple[str, ...] = LETTERS


def default_canvas() -> Canvas:
    """252 px, 9x9 grid: 28 px cells aligned with 14 px and 28 px patch grids."""
    return Canvas(image_size=252, grid=9)


def rsa_set(seed: int = 0, *, positions_per_conjunction: int = 4, positions: Literal["random", "all"] = "random",
            canvas: Canvas | None = None, colours: Sequence[str] = RSA_COLOURS,
            shapes: Sequence[str] = RSA_SHAPES) -> Dataset:
    """Generate the single-object RSA set (task ``"rsa"``).

    Args:
        seed: the seed.
        positions_per_conjunction: distinct cells per conjunction, drawn without replacement (ignored when
            ``positions="all"``).
        positions: ``"random"`` (``positions_per_conjunction`` random cells) or ``"all"`` (every cell of the grid).
        canvas: image size and grid; default :func:`default_canvas` (252 px, 9x9).
        colours: the colours (default red, green, blue, purple).
        shapes: the shapes or letters (default L, T, H, E).

    Returns:
        A :class:`Dataset` of ``len(colours) * len(shapes) * k`` examples (k positions each), one object per image;
        prompt ``what is in this image ?``, answer ``red L``; fields ``colour``, ``shape``, ``row``, ``col``,
        ``conjunction`` (index, colour-major) and ``cell`` (``row * cols + col``).

    Raises:
        StimulusError: unknown colour or shape, a bad ``positions`` mode, or more positions than cells.
    """
    canvas = canvas if canvas is not None else default_canvas()
    if not isinstance(canvas, Canvas):
        raise StimulusError(f"canvas must be a Canvas, got {type(canvas).__name__}")
    colours, shapes = check_colours(colours), check_shapes(shapes)
    if not colours or not shapes:
        raise StimulusError("colours and shapes must each name at least one value")
    if positions not in ("random", "all"):
        raise StimulusError(f"positions={positions!r}; use 'random' or 'all'")
    n_cells = canvas.n_cells
    if positions == "all":
        k = n_cells
    else:
        k = positions_per_conjunction
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= n_cells:
            rows, cols = canvas.shape
            raise StimulusError(f"positions_per_conjunction={k!r} must be an int in [1, {n_cells}] for a {rows}x{cols} "
                                f"grid; use positions='all' for every cell or a finer grid")
    rows, cols = canvas.shape

    examples = []
    conjunctions = [(c, s) for c in colours for s in shapes]
    for j, (colour, shape) in enumerate(conjunctions):
        # A permutation prefix, not choice(): a larger k keeps the first k cells the same.
        flat = np.arange(n_cells) if positions == "all" else example_rng(seed, j).permutation(n_cells)[:k]
        for cell in flat.tolist():
            r, c = divmod(int(cell), cols)
            obj = place(canvas, colour, shape, r, c)
            i = len(examples)
            fields = {"colour": colour, "shape": shape, "row": r, "col": c, "conjunction": j, "cell": int(cell)}
            examples.append(Example(f"{TASK}_{i:05d}", render(canvas, [obj]), [obj], PROMPT, obj.name, TASK, fields))

    params = {"positions": positions, "positions_per_conjunction": int(k), "canvas": canvas.to_dict(),
              "colours": list(colours), "shapes": list(shapes)}
    summary = {"n_conjunctions": len(conjunctions), "n_per_conjunction": int(k)}
    return Dataset(TASK, examples, params, int(seed), summary)
