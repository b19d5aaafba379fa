"""``vlmbind stimuli TASK --n N --seed S --out DIR``: generate a data set (or counterfactual pairs) to disk."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ...core.choices import PAIR_CONDITIONS
from ...core.choices import STIMULI_TASKS as TASKS
from .arguments import int_at_least, parse_range

# its place in `vlmbind --help`
HELP_ORDER = 30


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stimuli", parents=[common],
        help="generate a synthetic data set (images, meta.jsonl or pairs.jsonl, dataset.json)",
        description="Generate one of the papers' synthetic data sets, deterministic from the seed.",
    )
    p.add_argument("task", choices=sorted(TASKS), help="which data set")
    p.add_argument("--n", type=int, default=None, help="number of examples (pairs with --pairs); rsa takes none")
    p.add_argument("--seed", type=int_at_least(0, "--seed 0"), default=0,
                   help="stimulus seed (same seed, byte-identical files)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--pairs", choices=PAIR_CONDITIONS,
                   help="scene only: counterfactual pairs for this condition, written as pairs.jsonl (the folder "
                        "`vlmbind locate --pairs` reads)")
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


def cmd_stimuli(args: argparse.Namespace, command: list[str]) -> tuple[dict[str, Any], str, int]:
    from ...core.io import check_out_dir
    from ...stimuli.tasks import generate, task_kwargs

    kwargs = task_kwargs(args.task, vars(args))
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
