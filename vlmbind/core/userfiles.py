"""Every file a user hands to vlmbind, read and checked in one place.

A scores table, a saved result, a model folder's JSON, an image: each reader here either returns checked content or
raises :class:`UserFileError` (an :class:`~vlmbind.core.errors.InputError`, so the CLI prints one line and exits 2)
whose message names the file, the row or field and the bad value, and says what to pass instead. Nothing is unpickled;
JSON and CSV are parsed as text.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import InputError
from .images import read_image
from .text import read_utf8_text

__all__ = ["SCORE_COLUMNS", "UserFileError", "read_csv_columns", "read_image", "read_json_object", "read_scores",
           "read_utf8_text", "located_summary", "require_keys", "same_model", "scores_context", "scores_model"]

SCORE_COLUMNS = ("layer", "head", "score")
_INTEGER = re.compile(r"[+]?\d+(?:\.0*)?")


class UserFileError(InputError):
    """A file handed in by the user that is missing, unreadable or holds a bad value."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def read_json_object(path: str | os.PathLike, what: str = "") -> dict[str, Any]:
    """A JSON object from ``path`` (``what``: how the user named it, e.g. ``--reference``).

    Raises:
        UserFileError: missing, unreadable, not JSON, or not an object.
    """
    name = f"{what} {str(path)!r}".strip()
    try:
        value = json.loads(read_utf8_text(path, name, UserFileError))
    except FileNotFoundError:
        raise UserFileError(f"{name} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UserFileError(f"cannot read {name} as JSON ({_first_line(exc)}); re-run the command that wrote it"
                            ) from None
    if not isinstance(value, dict):
        raise UserFileError(f"{name} holds a JSON {type(value).__name__}, not an object; it is not a vlmbind file")
    return value


def require_keys(data: dict[str, Any], keys: tuple[str, ...], path: str | os.PathLike) -> None:
    """Raise UserFileError naming ``path`` when ``data`` lacks one of ``keys``."""
    missing = [k for k in keys if k not in data]
    if missing:
        raise UserFileError(f"{str(path)!r} has no key(s) {missing}; it is not the file vlmbind wrote")


def read_csv_columns(path: str | os.PathLike, columns: Sequence[str], what: str = "",
                     text_columns: Sequence[str] = (), nullable: Sequence[str] | None = None) -> pd.DataFrame:
    """A CSV with (at least) ``columns``, floats parsed exactly as written, ``text_columns`` kept as text (head
    labels such as ``2.10`` are not numbers).

    Args:
        nullable: given, only these columns may hold missing values (an empty cell); every other cell is read as
            written, so a decoded token ``nan``, ``null`` or ``""`` stays text.

    Raises:
        UserFileError: missing, unreadable, not CSV, or a column missing.
    """
    name = f"{what} {str(path)!r}".strip()
    missing_values: dict[str, Any] = ({} if nullable is None else
                                      {"keep_default_na": False, "na_values": {c: [""] for c in nullable}})
    try:
        # round_trip: the parsed floats are exactly the written ones (hover texts show repr())
        frame = pd.read_csv(io.StringIO(read_utf8_text(path, name, UserFileError)), float_precision="round_trip",
                            dtype={c: str for c in text_columns}, **missing_values)
    except FileNotFoundError:
        raise UserFileError(f"{name} does not exist") from None
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise UserFileError(f"cannot read {name} as CSV ({_first_line(exc)}); re-run the command that wrote it"
                            ) from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserFileError(f"{name} has no column(s) {missing} (its header: {list(frame.columns)[:8]}); it is not "
                            f"the file vlmbind wrote")
    return frame


def located_summary(path: str | os.PathLike) -> dict[str, Any]:
    """The ``summary.json`` vlmbind locate writes beside its ``scores.csv`` (``path``), as a dict; empty for a table
    without a readable one (made by hand or elsewhere)."""
    try:
        data = json.loads(Path(path).with_name("summary.json").read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def scores_context(path: str | os.PathLike, key: str) -> str | None:
    """What a scores table was located with (``key``: ``model``, ``condition``, ``method``), from
    :func:`located_summary`; None where it does not say."""
    value = located_summary(path).get(key)
    return value if isinstance(value, str) and value else None


def scores_model(path: str | os.PathLike) -> str | None:
    """The model a scores table was located on (:func:`scores_context`)."""
    return scores_context(path, "model")


def same_model(a: str, b: str) -> bool:
    """Whether two ``--model`` values name the same model: equal, or two paths to one existing directory."""
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def read_scores(path: str | os.PathLike, *, n_layers: int | None = None, n_heads: int | None = None,
                what: str = "--scores") -> pd.DataFrame:
    """A head-scores table (``layer, head, score``, any further columns kept), every row checked.

    Line numbers in messages are the file's own (the header is line 1). Every message names ``what`` and the file
    and says what to pass instead.

    Args:
        path: a CSV such as the ``scores.csv`` vlmbind locate writes.
        n_layers, n_heads: the model's shape: with both, the table must give every head of the model once (a head
            outside it is an error naming its line, a missing one an error naming what the table covers).
        what: how the user passed the file (the flag), for messages.

    Raises:
        UserFileError: a missing or unreadable file, a missing column, no rows, a layer or head that is not a
            non-negative integer, a score that is not a finite number, a head listed twice, a head outside the
            model, or (with both counts) a head of the model missing.
    """
    name = f"{what} {str(path)!r}"
    fix = "run vlmbind locate on this --model and pass the scores.csv it writes"
    p = Path(path)
    if not p.is_file():
        raise UserFileError(f"{name} {'is not a file' if p.exists() else 'does not exist'}; {fix}")
    try:
        text = read_utf8_text(p, name, UserFileError)
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skipinitialspace=True)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise UserFileError(f"{name} is not a readable CSV ({_first_line(exc)}); {fix}") from None
    missing = [c for c in SCORE_COLUMNS if c not in frame.columns]
    if missing:
        raise UserFileError(f"{name} has no column(s) {', '.join(missing)} (its header: {list(frame.columns)[:8]}); "
                            f"{fix}")
    if frame.empty:
        raise UserFileError(f"{name} has a header but no rows; {fix}")
    layers, heads, scores, seen = [], [], [], {}
    for i, (layer, head, score) in enumerate(zip(frame["layer"], frame["head"], frame["score"])):
        line = i + 2
        for column, value in (("layer", layer), ("head", head)):
            if not _INTEGER.fullmatch(value.strip()):
                raise UserFileError(f"{name} line {line}: {column} {value!r} is not a non-negative integer; {fix}")
        l, h = int(float(layer)), int(float(head))
        try:
            s = float(score)
        except ValueError:
            s = math.nan
        if not math.isfinite(s):
            raise UserFileError(f"{name} line {line}: score {score!r} is not a finite number; {fix}")
        if (l, h) in seen:
            raise UserFileError(f"{name} line {line}: head {l}.{h} is listed again (first on line {seen[l, h]}); "
                                f"{fix}")
        seen[l, h] = line
        layers.append(l), heads.append(h), scores.append(s)
    _check_shape(name, seen, n_layers, n_heads, fix)
    out = frame.copy()
    out["layer"], out["head"], out["score"] = layers, heads, scores
    for column in out.columns.difference(SCORE_COLUMNS):
        converted = pd.to_numeric(out[column], errors="coerce")
        if converted.notna().all():
            out[column] = converted
    return out.reset_index(drop=True)


def _check_shape(name: str, lines: dict[tuple[int, int], int], n_layers: int | None, n_heads: int | None,
                 fix: str) -> None:
    """Refuse a table (``lines``: head -> its line) with a head outside the model, or, given both counts, without
    every head of it; the message says what the table covers against the model's shape."""
    layers, heads = [l for l, _ in lines], [h for _, h in lines]
    covers = f"layers {min(layers)}..{max(layers)} x heads {min(heads)}..{max(heads)}"
    shape = f", the model has {n_layers} x {n_heads}" if n_layers is not None and n_heads is not None else ""
    for (l, h), line in lines.items():
        if n_layers is not None and not l < n_layers:
            raise UserFileError(f"{name} line {line}: layer {l} is outside the model (layers 0..{n_layers - 1}): "
                                f"the table covers {covers}{shape}; {fix}")
        if n_heads is not None and not h < n_heads:
            raise UserFileError(f"{name} line {line}: head {h} is outside the model (heads 0..{n_heads - 1}): the "
                                f"table covers {covers}{shape}; {fix}")
    if n_layers is None or n_heads is None:
        return
    absent = [f"{l}.{h}" for l in range(n_layers) for h in range(n_heads) if (l, h) not in lines]
    if absent:
        listed = ", ".join(absent[:4]) + (f" and {len(absent) - 4} more" if len(absent) > 4 else "")
        raise UserFileError(f"{name} covers {len(lines)} of the model's {n_layers * n_heads} heads: {covers}"
                            f"{shape} (missing {listed}); {fix}")
