"""Task accuracy by greedy generation: ``vb.evaluate(vlm, dataset)`` and ``vlmbind eval``.

Design: one scoring rule per task reads the generated text the way a person reads an answer, with the readers of
:mod:`vlmbind.stimuli.answers` (case, punctuation, markdown and articles ignored; number words read; every pointing
format cut out before a count or yes / no is read), so Direct, Point-to-Answer and ordinary Instruct answers are
judged on the final answer alone (a P2A count is right when its count is right; the points are reported beside it,
not required to be right):

* scene: the first colour word followed by a shape word equals the expected ``colour shape``;
* query: the first word of the expected word's kind (colour, shape, letter) equals it;
* search: the first yes / no outside the points equals the expected one;
* count: the total (a number marked as the total, else the first number) equals the expected count; a reply that
  only lists points, with no number, is read as the number of its points (``count_read_from: points`` in its
  record, and the summary counts them);
* a task file's examples (``vlmbind eval --data``): the example's ``scorer`` against its answer and ``accept`` list
  (:func:`vlmbind.stimuli.answers.score_text`);
* other tasks (rsa, colorshape, user data with answers): the answer's words start with the expected words.

Each record keeps the points as written (``points_raw``, ``point_formats``) and in canvas cells (``points``) when the
model's frame for every format it used is known (:meth:`vlmbind.engine.vlm.VLM.point_frames`); otherwise ``points`` is
None and ``point_frame`` says why.

Results hold every raw answer, accuracy overall and per object count, and save as ``results.json`` and
``answers.jsonl``. A run with a checkpoint appends each finished batch as one JSON line (flushed and synced) to
``eval.partial.jsonl`` after a header naming the run; a resumed run keeps only whole lines of whole batches, so a line
torn by a kill is never read as finished, and it regenerates exactly the batches a single uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from ..core.choices import EVAL_CHECKPOINT as CHECKPOINT  # noqa: F401  (public here too)
from ..core.errors import InputError
from ..core.io import json_default, write_json_atomic, write_jsonl_atomic, write_text_atomic
from ..core.results import Result, read_json_object, register_result, require_keys
from ..engine.decoding import GREEDY
from ..organisms.data import training_canvas
from ..stimuli.answers import (
    UnknownFrameError,
    answer_words,
    read_count,
    score_text,
    to_canvas,
)
from ..stimuli.core import Dataset, Example
from ..stimuli.points import pointing_spans
from ..stimuli.registry import TASKS as REGISTERED_TASKS
from ..stimuli.tasks import TASKS as STIMULUS_TASKS
from ..stimuli.tasks import default_canvas


def score(example: Example, output: str) -> tuple[bool, Any]:
    """Whether ``output`` answers ``example`` correctly, and the answer read from it (see the module docstring):
    a task file's scorer, else the registered task's (:func:`vlmbind.stimuli.register_task`), else the answer's
    words start with the expected words."""
    fields = getattr(example, "fields", None) or {}
    if "scorer" in fields:
        return score_text(fields["scorer"], output, [example.answer, *fields.get("accept", [])])
    task = REGISTERED_TASKS.get(example.task)
    if task is not None:
        return task.score(example, output)
    want = answer_words(example.answer)
    got = answer_words(output)
    return bool(want) and got[: len(want)] == want, " ".join(got)


def counted_points(example: Example, output: str, parsed: Any) -> bool:
    """Whether a count was read from the reply's points alone (it wrote no number)."""
    return example.task == "count" and parsed is not None and read_count(output) is None


def read_points(vlm: Any, output: str, canvas: Any, image: Any, resized: tuple[int, int] | None,
                frame: str | None = None) -> dict[str, Any]:
    """The points of ``output``: as written (``points_raw``, with their formats) and in canvas cells (``points``;
    None when a format's frame is unknown for this model, with the reason in ``point_frame``)."""
    spans = pointing_spans(output)
    out: dict[str, Any] = {"points_raw": [p for sp in spans for p in sp.points],
                           "point_formats": sorted({sp.format for sp in spans})}
    if canvas is None:
        return {**out, "points": None, "point_frame": "no canvas"}
    try:
        out["points"] = to_canvas(spans, vlm.point_frames(frame), canvas, image_size=image.size,
                                  resized_size=resized)
        out["point_frame"] = "canvas"
    except UnknownFrameError as e:
        out["points"], out["point_frame"] = None, f"unknown: {e}"
    return out


def max_new_tokens_for(example: Example, tokenizer: Any) -> int:
    """Enough new tokens for the longest expected answer plus a margin (P2A answers grow with the number of
    points)."""
    answers = [example.answer, *example.fields.get("accept", [])]
    return max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers) + 4


@register_result
@dataclass
class EvalResult(Result):
    """Accuracy of one model on one data set.

    Attributes:
        model: the model's name.
        task: the data set's task.
        records: one dict per example: id, n_objects, prompt, expected, output, parsed, correct, points.
        params: the data set's parameters and seed.
        prompt_format: ``raw`` or ``chat``.
        generation: the decoding settings (greedy, penalties off).
    """

    model: str
    task: str
    records: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)
    prompt_format: str = "raw"
    generation: dict[str, Any] = field(default_factory=dict)

    kind = "eval"
    reproduced_files = ("answers.jsonl", "results.json")
    marker_files = ("answers.jsonl",)
    marker_keys = ("accuracy", "per_count")
    table_name = "answers.csv"

    @classmethod
    def load(cls, directory: str | os.PathLike) -> EvalResult:
        """The answers and parameters saved in ``answers.jsonl`` and ``results.json``."""
        directory = Path(directory)
        summary = read_json_object(directory / "results.json")
        require_keys(summary, ("model", "task"), directory / "results.json")
        path = directory / "answers.jsonl"
        records = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{str(path)!r} line {number} is not JSON ({exc}); re-run vlmbind eval") from None
            if not isinstance(record, dict) or "correct" not in record or "n_objects" not in record:
                raise InputError(f"{str(path)!r} line {number} is not an answer record (no 'correct' or "
                                 f"'n_objects'); re-run vlmbind eval")
            records.append(record_from_json(record))
        return cls(model=summary["model"], task=summary["task"], records=records, params=summary.get("params", {}),
                   prompt_format=summary.get("prompt_format", "raw"), generation=summary.get("generation", {}))

    @property
    def n(self) -> int:
        return len(self.records)

    @property
    def accuracy(self) -> float:
        return sum(r["correct"] for r in self.records) / max(1, self.n)

    @property
    def per_count(self) -> dict[int, dict[str, float]]:
        groups: dict[int, list[bool]] = defaultdict(list)
        for r in self.records:
            groups[r["n_objects"]].append(r["correct"])
        return {k: {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in sorted(groups.items())}

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.records)

    @property
    def counts_from_points(self) -> int:
        """How many replies gave no number and were read as the number of their points."""
        return sum(r.get("count_read_from") == "points" for r in self.records)

    def summary(self) -> dict[str, Any]:
        out = {"model": self.model, "task": self.task, "n": self.n, "accuracy": self.accuracy,
               "per_count": {str(k): v for k, v in self.per_count.items()}, "params": self.params,
               "prompt_format": self.prompt_format, "generation": self.generation}
        if self.counts_from_points:
            out["counts_read_from_points"] = self.counts_from_points
        return out

    def save(self, out: str | os.PathLike) -> Path:
        out = Path(out)
        write_jsonl_atomic(self.records, out / "answers.jsonl")
        write_json_atomic(self.summary(), out / "results.json")
        return out


def run_key(vlm: Any, examples: list[Example], batch_size: int, chat: bool) -> dict[str, Any]:
    """What identifies an evaluation run for its checkpoint: the model, the options that shape the batches, the
    example ids and a digest of every example's image, prompt, answer and, for a task file's examples, accepted
    answers and scorer (so other data with the same ids differs)."""
    digest = hashlib.sha256()
    for e in examples:
        scoring = [e.fields[k] for k in ("accept", "scorer") if k in e.fields]
        digest.update(json.dumps([e.id, e.prompt, e.answer, *scoring]).encode())
        image = e.image.convert("RGB")
        digest.update(f"{image.size}".encode() + image.tobytes())
    return {"model": vlm.name, "batch_size": batch_size, "chat": chat, "ids": [e.id for e in examples],
            "data": digest.hexdigest()}


def record_from_json(record: dict[str, Any]) -> dict[str, Any]:
    """A record read back from JSON, with its points as tuples again (as :func:`evaluate` makes them)."""
    points = record.get("points")
    return {**record, "points": None if points is None else [tuple(p) for p in points]}


def _resume(path: Path, key: dict[str, Any], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """The records of the whole batches a checkpoint holds (none without one), truncating the file after them.

    Args:
        path: the checkpoint.
        key: this run's :func:`run_key`.
        batch_sizes: the number of examples of each batch of this run.

    Raises:
        InputError: the checkpoint belongs to another run, or is not an evaluation checkpoint.
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")[:-1]  # the part after the last newline is a torn write (or empty)
    try:
        saved = json.loads(lines[0])["run"] if lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        saved = None
    if saved is None:
        raise InputError(f"{path} is not a vlmbind eval checkpoint; remove it or use another --out")
    if saved != key:
        diff = sorted(k for k in key if saved.get(k) != key[k])
        raise InputError(f"checkpoint {path} is from another run ({', '.join(diff)} differ); remove it or use another "
                         "--out")
    records: list[dict[str, Any]] = []
    kept = len(lines[0]) + 1
    for i, line in enumerate(lines[1:]):
        try:
            batch = json.loads(line)
        except json.JSONDecodeError:  # damaged on disk: this batch and the later ones are generated again
            break
        if not isinstance(batch, dict) or i >= len(batch_sizes) or batch.get("batch") != i or len(batch.get("records", [])) != batch_sizes[i]:
            break
        records += [record_from_json(r) for r in batch["records"]]
        kept += len(line) + 1
    if kept < len(data):
        with open(path, "r+b") as fh:  # drop the torn tail so the next batch starts on a fresh line
            fh.truncate(kept)
    return records


def _append_batch(path: Path, index: int, records: list[dict[str, Any]]) -> None:
    """Append one finished batch as one line, flushed and synced before the next batch starts."""
    line = json.dumps({"batch": index, "records": records}, default=json_default) + "\n"
    with open(path, "ab") as fh:
        fh.write(line.encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())


def evaluate(vlm: Any, dataset: Dataset | list[Example], *, batch_size: int = 16, progress: bool = False,
             chat: bool | None = None, checkpoint: str | os.PathLike | None = None,
             point_frame: str | None = None, canvas: Any = None) -> EvalResult:
    """Greedy-generate an answer for every example and score it (see the module docstring).

    Args:
        vlm: a loaded VLM.
        dataset: the examples (a :class:`~vlmbind.stimuli.core.Dataset` also records its parameters).
        batch_size: examples generated together.
        progress: show a progress bar.
        chat: wrap prompts in the model's chat template (None: as the model's active prompt format says).
        checkpoint: a file each finished batch is appended to; an existing one from the same run (model, data,
            batch size, chat) is continued from, so a killed run resumes and ends with the same answers. It is
            removed when the run completes.
        point_frame: the frame of points in a format the model does not declare (see
            :meth:`vlmbind.engine.vlm.VLM.point_frames`); without one such points are recorded as written only.
        canvas: the stimulus canvas points are converted to (default: the data set's).

    Raises:
        InputError: the data set is empty, has examples without an expected answer, ``batch_size`` is not a
            positive int, or the checkpoint belongs to another run.
    """
    examples = list(dataset)
    if not examples:
        raise InputError("the data set is empty: nothing to evaluate")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
    missing = [e.id for e in examples if not e.answer]
    if missing:
        raise InputError(f"{len(missing)} examples have no expected answer (first: {missing[0]!r})")
    if chat is None:
        chat = vlm.active_prompt_format == "chat"
    tokenizer = vlm.adapter.tokenizer
    if canvas is None and isinstance(dataset, Dataset):
        canvas = dataset.params.get("canvas")
    records: list[dict[str, Any]] = []
    starts = range(0, len(examples), batch_size)
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        key = run_key(vlm, examples, batch_size, chat)
        records = _resume(checkpoint, key, [len(examples[s : s + batch_size]) for s in starts])
        if not checkpoint.is_file():
            write_text_atomic(json.dumps({"run": key}) + "\n", checkpoint)
    bar = tqdm(total=len(examples), initial=len(records), desc=f"eval {examples[0].task}", disable=not progress)
    for index, start in enumerate(starts):
        if start < len(records):  # finished before the interruption
            continue
        chunk = examples[start : start + batch_size]
        finished = len(records)
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk], chat=chat)
        budget = max(max_new_tokens_for(e, tokenizer) for e in chunk)
        outputs, _ = vlm.generate(batch, max_new_tokens=budget)
        for r, (e, out) in enumerate(zip(chunk, outputs)):
            correct, parsed = score(e, out)
            records.append({
                "id": e.id, "n_objects": len(e.objects), "prompt": e.prompt, "expected": e.answer,
                "output": out, "parsed": parsed, "correct": bool(correct),
                **read_points(vlm, out, canvas, e.image, vlm.adapter.resized_size(batch.inputs, r), point_frame),
                **({"count_read_from": "points"} if counted_points(e, out, parsed) else {}),
            })
        if checkpoint is not None:
            _append_batch(checkpoint, index, records[finished:])
        bar.update(len(chunk))
    bar.close()
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    params = dataset.describe() if isinstance(dataset, Dataset) else {}
    params.pop("n", None)
    return EvalResult(model=vlm.name, task=examples[0].task, records=records, params=params,
                      prompt_format="chat" if chat else "raw", generation=dict(GREEDY))


def outside_training(vlm: Any, task: str, kwargs: dict[str, Any]) -> str | None:
    """One line saying how stimuli of ``task`` with generator options ``kwargs`` lie outside what ``vlm`` was
    trained on (its task mixture, object counts and canvas, from an organism's training record); None inside it, or
    for a model without a record.
    """
    training = getattr(vlm, "training", None)
    if not training:
        return None
    trained = {t for t, weight in (training.get("tasks") or {}).items() if weight}
    if trained and task not in trained:
        return (f"{vlm.name} was not trained on {task} (its tasks: {', '.join(sorted(trained))}): its answers "
                "test stimuli outside its training")
    problems = []
    span = (training.get("task_options", {}).get(task) or {}).get("objects")
    asked = kwargs.get("objects" if task == "count" else "n_objects")
    if span and asked is not None:
        lo, hi = (asked, asked) if isinstance(asked, int) else (min(asked), max(asked))
        if lo < span[0] or hi > span[1]:
            asked_text = f"{lo}" if lo == hi else f"{lo}-{hi}"
            problems.append(f"{asked_text} objects per image (trained on {span[0]}-{span[1]})")
    canvas, own = kwargs.get("canvas"), training_canvas(training)
    if canvas is not None and (canvas.image_size, canvas.shape) != (own.image_size, own.shape):
        problems.append(f"a {canvas.image_size}-pixel canvas of {canvas.shape[0]} x {canvas.shape[1]} cells (trained "
                        f"on {own.image_size} pixels, {own.shape[0]} x {own.shape[1]})")
    if not problems:
        return None
    return (f"{task} stimuli with {' and '.join(problems)} lie outside what {vlm.name} was trained on: expect "
            "accuracy near chance there")


def training_defaults(vlm: Any, task: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Fill stimulus options the user left out from how ``vlm`` was trained (organisms record it): the canvas
    aligned with its token grid, its colour and shape pools, its answer regime and its object range."""
    training = getattr(vlm, "training", None)
    if not training:
        return kwargs
    kwargs = dict(kwargs)
    if "canvas" not in kwargs:
        kwargs["canvas"] = training_canvas(training)
    options = training.get("task_options", {}).get(task, {})
    if task in ("scene", "query", "count"):
        for pool in ("colours", "shapes"):
            if options.get(pool) and pool not in kwargs:
                kwargs[pool] = tuple(options[pool])
    if task in ("search", "count") and "regime" not in kwargs:
        kwargs["regime"] = training["regime"]
    # the object range too: a search display drawn with the generator's default range may not fit the canvas
    key = "objects" if task == "count" else "n_objects"
    if task in ("search", "count") and key not in kwargs and options.get("objects"):
        kwargs[key] = tuple(options["objects"])
    return kwargs


def stimulus_defaults(vlm: Any, task: str, kwargs: dict[str, Any],
                      image_size: int | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The generator options of ``task`` for stimuli shown to ``vlm``, and a record of their canvas.

    The canvas is drawn at ``image_size`` (``--image-size``) when given, else at the size of an organism's training
    record or, for any other model, at its family's ``typical_image_size``: a real checkpoint sees its stimuli at the
    size its users feed it. A canvas in ``kwargs`` (a grid the user gave) keeps its grid; without one the grid is the
    training record's (organisms) or the task generator's own (3 x 3 for scenes). :func:`training_defaults` fills the
    rest of an organism's options.

    Returns:
        ``(kwargs, canvas)``: ``canvas`` is ``{"image_size", "grid", "image_size_from"}``, ``image_size_from`` one of
        ``--image-size``, ``training record`` and ``family default``; None for a task drawn on no canvas of
        vlmbind's (colorshape, a task of a --plugin file).
    """
    if task not in STIMULUS_TASKS or "canvas" not in STIMULUS_TASKS[task][2]:
        return training_defaults(vlm, task, kwargs), None
    training = getattr(vlm, "training", None)
    if image_size is not None:
        size, source = image_size, "--image-size"
    elif training:
        size, source = int(training["image_size"]), "training record"
    else:
        size, source = int(vlm.adapter.typical_image_size), "family default"
    kwargs = dict(kwargs)
    if "canvas" in kwargs:
        kwargs["canvas"] = replace(kwargs["canvas"], image_size=size)
    elif source != "training record":  # an organism's own canvas comes from training_defaults
        grid = training_canvas(training) if training else default_canvas(task)
        kwargs["canvas"] = replace(grid, image_size=size)
    kwargs = training_defaults(vlm, task, kwargs)
    canvas = kwargs["canvas"]
    return kwargs, {"image_size": canvas.image_size, "grid": list(canvas.shape), "image_size_from": source}
