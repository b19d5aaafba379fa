"""``vlmbind track``: attention-centroid tracking of Point-to-Answer traces (PbP)."""

from __future__ import annotations

from typing import Any

from ...core.choices import TRACK_QUERIES as QUERIES
from ...core.choices import TRACK_TASKS as TASKS
from ...core.errors import InputError
from .arguments import (
    add_placement,
    add_point_frame,
    add_prompt_format,
    check_model,
    int_at_least,
    load_model,
    out_dir,
    parse_range,
)

# its place in `vlmbind --help`
HELP_ORDER = 60


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("track", parents=[common], help="attention-centroid tracking of Point-to-Answer traces (PbP)",
                       description="Generate Point-to-Answer traces, take every layer's and head's attention to "
                                   "the image while each point is written, and report the thresholded centroid's "
                                   "RMSE against the point per layer and head.")
    p.add_argument("--model", required=True, help="registered name, model directory or hub id")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--task", required=True, choices=TASKS, help="the pointing task the centroids are tracked on")
    p.add_argument("--n", type=int_at_least(1, "--n 32"), default=32, help="number of examples (default 32)")
    p.add_argument("--seed", type=int_at_least(0, "--seed 1"), default=1, help="stimulus seed (default 1)")
    p.add_argument("--objects", type=parse_range, help="objects per image: N or LOW-HIGH (default: training range)")
    p.add_argument("--threshold", type=float, default=0.9, help="centroid threshold, fraction of the max (0.9)")
    p.add_argument("--query", choices=QUERIES, default="emit",
                   help="emit: the step producing each token (default); self: the step where it is the query")
    add_point_frame(p)
    p.add_argument("--batch-size", type=int_at_least(1, "--batch-size 8"), default=8,
                   help="examples generated together (default 8)")
    p.add_argument("--out", default=None, help="output directory (default runs/track/<model>-<task>)")
    p.set_defaults(func=cmd_track)


def cmd_track(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    if not 0.0 <= args.threshold < 1.0:
        raise InputError(f"--threshold must be in [0, 1), got {args.threshold}")
    out = out_dir(args, "track", args.task)
    from ...analysis.tracking import track, tracking_dataset  # after the checks: it imports torch

    vlm = load_model(args)
    dataset = tracking_dataset(vlm, args.task, args.n, args.seed, objects=args.objects)
    result = track(vlm, dataset, threshold=args.threshold, query=args.query, batch_size=args.batch_size,
                   point_frame=args.point_frame, progress=not args.json)
    result.save(out)
    summary = {**result.summary(), "out": str(out), "command": " ".join(command)}
    rmse = ", ".join(f"L{l} {v:.3f}" for l, v in enumerate(result.rmse_mean))
    best = ", ".join(f"L{l}.H{h} {r:.3f}" for l, h, r in result.best_heads())
    text = (f"{vlm.name}, {args.task}, {len(result.examples)} examples, {result.n_points} points "
            f"({result.seconds:.1f} s)\n  RMSE (head-averaged): {rmse}\n  best head per layer: {best}\n"
            f"  valley layer: {result.valley_layer}\n  wrote {out}/rmse.csv, rmse.html, centroids.json, summary.json")
    return summary, text, 0
