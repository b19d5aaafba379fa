"""BalancedColorShape (FBP): 18 coloured shapes per image with exact feature and object codes and exact entropies.

Design: each image first draws a feature code F in {0,1}^16 (8 colour bits in :data:`core.COLOURS` order, then 8 shape
bits in the order circle, square, triangle, diamond, pentagon, hexagon, cross, star, as docs/methods.md section 1.6 lists
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
from dataclasses import dataclass
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
CS_SHAPES: tuple[str, ...] = SHAPES  # bit order of the shape half of F (docs/methods.md 1.6 order)
N_F_BITS = len(CS_COLOURS) + len(CS_SHAPES)
N_O_BITS = len(CS_COLOURS) * len(CS_SHAPES)
_MAX_REJECTIONS = 10_000  # P(10k rejections in a row) = 0.112**10000: never, but never loop forever either


@dataclass(frozen=True)
class ColorShapeWorld:
    """The palette, counts and canvas of one BalancedColorShape distribution.

    Attributes:
        name: the preset's name (``fbp``, ``organism``, or the caller's).
        colours, shapes: the pools, in bit order (F = colour bits then shape bits; O bit ``colour * |shapes| +
            shape``).
        n_colours, n_shapes: how many of each an image uses (exactly).
        n_objects: distinct conjunctions per image, using every chosen colour and shape.
        image_size, grid: the square canvas and its placement grid (one object per cell).
        object_size: an object's side in pixels (None: the canvas default, 70% of a cell).

    The F codes are split by hash rank: a sixth each (rounded) to val and test, the rest to train (FBP: 131 / 131 /
    522 of 784).
    """

    name: str
    colours: tuple[str, ...]
    shapes: tuple[str, ...]
    n_colours: int
    n_shapes: int
    n_objects: int
    image_size: int
    grid: int
    object_size: int | None

    def __post_init__(self) -> None:
        for pool, chosen, what in ((self.colours, self.n_colours, "colours"), (self.shapes, self.n_shapes, "shapes")):
            if len(set(pool)) != len(pool) or not 1 <= chosen <= len(pool):
                raise StimulusError(f"world {self.name!r}: choose 1..{len(pool)} of {len(pool)} distinct {what}, "
                                    f"got {chosen}")
        unknown = [c for c in self.colours if c not in COLOURS] + [x for x in self.shapes if x not in SHAPES]
        if unknown:
            raise StimulusError(f"world {self.name!r}: unknown colours or shapes {unknown}")
        if not self.n_colours <= self.n_objects <= self.n_colours * self.n_shapes or self.n_objects < self.n_shapes:
            raise StimulusError(f"world {self.name!r}: {self.n_objects} objects cannot use every one of "
                                f"{self.n_colours} colours and {self.n_shapes} shapes")
        if self.grid * self.grid < self.n_objects:
            raise StimulusError(f"world {self.name!r}: a {self.grid}x{self.grid} grid has fewer than "
                                f"{self.n_objects} cells")
        if self.n_f_codes < 3:
            raise StimulusError(f"world {self.name!r} has {self.n_f_codes} feature codes; disjoint train, val and "
                                "test splits need at least 3 (choose fewer colours or shapes than the pools hold)")

    @property
    def n_f_codes(self) -> int:
        return math.comb(len(self.colours), self.n_colours) * math.comb(len(self.shapes), self.n_shapes)

    @property
    def split_sizes(self) -> dict[str, int]:
        n = self.n_f_codes
        held = max(1, round(n / 6))
        return {"train": n - 2 * held, "val": held, "test": held}

    def canvas(self) -> Canvas:
        return Canvas(image_size=self.image_size, grid=self.grid, object_size=self.object_size)


# FBP's BalancedColorShape: 8 colours x 8 shapes, 6 + 6 chosen, 18 objects of 16 px on 256 px (an 8 x 8 grid)
FBP = ColorShapeWorld(name="fbp", colours=CS_COLOURS, shapes=CS_SHAPES, n_colours=N_CHOSEN_COLOURS,
                      n_shapes=N_CHOSEN_SHAPES, n_objects=N_OBJECTS, image_size=IMAGE_SIZE, grid=8,
                      object_size=OBJECT_SIZE)
# the organisms' world: their 4 colours and 4 shapes, their 168 px canvas with one object per token cell (6 x 6);
# 3 + 3 chosen (16 feature codes: 10 / 3 / 3) and 5 objects, the count that maximises H(O|F) = log2 90 = 6.49 bits
# (test split: H(F) = log2 3 = 1.58, H(O) = 8.08 bits)
ORGANISM = ColorShapeWorld(name="organism", colours=("red", "green", "blue", "yellow"),
                           shapes=("square", "circle", "triangle", "star"), n_colours=3, n_shapes=3, n_objects=5,
                           image_size=168, grid=6, object_size=None)
WORLDS = {w.name: w for w in (FBP, ORGANISM)}


def world_named(name: str | ColorShapeWorld) -> ColorShapeWorld:
    """A preset by name (or a world, returned as is)."""
    if isinstance(name, ColorShapeWorld):
        return name
    if name not in WORLDS:
        raise StimulusError(f"unknown ColorShape world {name!r}; presets: {', '.join(WORLDS)}")
    return WORLDS[name]


# ------------------------------------------------------------------------------------------------------------------
# Codes and splits
# ------------------------------------------------------------------------------------------------------------------
def f_code(colours: Sequence[str], shapes: Sequence[str], world: ColorShapeWorld | None = None) -> str:
    """The feature bit string of a set of colours and shapes (colour bits, then shape bits)."""
    w = world or FBP
    unknown = [c for c in colours if c not in w.colours] + [s for s in shapes if s not in w.shapes]
    if unknown:
        raise StimulusError(f"unknown colour or shape {unknown}; this world uses colours {list(w.colours)} "
                            f"and shapes {list(w.shapes)}")
    colour_bits = "".join("1" if c in colours else "0" for c in w.colours)
    return colour_bits + "".join("1" if s in shapes else "0" for s in w.shapes)


def o_code(objects: Sequence[SceneObject] | Sequence[tuple[str, str]], world: ColorShapeWorld | None = None) -> str:
    """The object bit string: bit ``colour_index * |shapes| + shape_index`` is 1 when that object is drawn."""
    w = world or FBP
    bits = ["0"] * (len(w.colours) * len(w.shapes))
    for o in objects:
        colour, shape = (o.colour, o.shape) if isinstance(o, SceneObject) else o
        if colour not in w.colours or shape not in w.shapes:
            raise StimulusError(f"object {colour} {shape} is not a BalancedColorShape conjunction of world {w.name!r}")
        bits[w.colours.index(colour) * len(w.shapes) + w.shapes.index(shape)] = "1"
    return "".join(bits)


def f_from_o(o_bits: str, world: ColorShapeWorld | None = None) -> str:
    """The feature code implied by an object code: a colour (shape) is present iff one of its objects is."""
    w = world or FBP
    n_o = len(w.colours) * len(w.shapes)
    if len(o_bits) != n_o or set(o_bits) - {"0", "1"}:
        raise StimulusError(f"an object code is a {n_o}-character 0/1 string, got {o_bits!r}")
    grid = np.array([int(b) for b in o_bits]).reshape(len(w.colours), len(w.shapes))
    return "".join(str(int(v)) for v in grid.any(1)) + "".join(str(int(v)) for v in grid.any(0))


@lru_cache(maxsize=16)
def _all_f_codes(world: ColorShapeWorld) -> tuple[str, ...]:
    colour_bits = ["".join("1" if c in cs else "0" for c in world.colours)
                   for cs in itertools.combinations(world.colours, world.n_colours)]
    shape_bits = ["".join("1" if s in ss else "0" for s in world.shapes)
                  for ss in itertools.combinations(world.shapes, world.n_shapes)]
    return tuple(c + s for c in colour_bits for s in shape_bits)


def all_f_codes(world: ColorShapeWorld | None = None) -> list[str]:
    """Every feature code of the world (FBP: 6 of 8 colours and 6 of 8 shapes, 784 codes), in enumeration order."""
    return list(_all_f_codes(world or FBP))


@lru_cache(maxsize=16)
def _split_table(world: ColorShapeWorld) -> dict[str, tuple[str, ...]]:
    # Hash rank: sha256 of the bit string fixes the order without a seed, so every run and machine agrees.
    ranked = sorted(_all_f_codes(world), key=lambda b: hashlib.sha256(b.encode("ascii")).hexdigest())
    sizes = world.split_sizes
    n_train, n_val = sizes["train"], sizes["val"]
    return {"train": tuple(ranked[:n_train]), "val": tuple(ranked[n_train:n_train + n_val]),
            "test": tuple(ranked[n_train + n_val:])}


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise StimulusError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return split


def split_codes(split: str, world: ColorShapeWorld | None = None) -> tuple[str, ...]:
    """The feature codes of ``split``, in hash-rank order."""
    return _split_table(world or FBP)[_check_split(split)]


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


def entropies(split: str, world: ColorShapeWorld | None = None) -> dict[str, Any]:
    """Exact entropies (bits) and counts of the world's code distribution in ``split`` (default world: FBP's).

    F is uniform over the split's codes and O is uniform given F over the covering ``n_objects``-subsets, so
    H(F) = log2(#codes), H(O|F) = log2(N), H(O) = H(F) + H(O|F) (O determines F, so H(O) = H(O, F)).
    FBP's reference values H(O) = 39.9 bits and H(F) = 7.0 bits are those of a 131-code split: val or test
    (log2 131 = 7.03, H(O) = 39.94); train has H(F) = log2 522 = 9.03 and H(O) = 41.94.

    Returns:
        ``split``, ``world``, ``n_f_codes``, ``n_o_given_f`` (N), ``n_o`` (= n_f_codes * N), ``H_F``,
        ``H_O_given_F``, ``H_O``.
    """
    w = world or FBP
    n_f = len(split_codes(split, w))
    n_o_given_f = covering_count(w.n_colours, w.n_shapes, w.n_objects)
    h_f, h_o_f = math.log2(n_f), math.log2(n_o_given_f)
    return {"split": split, "world": w.name, "n_f_codes": n_f, "n_o_given_f": n_o_given_f, "n_o": n_f * n_o_given_f,
            "H_F": h_f, "H_O_given_F": h_o_f, "H_O": h_f + h_o_f}


def code_arrays(dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """The F and O codes of a BalancedColorShape data set as 0/1 arrays, for the binding-information probes.

    Returns:
        ``(F, O)``: uint8 arrays of shape ``[n, |colours| + |shapes|]`` and ``[n, |colours| * |shapes|]``.
    """
    if dataset.task != TASK:
        raise StimulusError(f"code_arrays needs a {TASK!r} data set, got task {dataset.task!r}")
    n_f = len(dataset.params.get("colour_bits", CS_COLOURS)) + len(dataset.params.get("shape_bits", CS_SHAPES))
    n_o = len(dataset.params.get("colour_bits", CS_COLOURS)) * len(dataset.params.get("shape_bits", CS_SHAPES))
    f = np.array([[int(b) for b in e.fields["f_code"]] for e in dataset], dtype=np.uint8).reshape(-1, n_f)
    o = np.array([[int(b) for b in e.fields["o_code"]] for e in dataset], dtype=np.uint8).reshape(-1, n_o)
    return f, o


# ------------------------------------------------------------------------------------------------------------------
# Generator
# ------------------------------------------------------------------------------------------------------------------
def _sample_objects(rng: np.random.Generator, colours: list[str], shapes: list[str],
                    n_objects: int = N_OBJECTS) -> list[tuple[str, str]]:
    n_c, n_s = len(colours), len(shapes)
    for _ in range(_MAX_REJECTIONS):
        # A uniform k-subset kept only if it covers: uniform among covering subsets.
        flat = rng.choice(n_c * n_s, size=n_objects, replace=False)
        ci, si = flat // n_s, flat % n_s
        if len(set(ci.tolist())) == n_c and len(set(si.tolist())) == n_s:
            return [(colours[int(c)], shapes[int(s)]) for c, s in zip(ci, si)]
    raise StimulusError("could not draw a covering object set; this should not happen")  # pragma: no cover


def _colorshape_example(i: int, seed: int, split: str, w: ColorShapeWorld, canvas: Canvas, jitter: int) -> Example:
    """Example ``i`` of a BalancedColorShape split (drawn from ``example_rng(seed, i)`` alone)."""
    codes = split_codes(split, w)
    n_colour_bits = len(w.colours)
    rng = example_rng(seed, i)
    bits = codes[int(rng.integers(len(codes)))]
    colours = [c for c, b in zip(w.colours, bits[:n_colour_bits]) if b == "1"]
    shapes = [s for s, b in zip(w.shapes, bits[n_colour_bits:]) if b == "1"]
    conj = _sample_objects(rng, colours, shapes, w.n_objects)
    cells = random_cells(rng, canvas, w.n_objects)
    shifts = (rng.integers(-jitter, jitter + 1, size=(w.n_objects, 2)) if jitter
              else np.zeros((w.n_objects, 2), int))
    objects = []
    for (colour, shape), (r, c), (dx, dy) in zip(conj, cells, shifts):
        x, y = canvas.cell_centre(r, c)
        objects.append(SceneObject(colour, shape, r, c, x + float(dx), y + float(dy), canvas.size))
    objects = raster(objects)
    answer = " , ".join(o.name for o in objects)
    fields = {"split": split, "f_code": bits, "f_bits": [int(b) for b in bits], "o_code": o_code(objects, w),
              "colours": colours, "shapes": shapes}
    prefix = TASK if w.name == "fbp" else f"{TASK}_{w.name}"
    return Example(f"{prefix}_{split}_{i:06d}", render(canvas, objects), objects, PROMPT, answer, TASK, fields)


class ColorShapeSplits(Sequence):
    """The train, val and test images of a BalancedColorShape world, in that order, drawn on demand: item ``k``
    is example ``k`` of train, then of val, then of test, equal to :func:`balanced_color_shape`'s. Memory holds no
    image, so a capture of FBP's tens of thousands of images stays bounded (each is drawn when captured)."""

    def __init__(self, sizes: Sequence[int], seed: int = 0, world: ColorShapeWorld | str = "fbp") -> None:
        self.world = world_named(world)
        self.sizes = tuple(int(n) for n in sizes)
        self.seed = int(seed)
        self.canvas = Canvas(image_size=self.world.image_size, grid=self.world.grid,
                             object_size=self.world.object_size)
        self._starts = np.cumsum((0,) + self.sizes)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def split_of(self, k: int) -> tuple[str, int]:
        """``(split, index within the split)`` of item ``k``."""
        s = int(np.searchsorted(self._starts, k, side="right")) - 1
        return SPLITS[s], k - int(self._starts[s])

    def labels(self) -> np.ndarray:
        """The split label of every item."""
        return np.repeat(np.array(SPLITS), self.sizes)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        k = int(k)
        if not -len(self) <= k < len(self):
            raise IndexError(f"item {k} of {len(self)}")
        split, i = self.split_of(k % len(self))
        return _colorshape_example(i, self.seed, split, self.world, self.canvas, 0)


def balanced_color_shape(n: int, seed: int = 0, *, split: str = "train", grid: int | None = None, jitter: int = 0,
                         world: ColorShapeWorld | str = "fbp") -> Dataset:
    """Generate ``n`` BalancedColorShape images of one split (task ``"colorshape"``).

    Args:
        n: number of images.
        seed: the seed; example ``i`` draws from ``example_rng(seed, i)``.
        split: ``"train"``, ``"val"`` or ``"test"``: which F codes (disjoint across splits) the images use.
        grid: the placement grid (default: the world's; FBP: 8, 32 px cells on 256 px); needs a cell per object
            and cells larger than the objects by 2 px so objects keep a margin.
        jitter: maximum random shift of an object from its cell centre, in whole pixels, at most
            ``(cell - object) // 2 - 1`` (7 px on FBP's grid) so it stays inside its cell with a pixel to spare
            (default 0: centred, aligned with patch grids).
        world: a preset name (``fbp``: FBP's 8 x 8 palette, 6 + 6 chosen, 18 objects on 256 px; ``organism``: the
            organisms' 4 x 4 palette, 3 + 3 chosen, 5 objects, one per token cell of their 168 px canvas) or a
            :class:`ColorShapeWorld`.

    Returns:
        A :class:`Dataset`. Each example's objects are in raster order; the prompt is
        ``describe the objects in this image :``, the answer the objects in raster order (``red circle , blue star``).
        Fields: ``split``, ``f_code``, ``f_bits``, ``o_code``, ``colours`` and ``shapes`` (the chosen ones, in bit
        order). ``summary["entropy_bits"]`` holds :func:`entropies` for all three splits.

    Raises:
        StimulusError: bad ``n``, ``split``, ``grid``, ``jitter`` or world.
    """
    w = world_named(world)
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise StimulusError(f"n must be a non-negative int, got {n!r}")
    _check_split(split)
    grid = w.grid if grid is None else grid
    if not isinstance(grid, (int, np.integer)) or grid * grid < w.n_objects:
        raise StimulusError(f"grid={grid!r} has fewer than {w.n_objects} cells; use grid >= "
                            f"{math.ceil(math.sqrt(w.n_objects))}")
    object_size = w.object_size if w.object_size is not None else Canvas(image_size=w.image_size, grid=int(grid)).size
    if w.image_size / grid < object_size + 2:
        raise StimulusError(f"grid={grid} leaves {w.image_size / grid:.1f} px cells, too small for {object_size} px "
                            f"objects with a margin; use grid <= {w.image_size // (object_size + 2)}")
    canvas = Canvas(image_size=w.image_size, grid=int(grid), object_size=object_size)
    # One pixel of slack: PIL's hexagon reaches one pixel past its box's right edge.
    max_jitter = int((min(canvas.cell_size) - object_size) // 2) - 1
    if not isinstance(jitter, (int, np.integer)) or not 0 <= jitter <= max_jitter:
        raise StimulusError(f"jitter={jitter!r} must be an int in [0, {max_jitter}] px so objects stay in their cells")
    examples = [_colorshape_example(i, seed, split, w, canvas, jitter) for i in range(int(n))]
    params = {"n": int(n), "split": split, "canvas": canvas.to_dict(), "jitter": int(jitter), "world": w.name,
              "n_chosen_colours": w.n_colours, "n_chosen_shapes": w.n_shapes, "n_objects": w.n_objects,
              "colour_bits": list(w.colours), "shape_bits": list(w.shapes)}
    summary = {"entropy_bits": {s: entropies(s, w) for s in SPLITS}, "split_sizes": dict(w.split_sizes)}
    return Dataset(TASK, examples, params, int(seed), summary)
