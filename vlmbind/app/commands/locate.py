"""``vlmbind locate``: head-level causal mediation on counterfactual scene pairs (or the model's pointing traces)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ...core.choices import CONDITIONS, IG_STEPS, METHODS
from ...core.choices import LOCATE_CHECKPOINT as CHECKPOINT
from ...core.errors import InputError
from .arguments import (
    add_placement,
    add_plugin,
    add_prompt_format,
    check_model,
    int_at_least,
    load_plugins,
    model_session,
    out_dir,
    parse_layers,
    parse_range,
    rank_done,
)

# its place in `vlmbind --help`
HELP_ORDER = 50
DEFAULT_N_PAIRS = 16
# the options that build vlmbind's own pairs, and which conditions take each; a pairs file brings its own
GENERATOR_OPTIONS = {"n_pairs": CONDITIONS, "seed": CONDITIONS, "objects": CONDITIONS,
                     "entropy": CONDITIONS[:-1], "image_size": CONDITIONS[:-1], "trace_task": CONDITIONS[-1:]}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def draws_on_canvas(task: str) -> bool:
    """Whether ``task``'s stimuli are drawn on a canvas vlmbind sizes (``--image-size``): its built-in tasks'."""
    from ...stimuli.tasks import TASKS

    return task in TASKS and "canvas" in TASKS[task][2]


def check_pairs_arguments(args: Any) -> Any:
    """The condition and the pairs file (read and validated before any model loads), or the built-in condition with
    only the options it takes; None for built-in pairs.

    Raises:
        InputError: no --condition and no --pairs; a condition that is not built in (without --pairs); an option
            that does not apply (a generator option with --pairs, --entropy on attention_swap, ...).
    """
    from ...core.errors import close_matches

    load_plugins(args)
    given = [name for name in GENERATOR_OPTIONS if getattr(args, name) is not None]
    if args.pairs is not None:
        if given:
            raise InputError(f"{', '.join(map(flag, given))} {'does' if len(given) == 1 else 'do'} not apply with "
                             f"--pairs (the file holds the pairs); drop {'it' if len(given) == 1 else 'them'}")
        from ...stimuli.pairs import load_pairs

        pairs = load_pairs(args.pairs, args.condition)
        args.condition = pairs.condition
        return pairs
    if args.condition is None:
        raise InputError("pass --condition (one of " + ", ".join(CONDITIONS) + ") or --pairs PATH (your own pairs)")
    from ...stimuli.registry import CONDITIONS as REGISTERED

    known = [*CONDITIONS, *(c for c in REGISTERED if c not in CONDITIONS)]
    if args.condition not in known:
        raise InputError(f"--condition {args.condition!r} is not registered.{close_matches(args.condition, known)} "
                         f"Registered: {', '.join(known)}; a condition of your own comes with --pairs PATH (pairs "
                         "as data) or --plugin FILE.py (as code)")

    def applies(name: str) -> bool:
        if args.condition in CONDITIONS:
            return args.condition in GENERATOR_OPTIONS[name]
        # a plugin's condition draws its pairs from its task's generator
        task = REGISTERED[args.condition].task
        return (name in ("n_pairs", "seed", "objects") or (name == "entropy" and task == "scene")
                or (name == "image_size" and draws_on_canvas(task)))

    stray = [name for name in given if not applies(name)]
    if stray:
        raise InputError(f"{', '.join(map(flag, stray))} {'does' if len(stray) == 1 else 'do'} not apply to "
                         f"--condition {args.condition}")
    args.n_pairs = DEFAULT_N_PAIRS if args.n_pairs is None else args.n_pairs
    args.seed = 0 if args.seed is None else args.seed
    return None


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("locate", parents=[common], help="head-level causal mediation on counterfactual scene pairs",
                       description="Score every attention head by patching its output from counterfactual scenes.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    p.add_argument("--condition", default=None, metavar="CONDITION",
                   help=f"{', '.join(CONDITIONS[:-1])} (scene pairs, VSM's three) or {CONDITIONS[-1]} (PbP: the "
                        "model's own pointing traces); with --pairs, which of the file's conditions (default: its "
                        "only one)")
    p.add_argument("--pairs", default=None, metavar="PATH",
                   help="your own counterfactual pairs: a folder holding pairs.jsonl, or the file (format: "
                        "docs/your_experiment.md; `vlmbind stimuli scene --pairs` writes one)")
    p.add_argument("--n-pairs", type=int_at_least(1, "--n-pairs 16"), default=None,
                   help=f"counterfactual pairs (default {DEFAULT_N_PAIRS}); too few to separate any head from zero "
                        "is said")
    p.add_argument("--seed", type=int, default=None, help="pair seed (default 0)")
    p.add_argument("--objects", type=parse_range, help="objects per scene: N or LOW-HIGH (default 3)")
    p.add_argument("--entropy", choices=("high", "low"), default=None,
                   help="scenes of distinct features (high, the default) or shared ones (low)")
    p.add_argument("--image-size", type=int_at_least(8, "--image-size 448"), default=None,
                   help="scene pairs: canvas side in pixels (default: an organism's training size, else the model "
                        "family's typical input size; the summary records it)")
    add_prompt_format(p)
    add_plugin(p, "conditions")
    p.add_argument("--method", choices=METHODS, default="exact",
                   help="exact (fast, equal to naive), naive (one forward per head), attribution (first-order "
                        "estimate), integrated_gradients (path estimate), atp_star (AtP with the QK fix and GradDrop: "
                        "magnitudes)")
    p.add_argument("--verify-top", type=int_at_least(0, "--verify-top 10"), default=10,
                   help="attribution, integrated_gradients, atp_star: run exact on this many top candidates")
    p.add_argument("--ig-steps", type=int_at_least(1, "--ig-steps 1"), default=IG_STEPS,
                   help=f"integrated_gradients: points on the path from clean to counterfactual (default {IG_STEPS})")
    p.add_argument("--layers", default=None, help="score only the heads of these layers, e.g. 0-3 or 1,2,5 (the others "
                   "are written as 0 and listed as unscored)")
    p.add_argument("--heads", default=None, help="score only these heads, e.g. 2.3,3.1 (with --layers: those of them "
                   "in its layers)")
    p.add_argument("--trace-task", choices=("count", "search"), default=None,
                   help="attention_swap: displays the traces are generated on (default count)")
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
    if args.pairs is not None:
        pairs["--pairs"] = (done.get("pairs_file"), pairs_source(args.pairs))
        del pairs["--n-pairs"]
    if args.prompt_format:
        pairs["--prompt-format"] = (done.get("prompt_format"), args.prompt_format)
    if args.image_size:
        pairs["--image-size"] = ((done.get("canvas") or {}).get("image_size"), args.image_size)
    changed = [f"{flag} {then} (this command: {now})" for flag, (then, now) in pairs.items()
               if then is not None and then != now and not (flag == "--model" and same_model(then, now))]
    if changed:
        raise InputError(f"--resume: {out} holds a finished run with {', '.join(changed)}, so there is nothing to "
                         f"resume and it would be replaced; drop --resume and choose another --out, or repeat the "
                         f"finished run's arguments")


def prediction_lines(check: dict[str, Any] | None) -> str:
    """The clean-prediction rate, and a warning naming the pairs whose clean prediction is not a."""
    if not check:
        return ""
    line = f"  the model's clean prediction is a on {check['clean_is_a']}/{check['n']} pairs"
    if check["counterfactual_checked"]:
        line += (f"; on the counterfactual input its own answer on {check['counterfactual_is_own']}/"
                 f"{check['counterfactual_checked']}")
    line += "\n"
    failing = check["failing"]
    if failing:
        named = ", ".join(f"{f['id']} ({f['expected']!r} expected, {f['predicted']!r} predicted)" for f in failing)
        more = check["n"] - check["clean_is_a"] - len(failing)
        line += (f"  warning: not a on {named}{f' and {more} more' if more > 0 else ''}: check those answers' "
                 f"spelling and the prompt")
        if check["clean_rate"] < 0.5:
            line += "; on most pairs the scores compare answers the model does not give"
        line += "\n"
    return line


def pairs_source(path: Any) -> str:
    """The pairs file a --pairs argument names, resolved (what the summary records)."""
    from ...stimuli.pairs import PAIRS_FILE

    path = Path(path)
    return str((path / PAIRS_FILE if path.is_dir() else path).resolve())


def cmd_locate(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    from ...core.checks import check_head_list
    layers = parse_layers(args.layers)
    heads = check_head_list(args.heads, flag="--heads") if args.heads is not None else None
    user_pairs = check_pairs_arguments(args)
    from ...analysis import sweeps
    from ...analysis.evaluation import outside_training, stimulus_defaults
    from ...analysis.mediation import answer_casing, locate, prediction_check
    from ...analysis.traces import point_swap_pairs
    from ...engine import parallel
    from ...stimuli import make_pairs
    from ...stimuli.registry import CONDITIONS as REGISTERED_CONDITIONS
    from ...stimuli.tasks import TASKS as STIMULUS_TASKS
    from ...stimuli.tasks import task_kwargs

    method_kwargs: dict[str, Any] = {"steps": args.ig_steps} if args.method == "integrated_gradients" else {}
    out = (out_dir(args, "locate", args.condition) if user_pairs is None
           else out_dir(args, "locate", Path(pairs_source(args.pairs)).parent.name, args.condition))
    checkpoint = out / CHECKPOINT
    if args.resume:
        refuse_other_finished_run(out, args)
    world = parallel.world_size(args.processes)
    n_pairs = len(user_pairs) if user_pairs is not None else args.n_pairs
    if n_pairs < world:
        what = f"the {n_pairs} pairs of {args.pairs}" if user_pairs is not None else f"--n-pairs {n_pairs}"
        raise InputError(f"{what} cannot be shared by {world} processes; pass --processes {n_pairs} or fewer")
    with model_session(args, command, out, sweep="locate", checkpoint=checkpoint) as (group, vlm):
        if args.condition != "attention_swap":
            method_kwargs["prompt_format"] = vlm.prompt_format(args.prompt_format)
        if user_pairs is not None:
            pairs = user_pairs
        elif args.condition == "attention_swap":
            extra = {"objects": args.objects} if args.objects else {}
            pairs = point_swap_pairs(vlm, args.n_pairs, args.seed, task=args.trace_task or "count", **extra)
        else:
            task = REGISTERED_CONDITIONS[args.condition].task
            if task == "scene":
                options = {"n_objects": args.objects or 3, "entropy": args.entropy or "high"}
            else:  # a plugin's condition over another task
                options = task_kwargs(task, {"objects": args.objects}) if task in STIMULUS_TASKS else {}
            kwargs, canvas = stimulus_defaults(vlm, task, options, args.image_size)
            outside = outside_training(vlm, task, kwargs)
            if outside and group.is_main:
                print(f"vlmbind: warning: {outside}", file=sys.stderr)
            pairs = make_pairs(args.condition, args.n_pairs, args.seed, **kwargs)
        if group.world == 1:
            scores = locate(vlm, pairs, method=args.method, progress=not args.json, verify_top=args.verify_top,
                            checkpoint=checkpoint, layers=layers, heads=heads, **method_kwargs)
        else:
            scores = sweeps.locate(group, vlm, pairs, out, method=args.method, verify_top=args.verify_top,
                                   layers=layers, heads=heads,
                                   progress=group.is_main and not args.json, **method_kwargs)
            if not group.is_main:
                return rank_done(group, out)
        if args.condition != "attention_swap":
            scores.answer_casing = answer_casing(vlm, pairs, method_kwargs["prompt_format"])
            scores.predictions = prediction_check(vlm, pairs, method_kwargs["prompt_format"])
        if user_pairs is not None:
            scores.pairs_file = pairs_source(args.pairs)
        elif args.condition != "attention_swap":
            scores.canvas = canvas
    scores.save(out)
    parallel.remove_parts(out, "locate")
    summary = {**scores.summary(), "out": str(out), "command": " ".join(command)}
    if group.world > 1:
        summary["processes"] = group.world
    top = scores.ranking_text(5)
    significance = scores.significance_text(10)
    casing = scores.answer_casing
    note = ""
    if casing and casing["share"] > 0.5:
        note = (f"  note: on {casing['capitalised_preferred']}/{casing['n']} clean prompts the model prefers the "
                f"capitalised answer token (mean gap {casing['mean_logit_gap']:+.2f}); the scores use the lower-case "
                f"tokens\n")
    note += prediction_lines(scores.predictions)
    if scores.scored_heads is not None:
        note += (f"  scored {len(scores.scored_heads)} of {vlm.n_layers * vlm.n_heads} heads (--layers / --heads); the "
                 "others are written as 0, not measured\n")
    text = (f"{vlm.name}, {args.condition}, {scores.n} pairs, {args.method}, {scores.prompt_format} prompts: "
            f"{scores.seconds:.1f} s\n"
            f"  top heads ({scores.ranking_legend()}): {top}\n  {significance}\n{note}"
            f"  wrote {out}/scores.csv, heatmap.html, summary.json")
    return summary, text, 0
