"""User images as a data set: a folder of PNG/JPEG files plus an optional JSONL of prompts; and a task file, the
images, prompts and answers a model is scored on (``vlmbind eval --data``, ``ablate --data``, :func:`load_task`).

The JSONL holds one object per line, ``{"image": "cat.png", "prompt": "...", "answer": "..."}`` (answer optional; other
keys are kept as metadata); without it every image gets ``default_prompt``. No object metadata is needed for capture,
RSA on patches or attention maps, so ``Example.objects`` is empty. Files are read in sorted name order.
"""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image

from ..core.images import read_image
from .answers import SCORERS
from .core import Dataset, Example, StimulusError
from .pairs import PAIRS_FILE, load_pairs
from .rows import Row, RowsFileError, read_rows, rows_file, unique_ids

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
DEFAULT_PROMPT = "describe the objects in this image :"


def _open_rgb(path: Path) -> Image.Image:
    """The image at ``path`` as RGB (policy: :mod:`vlmbind.core.images`; animated images are refused)."""
    return read_image(path, StimulusError)


def user_images(folder: str | os.PathLike, prompts: str | os.PathLike | None = None, *,
                default_prompt: str = DEFAULT_PROMPT) -> Dataset:
    """Read a folder of images (and optionally a JSONL of prompts) as a :class:`Dataset` (task ``"user"``).

    Raises:
        StimulusError: the folder does not exist or has no images, a file is not a readable image, the JSONL is
            not UTF-8, is malformed or names an image that is not in the folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise StimulusError(f"{str(folder)!r} is not a directory of images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if prompts is None:
        if not files:
            raise StimulusError(f"{str(folder)!r} has no .png/.jpg/.jpeg images")
        rows = [{"image": p.name, "prompt": default_prompt} for p in files]
    else:
        rows = _read_prompts(Path(prompts), {p.name for p in files})
    examples = []
    for i, row in enumerate(rows):
        path = folder / row["image"]
        extra = {k: v for k, v in row.items() if k not in ("image", "prompt", "answer")}
        extra["source"] = row["image"]
        examples.append(Example(f"user-{i:06d}", _open_rgb(path), [], row["prompt"], row.get("answer", ""), "user",
                                extra))
    params = {"folder": str(folder.resolve()), "prompts": str(Path(prompts).resolve()) if prompts else None}
    return Dataset("user", examples, params, seed=0)


def _read_prompts(path: Path, names: set[str]) -> list[dict]:
    if not path.is_file():
        raise StimulusError(f"prompts file {str(path)!r} does not exist")
    rows = []
    for lineno, row in read_rows(path, ("image", "prompt"), StimulusError, name=f"prompts file {str(path)!r}"):
        if not isinstance(row.get("image"), str) or not isinstance(row.get("prompt"), str):
            raise StimulusError(f"{path.name} line {lineno}: needs string fields 'image' and 'prompt'")
        if not row["prompt"].strip():
            raise StimulusError(f"{path.name} line {lineno}: the prompt is empty")
        if row["image"] not in names:
            raise StimulusError(f"{path.name} line {lineno}: image {row['image']!r} is not in the folder")
        rows.append(row)
    return rows


TASK_FILE = "task.jsonl"
TASK_REQUIRED = ("image", "prompt", "answer")
TASK_OPTIONAL = ("id", "accept", "scorer", "meta")


class TaskFileError(RowsFileError):
    """A task file (``task.jsonl``) that cannot be read: the message names the file, the line and the field."""


def load_task(path: str | os.PathLike) -> Dataset:
    """Read a task file: a folder holding ``task.jsonl``, or the file. One JSON object per line::

        {"id": "q0", "image": "img/q0.png", "prompt": "the red object is a", "answer": "square",
         "accept": ["box"], "scorer": "first_word"}

    ``image`` (relative to the file), ``prompt`` and ``answer`` are required; ``accept`` lists other answers that
    count as right; ``scorer`` is one of :data:`vlmbind.stimuli.answers.SCORERS` (default ``starts_with``: the
    reply's words begin with the answer's); ``meta`` holds anything else. Examples keep ``accept``, ``scorer`` and
    ``meta`` in their fields, which :func:`vlmbind.analysis.evaluation.score` reads. A pairs folder or file
    (:mod:`vlmbind.stimuli.pairs`) reads as the task of its clean inputs (image, prompt, answer).

    Returns:
        A :class:`Dataset` of task ``"user"``, params ``{"source": <the file>}``.

    Raises:
        TaskFileError: a row that does not validate (file, line and field named) or ids that repeat.
        StimulusError: no such file or folder.
    """
    path = Path(path)
    if path.name == PAIRS_FILE or (path.is_dir() and not (path / TASK_FILE).is_file()
                                   and (path / PAIRS_FILE).is_file()):
        pairs = load_pairs(path)
        return Dataset(pairs.clean.task, [p.clean for p in pairs], pairs.params, pairs.seed)
    file = rows_file(path, TASK_FILE, StimulusError)
    examples, ids = [], []
    for lineno, raw in read_rows(file, TASK_REQUIRED, TaskFileError):
        row = Row(file, lineno, raw, TASK_REQUIRED, TASK_OPTIONAL, TaskFileError)
        eid = row.text("id", f"line{lineno}")
        fields = {"accept": row.texts("accept"), "scorer": row.choice("scorer", SCORERS, "starts_with"),
                  "source": row.row["image"], **({"meta": row.mapping("meta")} if "meta" in raw else {})}
        examples.append(Example(eid, row.image("image"), [], row.text("prompt"), row.text("answer"), "user",
                                fields))
        ids.append((lineno, eid))
    unique_ids(file, ids, TaskFileError)
    return Dataset("user", examples, {"source": str(file.resolve())}, seed=0)
