"""The JSON-lines files a person writes by hand (pairs, tasks): read as UTF-8, one object per line, every row checked
against its fields, and every error naming the file, the line and the field."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..core.errors import close_matches
from ..core.images import read_image
from ..core.text import read_utf8_text
from .core import StimulusError


class RowsFileError(StimulusError):
    """A hand-written JSON-lines file that cannot be read: the message names the file, the line and the field."""


def read_rows(file: Path, required: Sequence[str], error: type[StimulusError] = RowsFileError,
              name: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of every non-blank line of ``file`` (``name``: how the encoding message names it).

    Raises:
        error: the file is not UTF-8, a line is not JSON or not an object, or the file holds no rows.
    """
    text = read_utf8_text(file, name or str(file), error)
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{file} line {lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise error(f"{file} line {lineno}: a JSON {type(row).__name__}, not an object with the fields "
                        f"{', '.join(required)}")
        rows.append((lineno, row))
    if not rows:
        raise error(f"{name or file} has no records; write one JSON object per line")
    return rows


class Row:
    """One row's checked fields: each accessor raises ``error`` naming the file, the line and the field."""

    def __init__(self, file: Path, lineno: int, row: dict[str, Any], required: Sequence[str],
                 optional: Sequence[str], error: type[RowsFileError] = RowsFileError) -> None:
        self.file, self.lineno, self.row, self.error = file, lineno, row, error
        fields = (*required, *optional)
        unknown = sorted(set(row) - set(fields))
        if unknown:
            raise self.fail(unknown[0], f"not a field here.{close_matches(unknown[0], fields)} Fields: "
                                        f"{', '.join(fields)} (put your own data under 'meta')")
        for name in required:
            if name not in row:
                raise self.fail(name, "missing; every row needs " + ", ".join(required))

    def fail(self, name: str, what: str) -> RowsFileError:
        return self.error(f"{self.file} line {self.lineno}, field {name!r}: {what}")

    def text(self, name: str, default: str | None = None) -> str:
        value = self.row.get(name, default)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(name, f"must be a non-empty string, got {value!r}")
        return value

    def texts(self, name: str) -> list[str]:
        value = self.row.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise self.fail(name, f"must be a list of non-empty strings, got {value!r}")
        return list(value)

    def choice(self, name: str, choices: Sequence[str], default: str) -> str:
        value = self.row.get(name, default)
        if value not in choices:
            raise self.fail(name, f"{value!r} is not one of {', '.join(choices)}.{close_matches(str(value), choices)}")
        return value

    def image(self, name: str) -> Any:
        path = self.file.parent / self.text(name)
        if not path.is_file():
            raise self.fail(name, f"{self.row[name]!r} does not exist (paths are relative to {self.file.name}'s "
                                  "folder)")
        try:
            return read_image(path, self.error)
        except self.error as exc:
            raise self.fail(name, str(exc)) from None

    def mapping(self, name: str) -> dict[str, Any]:
        value = self.row.get(name, {})
        if not isinstance(value, dict):
            raise self.fail(name, f"must be a JSON object, got {type(value).__name__}")
        return dict(value)


def unique_ids(file: Path, ids: Sequence[tuple[int, str]], error: type[RowsFileError] = RowsFileError) -> None:
    """Refuse an id that repeats an earlier line's."""
    seen: dict[str, int] = {}
    for lineno, rid in ids:
        if rid in seen:
            raise error(f"{file} line {lineno}, field 'id': {rid!r} repeats line {seen[rid]}; give each row its own "
                        "id")
        seen[rid] = lineno


def rows_file(path: Path, name: str, error: Callable[[str], Exception]) -> Path:
    """The JSON-lines file ``path`` names: the file itself, or ``name`` inside a folder."""
    file = path / name if path.is_dir() else path
    if not file.is_file():
        where = f"{str(path)!r} holds no {name}" if path.is_dir() else f"{str(path)!r} does not exist"
        raise error(f"{where}; pass a folder holding {name} or the file itself")
    return file
