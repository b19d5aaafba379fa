"""``vlmbind relevancy``: relevancy maps over image and prompt tokens, scored by deletion / insertion curves against
random maps and by an attention knockout of the most relevant cells."""

from __future__ import annotations

from typing import Any

from ...core.choices import RELEVANCY_KNOCKOUT_QUERIES as KNOCKOUT_QUERIES
from ...core.choices import RELEVANCY_METHODS as METHODS
from ...core.choices import RELEVANCY_TARGETS as TARGETS
from ...core.choices import RELEVANCY_TASKS as TASKS
from ...core.errors import InputError, close_matches
from .arguments import add_placement, add_prompt_format, check_model, int_at_least, load_model, out_dir

# its place in `vlmbind --help`
HELP_ORDER = 67
HELP = "relevancy maps scored by deletion/insertion curves and knockout"


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("relevancy", parents=[common], help=HELP,
                       description="Explain the answer's first token with gradient-weighted attention (Chefer et "
                                   "al.), attention rollout and input x gradient over every prompt position; lay "
                                   "the maps on the image, score them by deletion / insertion curves against "
                                   "random maps, block the attention to the most relevant cells, and measure how "
                                   "much of each map falls on the object asked about.")
    p.add_argument("--model", required=True, help="registered name, model directory or hub id")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--task", choices=TASKS, default="query", help="the stimuli (default query)")
    p.add_argument("--n", type=int_at_least(1, "--n 32"), default=32, help="number of examples (default 32)")
    p.add_argument("--seed", type=int_at_least(0, "--seed 1"), default=1,
                   help="stimulus, random-map and bootstrap seed (default 1)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated maps (default {','.join(METHODS)})")
    p.add_argument("--target", choices=TARGETS, default="answer",
                   help="the explained token: the expected answer's first token (default) or the model's greedy one")
    p.add_argument("--fractions", type=int_at_least(1, "--fractions 10"), default=10,
                   help="steps of the deletion / insertion grid from 0 to 1 (default 10)")
    p.add_argument("--random-maps", type=int_at_least(1, "--random-maps 5"), default=5,
                   help="random orders per example to compare with (default 5)")
    p.add_argument("--knockout-k", type=int_at_least(1, "--knockout-k 1"), default=None,
                   help="cells knocked out (default: the cells the target object covers)")
    p.add_argument("--knockout-queries", choices=KNOCKOUT_QUERIES, default="text",
                   help="whose attention to them is blocked: every non-image position (default), the last "
                        "position, or every position")
    p.add_argument("--batch-size", type=int_at_least(1, "--batch-size 16"), default=16,
                   help="rows per forward (default 16)")
    p.add_argument("--out", default=None, help="output directory (default runs/relevancy/<model>-<task>)")
    p.set_defaults(func=cmd_relevancy)


def parse_methods(text: str) -> list[str]:
    """``--methods`` as a list, refused when it names an unknown or repeated method."""
    methods = [m.strip() for m in str(text).split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        hint = close_matches(bad[0], METHODS) if bad else ""
        raise InputError(f"--methods {text!r}: {bad or 'nothing'} not among {', '.join(METHODS)}.{hint}")
    if len(set(methods)) != len(methods):
        raise InputError(f"--methods {text!r} names a method twice")
    return methods


def _interval(row: dict[str, Any], name: str) -> str:
    return f"{row[name]:+.3f} [{row[name + '_lo']:+.3f}, {row[name + '_hi']:+.3f}]"


def cmd_relevancy(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    methods = parse_methods(args.methods)
    out = out_dir(args, "relevancy", args.task)
    from ...analysis.relevancy import RANDOM, relevancy, relevancy_dataset  # after the checks: it imports torch

    vlm = load_model(args)
    dataset = relevancy_dataset(vlm, args.task, args.n, args.seed)
    result = relevancy(vlm, dataset, methods=methods, target=args.target, fractions=args.fractions,
                       random_maps=args.random_maps, seed=args.seed, knockout_k=args.knockout_k,
                       knockout_queries=args.knockout_queries, batch_size=args.batch_size, progress=not args.json)
    result.save(out)
    summary = {**result.summary(), "out": str(out), "command": " ".join(command)}
    head = (f"{vlm.name}, {args.task}, {result.n} examples, target: {result.target_rule} (the model gives the "
            f"answer on {summary['gives_answer']:.0%}) ({result.seconds:.1f} s)")
    legend = "  AUC: deletion lower is better, insertion higher is better; differences to random with 95% intervals"
    lines = [head, legend]
    for row in result.scores().to_dict("records"):
        if row["method"] == RANDOM:
            lines.append(f"  {RANDOM}: deletion {row['deletion_auc']:.3f}, insertion {row['insertion_auc']:.3f}, "
                         f"knockout drop {row['knockout_drop']:+.3f}, changed {row['knockout_changed']:.0%}")
            continue
        lines.append(f"  {row['method']}: deletion {row['deletion_auc']:.3f} ({_interval(row, 'deletion_vs_random')}"
                     f"), insertion {row['insertion_auc']:.3f} ({_interval(row, 'insertion_vs_random')}), "
                     f"knockout drop {row['knockout_drop']:+.3f} (vs random {_interval(row, 'knockout_drop_vs_random')}"
                     f"), changed {row['knockout_changed']:.0%}, target share {row['target_share']:.3f} vs other "
                     f"objects {row['other_share']:.3f} (uniform {row['uniform_share']:.3f})")
    lines.append(f"  wrote {out}/method_scores.csv, maps.csv, curves.csv, knockout.csv, relevancy.html, curves.html, "
                 "relevancy.json, summary.json")
    return summary, "\n".join(lines), 0
