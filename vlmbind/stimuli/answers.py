"""Reading real answers: what a checkpoint writes, read the way a person would, and its points put on the canvas.

An Instruct model does not answer ``green triangle``; it writes ``Green triangle.``, ``The missing object is a green
triangle.``, ``**Three**``, ``There are 4 shapes: 1 red circle, ...`` or a JSON list of points. The readers here take
such text apart with fixed, documented rules (never raising):

* words are compared lower-cased, with punctuation, markdown emphasis and the articles *a*, *an*, *the* dropped,
  ``grey`` read as ``gray`` and a plural shape (``circles``, ``crosses``) as its singular;
* every point-bearing span (:func:`~vlmbind.stimuli.points.pointing_spans`: tuples, Qwen2.5-VL JSON, Qwen2-VL boxes,
  Molmo and Molmo2 tags, InternVL boxes) is cut out before a count or a yes / no is read, so a coordinate or a label such as
  ``"circle 2"`` is never taken for the answer;
* :func:`read_scene`: the first colour word directly followed by a shape word;
* :func:`read_query`: the first word of the expected answer's kind (a colour, a shape or a letter);
* :func:`read_count`: a number marked as the total (``a total of 3``, ``3 in total``, ``total: 3``, ``the answer is
  3``; the last such) if there is one, else the first number; digits or the words ``zero`` to ``twenty``
  (``none`` and ``a single`` count too); a decimal is never a count;
* :func:`read_yes_no`: the first standalone *yes* or *no*.

Points are converted from their format's frame into stimulus canvas cells (x = column, y = row, cell centres at
integers) through the original image's pixels (see :data:`FRAMES`). Four formats say their frame themselves
(Qwen2-VL boxes, Molmo2 tags and InternVL boxes are per-mille of the image, Molmo tags percent); plain ``(x, y)``
tuples are canvas cells only for a model trained on vlmbind's Point-to-Answer format, and JSON points are in the
pixels of the image the processor resized (Qwen2.5-VL); a model family declares the frames it writes, and a frame nobody declared is
``None``: :func:`to_canvas` then refuses with :class:`UnknownFrameError` instead of returning a number.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.choices import FRAMES
from ..core.errors import InputError
from .core import COLOURS, LETTERS, SHAPES
from .points import POINT_FORMATS, PointSpan, pointing_spans

__all__ = [
    "ARTICLES", "FRAMES", "NUMBER_WORDS", "SELF_DESCRIBING", "UnknownFrameError", "answer_words", "canvas_geometry",
    "frames_for", "pixels_to_cells",
    "read_count", "read_query", "read_scene", "read_yes_no", "strip_points", "to_canvas", "SCORERS", "SCORER_RULES",
    "score_text",
]

ARTICLES = frozenset({"a", "an", "the"})
NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
NUMBER_WORDS.update({"none": 0, "single": 1})
SPELLINGS = {"grey": "gray"}

# formats whose frame is part of the format, whatever model wrote them
SELF_DESCRIBING = {"box": "permille", "molmo": "percent", "molmo2": "permille", "internvl": "permille",
                   "glm": "permille"}

_WORD = re.compile(r"[a-z]+|\d+(?:\.\d+)?")
# a count: whole digits (never part of a decimal such as 2.5) or a number word
_COUNT = r"(?:(?<![\d.])\d+(?!\d|\.\d)|" + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True)) + ")"
_TOTAL = re.compile(
    r"(?:\btotal(?:\s+(?:of|is|count(?:\s+is)?|number(?:\s+is)?))?\s*[:=]?\s*|\banswer(?:\s+is)?\s*[:=]?\s*)"
    rf"(?P<a>{_COUNT})\b|\b(?P<b>{_COUNT})\s+(?:[a-z]+\s+){{0,3}}in\s+total\b")


class UnknownFrameError(InputError):
    """Points in a format whose coordinate frame the model family does not declare."""


def answer_words(text: str) -> list[str]:
    """``text`` as lower-case words and numbers, punctuation and markdown dropped, articles removed, ``grey`` as
    ``gray`` and plural shape names singular."""
    if not isinstance(text, str):
        return []
    out = []
    for w in _WORD.findall(text.lower()):
        if w in ARTICLES:
            continue
        w = SPELLINGS.get(w, w)
        if w not in SHAPES:
            for suffix in ("es", "s"):
                if w.endswith(suffix) and w[: -len(suffix)] in SHAPES:
                    w = w[: -len(suffix)]
                    break
        out.append(w)
    return out


def strip_points(text: str) -> str:
    """``text`` with every point-bearing span, Qwen's object-reference markers and code fences replaced by spaces."""
    if not isinstance(text, str):
        return ""
    pieces, cursor = [], 0
    for span in pointing_spans(text):
        pieces.append(text[cursor : span.start])
        cursor = span.end
    pieces.append(text[cursor:])
    out = " ".join(pieces)
    out = re.sub(r"<\|object_ref_(?:start|end)\|>|</?ref>|```(?:json)?", " ", out)
    return out


def _number(word: str) -> int | None:
    if word.isdigit():
        return int(word) if len(word) < 10 else None
    return NUMBER_WORDS.get(word)


def read_count(text: str) -> int | None:
    """The count an answer gives (see the module docstring), or None."""
    plain = strip_points(text).lower()
    plain = re.sub(r"[*_#`]", " ", plain)
    marked = [_number(m.group("a") or m.group("b")) for m in _TOTAL.finditer(plain)]
    marked = [n for n in marked if n is not None]
    if marked:
        return marked[-1]
    # "a single" reads as 1 only with its article; a lone "single" is an adjective
    plain = re.sub(r"\ba\s+single\b", " one ", plain)
    for w in _WORD.findall(plain):
        if "." in w or w == "single":
            continue
        n = _number(w)
        if n is not None:
            return n
    return None


def read_yes_no(text: str) -> str | None:
    """The first standalone ``yes`` or ``no`` outside the points, lower-cased, or None."""
    m = re.search(r"\b(yes|no)\b", strip_points(text), re.IGNORECASE)
    return m.group(1).lower() if m else None


def read_scene(text: str, colours: Iterable[str] = (), shapes: Iterable[str] = ()) -> str | None:
    """``"colour shape"``: the first colour word directly followed by a shape word, or None.

    ``colours`` and ``shapes`` add to the stimuli's own names (a data set with its own words passes them).
    """
    colour_set = set(COLOURS) | {c.lower() for c in colours}
    shape_set = set(SHAPES) | {s.lower() for s in shapes}
    words = answer_words(strip_points(text))
    for a, b in zip(words, words[1:]):
        if a in colour_set and b in shape_set:
            return f"{a} {b}"
    return None


def read_query(text: str, expected: str) -> str | None:
    """The first word of the expected answer's kind (colour, shape or letter), or None; for any other expected
    word, the answer's first word."""
    words = answer_words(strip_points(text))
    target = (answer_words(expected) or [""])[0]
    for kind in (set(COLOURS), set(SHAPES), {x.lower() for x in LETTERS}):
        if target in kind:
            return next((w for w in words if w in kind), None)
    return words[0] if words else None


def frames_for(declared: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """The frame of every point format: the self-describing ones, then what a family or the user ``declared``."""
    frames: dict[str, str | None] = {f: None for f in POINT_FORMATS}
    frames.update(SELF_DESCRIBING)
    for fmt, frame in (declared or {}).items():
        if fmt not in POINT_FORMATS:
            raise InputError(f"unknown point format {fmt!r}; formats: {', '.join(POINT_FORMATS)}")
        if frame is not None and frame not in FRAMES:
            raise InputError(f"unknown coordinate frame {frame!r} for {fmt}; frames: {', '.join(FRAMES)}")
        frames[fmt] = frame
    return frames


def canvas_geometry(canvas: Any) -> tuple[float, int, int]:
    """``(image_size, rows, cols)`` of a Canvas or its dict form."""
    if isinstance(canvas, Mapping):
        grid = canvas["grid"]
        size = float(canvas["image_size"])
    else:
        grid, size = canvas.grid, float(canvas.image_size)
    rows, cols = (grid, grid) if isinstance(grid, int) else (int(grid[0]), int(grid[1]))
    return size, int(rows), int(cols)


def pixels_to_cells(px: Any, py: Any, canvas: Any) -> tuple[Any, Any]:
    """Canvas pixels -> canvas cells (x = column, y = row, cell centres at integers); numbers or arrays."""
    size, rows, cols = canvas_geometry(canvas)
    return px / (size / cols) - 0.5, py / (size / rows) - 0.5


def to_canvas(spans: Sequence[PointSpan], frames: Mapping[str, str | None], canvas: Any, *,
              image_size: tuple[int, int] | None = None,
              resized_size: tuple[int, int] | None = None) -> list[tuple[float, float]]:
    """The spans' points in canvas cells.

    Args:
        spans: from :func:`~vlmbind.stimuli.points.pointing_spans`.
        frames: format -> frame (:func:`frames_for`); a format mapped to None has no known frame.
        canvas: the stimulus canvas (a :class:`~vlmbind.stimuli.Canvas` or its dict).
        image_size: ``(width, height)`` of the image the model saw before processing (default: the canvas').
        resized_size: ``(width, height)`` the processor resized it to (needed for the ``resized`` frame).

    Raises:
        UnknownFrameError: a span whose format has no frame, or a ``resized`` frame without ``resized_size``.
    """
    size, _, _ = canvas_geometry(canvas)
    width, height = image_size if image_size is not None else (size, size)
    out = []
    for span in spans:
        frame = frames.get(span.format)
        if frame is None:
            raise UnknownFrameError(
                f"points written as {POINT_FORMATS[span.format]} have no known coordinate frame for this model "
                f"(first: {span.points[0] if span.points else 'none'}); pass the frame explicitly (--point-frame "
                f"{'|'.join(FRAMES)})")
        if frame == "resized" and resized_size is None:
            raise UnknownFrameError("points in the resized image's pixels need the processed image size")
        for x, y in span.points:
            if frame == "canvas":
                out.append((float(x), float(y)))
                continue
            if frame == "pixels":
                px, py = x, y
            elif frame == "resized":
                px, py = x * width / resized_size[0], y * height / resized_size[1]
            elif frame == "permille":
                px, py = x / 1000 * width, y / 1000 * height
            else:  # percent
                px, py = x / 100 * width, y / 100 * height
            # original pixels -> canvas pixels (the canvas is the original image) -> cells
            cx, cy = pixels_to_cells(px * size / width, py * size / height, canvas)
            out.append((float(cx), float(cy)))
    return out


# how a user's task file scores an answer against its expected answer and accepted alternatives
SCORERS = ("starts_with", "exact", "first_word", "contains", "number")
SCORER_RULES = {
    "starts_with": "the answer's words begin with an expected answer's words (the default)",
    "exact": "the answer's words are an expected answer's words",
    "first_word": "the answer's first word is an expected answer's first word",
    "contains": "an expected answer's words occur together anywhere in the answer",
    "number": "the count the answer gives (read_count) is an expected number",
}


def score_text(scorer: str, output: str, expected: list[str]) -> tuple[bool, Any]:
    """Whether ``output`` matches one of the ``expected`` answers under ``scorer`` (:data:`SCORER_RULES`; words as
    :func:`answer_words` reads them: case, punctuation, markdown and articles ignored), and what was read."""
    if scorer == "number":
        got = read_count(output)
        return got is not None and got in {read_count(e) for e in expected}, got
    words = answer_words(output)
    wanted = [answer_words(e) for e in expected]
    if scorer == "starts_with":
        ok = any(w and words[: len(w)] == w for w in wanted)
    elif scorer == "exact":
        ok = any(w and words == w for w in wanted)
    elif scorer == "first_word":
        ok = any(w and words[:1] == w[:1] for w in wanted)
    elif scorer == "contains":
        ok = any(w and any(words[i : i + len(w)] == w for i in range(len(words) - len(w) + 1)) for w in wanted)
    else:
        raise ValueError(f"unknown scorer {scorer!r}; scorers: {', '.join(SCORERS)}")
    return ok, " ".join(words)
