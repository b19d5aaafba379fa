"""``vlmbind ablate``: task accuracy with heads ablated (top-k vs random-k vs bottom-k of a scores.csv)."""

from __future__ import annotations

from typing import Any

from ...core.choices import ABLATION_MODES as MODES
from ...core.choices import TEXT_POSITION_CONDITIONS
from ...core.errors import InputError
from .arguments import (
    add_placement,
    add_prompt_format,
    add_scores_options,
    check_model,
    check_scores_model,
    int_at_least,
    load_model,
    out_dir,
    parse_range,
    task_data,
    task_label,
)

# its place in `vlmbind --help`
HELP_ORDER = 90


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("ablate", parents=[common], help="task accuracy with heads ablated (top-k vs random vs bottom)",
                       description="Ablate heads given by --heads, or the top / random / bottom k of a scores.csv "
                                   "written by `vlmbind locate`, and report task accuracy for each arm.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    add_prompt_format(p)
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--task", choices=("scene", "query", "search", "count"),
                      help="the built-in task whose accuracy is measured")
    data.add_argument("--data", metavar="PATH", help="your own task: a folder holding task.jsonl, or the file (image, "
                                                     "prompt, answer; optional accept and scorer)")
    heads = p.add_mutually_exclusive_group(required=True)
    heads.add_argument("--heads", help="LAYER.HEAD list, e.g. 2.1,3.0")
    add_scores_options(p, heads)
    p.add_argument("--top-k", type=int_at_least(1, "--top-k 5"), default=5, help="heads per arm (default 5)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="image_attention (zero attention to image tokens), zero, mean (the head's output replaced by "
                        "its mean over every token) or role_mean (by its mean over the tokens of the same role: image, "
                        "text); default: zero for scores located on id_selection / id_retrieval (heads that act at "
                        "text positions), image_attention otherwise")
    p.add_argument("--renormalize", action="store_true", help="image_attention: renormalise the remaining attention")
    p.add_argument("--seeds", type=int_at_least(1, "--seeds 5"), default=5,
                   help="random-k draws, each from the heads outside the top-k (default 5)")
    p.add_argument("--bottom-by", choices=("abs", "score"), default="abs",
                   help="the bottom arm: the k smallest |score| (default; the heads least involved either way) or "
                        "the k lowest scores (the most negative heads)")
    p.add_argument("--n", type=int_at_least(1, "--n 200"), default=None, help="evaluation examples (default 200)")
    p.add_argument("--seed", type=int, default=None, help="stimulus seed (default 1)")
    p.add_argument("--objects", type=parse_range, help="objects per display: N or LOW-HIGH (default: the task's)")
    p.add_argument("--out", default=None,
                   help="output directory (default runs/ablate/<model>-<task>-<mode>-top<k>, or -heads with --heads)")
    p.set_defaults(func=cmd_ablate)


def cmd_ablate(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    check_scores_model(args)
    user_data = task_data(args, ("n", "seed", "objects"))
    import pandas as pd

    from ...analysis.ablation import ablation_study
    from ...analysis.evaluation import training_defaults
    from ...core.sites import parse_heads
    from ...core.userfiles import read_scores, scores_context
    from ...stimuli.tasks import generate

    condition = scores_context(args.scores, "condition") if args.scores else None
    mode = args.mode or ("zero" if condition in TEXT_POSITION_CONDITIONS else "image_attention")
    # what tells runs apart names the default folder, so that a run in another mode never replaces one
    out = out_dir(args, "ablate", task_label(args), mode, f"top{args.top_k}" if args.scores else "heads")
    vlm = load_model(args)
    if user_data is None:
        kwargs = {} if args.objects is None else {"objects" if args.task == "count" else "n_objects": args.objects}
        dataset = generate(args.task, args.n, args.seed, training_defaults(vlm, args.task, kwargs))
    else:
        dataset = user_data
    if args.scores:
        scores = read_scores(args.scores, n_layers=vlm.n_layers, n_heads=vlm.n_heads)
        result = ablation_study(vlm, dataset, scores, k=args.top_k, mode=mode,
                                renormalize=args.renormalize, seeds=tuple(range(args.seeds)),
                                bottom_by=args.bottom_by)
    else:
        heads = parse_heads(args.heads)
        if not heads:
            raise InputError(f"--heads {args.heads!r} lists no heads; pass LAYER.HEAD pairs, e.g. 2.1,3.0")
        bad = [f"{l}.{h}" for l, h in heads if not (0 <= l < vlm.n_layers and 0 <= h < vlm.n_heads)]
        if bad:
            raise InputError(f"heads {bad} do not exist: the model has layers 0..{vlm.n_layers - 1} and heads "
                             f"0..{vlm.n_heads - 1}")
        ranked = heads + [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads) if (l, h) not in heads]
        frame = pd.DataFrame([{"layer": l, "head": h, "score": float(len(ranked) - i)} for i, (l, h) in
                              enumerate(ranked)])
        result = ablation_study(vlm, dataset, frame, k=len(heads), mode=mode, renormalize=args.renormalize,
                                seeds=tuple(range(args.seeds)), bottom_by=args.bottom_by)
    result.save(out)
    summary = {**result.summary(), "prompt_format": vlm.active_prompt_format,
               "out": str(out), "command": " ".join(command)}
    if condition is not None:
        summary["scores_condition"] = condition
    note = ""
    if mode == "image_attention" and condition in TEXT_POSITION_CONDITIONS:
        note = (f"  note: these heads were located on {condition}, where they act at text positions; removing their "
                f"attention to the image cannot remove them (--mode zero, mean or role_mean can)\n")
    text = (f"{vlm.name} on {args.task or args.data} (n={len(dataset)}), {mode} ablation of {result.k} heads\n"
            f"{note}  "
            + result.text().replace("\n", "\n  ") + f"\n  wrote {out}/results.json")
    return summary, text, 0
