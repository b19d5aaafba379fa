"""Atomic file writing: a reader never sees a half-written file, and a failed write leaves the old file intact."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError


def write_bytes_atomic(data: bytes, path: str | os.PathLike) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file in the same directory, synced, then ``os.replace``).

    The parent directory is created if needed. On failure the temporary file is removed and any previous file at
    ``path`` is left untouched.

    Args:
        data: the bytes to write.
        path: the destination file.

    Returns:
        The destination as a :class:`~pathlib.Path`.

    Raises:
        InputError: ``path`` is an existing directory.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
    return Path(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to ``path`` for a writer that takes a file name (e.g. safetensors' ``save_file``); on
    a clean exit it is synced and renamed onto ``path``, on an error removed (``path`` is left untouched)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"cannot write {str(path)!r}: it is a directory; pass a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Refuse an output directory that cannot be created or written, before any work is done; creates nothing.

    A command checks its ``--out`` with this first, so a bad path fails in a second with a named error instead of
    after a long run (and leaves no partial output behind).

    Args:
        path: the output directory (it may not exist yet).
        flag: the option name shown in the message.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        InputError: ``path`` is an existing file, a folder above it is a file, or the nearest existing folder above
            it is not writable.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {str(path)!r} is an existing file; pass a directory (it is created if missing)")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{flag} {str(path)!r} cannot be created: {str(existing)!r} is a file, not a directory; "
                         f"pass another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {str(path)!r} is not writable: {str(existing)!r} is read-only; pass another {flag}")
    return path


def _remove_quietly(path: str) -> None:
    """Remove a leftover temporary file; a file that is already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically (see :func:`write_bytes_atomic`)."""
    return write_bytes_atomic(text.encode("utf-8"), path)


def write_json_atomic(value: Any, path: str | os.PathLike, indent: int | None = 2) -> Path:
    """Write ``value`` as JSON (indented unless ``indent`` is None) to ``path`` atomically."""
    return write_text_atomic(json.dumps(value, indent=indent, default=json_default) + "\n", path)


def write_jsonl_atomic(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write one JSON object per line to ``path`` atomically."""
    return write_text_atomic("".join(json.dumps(r, default=json_default) + "\n" for r in records), path)


def json_default(value: Any) -> Any:
    """JSON for numpy scalars and arrays (``json.dumps(..., default=json_default)``)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
