"""``vlmbind locate``: head-level causal mediation on counterfactual scene pairs (or the model's pointing traces)."""

from __future__ import annotations

from typing import Any

from ...core.choices import CONDITIONS, IG_STEPS, METHODS
from ...core.choices import LOCATE_CHECKPOINT as CHECKPOINT
from ...core.errors import InputError
from .arguments import (
    add_placement,
    add_prompt_format,
    check_model,
    int_at_least,
    model_session,
    out_dir,
    parse_range,
    rank_done,
)

# its place in `vlmbind --help`
HELP_ORDER = 50


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("locate", parents=[common], help="head-level causal mediation on counterfactual scene pairs",
                       description="Score every attention head by patching its output from counterfactual scenes.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    p.add_argument("--condition", required=True, choices=CONDITIONS,
                   help="scene pairs (VSM's three) or attention_swap (PbP: the model's own pointing traces)")
    p.add_argument("--n-pairs", type=int_at_least(1, "--n-pairs 16"), default=16,
                   help="counterfactual pairs (default 16); too few to separate any head from zero is said")
    p.add_argument("--seed", type=int, default=0, help="pair seed")
    p.add_argument("--objects", type=parse_range, help="objects per scene: N or LOW-HIGH (default 3)")
    p.add_argument("--entropy", choices=("high", "low"), default="high",
                   help="scenes of distinct features (high) or shared ones (low)")
    add_prompt_format(p)
    p.add_argument("--method", choices=METHODS, default="exact",
                   help="exact (fast, equal to naive), naive (one forward per head), attribution (first-order "
                        "estimate), integrated_gradients (path estimate)")
    p.add_argument("--verify-top", type=int_at_least(0, "--verify-top 10"), default=10,
                   help="attribution, integrated_gradients: run exact on this many top candidates")
    p.add_argument("--ig-steps", type=int_at_least(1, "--ig-steps 1"), default=IG_STEPS,
                   help=f"integrated_gradients: points on the path from clean to counterfactual (default {IG_STEPS})")
    p.add_argument("--trace-task", choices=("count", "search"), default="count",
                   help="attention_swap: displays the traces are generated on")
    p.add_argument("--out", default=None, help="output directory (default runs/locate/<model>-<condition>)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from OUT/locate.partial.safetensors (same arguments)")
    p.add_argument("--processes", type=int, default=1,
                   help="split the pairs over N worker processes (default 1; implied by torchrun / accelerate launch)")
    p.set_defaults(func=cmd_locate)


def refuse_other_finished_run(out: Any, args: Any) -> None:
    """``--resume`` on a folder whose run finished (no checkpoint or parts left) with other arguments has nothing to
    resume and would replace that run: refuse it, naming what differs (from the finished run's summary.json)."""
    from ...core.userfiles import located_summary, same_model

    if (out / CHECKPOINT).is_file() or (out / ".parts").is_dir():
        return
    done = located_summary(out / "scores.csv")
    if not done or done.get("kind", "head_scores") != "head_scores":
        return
    pairs = {"--model": (done.get("model"), str(args.model)), "--condition": (done.get("condition"), args.condition),
             "--method": (done.get("method"), args.method), "--n-pairs": (done.get("n"), args.n_pairs)}
    if args.prompt_format:
        pairs["--prompt-format"] = (done.get("prompt_format"), args.prompt_format)
    changed = [f"{flag} {then} (this command: {now})" for flag, (then, now) in pairs.items()
               if then is not None and then != now and not (flag == "--model" and same_model(then, now))]
    if changed:
        raise InputError(f"--resume: {out} holds a finished run with {', '.join(changed)}, so there is nothing to "
                         f"resume and it would be replaced; drop --resume and choose another --out, or repeat the "
                         f"finished run's arguments")


def cmd_locate(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    from ...analysis import sweeps
    from ...analysis.evaluation import training_defaults
    from ...analysis.mediation import answer_casing, locate
    from ...analysis.traces import point_swap_pairs
    from ...engine import parallel
    from ...stimuli import scene_pairs

    method_kwargs: dict[str, Any] = {"steps": args.ig_steps} if args.method == "integrated_gradients" else {}
    out = out_dir(args, "locate", args.condition)
    checkpoint = out / CHECKPOINT
    if args.resume:
        refuse_other_finished_run(out, args)
    world = parallel.world_size(args.processes)
    if args.n_pairs < world:
        raise InputError(f"--n-pairs {args.n_pairs} cannot be shared by {world} processes; pass --processes "
                         f"{args.n_pairs} or more pairs")
    with model_session(args, command, out, sweep="locate", checkpoint=checkpoint) as (group, vlm):
        if args.condition != "attention_swap":
            method_kwargs["prompt_format"] = vlm.prompt_format(args.prompt_format)
        if args.condition == "attention_swap":
            extra = {"objects": args.objects} if args.objects else {}
            pairs = point_swap_pairs(vlm, args.n_pairs, args.seed, task=args.trace_task, **extra)
        else:
            kwargs = training_defaults(vlm, "scene", {"n_objects": args.objects or 3, "entropy": args.entropy})
            pairs = scene_pairs(args.n_pairs, args.condition, args.seed, **kwargs)
        if group.world == 1:
            scores = locate(vlm, pairs, method=args.method, progress=not args.json, verify_top=args.verify_top,
                            checkpoint=checkpoint, **method_kwargs)
        else:
            scores = sweeps.locate(group, vlm, pairs, out, method=args.method, verify_top=args.verify_top,
                                   progress=group.is_main and not args.json, **method_kwargs)
            if not group.is_main:
                return rank_done(group, out)
        if args.condition != "attention_swap":
            scores.answer_casing = answer_casing(vlm, pairs, method_kwargs["prompt_format"])
    scores.save(out)
    parallel.remove_parts(out, "locate")
    summary = {**scores.summary(), "out": str(out), "command": " ".join(command)}
    if group.world > 1:
        summary["processes"] = group.world
    top = scores.ranking_text(5)
    significance = scores.significance_note() or (
        "significant (BH q < 0.05): " + ", ".join(f"{l}.{h}" for l, h in scores.significant_top(10)))
    casing = scores.answer_casing
    note = ""
    if casing and casing["share"] > 0.5:
        note = (f"  note: on {casing['capitalised_preferred']}/{casing['n']} clean prompts the model prefers the "
                f"capitalised answer token (mean gap {casing['mean_logit_gap']:+.2f}); the scores use the lower-case "
                f"tokens\n")
    text = (f"{vlm.name}, {args.condition}, {scores.n} pairs, {args.method}, {scores.prompt_format} prompts: "
            f"{scores.seconds:.1f} s\n"
            f"  top heads (mean [95% interval], * significant): {top}\n  {significance}\n{note}  wrote {out}/scores.csv, heatmap.html, summary.json")
    return summary, text, 0
