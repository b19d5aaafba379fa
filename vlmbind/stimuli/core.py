"""The stimuli's shared core: colours, shapes, the canvas grid, drawing, examples and datasets on disk.

Design: every generator is a pure function of ``(n, seed, params)``. Example ``i`` draws from its own random stream
``np.random.default_rng([seed, i])``, so the same seed gives byte-identical images and metadata, and a larger ``n``
extends a data set without changing its first examples. Objects sit in the cells of a ``rows x cols`` grid laid over a
square canvas (one object per cell, so they never overlap), which lets an object be aligned with a model's
image-token grid: pick ``image_size`` and ``grid`` so that cells coincide with token boxes, and
:func:`object_token_positions` gives the tokens each object covers. Drawing uses PIL without anti-aliasing, so each
object's pixels have exactly its colour.

A :class:`Dataset` saves as ``images/*.png``, ``meta.jsonl`` (one object per example: objects, prompt, answer, task
fields) and ``dataset.json`` (task, parameters, seed, summary such as entropies or ceilings), all written atomically.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from ..core.errors import InputError, VlmbindError, close_matches
from ..core.images import read_image
from ..core.io import json_default


class StimulusError(InputError):
    """Impossible stimulus parameters (too many objects for the grid, unknown colour or shape, ...)."""


class PairAlignmentError(VlmbindError):
    """A counterfactual pair whose clean and counterfactual inputs do not line up token for token."""


# FBP's colours and RGB values; the other generators use the same palette.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 60),
    "blue": (30, 144, 255),
    "green": (34, 139, 34),
    "yellow": (255, 215, 0),
    "purple": (138, 43, 226),
    "orange": (255, 140, 0),
    "cyan": (0, 206, 209),
    "gray": (128, 128, 128),
}
SHAPES = ("circle", "square", "triangle", "diamond", "pentagon", "hexagon", "cross", "star")
LETTERS = ("L", "T", "H", "E")
BACKGROUND = (255, 255, 255)


def check_colours(colours: Sequence[str]) -> tuple[str, ...]:
    for c in colours:
        if c not in COLOURS:
            raise StimulusError(f"unknown colour {c!r}.{close_matches(c, COLOURS)} Colours: {', '.join(COLOURS)}")
    if len(set(colours)) != len(colours):
        raise StimulusError(f"colours repeat in {list(colours)}")
    return tuple(colours)


def check_shapes(shapes: Sequence[str]) -> tuple[str, ...]:
    valid = SHAPES + LETTERS
    for s in shapes:
        if s not in valid:
            raise StimulusError(f"unknown shape {s!r}.{close_matches(s, valid)} Shapes: {', '.join(valid)}")
    if len(set(shapes)) != len(shapes):
        raise StimulusError(f"shapes repeat in {list(shapes)}")
    return tuple(shapes)


# the parameter checks every generator shares
def check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise StimulusError(f"n must be a non-negative int (the number of examples), got {n!r}")
    return int(n)


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise StimulusError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


def check_canvas(canvas: Any) -> Canvas:
    if not isinstance(canvas, Canvas):
        raise StimulusError(f"canvas must be a vlmbind.stimuli.Canvas, got {type(canvas).__name__}")
    return canvas


def object_range(n_objects: Any, canvas: Canvas, low: int = 2, high: int | None = None) -> tuple[int, int]:
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


def feature_pools(colours: Sequence[str] | None,
                  shapes: Sequence[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    cs = tuple(COLOURS) if colours is None else check_colours(list(colours))
    ss = SHAPES if shapes is None else check_shapes(list(shapes))
    if not cs or not ss:
        raise StimulusError("colours and shapes must each name at least one value (or be None for all)")
    return cs, ss


def object_count_summary(examples: Sequence[Example]) -> dict[str, Any]:
    counts = Counter(len(e.objects) for e in examples)
    return {"n_objects_counts": {str(k): counts[k] for k in sorted(counts)}}


# ------------------------------------------------------------------------------------------------------------------
# Canvas and drawing
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Canvas:
    """A square image with a ``rows x cols`` grid of cells; objects are drawn centred in cells.

    Attributes:
        image_size: side of the image in pixels.
        grid: ``rows`` (square grid) or ``(rows, cols)``.
        object_size: side of an object's bounding square in pixels; default 70% of the smaller cell side.
    """

    image_size: int = 224
    grid: int | tuple[int, int] = 3
    object_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or self.image_size < 8:
            raise StimulusError(f"image_size must be an int >= 8 pixels, got {self.image_size!r}")
        rows, cols = self.shape
        if rows < 1 or cols < 1:
            raise StimulusError(f"grid must be at least 1x1, got {self.grid!r}")
        if self.cell_size[0] < 4 or self.cell_size[1] < 4:
            raise StimulusError(
                f"a {rows}x{cols} grid on a {self.image_size} px image leaves cells under 4 px; use a larger image "
                f"or a smaller grid"
            )
        if self.object_size is not None and not (2 <= self.object_size <= min(self.cell_size)):
            raise StimulusError(
                f"object_size {self.object_size} px does not fit a cell of {min(self.cell_size):.1f} px "
                f"({rows}x{cols} grid on {self.image_size} px): use a smaller object or a coarser grid"
            )

    @property
    def shape(self) -> tuple[int, int]:
        g = self.grid
        rows, cols = (g, g) if isinstance(g, (int, np.integer)) else tuple(g)
        return int(rows), int(cols)

    @property
    def n_cells(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def cell_size(self) -> tuple[float, float]:
        """``(width, height)`` of a cell in pixels."""
        rows, cols = self.shape
        return self.image_size / cols, self.image_size / rows

    @property
    def size(self) -> int:
        return self.object_size if self.object_size is not None else max(2, int(0.7 * min(self.cell_size)))

    def cell_centre(self, row: int, col: int) -> tuple[float, float]:
        w, h = self.cell_size
        return (col + 0.5) * w, (row + 0.5) * h

    def cell_box(self, row: int, col: int) -> tuple[float, float, float, float]:
        w, h = self.cell_size
        return col * w, row * h, (col + 1) * w, (row + 1) * h

    def check_fits(self, n_objects: int) -> None:
        if n_objects > self.n_cells:
            rows, cols = self.shape
            side = math.ceil(math.sqrt(n_objects))
            raise StimulusError(
                f"{n_objects} objects do not fit a {rows}x{cols} grid ({self.n_cells} cells, one object per cell): "
                f"use grid={side} or larger"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"image_size": self.image_size, "grid": list(self.shape), "object_size": self.size}


def _polygon(n: int, cx: float, cy: float, r: float, rotation: float = -math.pi / 2) -> list[tuple[float, float]]:
    return [(cx + r * math.cos(rotation + 2 * math.pi * k / n), cy + r * math.sin(rotation + 2 * math.pi * k / n))
            for k in range(n)]


def draw_object(draw: ImageDraw.ImageDraw, shape: str, rgb: tuple[int, int, int], cx: float, cy: float,
                size: int) -> None:
    """Draw one shape or letter (no anti-aliasing) inside the ``size`` px square centred at ``(cx, cy)``."""
    h = size / 2
    x0, y0, x1, y1 = cx - h, cy - h, cx + h - 1, cy + h - 1
    stroke = max(1, round(size / 4))
    if shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=rgb)
    elif shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=rgb)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=rgb)
    elif shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=rgb)
    elif shape == "pentagon":
        draw.polygon(_polygon(5, cx, cy, h), fill=rgb)
    elif shape == "hexagon":
        draw.polygon(_polygon(6, cx, cy, h - 1, rotation=0.0), fill=rgb)  # PIL inks vertices: stay in the box
    elif shape == "star":
        outer, inner = _polygon(5, cx, cy, h), _polygon(5, cx, cy, h * 0.45, rotation=-math.pi / 2 + math.pi / 5)
        draw.polygon([p for pair in zip(outer, inner) for p in pair], fill=rgb)
    elif shape == "cross":
        s = stroke / 2
        draw.rectangle([cx - s, y0, cx + s - 1, y1], fill=rgb)
        draw.rectangle([x0, cy - s, x1, cy + s - 1], fill=rgb)
    elif shape == "L":
        draw.rectangle([x0, y0, x0 + stroke - 1, y1], fill=rgb)
        draw.rectangle([x0, y1 - stroke + 1, x1, y1], fill=rgb)
    elif shape == "T":
        draw.rectangle([x0, y0, x1, y0 + stroke - 1], fill=rgb)
        draw.rectangle([cx - stroke / 2, y0, cx + stroke / 2 - 1, y1], fill=rgb)
    elif shape == "H":
        draw.rectangle([x0, y0, x0 + stroke - 1, y1], fill=rgb)
        draw.rectangle([x1 - stroke + 1, y0, x1, y1], fill=rgb)
        draw.rectangle([x0, cy - stroke / 2, x1, cy + stroke / 2 - 1], fill=rgb)
    elif shape == "E":
        draw.rectangle([x0, y0, x0 + stroke - 1, y1], fill=rgb)
        for y in (y0, cy - stroke / 2, y1 - stroke + 1):
            draw.rectangle([x0, y, x1, y + stroke - 1], fill=rgb)
    else:
        raise StimulusError(f"unknown shape {shape!r}.{close_matches(shape, SHAPES + LETTERS)}")


@dataclass(frozen=True)
class SceneObject:
    """One drawn object. ``x, y`` is the centre in pixels, ``size`` the side of its bounding square."""

    colour: str
    shape: str
    row: int
    col: int
    x: float
    y: float
    size: int

    @property
    def box(self) -> tuple[float, float, float, float]:
        h = self.size / 2
        return self.x - h, self.y - h, self.x + h, self.y + h

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["box"] = list(self.box)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SceneObject:
        return cls(d["colour"], d["shape"], int(d["row"]), int(d["col"]), float(d["x"]), float(d["y"]), int(d["size"]))


def place(canvas: Canvas, colour: str, shape: str, row: int, col: int) -> SceneObject:
    x, y = canvas.cell_centre(row, col)
    return SceneObject(colour, shape, row, col, x, y, canvas.size)


def render(canvas: Canvas, objects: Sequence[SceneObject]) -> Image.Image:
    """Draw objects on a white canvas."""
    img = Image.new("RGB", (canvas.image_size, canvas.image_size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for o in objects:
        draw_object(draw, o.shape, COLOURS[o.colour], o.x, o.y, o.size)
    return img


def example_rng(seed: int, index: int) -> np.random.Generator:
    """The random stream of example ``index`` of a data set drawn with ``seed``."""
    return np.random.default_rng([int(seed), int(index)])


def random_cells(rng: np.random.Generator, canvas: Canvas, n: int) -> list[tuple[int, int]]:
    """``n`` distinct cells, uniformly at random."""
    canvas.check_fits(n)
    rows, cols = canvas.shape
    flat = rng.choice(rows * cols, size=n, replace=False)
    return [(int(i) // cols, int(i) % cols) for i in flat]


def raster(objects: Sequence[SceneObject]) -> list[SceneObject]:
    """Objects in raster order (row, then column)."""
    return sorted(objects, key=lambda o: (o.row, o.col))


# ------------------------------------------------------------------------------------------------------------------
# Examples and data sets
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class Example:
    """One stimulus: an image, its objects, a prompt and the expected answer.

    Attributes:
        id: unique within the data set, also the image's file stem.
        image: the RGB image.
        objects: every object drawn, with colour, shape, cell, centre and size.
        prompt: the text after the image.
        answer: the expected continuation.
        task: the generator's task name.
        fields: task-specific metadata (target, condition, codes, points, ...), JSON-serialisable.
    """

    id: str
    image: Image.Image
    objects: list[SceneObject]
    prompt: str
    answer: str
    task: str
    fields: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {"id": self.id, "image": f"images/{self.id}.png", "task": self.task, "prompt": self.prompt,
                "answer": self.answer, "objects": [o.to_dict() for o in self.objects], **self.fields}


@dataclass
class Dataset:
    """A list of examples plus the parameters that made them.

    Attributes:
        task: generator name.
        examples: the examples.
        params: the generator's parameters (JSON-serialisable).
        seed: the seed.
        summary: data-set level facts (entropies, ceilings, counts), JSON-serialisable.
    """

    task: str
    examples: list[Example]
    params: dict[str, Any]
    seed: int
    summary: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    @property
    def images(self) -> list[Image.Image]:
        return [e.image for e in self.examples]

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.examples]

    @property
    def answers(self) -> list[str]:
        return [e.answer for e in self.examples]

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, "n": len(self), "seed": self.seed, "params": self.params, **self.summary}

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``images/*.png``, ``meta.jsonl`` and ``dataset.json`` into ``out`` atomically.

        Everything is written to a temporary sibling directory first; files already in ``out`` with the same names are
        replaced only once the whole data set is written.
        """
        return save_records(out, [(e.id, e.image) for e in self.examples], [e.to_record() for e in self.examples],
                            self.describe())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Dataset:
        """Read a data set written by :meth:`save` (images are loaded into memory)."""
        path = Path(path)
        info, records = read_records(path)
        examples = []
        for r in records:
            image = read_image(path / r["image"], StimulusError)
            extra = {k: v for k, v in r.items() if k not in ("id", "image", "task", "prompt", "answer", "objects")}
            examples.append(Example(r["id"], image, [SceneObject.from_dict(o) for o in r.get("objects", [])],
                                    r["prompt"], r["answer"], r.get("task", info.get("task", "")), extra))
        summary = {k: v for k, v in info.items() if k not in ("task", "n", "seed", "params")}
        return cls(info.get("task", ""), examples, info.get("params", {}), info.get("seed", 0), summary)


def dumps(value: Any) -> str:
    return json.dumps(value, default=json_default, sort_keys=False)


def save_records(out: str | os.PathLike, images: Sequence[tuple[str, Image.Image]], records: Sequence[dict],
                 info: dict[str, Any], *, records_name: str = "meta.jsonl") -> Path:
    """Write images, the records (``meta.jsonl``, one JSON object per line) and ``dataset.json`` into ``out``
    through a temporary directory.

    Raises:
        StimulusError: ``out`` exists and is not a directory, or cannot be written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StimulusError(f"output path {str(out)!r} exists and is not a directory; choose another --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise StimulusError(f"cannot write to {str(out)!r}: {exc.strerror}; choose a writable --out") from exc
    try:
        (tmp / "images").mkdir()
        for name, image in images:
            image.save(tmp / "images" / f"{name}.png", format="PNG")
        (tmp / records_name).write_text("".join(dumps(r) + "\n" for r in records), encoding="utf-8")
        (tmp / "dataset.json").write_text(json.dumps(info, default=json_default, indent=2) + "\n")
        out.mkdir(exist_ok=True)
        if (out / "images").exists():
            shutil.rmtree(out / "images")
        for name in ("images", records_name, "dataset.json"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_records(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if not (path / "meta.jsonl").is_file() or not (path / "dataset.json").is_file():
        raise StimulusError(f"{str(path)!r} is not a vlmbind stimuli directory (needs meta.jsonl and dataset.json)")
    try:
        info = json.loads((path / "dataset.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StimulusError(f"{str(path / 'dataset.json')!r} is not readable JSON ({exc}); regenerate the data "
                            "set") from None
    if not isinstance(info, dict):
        raise StimulusError(f"{str(path / 'dataset.json')!r} holds a JSON {type(info).__name__}, not an object; "
                            "regenerate the data set")
    records = []
    for lineno, line in enumerate((path / "meta.jsonl").read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StimulusError(f"{str(path / 'meta.jsonl')!r} line {lineno} is not JSON ({exc.msg}); regenerate "
                                "the data set") from None
        if not isinstance(record, dict) or "id" not in record:
            raise StimulusError(f"{str(path / 'meta.jsonl')!r} line {lineno} is not a record with an 'id'; it is "
                                "not a file vlmbind wrote")
        records.append(record)
    return info, records


# ------------------------------------------------------------------------------------------------------------------
# Objects and a model's image tokens
# ------------------------------------------------------------------------------------------------------------------
def object_token_positions(index: Any, objects: Sequence[SceneObject], image: int = 0,
                           min_overlap: float = 0.0) -> list[np.ndarray]:
    """The image-token positions each object covers, from a prepared batch row's TokenIndex.

    Args:
        index: the :class:`~vlmbind.core.tokens.TokenIndex` of the row holding the example's image.
        objects: the example's objects.
        image: which image of the row.
        min_overlap: keep tokens whose box overlaps the object's box by more than this share of the token's area.

    Returns:
        One sorted position array per object (every grid of the image: low- and high-res, base and tiles).
    """
    return [index.positions_covering(o.box, image=image, min_overlap=min_overlap) for o in objects]


def object_tokens(vlm: Any, example: Example, min_overlap: float = 0.0) -> list[list[dict[str, Any]]]:
    """For each object of ``example``, the image tokens it covers in ``vlm``'s grids: grid name, row, col and the
    sequence position when the example's own prompt is used."""
    batch = vlm.prepare(example.image, example.prompt)
    ti = batch.index[0]
    out = []
    for positions in object_token_positions(ti, example.objects, min_overlap=min_overlap):
        cells = []
        for p in positions:
            grid, img, r, c = ti.cell(int(p))
            cells.append({"grid": grid, "image": img, "row": r, "col": c, "position": int(p)})
        out.append(cells)
    return out
