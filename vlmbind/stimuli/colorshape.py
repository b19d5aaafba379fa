"""BalancedColorShape (FBP): 18 coloured shapes per image with exact feature and object codes and exact entropies.

Design: each image first draws a feature code F in {0,1}^16 (8 colour bits in :data:`core.COLOURS` order, then 8 shape
bits in the order circle, square, triangle, diamond, pentagon, hexagon, cross, star, as methods.md section 1.6 lists
them and :data:`core.SHAPES` holds them) with exactly 6 colours and 6 shapes on, uniformly among the codes of its
split; then an object code O in {0,1}^64 (bit ``colour * 8 + shape``) with 18 distinct conjunctions from the 6x6 grid
of chosen features, uniform among the 18-subsets that use every chosen colour and every chosen shape (rejection from
uniform 18-subsets: about 88.8% of them cover). The 784 F codes are split by a hash rank (sha256 of the 16-character
bit string, sorted by digest: 522 train, 131 val, 131 test), so splits are disjoint and independent of any seed.
Because the sampling is uniform at both stages, the data set's entropies are exact combinatorial numbers:
H(F) = log2 |codes of the split|, H(O|F) = log2 N with N the number of covering 18-subsets of a 6x6 grid (counted by
inclusion-exclusion over excluded rows and columns), and H(O) = H(F) + H(O|F) because O determines F. Placement: the
256 px canvas is an 8x8 grid of 32 px cells; the 18 objects (16 px) occupy 18 distinct random cells, centred (or
jittered by at most ``(32 - 16) / 2 - 1 = 7`` px, which keeps each object inside its own cell), so objects never
overlap and at least ``32 - 16 - 2 * jitter >= 2`` px separate neighbouring boxes.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from .core import (
    COLOURS,
    SHAPES,
    Canvas,
    Dataset,
    Example,
    SceneObject,
    StimulusError,
    example_rng,
    random_cells,
    raster,
    render,
)

TASK = "colorshape"
IMAGE_SIZE = 256
OBJECT_SIZE = 16
N_CHOSEN_COLOURS = 6
N_CHOSEN_SHAPES = 6
N_OBJECTS = 18
PROMPT = "describe the objects in this image :"
SPLITS = ("train", "val", "test")
SPLIT_SIZES = {"train": 522, "val": 131, "test": 131}
CS_COLOURS: tuple[str, ...] = tuple(COLOURS)  # bit order of the colour half of F
CS_SHAPES: tuple[str, ...] = SHAPES  # bit order of the shape half of F (methods.md 1.6 order)
N_F_BITS = len(CS_COLOURS) + len(CS_SHAPES)
N_O_BITS = len(CS_COLOURS) * len(CS_SHAPES)
_MAX_REJECTIONS = 10_000  # P(10k rejections in a row) = 0.112**10000: never, but never loop forever either


# ------------------------------------------------------------------------------------------------------------------
# Codes and splits
# ------------------------------------------------------------------------------------------------------------------
def f_code(colours: Sequence[str], shapes: Sequence[str]) -> str:
    """The 16-character feature bit string of a set of colours and shapes (colour bits, then shape bits)."""
    unknown = [c for c in colours if c not in CS_COLOURS] + [s for s in shapes if s not in CS_SHAPES]
    if unknown:
        raise StimulusError(f"unknown colour or shape {unknown}; BalancedColorShape uses colours {list(CS_COLOURS)} "
                            f"and shapes {list(CS_SHAPES)}")
    colour_bits = "".join("1" if c in colours else "0" for c in CS_COLOURS)
    return colour_bits + "".join("1" if s in shapes else "0" for s in CS_SHAPES)


def o_code(objects: Sequence[SceneObject] | Sequence[tuple[str, str]]) -> str:
    """The 64-character object bit string: bit ``colour_index * 8 + shape_index`` is 1 when that object is drawn."""
    bits = ["0"] * N_O_BITS
    for o in objects:
        colour, shape = (o.colour, o.shape) if isinstance(o, SceneObject) else o
        if colour not in CS_COLOURS or shape not in CS_SHAPES:
            raise StimulusError(f"object {colour} {shape} is not a BalancedColorShape conjunction")
        bits[CS_COLOURS.index(colour) * len(CS_SHAPES) + CS_SHAPES.index(shape)] = "1"
    return "".join(bits)


def f_from_o(o_bits: str) -> str:
    """The feature code implied by an object code: a colour (shape) is present iff one of its objects is."""
    if len(o_bits) != N_O_BITS or set(o_bits) - {"0", "1"}:
        raise StimulusError(f"an object code is a {N_O_BITS}-character 0/1 string, got {o_bits!r}")
    grid = np.array([int(b) for b in o_bits]).reshape(len(CS_COLOURS), len(CS_SHAPES))
    return "".join(str(int(v)) for v in grid.any(1)) + "".join(str(int(v)) for v in grid.any(0))


def all_f_codes() -> list[str]:
    """Every feature code with 6 of 8 colours and 6 of 8 shapes on (784 codes), in lexicographic enumeration order."""
    return [f_code(cs, ss) for cs in itertools.combinations(CS_COLOURS, N_CHOSEN_COLOURS)
            for ss in itertools.combinations(CS_SHAPES, N_CHOSEN_SHAPES)]


@lru_cache(maxsize=1)
def _split_table() -> dict[str, tuple[str, ...]]:
    # Hash rank: sha256 of the bit string fixes the order without a seed, so every run and machine agrees.
    ranked = sorted(all_f_codes(), key=lambda b: hashlib.sha256(b.encode("ascii")).hexdigest())
    n_train, n_val = SPLIT_SIZES["train"], SPLIT_SIZES["val"]
    return {"train": tuple(ranked[:n_train]), "val": tuple(ranked[n_train:n_train + n_val]),
            "test": tuple(ranked[n_train + n_val:])}


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise StimulusError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return split


def split_codes(split: str) -> tuple[str, ...]:
    """The feature codes (16-character bit strings) of ``split``, in hash-rank order."""
    return _split_table()[_check_split(split)]


# ------------------------------------------------------------------------------------------------------------------
# Exact counts and entropies
# ------------------------------------------------------------------------------------------------------------------
def covering_count(rows: int, cols: int, k: int) -> int:
    """The number of ``k``-subsets of a ``rows x cols`` grid that use every row and every column.

    Inclusion-exclusion over the set of rows ``I`` and columns ``J`` left empty:
    ``sum_{i,j} (-1)^(i+j) C(rows, i) C(cols, j) C((rows - i)(cols - j), k)``. Exact integer arithmetic.
    """
    for name, v in (("rows", rows), ("cols", cols), ("k", k)):
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise StimulusError(f"{name} must be a non-negative int, got {v!r}")
    return sum((-1) ** (i + j) * math.comb(rows, i) * math.comb(cols, j) * math.comb((rows - i) * (cols - j), k)
               for i in range(rows + 1) for j in range(cols + 1))


def entropies(split: str) -> dict[str, Any]:
    """Exact entropies (bits) and counts of BalancedColorShape's code distribution in ``split``.

    F is uniform over the split's codes and O is uniform given F over the covering 18-subsets, so
    H(F) = log2(#codes), H(O|F) = log2(N), H(O) = H(F) + H(O|F) (O determines F, so H(O) = H(O, F)).
    FBP's reference values H(O) = 39.9 bits and H(F) = 7.0 bits are those of a 131-code split: val or test
    (log2 131 = 7.03, H(O) = 39.94); train has H(F) = log2 522 = 9.03 and H(O) = 41.94.

    Returns:
        ``split``, ``n_f_codes``, ``n_o_given_f`` (N), ``n_o`` (= n_f_codes * N), ``H_F``, ``H_O_given_F``, ``H_O``.
    """
    n_f = len(split_codes(split))
    n_o_given_f = covering_count(N_CHOSEN_COLOURS, N_CHOSEN_SHAPES, N_OBJECTS)
    h_f, h_o_f = math.log2(n_f), math.log2(n_o_given_f)
    return {"split": split, "n_f_codes": n_f, "n_o_given_f": n_o_given_f, "n_o": n_f * n_o_given_f,
            "H_F": h_f, "H_O_given_F": h_o_f, "H_O": h_f + h_o_f}


def code_arrays(dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """The F and O codes of a BalancedColorShape data set as 0/1 arrays, for the binding-information probes.

    Returns:
        ``(F, O)``: uint8 arrays of shape ``[n, 16]`` and ``[n, 64]``.
    """
    if dataset.task != TASK:
        raise StimulusError(f"code_arrays needs a {TASK!r} data set, got task {dataset.task!r}")
    f = np.array([[int(b) for b in e.fields["f_code"]] for e in dataset], dtype=np.uint8).reshape(-1, N_F_BITS)
    o = np.array([[int(b) for b in e.fields["o_code"]] for e in dataset], dtype=np.uint8).reshape(-1, N_O_BITS)
    return f, o


# ------------------------------------------------------------------------------------------------------------------
# Generator
# ------------------------------------------------------------------------------------------------------------------
def _sample_objects(rng: np.random.Generator, colours: list[str], shapes: list[str]) -> list[tuple[str, str]]:
    n_c, n_s = len(colours), len(shapes)
    for _ in range(_MAX_REJECTIONS):
        # A uniform 18-subset kept only if it covers: uniform among covering subsets.
        flat = rng.choice(n_c * n_s, size=N_OBJECTS, replace=False)
        ci, si = flat // n_s, flat % n_s
        if len(set(ci.tolist())) == n_c and len(set(si.tolist())) == n_s:
            return [(colours[int(c)], shapes[int(s)]) for c, s in zip(ci, si)]
    raise StimulusError("could not draw a covering object set; this should not happen")  # pragma: no cover


def balanced_color_shape(n: int, seed: int = 0, *, split: str = "train", grid: int = 8, jitter: int = 0) -> Dataset:
    """Generate ``n`` BalancedColorShape images of one split (task ``"colorshape"``).

    Args:
        n: number of images.
        seed: the seed; example ``i`` draws from ``example_rng(seed, i)``.
        split: ``"train"``, ``"val"`` or ``"test"``: which F codes (disjoint across splits) the images use.
        grid: the placement grid on the 256 px canvas (default 8: 32 px cells); needs >= 18 cells and cells of at
            least 16 + 2 px so objects keep a margin.
        jitter: maximum random shift of an object from its cell centre, in whole pixels, at most
            ``(cell - 16) // 2 - 1`` (7 px on the default grid) so it stays inside its cell with a pixel to spare
            (default 0: centred, aligned with patch grids).

    Returns:
        A :class:`Dataset`. Each example's objects are in raster order; the prompt is
        ``describe the objects in this image :``, the answer the objects in raster order (``red circle , blue star``).
        Fields: ``split``, ``f_code`` (16-char bit string), ``f_bits`` (list of 16 ints), ``o_code`` (64-char bit
        string), ``colours`` and ``shapes`` (the 6 chosen, in bit order). ``summary["entropy_bits"]`` holds
        :func:`entropies` for all three splits.

    Raises:
        StimulusError: bad ``n``, ``split``, ``grid`` or ``jitter``.
    """
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise StimulusError(f"n must be a non-negative int, got {n!r}")
    _check_split(split)
    if not isinstance(grid, (int, np.integer)) or grid * grid < N_OBJECTS:
        raise StimulusError(f"grid={grid!r} has fewer than {N_OBJECTS} cells; use grid >= 5")
    if IMAGE_SIZE / grid < OBJECT_SIZE + 2:
        raise StimulusError(f"grid={grid} leaves {IMAGE_SIZE / grid:.1f} px cells, too small for {OBJECT_SIZE} px "
                            f"objects with a margin; use grid <= {IMAGE_SIZE // (OBJECT_SIZE + 2)}")
    canvas = Canvas(image_size=IMAGE_SIZE, grid=int(grid), object_size=OBJECT_SIZE)
    # One pixel of slack: PIL's hexagon reaches one pixel past its box's right edge.
    max_jitter = int((min(canvas.cell_size) - OBJECT_SIZE) // 2) - 1
    if not isinstance(jitter, (int, np.integer)) or not 0 <= jitter <= max_jitter:
        raise StimulusError(f"jitter={jitter!r} must be an int in [0, {max_jitter}] px so objects stay in their cells")
    codes = split_codes(split)

    examples = []
    for i in range(int(n)):
        rng = example_rng(seed, i)
        bits = codes[int(rng.integers(len(codes)))]
        colours = [c for c, b in zip(CS_COLOURS, bits[:len(CS_COLOURS)]) if b == "1"]
        shapes = [s for s, b in zip(CS_SHAPES, bits[len(CS_COLOURS):]) if b == "1"]
        conj = _sample_objects(rng, colours, shapes)
        cells = random_cells(rng, canvas, N_OBJECTS)
        shifts = rng.integers(-jitter, jitter + 1, size=(N_OBJECTS, 2)) if jitter else np.zeros((N_OBJECTS, 2), int)
        objects = []
        for (colour, shape), (r, c), (dx, dy) in zip(conj, cells, shifts):
            x, y = canvas.cell_centre(r, c)
            objects.append(SceneObject(colour, shape, r, c, x + float(dx), y + float(dy), OBJECT_SIZE))
        objects = raster(objects)
        answer = " , ".join(o.name for o in objects)
        fields = {"split": split, "f_code": bits, "f_bits": [int(b) for b in bits], "o_code": o_code(objects),
                  "colours": colours, "shapes": shapes}
        examples.append(Example(f"{TASK}_{split}_{i:06d}", render(canvas, objects), objects, PROMPT, answer, TASK,
                                fields))

    params = {"n": int(n), "split": split, "canvas": canvas.to_dict(), "jitter": int(jitter),
              "n_chosen_colours": N_CHOSEN_COLOURS, "n_chosen_shapes": N_CHOSEN_SHAPES, "n_objects": N_OBJECTS,
              "colour_bits": list(CS_COLOURS), "shape_bits": list(CS_SHAPES)}
    summary = {"entropy_bits": {s: entropies(s) for s in SPLITS}, "split_sizes": dict(SPLIT_SIZES)}
    return Dataset(TASK, examples, params, int(seed), summary)
