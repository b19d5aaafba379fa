"""``vlmbind circuit``: edges between heads (into q, k, v or the logits), scored by path patching on counterfactual
scene pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...core.choices import CIRCUIT_ABLATIONS, CIRCUIT_CHECKPOINT, CIRCUIT_METHODS, CONDITIONS, PATH_CHANNELS
from ...core.errors import InputError
from .arguments import (
    add_plugin,
    add_prompt_format,
    check_model,
    int_at_least,
    model_session,
    out_dir,
    parse_layers,
    parse_range,
)

METHOD_WORDS = {"exact": "exact path patching", "naive": "naive path patching", "eap": "EAP estimates",
                "eap_ig": "EAP-IG estimates", "atp_star": "AtP* estimates"}
# its place in `vlmbind --help`
HELP_ORDER = 55
DEFAULT_N_PAIRS = 16


def parse_channels(text: str) -> tuple[str, ...]:
    """``q,k,v`` (any non-empty subset, each once)."""
    channels = tuple(c.strip() for c in str(text).split(",") if c.strip())
    bad = [c for c in channels if c not in PATH_CHANNELS]
    if not channels or bad or len(set(channels)) != len(channels):
        raise InputError(f"--channels {text!r}: list some of {', '.join(PATH_CHANNELS)}, each once (e.g. q,v)")
    return channels


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("circuit", parents=[common],
                       help="edges between heads by path patching; faithfulness (CPR, CMD)",
                       description="Score every edge between heads (sender -> receiver's query, key or value, and "
                                   "sender -> logits) by path patching on counterfactual scene pairs.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    p.add_argument("--condition", default=None, metavar="CONDITION",
                   help=f"{', '.join(CONDITIONS[:-1])} (scene pairs); with --pairs, which of the file's conditions")
    p.add_argument("--pairs", default=None, metavar="PATH",
                   help="your own counterfactual pairs: a folder holding pairs.jsonl, or the file "
                        "(docs/your_experiment.md)")
    p.add_argument("--n-pairs", type=int_at_least(1, "--n-pairs 16"), default=None,
                   help=f"counterfactual pairs (default {DEFAULT_N_PAIRS})")
    p.add_argument("--seed", type=int, default=None, help="pair seed (default 0)")
    p.add_argument("--objects", type=parse_range, help="objects per scene: N or LOW-HIGH (default 3)")
    p.add_argument("--entropy", choices=("high", "low"), default=None, help="scenes of distinct (high) or shared "
                   "(low) features")
    p.add_argument("--image-size", type=int_at_least(8, "--image-size 448"), default=None,
                   help="canvas side in pixels (default: an organism's training size, else the family's)")
    add_prompt_format(p)
    add_plugin(p, "conditions")
    p.add_argument("--method", choices=CIRCUIT_METHODS, default="exact",
                   help="exact (fast), naive (four forwards per edge; the same numbers), eap (first-order estimate: "
                        "one forward and backward per pair), eap_ig (the gradient averaged along the path) or atp_star "
                        "(each receiver's change exact, what follows it first-order, with GradDrop)")
    p.add_argument("--verify-top", type=int_at_least(0, "--verify-top 10"), default=10,
                   help="eap, eap_ig, atp_star: score this many top edges again by exact path patching (default 10)")
    p.add_argument("--from", dest="sender_at", default="all", metavar="CLASS",
                   help="where senders are patched: all (default), image, text, last, patch (the pairs' own patch), "
                        "span:TEXT or box:X0,Y0,X1,Y1")
    p.add_argument("--to", dest="receiver_at", default="all", metavar="CLASS",
                   help="where receivers are patched (same classes; default all)")
    p.add_argument("--heads", default=None, help="only edges between these heads, e.g. 1.0,2.3,3.1,5.2")
    p.add_argument("--layers", default=None, help="only edges between heads of these layers, e.g. 0-3 or 1,2,5")
    p.add_argument("--channels", default=",".join(PATH_CHANNELS),
                   help="receiver inputs to score (default q,k,v)")
    p.add_argument("--no-logits", dest="logits", action="store_false",
                   help="leave out each sender's direct edge into the logits")
    p.add_argument("--no-faithfulness", dest="faithfulness", action="store_false",
                   help="skip the faithfulness curve of the top edges (CPR, CMD; one forward per fraction and pair)")
    p.add_argument("--ablation", choices=CIRCUIT_ABLATIONS, default="patch",
                   help="how the faithfulness curve ablates the edges outside a circuit: patch (each pair's "
                        "counterfactual sender outputs; default) or mean (their mean over the pairs)")
    p.add_argument("--out", default=None, help="output directory (default runs/circuit/<model>-<condition>)")
    p.add_argument("--resume", action="store_true",
                   help=f"continue an interrupted run from OUT/{CIRCUIT_CHECKPOINT} (same arguments)")
    p.set_defaults(func=cmd_circuit, trace_task=None)


def cmd_circuit(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    from ...core.checks import check_head_list, check_position_class
    from .locate import check_pairs_arguments, pairs_source

    check_model(args)
    check_position_class(args.sender_at, flag="--from")
    check_position_class(args.receiver_at, flag="--to")
    layers = parse_layers(args.layers)
    channels = parse_channels(args.channels)
    heads = check_head_list(args.heads, flag="--heads") if args.heads is not None else None
    if args.condition == "attention_swap":
        raise InputError("--condition attention_swap scores pointing traces, not scene pairs; vlmbind circuit takes "
                         f"{', '.join(CONDITIONS[:-1])} or --pairs PATH")
    user_pairs = check_pairs_arguments(args)
    out = (out_dir(args, "circuit", args.condition) if user_pairs is None
           else out_dir(args, "circuit", Path(pairs_source(args.pairs)).parent.name, args.condition))
    checkpoint = out / CIRCUIT_CHECKPOINT
    if checkpoint.is_file() and not args.resume:
        raise InputError(f"{out} holds an interrupted run ({CIRCUIT_CHECKPOINT}); pass --resume to continue it, or "
                         "choose another --out")
    if args.verify_top != 10 and args.method not in ("eap", "eap_ig", "atp_star"):
        raise InputError(f"--verify-top applies to the estimates (eap, eap_ig, atp_star); --method {args.method} is "
                         "exact")
    if args.ablation != "patch" and not args.faithfulness:
        raise InputError("--ablation sets how the faithfulness curve ablates edges; it has no effect with "
                         "--no-faithfulness")
    args.processes = 1
    from ...analysis.circuits import circuit
    from ...analysis.evaluation import outside_training, stimulus_defaults
    from ...analysis.mediation import prediction_check
    from ...analysis.validate import recorded_edges
    from ...stimuli import make_pairs
    from ...stimuli.registry import CONDITIONS as REGISTERED_CONDITIONS

    with model_session(args, command, out, checkpoint=checkpoint) as (_, vlm):
        fmt = vlm.prompt_format(args.prompt_format)
        if user_pairs is not None:
            pairs = user_pairs
        else:
            task = REGISTERED_CONDITIONS[args.condition].task
            options = {"n_objects": args.objects or 3, "entropy": args.entropy or "high"} if task == "scene" else {}
            kwargs, _ = stimulus_defaults(vlm, task, options, args.image_size)
            outside = outside_training(vlm, task, kwargs)
            if outside:
                import sys

                print(f"vlmbind: warning: {outside}", file=sys.stderr)
            pairs = make_pairs(args.condition, args.n_pairs, args.seed, **kwargs)
        result = circuit(vlm, pairs, heads=heads, layers=layers, channels=channels, logits=args.logits,
                         sender_at=args.sender_at, receiver_at=args.receiver_at, method=args.method,
                         progress=not args.json, checkpoint=checkpoint, prompt_format=fmt, verify_top=args.verify_top,
                         faithfulness=args.faithfulness, ablation=args.ablation,
                         declared=recorded_edges(args.model) if args.faithfulness else None)
        predictions = prediction_check(vlm, pairs, fmt)
    result.save(out)
    summary = {**result.summary(), "predictions": predictions, "out": str(out), "command": " ".join(command)}
    from .locate import prediction_lines

    text = (f"{vlm.name}, {result.condition}, {result.n} pairs, {METHOD_WORDS[result.method]}, {result.sender_at} -> "
            f"{result.receiver_at}, {len(result.edges)} edges: {result.seconds:.1f} s\n"
            f"  top edges (mean change of logit[a*] - logit[a], 95% CI):\n{result.ranking_text(5)}\n"
            f"  significant edges: {len(summary['significant_edges'])}\n{result.faithfulness_text()}"
            f"{prediction_lines(predictions)}"
            f"  wrote {out}/edges.csv, circuit.html, "
            f"{'faithfulness.csv, faithfulness.html, ' if args.faithfulness else ''}summary.json")
    return summary, text, 0
