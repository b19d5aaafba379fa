"""Users' text files (prompts, score tables, JSON) read as UTF-8 whatever the machine's locale, with a message that
names the file, the line and the byte when they were saved in another encoding."""

from __future__ import annotations

import codecs
import os
from pathlib import Path

from .errors import InputError


def read_utf8_text(path: str | os.PathLike, name: str, error: type[InputError] = InputError) -> str:
    """The text of a user's file read as UTF-8, whatever the machine's locale (a UTF-8 byte-order mark, as Windows
    editors write it, is dropped).

    Args:
        path: the file.
        name: how messages name it, e.g. ``--scores 'x.csv'``.
        error: the :class:`~vlmbind.core.errors.InputError` subclass to raise (``UserFileError``,
            ``StimulusError``, ...).

    Raises:
        error: the file is UTF-16 or another encoding (the message names the line and the byte, and says to save it
            as UTF-8).
        OSError: the file cannot be read (FileNotFoundError when it does not exist).
    """
    data = Path(path).read_bytes()
    fix = "save it as UTF-8 (the encoding in the editor's Save As dialog)"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise error(f"{name} is UTF-16 text, not UTF-8; {fix}")
    if b"\0" in data:  # text never holds NUL; UTF-16 without a byte-order mark does on every ASCII character
        raise error(f"{name} holds NUL bytes: it is UTF-16 text or not a text file; {fix}")
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line = data.count(b"\n", 0, exc.start) + 1
        column = len(data[line_start : exc.start].decode("utf-8")) + 1  # what precedes the first bad byte decodes
        raise error(f"{name} line {line} is not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}, e.g. "
                    f"Latin-1 or Windows-1252); {fix}") from None
