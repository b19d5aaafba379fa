"""``vlmbind steer``: redirect chosen heads' attention to an object, cell or box and count the answers that follow."""

from __future__ import annotations

from typing import Any

from ...core.choices import EDIT_POSITIONS, STEER_TASKS
from ...core.errors import InputError
from .arguments import add_placement, add_prompt_format, check_model, int_at_least, load_model, out_dir, parse_range

# its place in `vlmbind --help`
HELP_ORDER = 105


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("steer", parents=[common], help="steer chosen heads' attention to an object, cell or box",
                       description="Mask every key outside a target's image tokens before the softmax of the chosen "
                                   "heads (their attention renormalised over the target) on scene-description "
                                   "scenes or Point-to-Answer traces, and report how often the answer names the "
                                   "object steered to, or points at it first (efficacy), beside the same push on "
                                   "random heads, with each head's gaze.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--heads", required=True, help="LAYER.HEAD list, e.g. 3.1 or 2.3,3.1")
    p.add_argument("--task", choices=STEER_TASKS, default="scene",
                   help="scene (the answer names the missing object; default), or search / count (the answer points "
                        "at objects first: the outcome is the first point)")
    p.add_argument("--to", default=None,
                   help="described (per scene, a uniformly drawn object the prompt names; the default on scene), "
                        "distractor (an object the answer is not about or does not point at first; the default on "
                        "search and count), object:K (the scene's object K, 0-based), cell:ROW,COL (a cell of the "
                        "stimulus grid) or box:X0,Y0,X1,Y1 (pixels)")
    p.add_argument("--positions", choices=EDIT_POSITIONS, default=None,
                   help="where the heads are steered: the prompt's last position (the default on other models) or "
                        "also every answer position (the default on models vlmbind trained)")
    p.add_argument("--n", type=int_at_least(1, "--n 64"), default=64, help="scenes (default 64)")
    p.add_argument("--seed", type=int_at_least(0, "--seed 1000"), default=1000,
                   help="stimulus, target and random-heads seed (default 1000)")
    p.add_argument("--objects", type=parse_range, help="objects per scene: N or LOW-HIGH (default: training range, "
                                                       "else 3)")
    p.add_argument("--random-draws", type=int_at_least(0, "--random-draws 5"), default=5,
                   help="draws of as many random heads for the control (default 5; 0: none)")
    p.add_argument("--batch-size", type=int_at_least(1, "--batch-size 32"), default=32,
                   help="scenes per forward (default 32)")
    p.add_argument("--out", default=None, help="output directory (default runs/steer/<model>-<heads>-<target>)")
    p.set_defaults(func=cmd_steer)


def cmd_steer(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    from ...core.checks import check_head_list, check_steer_target

    heads = check_head_list(args.heads, flag="--heads")
    to = args.to or ("described" if args.task == "scene" else "distractor")
    kind, _ = check_steer_target(to, flag="--to")
    if kind == "described" and args.task != "scene":
        raise InputError(f"--to described: a {args.task} prompt names no object; use distractor, object:K, cell:R,C "
                         "or box:...")
    label = "_".join(f"{l}.{h}" for l, h in heads)
    out = out_dir(args, "steer", *([] if args.task == "scene" else [args.task]), label, kind)
    from ...analysis.steering import steer

    vlm = load_model(args)
    result = steer(vlm, heads, to, task=args.task, n=args.n, seed=args.seed, n_objects=args.objects,
                   positions=args.positions,
                   n_random=args.random_draws, batch_size=args.batch_size, progress=not args.json)
    result.save(out)
    s = result.summary()
    summary = {**s, "out": str(out), "command": " ".join(command)}

    def share(value: Any, interval: Any) -> str:
        return "n/a" if value is None else f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"

    top = result.gaze.assign(excess=result.gaze["gaze"] - result.gaze["chance"]).nlargest(3, "excess")
    gaze = ", ".join(f"{int(r.layer)}.{int(r.head)} {r.gaze:.2f}" for r in top.itertuples())
    outcome = "names the object steered to" if args.task == "scene" else "first point at the object steered to"
    text = (f"{vlm.name}: heads {', '.join(result.heads)} steered to {to} at {result.positions} positions, "
            f"{args.task} "
            f"({s['seconds']:.1f} s)\n"
            f"  efficacy ({outcome}): {share(s['efficacy'], s['efficacy_interval'])}, "
            f"n={s['n_counted']} scenes\n"
            f"  random heads, same push ({len(result.random_heads)} draws): "
            f"{share(s['random_heads_efficacy'], s['random_heads_efficacy_interval'])}, n={s['random_heads_n']}\n"
            f"  unsteered: {outcome} {s['clean_efficacy']:.3f}, gives the expected answer {s['clean_accuracy']:.3f}"
            f"; identity (every key) exact: {s['identity_exact']}\n"
            f"  gaze (share of image attention on the answer's object; chance {top['chance'].iloc[0]:.3f}): {gaze}\n"
            f"  wrote {out}/arms.csv, steering.csv, gaze.csv, steering.html, gaze.html, summary.json")
    if s["n_counted"] == 0:
        text += ("\n  no scene had a target object other than the answer's: efficacy is undefined (choose another "
                 "--to)")
    return summary, text, 0
