"""``vlmbind ablate``: task accuracy with heads ablated (top-k vs random-k vs bottom-k of a scores.csv)."""

from __future__ import annotations

import sys
from typing import Any

from ...core.choices import ABLATION_MODES as MODES
from ...core.choices import ABLATION_RANDOM_POOLS as RANDOM_POOLS
from ...core.choices import TEXT_POSITION_CONDITIONS
from ...core.errors import InputError
from .arguments import (
    add_placement,
    add_plugin,
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
# the random arms when --random-from is not given: from the heads outside the top-k, and from the top-k's own layers
# (dropped, with a note, where a layer has no other head to draw)
DEFAULT_RANDOM_FROM = ("rest", "same_layers")
DEFAULT_TOP_K = 5


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("ablate", parents=[common], help="task accuracy with heads ablated (top-k vs random vs bottom)",
                       description="Ablate heads given by --heads, or the top / random / bottom k of a scores.csv "
                                   "written by `vlmbind locate`, and report task accuracy for each arm.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    add_prompt_format(p)
    add_plugin(p, "tasks")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--task", metavar="TASK", help="the task whose accuracy is measured: scene, query, search, "
                                                     "count, or one a --plugin file registers")
    data.add_argument("--data", metavar="PATH", help="your own task: a folder holding task.jsonl, or the file (image, "
                                                     "prompt, answer; optional accept and scorer)")
    heads = p.add_mutually_exclusive_group(required=True)
    heads.add_argument("--heads", help="LAYER.HEAD list, e.g. 2.1,3.0")
    add_scores_options(p, heads)
    p.add_argument("--top-k", type=int_at_least(1, "--top-k 5"), default=None,
                   help=f"with --scores: heads per arm (default {DEFAULT_TOP_K}; with --heads, as many as it lists)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="image_attention (zero attention to image tokens), zero, mean (the head's output replaced by "
                        "its mean over every token) or role_mean (by its mean over the tokens of the same role: image, "
                        "text); default: zero for scores located on id_selection / id_retrieval (heads that act at "
                        "text positions), image_attention otherwise")
    p.add_argument("--renormalize", action="store_true", help="image_attention: renormalise the remaining attention")
    p.add_argument("--seeds", type=int_at_least(1, "--seeds 5"), default=5,
                   help="random-k draws per random arm (default 5)")
    p.add_argument("--random-from", metavar="POOLS", default=None,
                   help="the random arms' pools, comma-separated: rest (the heads outside the top-k), same_layers "
                        "(per top-k head another head of its layer), all (every head); the first is the random arm, "
                        "each other one an arm random_<pool> on the same seeds (default rest,same_layers, "
                        "same_layers left out where a top-k layer has no other head to draw)")
    p.add_argument("--bottom-by", choices=("abs", "score"), default=None,
                   help="with --scores, the bottom arm: the k smallest |score| (default; the heads least involved "
                        "either way) or the k lowest scores (the most negative heads)")
    p.add_argument("--n", type=int_at_least(1, "--n 200"), default=None, help="evaluation examples (default 200)")
    p.add_argument("--seed", type=int, default=None, help="stimulus seed (default 1)")
    p.add_argument("--objects", type=parse_range, help="objects per display: N or LOW-HIGH (default: the task's)")
    p.add_argument("--image-size", type=int_at_least(8, "--image-size 448"), default=None,
                   help="canvas side in pixels (default: an organism's training size, else the model family's typical "
                        "input size; results.json records it)")
    p.add_argument("--out", default=None,
                   help="output directory (default runs/ablate/<model>-<task>-<mode>-top<k>, or -heads with --heads)")
    p.set_defaults(func=cmd_ablate)


def random_pools(text: str | None) -> tuple[str, ...]:
    """``--random-from``'s pools in order (the default's when not given).

    Raises:
        InputError: an unknown or repeated pool, or none.
    """
    if text is None:
        return DEFAULT_RANDOM_FROM
    pools = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in pools if p not in RANDOM_POOLS]
    if unknown or not pools:
        what = f"unknown pool {', '.join(map(repr, unknown))}" if unknown else "no pool"
        raise InputError(f"--random-from {text!r}: {what}; pass a comma-separated list of {', '.join(RANDOM_POOLS)}, "
                         f"e.g. --random-from {','.join(DEFAULT_RANDOM_FROM)}")
    repeated = sorted({p for p in pools if pools.count(p) > 1})
    if repeated:
        raise InputError(f"--random-from {text!r} names {', '.join(repeated)} twice; name each pool once")
    return pools


def refuse_inapplicable(args: Any, mode: str, condition: str | None) -> None:
    """Refuse the options that would change nothing in this run (``mode``: the ablation mode it runs in).

    Raises:
        InputError: an option that does not apply, named with why and what to do.
    """
    if args.heads is not None:
        if args.top_k is not None:
            raise InputError("--top-k does not apply with --heads (the arms have as many heads as --heads lists); "
                             "drop it, or pass --scores to ablate the top k of a table")
        if args.bottom_by is not None:
            raise InputError("--bottom-by does not apply with --heads (it orders a --scores table's heads; with "
                             "--heads the bottom arm is the heads with the highest indices either way); drop it, or "
                             "pass --scores")
        if args.scores_from_any_model:
            raise InputError("--scores-from-any-model does not apply with --heads (it accepts a --scores table "
                             "located on another model); drop it")
    if args.renormalize and mode != "image_attention":
        chosen = "--mode " + mode if args.mode else f"{mode}, the default for scores located on {condition}"
        raise InputError(f"--renormalize applies to --mode image_attention only (it renormalises the attention left "
                         f"once the image's is removed); this run ablates with {chosen}; drop --renormalize or pass "
                         f"--mode image_attention")


def refuse_image_size(args: Any) -> None:
    """Refuse ``--image-size`` on a task whose stimuli are drawn on no canvas of vlmbind's (a --plugin file's task,
    colorshape), before any model loads.

    Raises:
        InputError: the task takes no canvas.
    """
    if args.image_size is not None and args.data is None:
        from ...stimuli.tasks import task_kwargs

        task_kwargs(args.task, {"image_size": args.image_size})


def cmd_ablate(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    check_scores_model(args)
    user_data = task_data(args, ("n", "seed", "objects", "image_size"))
    refuse_image_size(args)
    # the checks of the arguments alone, before the imports below, which import torch
    from ...core.checks import check_head_list
    from ...core.userfiles import scores_context

    pools = random_pools(args.random_from)
    given_heads = check_head_list(args.heads, flag="--heads") if args.heads is not None else None
    # a scores table's condition chooses the default mode
    condition = scores_context(args.scores, "condition") if args.scores else None
    mode = args.mode or ("zero" if condition in TEXT_POSITION_CONDITIONS else "image_attention")
    refuse_inapplicable(args, mode, condition)
    k = args.top_k or DEFAULT_TOP_K
    # what tells runs apart names the default folder, so that a run in another mode never replaces one
    out = out_dir(args, "ablate", task_label(args), mode, f"top{k}" if args.scores else "heads")
    import pandas as pd

    from ...analysis.ablation import POOL_LABELS, ablation_study, layers_short_of_heads, ranked_heads
    from ...analysis.evaluation import outside_training, stimulus_defaults
    from ...core.userfiles import read_scores
    from ...stimuli.tasks import generate

    vlm = load_model(args)
    canvas = None
    if user_data is None:
        kwargs = {} if args.objects is None else {"objects" if args.task == "count" else "n_objects": args.objects}
        kwargs, canvas = stimulus_defaults(vlm, args.task, kwargs, args.image_size)
        outside = outside_training(vlm, args.task, kwargs)
        if outside:
            print(f"vlmbind: warning: {outside}", file=sys.stderr)
        dataset = generate(args.task, args.n, args.seed, kwargs)
    else:
        dataset = user_data
    if args.scores:
        frame = read_scores(args.scores, n_layers=vlm.n_layers, n_heads=vlm.n_heads)
    else:
        heads = check_head_list(given_heads, n_layers=vlm.n_layers, n_heads=vlm.n_heads)
        ranked = heads + [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads) if (l, h) not in heads]
        frame = pd.DataFrame([{"layer": l, "head": h, "score": float(len(ranked) - i)} for i, (l, h) in
                              enumerate(ranked)])
        k = len(heads)
    note = ""
    short = layers_short_of_heads(ranked_heads(frame)[:k], vlm.n_heads)
    if "same_layers" in pools and short and 1 <= k <= vlm.n_layers * vlm.n_heads // 2:
        layers = ", ".join(map(str, short))
        if args.random_from is not None:
            raise InputError(f"--random-from same_layers draws, for each top-k head, another head of its layer, and "
                             f"layer {layers} of {vlm.name} ({vlm.n_heads} heads) has too few heads outside the "
                             f"top-k; drop same_layers from --random-from")
        pools = tuple(p for p in pools if p != "same_layers")
        note += (f"  note: no random arm {POOL_LABELS['same_layers']}: layer {layers} has too few heads outside the "
                 f"top-k to match each top-k head there\n")
    result = ablation_study(vlm, dataset, frame, k=k, mode=mode, renormalize=args.renormalize,
                            seeds=tuple(range(args.seeds)), bottom_by=args.bottom_by or "abs",
                            random_from=pools[0], also_random_from=pools[1:])
    result.canvas = canvas
    result.save(out)
    summary = {**result.summary(), "prompt_format": vlm.active_prompt_format,
               "out": str(out), "command": " ".join(command)}
    if condition is not None:
        summary["scores_condition"] = condition
    if mode == "image_attention" and condition in TEXT_POSITION_CONDITIONS:
        note += (f"  note: these heads were located on {condition}, where they act at text positions; removing their "
                 f"attention to the image cannot remove them (--mode zero, mean or role_mean can)\n")
    text = (f"{vlm.name} on {args.task or args.data} (n={len(dataset)}), {mode} ablation of {result.k} heads\n"
            f"{note}  "
            + result.text().replace("\n", "\n  ") + f"\n  wrote {out}/results.json")
    return summary, text, 0
