"""``vlmbind edit``: position-ID additive edits (VSM) and entropy repair."""

from __future__ import annotations

from typing import Any

from ...core.choices import EDIT_POSITIONS
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
)

# its place in `vlmbind --help`
HELP_ORDER = 100
DEFAULT_TOP_K = 3


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("edit", parents=[common], help="position-ID additive edits (VSM) and entropy repair",
                       description="Estimate position IDs at chosen heads, add alpha * (d_t - d_o) at the last "
                                   "prompt token, and report how often the answer switches to the object at t "
                                   "(with an empty-cell control); --repair adds the entropy-repair experiment.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    add_prompt_format(p)
    heads = p.add_mutually_exclusive_group(required=True)
    heads.add_argument("--heads", help="LAYER.HEAD list, e.g. 2.1,3.0")
    add_scores_options(p, heads)
    p.add_argument("--top-k", type=int_at_least(1, "--top-k 3"), default=None,
                   help=f"with --scores: edit the k best heads (default {DEFAULT_TOP_K})")
    p.add_argument("--alpha", default="0,0.5,1,2,4,8", help="comma-separated alphas (0 is always added)")
    p.add_argument("--n-estimate", type=int, default=512, help="estimation examples (default 512)")
    p.add_argument("--positions", choices=EDIT_POSITIONS, default=None,
                   help="where the edit is added: the prompt's last position (VSM's edit; the default on other "
                        "models) or also every answer position (the default on models vlmbind trained, whose IDs are "
                        "read there too, as validate edits them)")
    p.add_argument("--n-eval", type=int, default=64, help="evaluation examples (default 64)")
    p.add_argument("--seed", type=int, default=0, help="stimulus seed")
    p.add_argument("--objects", type=parse_range, help="objects per scene: N or LOW-HIGH (default 3)")
    p.add_argument("--repair", action="store_true", help="also run entropy repair (high-entropy IDs into "
                                                          "low-entropy scenes)")
    p.add_argument("--out", default=None,
                   help="output directory (default runs/edit/<model>-<positions>-top<k>, or -heads with --heads)")
    p.set_defaults(func=cmd_edit)


def _heads_from_scores(path_text: str, top_k: int, vlm: Any) -> list[tuple[int, int]]:
    from ...analysis.ablation import ranked_heads
    from ...analysis.position_ids import check_heads
    from ...core.userfiles import read_scores

    frame = read_scores(path_text, n_layers=vlm.n_layers, n_heads=vlm.n_heads)
    ranked = ranked_heads(frame)
    if not 1 <= top_k <= len(ranked):
        raise InputError(f"--top-k {top_k} must be between 1 and the {len(ranked)} heads in {path_text!r}")
    return check_heads(vlm, ranked[:top_k])


def n_estimate_error(exc: Any, args: Any) -> InputError:
    """A study's too-few-estimates error (``reason`` and ``enough`` on it) in the command line's terms."""
    fix = (f"rerun with --n-estimate {exc.enough} (its scenes leave examples to edit, at this --seed and --n-eval)"
           if exc.enough is not None else
           "more --n-estimate does not help with these scenes: raise --n-eval")
    return type(exc)(f"--n-estimate {args.n_estimate} is too few: {exc.reason}; {fix}")


def cmd_edit(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    if args.heads is not None and args.top_k is not None:
        raise InputError("--top-k does not apply with --heads (the edit is added at every head --heads lists); drop "
                         "it, or pass --scores to edit the top k of a table")
    if args.heads is not None and args.scores_from_any_model:
        raise InputError("--scores-from-any-model does not apply with --heads (it accepts a --scores table located "
                         "on another model); drop it")
    check_scores_model(args)
    # the checks of the arguments alone, before the imports below, which import torch
    from ...core.checks import check_alphas, check_head_list, check_positive

    alphas = check_alphas(args.alpha)
    check_positive(**{"--n-estimate": args.n_estimate, "--n-eval": args.n_eval})
    if args.heads is not None:
        check_head_list(args.heads, flag="--heads")  # the range is checked once the model is loaded
    args.top_k = args.top_k or DEFAULT_TOP_K
    # the default folder names the positions, whose default needs the model: every candidate is checked now
    label = f"top{args.top_k}" if args.scores else "heads"
    outs = {p: out_dir(args, "edit", p, label) for p in ([args.positions] if args.positions else EDIT_POSITIONS)}
    from ...analysis.edits import (
        alpha_label,
        check_estimates,
        default_positions,
        edit_study,
        entropy_repair,
    )
    from ...analysis.position_ids import check_heads
    from ...core.errors import TooFewEstimatesError

    vlm = load_model(args)
    positions = args.positions or default_positions(vlm)
    out = outs[positions]
    heads = _heads_from_scores(args.scores, args.top_k, vlm) if args.scores else check_heads(vlm, args.heads)
    options = dict(n_estimate=args.n_estimate, n_eval=args.n_eval, seed=args.seed, n_objects=args.objects or 3,
                   progress=not args.json, positions=positions)
    scenes = {k: options[k] for k in ("n_estimate", "n_eval", "seed", "n_objects")}
    try:
        # read from the scenes alone: a too-small --n-estimate is refused before any forward pass, for both studies
        check_estimates(vlm, **scenes, studies=("edit", "repair") if args.repair else ("edit",))
    except TooFewEstimatesError as exc:
        raise n_estimate_error(exc, args) from None
    result = edit_study(vlm, heads, alphas, **options)
    if args.repair:
        result.repair = entropy_repair(vlm, heads, alphas, **options)
    result.save(out)
    summary = {**result.summary(), "prompt_format": vlm.active_prompt_format,
               "out": str(out), "command": " ".join(command)}
    eff = ", ".join(f"{alpha_label(a)}: {result.efficacy(a):.3f}/{result.efficacy(a, 'control'):.3f}"
                    for a in alphas)
    lines = [f"{vlm.name}, position-ID edit at heads {', '.join(f'{l}.{h}' for l, h in heads)} "
             f"(n={result.n_used}, clean accuracy {result.clean_accuracy:.3f}, {result.seconds:.1f} s)",
             f"  efficacy / empty-cell control per alpha: {eff}"]
    if sum(result.skipped.values()):
        lines.append(f"  skipped evaluation examples: {result.skipped}")
    if result.repair is not None:
        rep = result.repair
        change = ", ".join(f"{alpha_label(a)}: {rep.accuracy(a) - rep.accuracy(0.0):+.3f}/"
                           f"{rep.accuracy(a, 'control') - rep.accuracy(0.0, 'control'):+.3f}" for a in alphas)
        lines.append(f"  entropy repair (oracle, correct ID / wrong-cell ID), low-entropy accuracy "
                     f"{rep.clean_accuracy:.3f} (high {rep.high_accuracy:.3f}), change per alpha: {change}")
    lines.append(f"  wrote {out}/results.json and curve.html")
    return summary, "\n".join(lines), 0
