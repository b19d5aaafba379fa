"""``vlmbind stimuli TASK --n N --seed S --out DIR``: generate a data set (or counterfactual pairs) to disk.

Design: one table maps each task to its generator and to the command-line options it accepts; an option given for a
task that does not use it is bad input (exit 2), never silently ignored. Canvas options (``--image-size``, ``--grid``,
``--object-size``) build a :class:`~vlmbind.stimuli.core.Canvas` for the generators that take one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from .core import Canvas, StimulusError

# task -> (module, function, options it accepts besides n / seed / out)
TASKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "scene": ("scenes", "scene_description", ("objects", "entropy", "canvas", "pairs")),
    "query": ("scenes", "binding_query", ("objects", "canvas")),
    "search": ("search", "visual_search", ("objects", "kind", "present", "regime", "canvas")),
    "count": ("search", "counting", ("objects", "diversity", "regime", "canvas")),
    "rsa": ("rsa_set", "rsa_set", ("positions", "canvas")),
    "colorshape": ("colorshape", "balanced_color_shape", ("split",)),
}
PAIR_CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval")
_CANVAS_OPTIONS = ("image_size", "grid", "object_size")


def parse_range(text: str) -> int | tuple[int, int]:
    """``"7"`` -> 7, ``"2-4"`` -> (2, 4) (inclusive)."""
    try:
        if "-" in text.strip().lstrip("-"):
            lo, hi = (int(p) for p in text.split("-", 1))
            if lo > hi:
                raise argparse.ArgumentTypeError(f"range {text!r} is empty: write LOW-HIGH with LOW <= HIGH")
            return lo, hi
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count or a range like 2-4") from None


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stimuli", parents=[common], help="generate a synthetic data set (images, meta.jsonl, dataset.json)",
        description="Generate one of the papers' synthetic data sets, deterministic from the seed.",
    )
    p.add_argument("task", choices=sorted(TASKS), help="which data set")
    p.add_argument("--n", type=int, default=None, help="number of examples (pairs with --pairs); rsa takes none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--pairs", choices=PAIR_CONDITIONS, help="scene only: counterfactual pairs for this condition")
    p.add_argument("--objects", type=parse_range, help="objects per image: N or LOW-HIGH")
    p.add_argument("--entropy", choices=("high", "low"), help="scene: distinct features or shared features")
    p.add_argument("--kind", choices=("disjunctive", "conjunctive"), help="search: the display type")
    p.add_argument("--present", type=float, help="search: probability that the target is present")
    p.add_argument("--regime", choices=("direct", "p2a"), help="search / count: Direct-Answer or Point-to-Answer")
    p.add_argument("--diversity", choices=("low", "high"), help="count: one colour and shape, or many")
    p.add_argument("--split", choices=("train", "val", "test"), help="colorshape: the F-code split")
    p.add_argument("--positions", help="rsa: positions per conjunction (a number) or 'all'")
    p.add_argument("--image-size", type=int, help="canvas side in pixels")
    p.add_argument("--grid", type=parse_range, help="object grid: N (square) or ROWS-COLS")
    p.add_argument("--object-size", type=int, help="object size in pixels")
    p.set_defaults(func=cmd_stimuli)


def _kwargs(task: str, args: argparse.Namespace) -> dict[str, Any]:
    module, function, accepted = TASKS[task]
    given = {k for k in ("objects", "entropy", "kind", "present", "regime", "diversity", "split", "positions",
                         "pairs", *_CANVAS_OPTIONS) if getattr(args, k) is not None}
    allowed = set(accepted) | (set(_CANVAS_OPTIONS) if "canvas" in accepted else set())
    allowed.discard("canvas")
    stray = sorted(given - allowed)
    if stray:
        flags = ", ".join("--" + s.replace("_", "-") for s in stray)
        verb = "does" if len(stray) == 1 else "do"
        raise StimulusError(f"{flags} {verb} not apply to task {task!r}; it accepts "
                            f"{', '.join('--' + a.replace('_', '-') for a in sorted(allowed)) or 'no options'}")
    kw: dict[str, Any] = {}
    if args.objects is not None:
        kw["objects" if task == "count" else "n_objects"] = args.objects
    for name in ("entropy", "kind", "present", "regime", "diversity", "split"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.positions is not None:
        if args.positions == "all":
            kw["positions"] = "all"
        else:
            try:
                kw["positions_per_conjunction"] = int(args.positions)
            except ValueError:
                raise StimulusError(f"--positions {args.positions!r} must be a number or 'all'") from None
    if given & set(_CANVAS_OPTIONS):
        defaults = {"image_size": 224, "grid": 3, "object_size": None}
        canvas_kw = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k] for k in _CANVAS_OPTIONS}
        kw["canvas"] = Canvas(**canvas_kw)
    return kw


def generate(task: str, n: int | None, seed: int, kwargs: dict[str, Any], pairs: str | None = None) -> Any:
    """Run the generator of ``task`` (``pairs``: counterfactual pairs of that condition, scene only)."""
    import importlib

    if task not in TASKS:
        raise StimulusError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    module, function, _ = TASKS[task]
    if task == "rsa" and n is not None:
        raise StimulusError("rsa makes every conjunction at --positions positions; it takes no --n")
    if task != "rsa" and (n is None or n < 1):
        raise StimulusError(f"--n must be a positive number of examples, got {n}")
    mod = importlib.import_module(f"vlmbind.stimuli.{module}")
    if task == "rsa":
        return mod.rsa_set(seed, **kwargs)
    if pairs is not None:
        kwargs = {k: v for k, v in kwargs.items() if k != "pairs"}
        return mod.scene_pairs(n, pairs, seed, **kwargs)
    return getattr(mod, function)(n, seed, **kwargs)


def cmd_stimuli(args: argparse.Namespace, command: list[str]) -> tuple[dict[str, Any], str, int]:
    from ..io import check_out_dir

    kwargs = _kwargs(args.task, args)
    if args.seed < 0:
        raise StimulusError(f"--seed must be >= 0, got {args.seed}")
    check_out_dir(args.out)
    start = time.perf_counter()
    data = generate(args.task, args.n, args.seed, kwargs, pairs=args.pairs)
    elapsed = time.perf_counter() - start
    out = Path(args.out)
    data.save(out)
    summary = {"task": args.task, "pairs": args.pairs, "n": len(data), "seed": args.seed, "out": str(out),
               "seconds": round(elapsed, 3), "per_second": round(len(data) / elapsed, 1) if elapsed > 0 else None,
               "command": " ".join(command), **{k: v for k, v in data.summary.items()}}
    what = f"{len(data)} {args.pairs + ' pairs' if args.pairs else args.task + ' examples'}"
    text = f"wrote {what} (seed {args.seed}) to {out} in {elapsed:.1f} s"
    for key, value in data.summary.items():
        text += f"\n  {key}: {value}"
    return summary, text, 0
