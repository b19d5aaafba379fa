"""Checks of arguments that need no model, shared by the analyses and the command line: an analysis runs them for
the Python API, a command runs them before it imports torch, and both say the same thing.

It imports only the standard library and other core modules, so a command that refuses an argument here answers at
once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from .choices import ABLATION_MODES, VALIDATION_METHODS
from .errors import InputError
from .sites import parse_heads


def check_head_list(heads: Any, *, flag: str | None = None, n_layers: int | None = None,
                    n_heads: int | None = None) -> list[tuple[int, int]]:
    """``[(layer, head), ...]`` from pairs or ``"12.3,14.0"``: at least one, each once, and, given the model's
    shape, every head inside it.

    Args:
        flag: the option the heads came from (``--heads``), named in the messages; None for the Python API.
        n_layers, n_heads: the model's shape (None: the range is checked once the model is loaded).

    Raises:
        InputError: a malformed head, no heads, a head outside the model, or a repeated head.
    """
    parsed = parse_heads(heads)
    if not parsed:
        if flag is not None:
            raise InputError(f"{flag} {heads!r} lists no heads; pass LAYER.HEAD pairs, e.g. 2.1,3.0")
        raise InputError("no heads given: pass LAYER.HEAD pairs, e.g. '2.1,3.0'")
    if n_layers is not None and n_heads is not None:
        bad = [f"{l}.{h}" for l, h in parsed if not (0 <= l < n_layers and 0 <= h < n_heads)]
        if bad:
            raise InputError(f"heads {bad} do not exist: the model has layers 0..{n_layers - 1} and heads "
                             f"0..{n_heads - 1}")
    repeated = sorted({f"{l}.{h}" for l, h in parsed if parsed.count((l, h)) > 1})
    if repeated:
        raise InputError(f"{flag + ': ' if flag else ''}heads {repeated} are given more than once; list each head "
                         "once")
    return parsed


def check_alphas(alphas: Any) -> list[float]:
    """Sorted distinct finite alphas from numbers or ``"0,1,2"``; alpha 0 is always included (the identity
    check and the baseline every change is measured from).

    Raises:
        InputError: a value that is not a finite number, or no values.
    """
    if isinstance(alphas, str):
        alphas = [a for a in alphas.split(",") if a.strip()]
    elif isinstance(alphas, (int, float)):
        alphas = [alphas]
    values = []
    for a in alphas:
        try:
            v = float(a)
        except (TypeError, ValueError):
            raise InputError(f"alpha {a!r} is not a number; pass e.g. --alpha 0,1,2,4") from None
        if not math.isfinite(v):
            raise InputError(f"alpha {a!r} is not finite; pass finite numbers, e.g. 0,1,2,4")
        values.append(v)
    if not values:
        raise InputError("no alphas given: pass e.g. --alpha 0,1,2,4")
    return sorted({0.0, *values})


def check_positive(**values: int) -> None:
    """Each value a positive whole number (numpy's integers included); the keyword names it in the message."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise InputError(f"{name} must be a positive int, got {v!r}")


def check_validation_methods(methods: Sequence[str], what: str = "methods") -> None:
    """The mediation methods of a validation: known, at least one, and ``exact`` beside ``naive`` (naive is checked
    against exact on a sample of heads). ``what`` names them in the message (``--methods`` on the command line).

    Raises:
        InputError: an unknown method, none, or naive without exact.
    """
    bad = [m for m in methods if m not in VALIDATION_METHODS]
    if bad or not methods:
        raise InputError(f"{what} {bad or '(none)'} are not among {VALIDATION_METHODS}")
    if "naive" in methods and "exact" not in methods:
        where = "the methods" if what == "methods" else what
        raise InputError(f"naive is checked against exact on a sample of heads: add exact to {where}")


def check_ablation_modes(modes: Sequence[str], what: str = "ablation modes") -> None:
    """Every mode one of :data:`~vlmbind.core.choices.ABLATION_MODES`.

    Raises:
        InputError: an unknown mode.
    """
    bad = [m for m in modes if m not in ABLATION_MODES]
    if bad:
        raise InputError(f"{what} {bad} are not among {ABLATION_MODES}")


def check_reference_conditions(conditions: Sequence[str], validated: Sequence[str]) -> None:
    """Every condition reference heads are given for is one the validation runs.

    Raises:
        InputError: a condition outside ``validated``.
    """
    unknown = sorted(set(conditions) - set(validated))
    if unknown:
        raise InputError(f"reference conditions {unknown} are not the conditions validated here: "
                         f"{', '.join(validated)}")


POSITION_CLASSES = ("all", "image", "text", "last", "patch")


def check_position_class(value: Any, *, flag: str | None = None) -> tuple[str, Any]:
    """A class of positions a path-patching edge starts or ends at, parsed: ``all`` (every position of the prompt),
    ``image`` (its image tokens), ``text`` (every other token), ``last`` (the scored token), ``patch`` (each pair's
    own patch positions), ``span:TEXT`` (the tokens of a text span, its last occurrence) or ``box:X0,Y0,X1,Y1`` (the
    image tokens covering a pixel box of the clean image).

    Returns:
        ``(kind, argument)``: the span's text, the box as four floats, or None.

    Raises:
        InputError: anything else.
    """
    text = str(value).strip()
    where = f"{flag} {value!r}" if flag else f"position class {value!r}"
    if text in POSITION_CLASSES:
        return text, None
    kind, _, rest = text.partition(":")
    if kind == "span" and rest:
        return "span", rest
    if kind == "box":
        parts = rest.split(",")
        try:
            box = tuple(float(p) for p in parts)
        except ValueError:
            box = ()
        if len(box) == 4 and box[0] < box[2] and box[1] < box[3]:
            return "box", box
        raise InputError(f"{where}: a box is box:X0,Y0,X1,Y1 in pixels of the clean image, with X0 < X1 and Y0 < Y1")
    raise InputError(f"{where} is not a position class: use one of {', '.join(POSITION_CLASSES)}, span:TEXT or "
                     "box:X0,Y0,X1,Y1")


def check_steer_target(value: Any, *, flag: str | None = None) -> tuple[str, Any]:
    """Where attention steering sends the heads, parsed: ``described`` (per scene, a uniformly drawn object the prompt
    names), ``distractor`` (one the answer is not about, or does not point at first), ``object:K`` (the scene's object
    K, 0-based in drawing order), ``cell:ROW,COL`` (a cell of the stimulus grid, 0-based) or ``box:X0,Y0,X1,Y1`` (a
    pixel box of the image).

    Returns:
        ``(kind, argument)``: None, the object index, the cell ``(row, col)`` or the box as four floats.

    Raises:
        InputError: anything else.
    """
    text = str(value).strip()
    where = f"{flag} {value!r}" if flag else f"steering target {value!r}"
    if text in ("described", "distractor"):
        return text, None
    kind, _, rest = text.partition(":")
    try:
        numbers_ = [float(p) for p in rest.split(",")] if rest else []
    except ValueError:
        numbers_ = []
    whole = all(float(v).is_integer() and v >= 0 for v in numbers_)
    if kind == "object" and len(numbers_) == 1 and whole:
        return "object", int(numbers_[0])
    if kind == "cell" and len(numbers_) == 2 and whole:
        return "cell", (int(numbers_[0]), int(numbers_[1]))
    if kind == "box" and len(numbers_) == 4 and numbers_[0] < numbers_[2] and numbers_[1] < numbers_[3]:
        return "box", tuple(numbers_)
    raise InputError(f"{where} is not a steering target: use described, distractor, object:K (K >= 0), cell:ROW,COL "
                     "(0-based) or box:X0,Y0,X1,Y1 (pixels, X0 < X1 and Y0 < Y1)")
