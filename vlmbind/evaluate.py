"""Task accuracy by greedy generation: ``vb.evaluate(vlm, dataset)`` and ``vlmbind eval``.

Design: one scoring rule per task reads the generated text the way the task's answer is written, with the stimuli's
parsers, so Direct and Point-to-Answer outputs are judged on the final answer alone (a P2A count is right when the
number after the points is right; the points are reported beside it, not required to be right):

* scene: the first two words equal the expected ``colour shape``;
* query: the first word equals the expected word;
* search: the yes / no after any points equals the expected one;
* count: the integer after any points equals the expected count;
* other tasks (rsa, colorshape, user data with answers): the whitespace-normalised text starts with the answer.

Results hold every raw answer, accuracy overall and per object count, and save as ``results.json`` and
``answers.jsonl``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from .errors import InputError
from .io import write_json_atomic, write_jsonl_atomic
from .stimuli.core import Dataset, Example
from .stimuli.points import parse_count, parse_points, parse_yes_no


def _words(text: str) -> list[str]:
    return text.strip().split()


def score(example: Example, output: str) -> tuple[bool, Any]:
    """Whether ``output`` answers ``example`` correctly, and the parsed answer."""
    task = example.task
    if task == "scene":
        parsed = " ".join(_words(output)[:2])
        return parsed == " ".join(_words(example.answer)[:2]), parsed
    if task == "query":
        parsed = (_words(output) or [""])[0]
        return parsed == _words(example.answer)[0], parsed
    if task == "search":
        parsed = parse_yes_no(output)
        return parsed is not None and parsed == parse_yes_no(example.answer), parsed
    if task == "count":
        parsed = parse_count(output)
        return parsed is not None and parsed == parse_count(example.answer), parsed
    expected = " ".join(_words(example.answer))
    parsed = " ".join(_words(output))
    return bool(expected) and parsed.startswith(expected), parsed


def max_new_tokens_for(example: Example, tokenizer: Any) -> int:
    """Enough new tokens for the expected answer plus a margin (P2A answers grow with the number of points)."""
    return len(tokenizer(example.answer, add_special_tokens=False)["input_ids"]) + 4


@dataclass
class EvalResult:
    """Accuracy of one model on one data set.

    Attributes:
        model: the model's name.
        task: the data set's task.
        records: one dict per example: id, n_objects, prompt, expected, output, parsed, correct, points.
        params: the data set's parameters and seed.
    """

    model: str
    task: str
    records: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)

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

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "n": self.n, "accuracy": self.accuracy,
                "per_count": {str(k): v for k, v in self.per_count.items()}, "params": self.params}

    def save(self, out: str | os.PathLike) -> Path:
        out = Path(out)
        write_jsonl_atomic(self.records, out / "answers.jsonl")
        write_json_atomic(self.summary(), out / "results.json")
        return out


def evaluate(vlm: Any, dataset: Dataset | list[Example], *, batch_size: int = 16, progress: bool = False,
             chat: bool = False) -> EvalResult:
    """Greedy-generate an answer for every example and score it (see the module docstring).

    Raises:
        InputError: the data set is empty, or has examples without an expected answer.
    """
    examples = list(dataset)
    if not examples:
        raise InputError("the data set is empty: nothing to evaluate")
    missing = [e.id for e in examples if not e.answer]
    if missing:
        raise InputError(f"{len(missing)} examples have no expected answer (first: {missing[0]!r})")
    tokenizer = vlm.adapter.tokenizer
    records = []
    bar = tqdm(total=len(examples), desc=f"eval {examples[0].task}", disable=not progress)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk], chat=chat)
        budget = max(max_new_tokens_for(e, tokenizer) for e in chunk)
        outputs, _ = vlm.generate(batch, max_new_tokens=budget)
        for e, out in zip(chunk, outputs):
            correct, parsed = score(e, out)
            records.append({
                "id": e.id, "n_objects": len(e.objects), "prompt": e.prompt, "expected": e.answer,
                "output": out, "parsed": parsed, "correct": bool(correct), "points": parse_points(out),
            })
        bar.update(len(chunk))
    bar.close()
    params = dataset.describe() if isinstance(dataset, Dataset) else {}
    params.pop("n", None)
    return EvalResult(model=vlm.name, task=examples[0].task, records=records, params=params)


# ----------------------------------------------------------------------------------------------------------------
# vlmbind eval
# ----------------------------------------------------------------------------------------------------------------
def add_parser(sub: Any, common: Any) -> None:
    from .stimuli.commands import parse_range

    p = sub.add_parser("eval", parents=[common], help="task accuracy of a model by greedy generation",
                       description="Generate a task's stimuli, let the model answer greedily, and score the answers.")
    p.add_argument("--model", required=True, help="registered name, model directory or hub id")
    p.add_argument("--task", required=True, choices=("scene", "query", "search", "count"))
    p.add_argument("--n", type=int, default=200, help="number of examples (default 200)")
    p.add_argument("--seed", type=int, default=1, help="stimulus seed (default 1; training uses others)")
    p.add_argument("--objects", type=parse_range, help="objects per image: N or LOW-HIGH")
    p.add_argument("--regime", choices=("direct", "p2a"), help="search / count: the answer format")
    p.add_argument("--entropy", choices=("high", "low"), help="scene: distinct or shared features")
    p.add_argument("--kind", choices=("disjunctive", "conjunctive"), help="search: the display type")
    p.add_argument("--diversity", choices=("low", "high"), help="count: one colour and shape, or many")
    p.add_argument("--image-size", type=int, help="canvas side in pixels (default: the model's training size)")
    p.add_argument("--grid", type=parse_range, help="object grid: N or ROWS-COLS")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=None, help="output directory (default runs/eval/<model>-<task>)")
    p.set_defaults(func=cmd_eval)


def training_defaults(vlm: Any, task: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Fill stimulus options the user left out from how ``vlm`` was trained (organisms record it): the canvas
    aligned with its token grid, its colour and shape pools, and its answer regime."""
    training = getattr(vlm, "training", None)
    if not training:
        return kwargs
    from .stimuli.core import Canvas

    kwargs = dict(kwargs)
    if "canvas" not in kwargs:
        kwargs["canvas"] = Canvas(image_size=int(training["image_size"]), grid=int(training["grid"]))
    options = training.get("task_options", {}).get(task, {})
    if task in ("scene", "query", "count"):
        for pool in ("colours", "shapes"):
            if options.get(pool) and pool not in kwargs:
                kwargs[pool] = tuple(options[pool])
    if task in ("search", "count") and "regime" not in kwargs:
        kwargs["regime"] = training["regime"]
    return kwargs


def cmd_eval(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    import argparse

    from . import load
    from .stimuli.commands import _kwargs, generate

    if args.n < 1:
        raise InputError(f"--n must be a positive number of examples, got {args.n}")
    stim_args = argparse.Namespace(
        objects=args.objects, entropy=args.entropy, kind=args.kind, present=None, regime=args.regime,
        diversity=args.diversity, split=None, positions=None, pairs=None, image_size=args.image_size,
        grid=args.grid, object_size=None,
    )
    kwargs = _kwargs(args.task, stim_args)
    vlm = load(args.model)
    kwargs = training_defaults(vlm, args.task, kwargs)
    dataset = generate(args.task, args.n, args.seed, kwargs)
    result = evaluate(vlm, dataset, batch_size=args.batch_size, progress=not args.json)
    out = Path(args.out or f"runs/eval/{Path(str(args.model)).name}-{args.task}")
    result.save(out)
    summary = {**result.summary(), "out": str(out), "command": " ".join(command)}
    lines = [f"{vlm.name} on {args.task} (n={result.n}, seed {args.seed}): accuracy {result.accuracy:.3f}"]
    lines += [f"  {k} objects: {v['accuracy']:.3f} (n={v['n']})" for k, v in result.per_count.items()]
    lines.append(f"  wrote {out}/results.json and answers.jsonl")
    return summary, "\n".join(lines), 0
