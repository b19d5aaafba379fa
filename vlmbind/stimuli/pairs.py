"""Counterfactual pairs as data: :class:`CounterfactualPair`, :class:`PairSet` and the ``pairs.jsonl`` folder format
that vlmbind writes (``vlmbind stimuli scene --pairs``, :meth:`PairSet.save`) and reads (``vlmbind locate --pairs``,
:func:`load_pairs`), and that a person writes by hand.

A pairs folder holds ``pairs.jsonl`` (one JSON object per line; image paths relative to the file) and, when vlmbind
wrote it, ``dataset.json`` (the generator's parameters) and ``images/``. One line::

    {"id": "p0", "condition": "colour_swap", "clean_image": "img/p0a.png", "counterfactual_image": "img/p0b.png",
     "prompt": "the red object is a", "answer": "square", "answer_counterfactual": "circle", "patch": "last"}

Fields (``*`` required):

* ``id``: unique per file (default: ``line<N>``).
* ``condition`` *: any name; a file may hold several conditions, ``locate`` takes one at a time.
* ``clean_image`` *, ``counterfactual_image`` *: image files. Both sides must line up token for token on the model
  (same size on families whose image-token count depends on it).
* ``prompt`` *: the text after the image; ``counterfactual_prompt``: the counterfactual's, with the same token count
  (default: ``prompt``).
* ``answer`` * (a) and ``answer_counterfactual`` * (a*): the score is the logit difference of their first differing
  tokens; patching the counterfactual in moves the answer from a towards a*.
* ``answer_on_counterfactual``: what the model should answer on the counterfactual input itself (default: a*), the
  check of the counterfactual's own prediction.
* ``patch``: where to patch (default ``"last"``): ``"last"`` (the last prompt token), ``{"text": "red object",
  "occurrence": -1}`` (the tokens of a piece of the prompt; ``occurrence`` counts matches, -1 the last),
  ``{"box": [x0, y0, x1, y1]}`` (the image tokens whose cells overlap that pixel box of the clean image) or
  ``{"positions": [...]}`` (sequence positions of the pair's own token sequence; negative counts from its end).
* ``meta``: anything else, kept with the pair (vlmbind stores the scene's objects there).

Every row is checked when read; an error names the file, the line and the field.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import close_matches
from ..core.images import read_image
from .core import Dataset, Example, SceneObject, StimulusError, read_records, save_records
from .rows import Row, RowsFileError, read_rows, rows_file, unique_ids

PAIRS_FILE = "pairs.jsonl"
REQUIRED = ("condition", "clean_image", "counterfactual_image", "prompt", "answer", "answer_counterfactual")
OPTIONAL = ("id", "counterfactual_prompt", "answer_on_counterfactual", "patch", "meta")
PATCH_FORMS = ('"last"', '{"text": ..., "occurrence": -1}', '{"box": [x0, y0, x1, y1]}', '{"positions": [...]}')
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class PairsFileError(RowsFileError):
    """A pairs file (``pairs.jsonl``) that cannot be read: the message names the file, the line and the field."""


@dataclass
class CounterfactualPair:
    """A clean input and its counterfactual for one condition.

    Attributes:
        id: pair id (the examples are ``{id}-clean`` and ``{id}-cf``).
        condition: the condition's name (VSM's ``id_retrieval``, ``id_selection``, ``feature_retrieval``, or a
            user's).
        clean: the clean example (``answer`` = a).
        counterfactual: the counterfactual example. Its own ``answer`` is what a model should say on the
            counterfactual input itself (the target for the swap conditions, the recoloured target for feature
            retrieval, ``answer_on_counterfactual`` for a user's pair).
        patch: where to patch: ``{"kind": "last"}``, ``{"kind": "span", "text": ..., "occurrence": -1}``
            (``occurrence`` counts matches of ``text`` in the prompt from its end, for :meth:`TokenIndex.span`),
            ``{"kind": "box", "box": [x0, y0, x1, y1]}`` or ``{"kind": "positions", "positions": [...]}``.
        answer: a, the clean answer.
        answer_counterfactual: a*, the answer patching the counterfactual into the clean run implies.
        first_difference: the first word where ``answer`` and ``answer_counterfactual`` differ (scenes: 0 colour,
            1 shape).
        meta: what a pairs file's ``meta`` held (user data).
    """

    id: str
    condition: str
    clean: Example
    counterfactual: Example
    patch: dict[str, Any]
    answer: str
    answer_counterfactual: str
    first_difference: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def counterfactual_prompt_differs(self) -> bool:
        return self.counterfactual.prompt != self.clean.prompt

    def to_record(self, clean_image: str, counterfactual_image: str) -> dict[str, Any]:
        """The pair as one ``pairs.jsonl`` line (images at the given relative paths)."""
        record: dict[str, Any] = {
            "id": self.id, "condition": self.condition, "clean_image": clean_image,
            "counterfactual_image": counterfactual_image, "prompt": self.clean.prompt, "answer": self.answer,
            "answer_counterfactual": self.answer_counterfactual,
        }
        if self.counterfactual_prompt_differs:
            record["counterfactual_prompt"] = self.counterfactual.prompt
        if self.counterfactual.answer != self.answer_counterfactual:
            record["answer_on_counterfactual"] = self.counterfactual.answer
        record["patch"] = patch_to_file(self.patch)
        meta = dict(self.meta)
        if self.clean.task != "user":  # a generated pair keeps its scenes, so that it reads back the same
            meta["first_difference"] = self.first_difference
            meta["clean"] = _example_meta(self.clean)
            meta["counterfactual"] = _example_meta(self.counterfactual)
        if meta:
            record["meta"] = meta
        return record


@dataclass
class PairSet:
    """Counterfactual pairs of one condition plus the parameters that made them.

    Attributes:
        condition: the condition.
        pairs: the pairs.
        params: generator parameters (JSON-serialisable; canvas via ``Canvas.to_dict``); a read pairs file:
            ``{"source": <path>}``.
        seed: the seed.
        summary: data-set level facts (object counts, how many pairs first differ at the colour / shape word).
    """

    condition: str
    pairs: list[CounterfactualPair]
    params: dict[str, Any]
    seed: int
    summary: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self) -> Iterator[CounterfactualPair]:
        return iter(self.pairs)

    def __getitem__(self, i: int) -> CounterfactualPair:
        return self.pairs[i]

    @property
    def clean(self) -> Dataset:
        """The clean examples as a Dataset."""
        return Dataset(self._task(), [p.clean for p in self.pairs], self.params, self.seed, dict(self.summary))

    @property
    def counterfactual(self) -> Dataset:
        """The counterfactual examples as a Dataset (fields name what changed)."""
        return Dataset(self._task(), [p.counterfactual for p in self.pairs], self.params, self.seed,
                       dict(self.summary))

    def _task(self) -> str:
        return self.pairs[0].clean.task if self.pairs else "scene"

    def describe(self) -> dict[str, Any]:
        return {"task": "scene_pairs", "condition": self.condition, "n": len(self), "seed": self.seed,
                "params": self.params, **self.summary}

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``images/{id}-clean.png``, ``images/{id}-cf.png``, ``pairs.jsonl`` (one line per pair) and
        ``dataset.json`` into ``out`` atomically."""
        images = [(f"{p.id}-{side}", img) for p in self.pairs
                  for side, img in (("clean", p.clean.image), ("cf", p.counterfactual.image))]
        records = [p.to_record(f"images/{p.id}-clean.png", f"images/{p.id}-cf.png") for p in self.pairs]
        return save_records(out, images, records, self.describe(), records_name=PAIRS_FILE)

    @classmethod
    def load(cls, path: str | os.PathLike, condition: str | None = None) -> PairSet:
        """Read a pairs folder or file (:func:`load_pairs`); folders of the earlier format (``meta.jsonl`` with
        ``dataset.json``) are read too.

        Raises:
            StimulusError: ``path`` is not a pairs folder or file; a row that does not validate
                (:class:`PairsFileError`).
        """
        return load_pairs(path, condition)


# ------------------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------------------
def load_pairs(path: str | os.PathLike, condition: str | None = None) -> PairSet:
    """Read counterfactual pairs from a folder holding ``pairs.jsonl`` or from the file itself.

    Args:
        path: the folder or the ``.jsonl`` file (image paths are relative to the file).
        condition: keep the pairs of this condition (needed when the file holds several).

    Returns:
        A :class:`PairSet`; its ``params`` are the generator's (from ``dataset.json``) when vlmbind wrote the
        folder, else ``{"source": <the file>}``.

    Raises:
        PairsFileError: a row that does not validate (file, line and field named), duplicate ids, several
            conditions and no ``condition`` chosen, or none of ``condition``.
        StimulusError: no such file or folder.
    """
    path = Path(path)
    if path.is_dir() and not (path / PAIRS_FILE).is_file() and (path / "meta.jsonl").is_file():
        return _load_earlier_format(path)
    file = rows_file(path, PAIRS_FILE, StimulusError)
    rows = read_rows(file, REQUIRED, PairsFileError)
    pairs = [_pair_from_row(Row(file, lineno, row, REQUIRED, OPTIONAL, PairsFileError)) for lineno, row in rows]
    unique_ids(file, [(lineno, p.id) for (lineno, _), p in zip(rows, pairs)], PairsFileError)
    conditions = sorted({p.condition for p in pairs})
    if condition is None and len(conditions) > 1:
        raise PairsFileError(f"{file} holds the conditions {conditions}; choose one (--condition on the command "
                             "line, condition= in Python)")
    if condition is not None:
        pairs = [p for p in pairs if p.condition == condition]
        if not pairs:
            hint = close_matches(condition, conditions)
            raise PairsFileError(f"{file} holds no pair of condition {condition!r}.{hint} Its conditions: "
                                 f"{', '.join(conditions)}")
    info = _dataset_info(file.parent)
    if info:
        summary = {k: v for k, v in info.items() if k not in ("task", "condition", "n", "seed", "params")}
        return PairSet(pairs[0].condition, pairs, info.get("params", {}), int(info.get("seed", 0)), summary)
    return PairSet(pairs[0].condition, pairs, {"source": str(file.resolve())}, 0, {})


def _pair_from_row(row: Row) -> CounterfactualPair:
    pid = row.text("id", f"line{row.lineno}")
    condition = row.text("condition")
    if not _NAME.match(condition):
        raise row.fail("condition", f"{condition!r} must be a name of letters, digits, '_', '-' or '.'")
    prompt, answer, answer_cf = row.text("prompt"), row.text("answer"), row.text("answer_counterfactual")
    cf_prompt = row.text("counterfactual_prompt", prompt)
    on_cf = row.text("answer_on_counterfactual", answer_cf)
    if answer.strip() == answer_cf.strip():
        raise row.fail("answer_counterfactual", f"equals 'answer' ({answer!r}); a pair needs two different answers")
    clean_image, cf_image = row.image("clean_image"), row.image("counterfactual_image")
    meta = row.mapping("meta")
    patch = _patch_from_file(row.row.get("patch", "last"), clean_image.size, row.fail)
    clean_meta, cf_meta = meta.pop("clean", None), meta.pop("counterfactual", None)
    first = meta.pop("first_difference", None)
    if first is None:
        first = _first_difference(answer, answer_cf)
    clean = _example(f"{pid}-clean", clean_image, prompt, answer, clean_meta)
    counterfactual = _example(f"{pid}-cf", cf_image, cf_prompt, on_cf, cf_meta)
    return CounterfactualPair(pid, condition, clean, counterfactual, patch, answer, answer_cf, int(first), meta)


def _patch_from_file(patch: Any, size: tuple[int, int], fail: Any) -> dict[str, Any]:
    forms = ", ".join(PATCH_FORMS)
    if patch == "last":
        return {"kind": "last"}
    if not isinstance(patch, dict) or len({"text", "box", "positions"} & set(patch)) != 1:
        raise fail("patch", f"{json.dumps(patch)} is not one of {forms}")
    if "text" in patch:
        stray = sorted(set(patch) - {"text", "occurrence", "object"})
        occurrence = patch.get("occurrence", -1)
        if stray or not isinstance(patch["text"], str) or not patch["text"] or not _is_int(occurrence):
            raise fail("patch", f"{json.dumps(patch)}: a text patch is {PATCH_FORMS[1]} (a non-empty text, an int "
                                "occurrence)")
        return {"kind": "span", **{k: v for k, v in patch.items()}}
    if "box" in patch:
        box = patch["box"]
        if (set(patch) != {"box"} or not isinstance(box, list) or len(box) != 4
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
            raise fail("patch", f"{json.dumps(patch)}: a box patch is {PATCH_FORMS[2]}, pixels of the clean image")
        x0, y0, x1, y1 = box
        w, h = size
        if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
            raise fail("patch", f"box {box} is not inside the clean image ({w} x {h} pixels) with x0 < x1 and "
                                "y0 < y1")
        return {"kind": "box", "box": [float(v) for v in box]}
    positions = patch["positions"]
    if set(patch) != {"positions"} or not isinstance(positions, list) or not positions or not all(
            _is_int(v) for v in positions):
        raise fail("patch", f"{json.dumps(patch)}: a positions patch is {PATCH_FORMS[3]}, a non-empty list of ints")
    if len(set(positions)) != len(positions):
        raise fail("patch", f"positions {positions} repeat")
    return {"kind": "positions", "positions": [int(v) for v in positions]}


# a patch as pairs files and conditions write it: "last" or one of the dicts of PATCH_FORMS
PatchForm = Any


def patch_from_form(patch: PatchForm, size: tuple[int, int]) -> dict[str, Any]:
    """A patch in the pairs file's form (on an image of ``size``) as a pair's ``patch`` dict.

    Raises:
        StimulusError: not one of :data:`PATCH_FORMS`, or a box outside the image.
    """
    return _patch_from_file(patch, size, lambda _name, what: StimulusError(f"patch {what}"))


def patch_to_file(patch: dict[str, Any]) -> Any:
    """A pair's patch in the ``pairs.jsonl`` form."""
    kind = patch.get("kind")
    if kind == "last":
        return "last"
    if kind == "span":
        return {k: v for k, v in patch.items() if k != "kind"}
    if kind in ("box", "positions"):
        return {kind: patch[kind]}
    raise StimulusError(f"patch {patch!r} has no kind among last, span, box, positions")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_difference(answer: str, answer_cf: str) -> int:
    a, b = answer.split(), answer_cf.split()
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _example(eid: str, image: Any, prompt: str, answer: str, meta: dict[str, Any] | None) -> Example:
    if not meta:
        return Example(eid, image, [], prompt, answer, "user", {})
    fields = {k: v for k, v in meta.items() if k not in ("task", "objects")}
    objects = [SceneObject.from_dict(o) for o in meta.get("objects", [])]
    return Example(eid, image, objects, prompt, answer, meta.get("task", "user"), fields)


def _example_meta(e: Example) -> dict[str, Any]:
    return {"task": e.task, "objects": [o.to_dict() for o in e.objects], **e.fields}


def _dataset_info(folder: Path) -> dict[str, Any] | None:
    info_file = folder / "dataset.json"
    if not info_file.is_file():
        return None
    try:
        info = json.loads(info_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StimulusError(f"{str(info_file)!r} is not readable JSON ({exc}); regenerate the pairs or remove it")
    return info if isinstance(info, dict) and info.get("task") == "scene_pairs" else None


def _load_earlier_format(path: Path) -> PairSet:
    """A pair set saved as ``meta.jsonl`` (records with nested ``clean`` / ``counterfactual`` examples)."""
    info, records = read_records(path)
    if info.get("task") != "scene_pairs":
        raise StimulusError(f"{str(path)!r} holds task {info.get('task')!r}, not scene_pairs; use Dataset.load")
    pairs = []
    for r in records:
        sides = []
        for side in ("clean", "counterfactual"):
            e = r[side]
            fields = {k: v for k, v in e.items() if k not in ("id", "image", "task", "prompt", "answer", "objects")}
            sides.append(Example(e["id"], read_image(path / e["image"], StimulusError),
                                 [SceneObject.from_dict(o) for o in e.get("objects", [])], e["prompt"], e["answer"],
                                 e.get("task", ""), fields))
        pairs.append(CounterfactualPair(r["id"], r["condition"], sides[0], sides[1], r["patch"], r["answer"],
                                        r["answer_counterfactual"], int(r["first_difference"])))
    summary = {k: v for k, v in info.items() if k not in ("task", "condition", "n", "seed", "params")}
    return PairSet(info["condition"], pairs, info.get("params", {}), int(info.get("seed", 0)), summary)


__all__ = ["PAIRS_FILE", "CounterfactualPair", "PairSet", "PairsFileError", "load_pairs", "patch_from_form",
           "patch_to_file"]
