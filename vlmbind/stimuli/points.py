"""Points in generated text: the Point-to-Answer format and a robust parser for it and the real models' formats.

Design: one format is written, several are read. The stimuli write points as ``(x, y)`` pairs separated by single
spaces, followed by the answer (``(3, 1) (0, 4) 2``); integers print as integers and floats with Python's shortest
round-tripping ``repr``, so formatting then parsing gives the same numbers back. The parser reads that style (also
``(x,y)``, extra spaces, signs, decimals, exponents) and the tags Molmo models emit: Molmo's ``<point x=".." y="..">``
and ``<points x1=".." y1=".." x2=".." ...>`` (percent of the image) and Molmo2's
``<points coords="[frame] idx x y idx x y ...">`` (per-mille, frame groups separated by ``;``), Qwen2-VL's boxes
``<|box_start|>(x0,y0),(x1,y1)<|box_end|>`` (0-1000; one point, the box centre) and Qwen2.5-VL's JSON objects
``{"point_2d": [x, y], ...}`` / ``{"bbox_2d": [x0, y0, x1, y1], ...}`` (the box centre) and InternVL's grounding boxes
``<ref>label</ref><box>[[x0, y0, x1, y1], ...]</box>`` (0-1000; each box's centre) and GLM-4.1V / GLM-4.6V's
``<|begin_of_box|>[x0, y0, x1, y1]<|end_of_box|>`` (0-1000, one box or a list of them; each box's centre). Points
come back in order of appearance, in the coordinate frame of the text; :func:`pointing_spans` names each span's
format, and :mod:`vlmbind.stimuli.answers` converts formats to the stimulus canvas.
Parsing scans the text once with a regular expression that has no nested quantifiers, so it stays linear on hostile
input and never raises: anything that is not a complete point (an unbalanced parenthesis, ``(a, b)``, a lone
number, a tag without both coordinates, a non-finite value) is skipped. Text inside a ``<point>..</point>`` element is
its label, not a point. :func:`parse_count` and :func:`parse_yes_no` read the answer that follows the points.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from numbers import Integral, Real
from typing import NamedTuple

from .core import StimulusError

__all__ = ["NO_POINTS", "POINT_FORMATS", "PointSpan", "format_points", "p2a_text", "parse_points", "parse_count",
           "parse_yes_no", "point_spans", "pointing_spans"]

# What a Point-to-Answer trace says when there is nothing to point at (visual search, target absent).
NO_POINTS = "none"

# A decimal number: the integer part has no optional digits after it, so the engine never backtracks quadratically.
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_TAG = r"<(?P<tag>points?)\b(?P<attrs>[^<>]*)>(?:[^<]*</(?P=tag)\s*>)?"
_TUPLE = rf"\(\s*(?P<x>{_NUM})\s*,\s*(?P<y>{_NUM})\s*\)"
_BOX = (rf"<\|box_start\|>\s*\(\s*(?P<bx0>{_NUM})\s*,\s*(?P<by0>{_NUM})\s*\)\s*,?\s*"
        rf"\(\s*(?P<bx1>{_NUM})\s*,\s*(?P<by1>{_NUM})\s*\)\s*<\|box_end\|>")
# InternVL: one or more [x0, y0, x1, y1] lists inside <box>..</box> (no nested tags, so the scan stays linear)
_IBOX = r"<box>(?P<ibox>[^<>]*)</box>"
# GLM: one box [x0, y0, x1, y1] or a list of them between <|begin_of_box|> and <|end_of_box|>
_GBOX = r"<\|begin_of_box\|>(?P<gbox>[^<>]*)<\|end_of_box\|>"
_IBOX_ITEM = re.compile(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\]")
# a flat JSON object naming point_2d or bbox_2d (the lookahead stops at the next brace, so the scan stays linear)
_JSON = r"""\{(?=[^{}]*["'](?:point_2d|bbox_2d)["'])(?P<json>[^{}]*)\}"""
_JSON_KEY = re.compile(rf"""["'](?P<key>point_2d|bbox_2d)["']\s*:\s*\[(?P<values>[^\[\]]*)\]""")
_SCAN = re.compile(rf"{_BOX}|{_IBOX}|{_GBOX}|{_JSON}|{_TAG}|{_TUPLE}", re.IGNORECASE)
# what each format is, for messages and docs
POINT_FORMATS = {
    "tuple": "(x, y) pairs (vlmbind's Point-to-Answer format)",
    "json": 'JSON objects with "point_2d": [x, y] or "bbox_2d": [x0, y0, x1, y1] (Qwen2.5-VL; a box gives its centre)',
    "box": "<|box_start|>(x0,y0),(x1,y1)<|box_end|> (Qwen2-VL; the box centre)",
    "molmo": '<point x=".." y=".."> and <points x1=".." y1=".." ...> (Molmo)',
    "molmo2": '<points coords="[frame] idx x y ..."> (Molmo2)',
    "internvl": "<ref>label</ref><box>[[x0, y0, x1, y1], ...]</box> (InternVL; each box's centre)",
    "glm": "<|begin_of_box|>[x0, y0, x1, y1]<|end_of_box|> (GLM-4.1V / GLM-4.6V; each box's centre)",
}
_ATTR = re.compile(r"""([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|'([^']*)')""")
_INDEXED = re.compile(r"([xy])(\d+)", re.IGNORECASE)
_NUMBER = re.compile(_NUM)
_INTEGER = re.compile(r"(?<![\w.])\d+(?!\w|\.\d)")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def _format_number(value: object) -> str:
    """An int as an int, a float by its shortest round-tripping repr; anything else is an error."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise StimulusError(f"a point coordinate must be a real number, got {value!r}")
    if isinstance(value, Integral):
        return str(int(value))
    v = float(value)
    if not math.isfinite(v):
        raise StimulusError(f"a point coordinate must be finite, got {v!r}")
    return repr(v)


def format_points(points: Iterable[Sequence[float]]) -> str:
    """Points in the Point-to-Answer style: ``(x, y) (x, y) ...``; the empty string for no points.

    Args:
        points: ``(x, y)`` pairs (ints or finite floats; numpy scalars are fine).

    Returns:
        The pairs, each ``(x, y)``, separated by single spaces.

    Raises:
        StimulusError: a point that is not a pair of finite real numbers.
    """
    parts = []
    for p in points:
        if len(p) != 2:
            raise StimulusError(f"a point must be an (x, y) pair, got {p!r}")
        parts.append(f"({_format_number(p[0])}, {_format_number(p[1])})")
    return " ".join(parts)


def p2a_text(points: Sequence[Sequence[float]], answer: str) -> str:
    """A Point-to-Answer target: the points, then the answer; :data:`NO_POINTS` stands in for an empty list.

    Example: ``p2a_text([(3, 1)], "yes") == "(3, 1) yes"`` and ``p2a_text([], "no") == "none no"``.
    """
    return f"{format_points(points) if len(points) else NO_POINTS} {answer}"


def _finite_pair(x: str, y: str) -> tuple[float, float] | None:
    try:
        fx, fy = float(x), float(y)
    except ValueError:  # cannot happen for _NUM matches; kept so parsing never raises
        return None
    return (fx, fy) if math.isfinite(fx) and math.isfinite(fy) else None


def _tag_points(attrs: str) -> list[tuple[float, float]]:
    """Points of one Molmo tag's attribute string, in the tag's own order."""
    values: dict[str, str] = {}
    for name, dq, sq in _ATTR.findall(attrs):
        values.setdefault(name.lower(), dq if dq or not sq else sq)
    out: list[tuple[float, float]] = []
    if "coords" in values:  # Molmo2
        return [p for _, _, p in _molmo2_triples(values["coords"])]
    if "x" in values and "y" in values:  # Molmo: <point x=".." y="..">
        xs, ys = _NUMBER.fullmatch(values["x"].strip()), _NUMBER.fullmatch(values["y"].strip())
        p = _finite_pair(xs.group(), ys.group()) if xs and ys else None
        return [p] if p is not None else []
    indexed: dict[int, dict[str, str]] = {}  # Molmo: <points x1=".." y1=".." x2=".." ...>
    for name, value in values.items():
        m = _INDEXED.fullmatch(name)
        if m and len(m.group(2)) < 10:
            indexed.setdefault(int(m.group(2)), {})[m.group(1).lower()] = value.strip()
    for k in sorted(indexed):
        xy = indexed[k]
        xs, ys = _NUMBER.fullmatch(xy.get("x", "")), _NUMBER.fullmatch(xy.get("y", ""))
        p = _finite_pair(xs.group(), ys.group()) if xs and ys else None
        if p is not None:
            out.append(p)
    return out


class PointSpan(NamedTuple):
    """One point-bearing span of generated text.

    Attributes:
        start, end: character offsets of the span (a tag element with its label and closing tag; a whole JSON
            object).
        parts: for a span with several points whose characters can be told apart (Molmo2's ``idx x y`` triples),
            each point's ``(start, end)``; None otherwise.
        format: a key of :data:`POINT_FORMATS`.
        points: the span's points in the format's own frame (a box gives its centre).
    """

    start: int
    end: int
    format: str
    points: list[tuple[float, float]]
    parts: list[tuple[int, int]] | None = None  # per point, its own characters (Molmo2 triples), where known


def _centre(x0: str, y0: str, x1: str, y1: str) -> list[tuple[float, float]]:
    a, b = _finite_pair(x0, y0), _finite_pair(x1, y1)
    return [((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)] if a is not None and b is not None else []


def _json_points(body: str) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for m in _JSON_KEY.finditer(body):
        nums = [v.strip() for v in m.group("values").split(",")]
        if not all(_NUMBER.fullmatch(v) for v in nums):
            continue
        if m.group("key").lower() == "point_2d" and len(nums) == 2:
            p = _finite_pair(*nums)
            out.extend([p] if p is not None else [])
        elif m.group("key").lower() == "bbox_2d" and len(nums) == 4:
            out.extend(_centre(*nums))
    return out


def _molmo2_triples(coords: str) -> list[tuple[int, int, tuple[float, float]]]:
    """``(start, end, point)`` of each finite ``idx x y`` triple of a Molmo2 ``coords`` value (offsets into it):
    groups ``[frame] idx x y idx x y ...`` separated by ``;``, a group whose count does not fit skipped."""
    out, cursor = [], 0
    for group in coords.split(";"):
        nums = list(_NUMBER.finditer(group))
        start = 1 if len(nums) % 3 == 1 else 0  # a leading frame / image index
        if (len(nums) - start) % 3 == 0:
            for k in range(start, len(nums), 3):
                p = _finite_pair(nums[k + 1].group(), nums[k + 2].group())
                if p is not None:
                    out.append((cursor + nums[k].start(), cursor + nums[k + 2].end(), p))
        cursor += len(group) + 1
    return out


def _molmo2_parts(text: str, offset: int, attrs: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` in ``text`` of each point's triple in a Molmo2 tag whose attributes start at
    ``offset``."""
    m = re.search(r"""\bcoords\s*=\s*(?:"([^"]*)"|'([^']*)')""", attrs, re.IGNORECASE)
    if m is None:
        return []
    group = 1 if m.group(1) is not None else 2
    base = offset + m.start(group)
    return [(base + a, base + b) for a, b, _ in _molmo2_triples(m.group(group))]


def pointing_spans(text: str) -> list[PointSpan]:
    """Every point-bearing span of ``text`` with its format, in order of appearance; never raises.

    A plain ``(x, y)`` holds one point, a Qwen2-VL box or a JSON object one (its centre for a box), a Molmo tag
    element its points (possibly none when its attributes are incomplete).
    """
    spans: list[PointSpan] = []
    if not isinstance(text, str):
        return spans
    for m in _SCAN.finditer(text):
        if m.group("bx0") is not None:
            spans.append(PointSpan(m.start(), m.end(), "box",
                                   _centre(m.group("bx0"), m.group("by0"), m.group("bx1"), m.group("by1"))))
        elif m.group("ibox") is not None or m.group("gbox") is not None:
            group, fmt = ("ibox", "internvl") if m.group("ibox") is not None else ("gbox", "glm")
            base = m.start(group)
            items = [(base + b.start(), base + b.end(), _centre(*b.groups())) for b in
                     _IBOX_ITEM.finditer(m.group(group))]
            items = [(a, b, pts[0]) for a, b, pts in items if pts]
            spans.append(PointSpan(m.start(), m.end(), fmt, [pt for _, _, pt in items],
                                   [(a, b) for a, b, _ in items]))
        elif m.group("json") is not None:
            spans.append(PointSpan(m.start(), m.end(), "json", _json_points(m.group("json"))))
        elif m.group("tag") is not None:
            attrs = m.group("attrs")
            if re.search(r"\bcoords\s*=", attrs, re.IGNORECASE):
                points = _tag_points(attrs)
                parts = _molmo2_parts(text, m.start("attrs"), attrs)
                spans.append(PointSpan(m.start(), m.end(), "molmo2", points,
                                       parts if len(parts) == len(points) else None))
            else:
                spans.append(PointSpan(m.start(), m.end(), "molmo", _tag_points(attrs)))
        else:
            p = _finite_pair(m.group("x"), m.group("y"))
            spans.append(PointSpan(m.start(), m.end(), "tuple", [p] if p is not None else []))
    return spans


def point_spans(text: str) -> list[tuple[int, int, list[tuple[float, float]]]]:
    """Every point-bearing span of ``text``: ``(start, end, points)`` in order of appearance (see
    :func:`pointing_spans`, which also names the format)."""
    return [(s.start, s.end, s.points) for s in pointing_spans(text)]


def parse_points(text: str) -> list[tuple[float, float]]:
    """All points in ``text``, in order of appearance; never raises.

    Args:
        text: generated text: the plain ``(x, y)`` style, Molmo ``<point>`` / ``<points>`` tags, or a mixture, with
            any other text around them.

    Returns:
        ``(x, y)`` float pairs in the text's own coordinate frame; an empty list when there are none.
    """
    return [p for _, _, pts in point_spans(text) for p in pts]


def _after_points(text: str) -> str:
    """The text after the last point-bearing span (all of it when there is none)."""
    spans = point_spans(text)
    return text[spans[-1][1]:] if spans else text


def parse_count(text: str) -> int | None:
    """The final integer after the points (``(1, 2) (3, 4) 2`` -> 2; ``7`` -> 7), or None; never raises.

    Only digits count (no number words); a decimal such as ``2.5`` is not a count, a trailing full stop is fine.
    """
    if not isinstance(text, str):
        return None
    found = _INTEGER.findall(_after_points(text))
    for digits in reversed(found):
        try:
            return int(digits)
        except ValueError:  # more digits than Python converts: not a count
            continue
    return None


def parse_yes_no(text: str) -> str | None:
    """The first standalone ``yes`` or ``no`` after the points, lower-cased, or None; never raises.

    ``none no`` -> ``"no"`` (``none`` is not ``no``); ``(2, 5) yes`` -> ``"yes"``.
    """
    if not isinstance(text, str):
        return None
    m = _YES_NO.search(_after_points(text))
    return m.group(1).lower() if m else None
