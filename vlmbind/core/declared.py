"""The rows ``vlmbind models`` lists (family, shape, image-token grids of the probe image, where the weights come
from), read from ``declared_models.json`` beside this module instead of building every model: building them all
imports torch and takes seconds, reading the file takes milliseconds.

The file is generated from the built models (``python scripts/declare_models.py``, through
:func:`vlmbind.app.commands.models.declarations`), and ``tests/app/test_cli.py`` checks that it equals what the
models give now. A shipped organism's row holds only while the organism's files it was computed from are unchanged
(:func:`fingerprint`): an organism shipped again after the file was written is described from its weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .shipped import ORGANISM_NAMES, organism_dir

DECLARED_FILE = Path(__file__).with_name("declared_models.json")
# the files of a shipped organism its row is computed from (not the weights, not the model card)
ORGANISM_INPUTS = ("config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json")


def fingerprint(name: str) -> str | None:
    """A digest of the files a shipped organism's row is computed from; None for the other registered names, whose
    rows follow from vlmbind's code alone."""
    if name not in ORGANISM_NAMES:
        return None
    digest = hashlib.sha256()
    for file in ORGANISM_INPUTS:
        path = organism_dir(name) / file
        digest.update(file.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return digest.hexdigest()


def declared_rows(probe_size: int, path: Path = DECLARED_FILE) -> dict[str, dict[str, Any]]:
    """``name -> row`` of every declared model whose row still holds: the file's probe image is ``probe_size``
    pixels square, and a shipped organism's files are those its row was computed from. A name missing here is to be
    described by building it; an unreadable file declares nothing."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(document, dict) or document.get("probe_size") != probe_size:
        return {}
    fingerprints = document.get("fingerprints", {})
    return {row["name"]: row for row in document.get("models", [])
            if fingerprints.get(row["name"]) == fingerprint(row["name"])}
