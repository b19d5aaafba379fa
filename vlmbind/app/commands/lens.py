"""``vlmbind lens``: the logit lens over the image grid, and the head lens."""

from __future__ import annotations

from typing import Any

from ...core.choices import LENS_TASKS as TASKS
from ...core.errors import InputError
from .arguments import (
    add_placement,
    add_prompt_format,
    check_model,
    format_table,
    int_at_least,
    load_model,
    out_dir,
    parse_layers,
)

# its place in `vlmbind --help`
HELP_ORDER = 65

HELP = "logit lens and head lens over the image tokens: where objects' colour and shape words decode"


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("lens", parents=[common], help=HELP,
                       description="Decode every image token's residual stream after each layer (and the projector "
                                   "output, row 'embed') through the final norm and the unembedding; report per "
                                   "layer the share of objects whose colour / shape word is the top word of its "
                                   "pool at their own image tokens, beside background tokens and chance; decode "
                                   "each head's write (its slice of W_O, the final norm applied to the write alone) "
                                   "at the last prompt token, and at the image tokens for the heads named.")
    p.add_argument("--model", required=True, help="registered name, model directory or hub id")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--task", choices=TASKS, default="scene",
                   help="stimuli whose objects have a colour and a shape (default scene)")
    p.add_argument("--n", type=int_at_least(1, "--n 16"), default=16, help="number of examples (default 16)")
    p.add_argument("--seed", type=int_at_least(0, "--seed 1"), default=1, help="stimulus seed (default 1)")
    p.add_argument("--layers", default=None, help="decoder layers to decode after, e.g. 0-3 or 1,2,5 (default all; "
                                                   "the 'embed' row is always read)")
    p.add_argument("--words", default=None,
                   help="comma-separated words whose probabilities are saved, e.g. red,square (default: the "
                        "objects' colour and shape names); a word's probability is that of its first token with a "
                        "leading space")
    p.add_argument("--heads", default=None,
                   help="heads for the head lens at every image token, e.g. 3.1,5.2 (default: every head, at the "
                        "last prompt token only)")
    p.add_argument("--batch-size", type=int_at_least(1, "--batch-size 8"), default=8,
                   help="examples run together (default 8)")
    p.add_argument("--out", default=None, help="output directory (default runs/lens/<model>-<task>)")
    p.set_defaults(func=cmd_lens)


def _words(text: str | None) -> list[str] | None:
    if text is None:
        return None
    words = [w.strip() for w in text.split(",")]
    if not all(words) or len(set(words)) != len(words):
        raise InputError(f"--words {text!r}: give distinct comma-separated words, e.g. red,square")
    return words


def cmd_lens(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    layers = parse_layers(args.layers)
    words = _words(args.words)
    from ...core.sites import parse_heads  # light: no torch

    heads = parse_heads(args.heads) if args.heads is not None else None
    if heads is not None and not heads:
        raise InputError(f"--heads {args.heads!r} names no head; give LAYER.HEAD labels, e.g. 3.1,5.2")
    out = out_dir(args, "lens", args.task)
    from ...analysis.lens import lens, lens_dataset  # after the checks: it imports torch

    vlm = load_model(args)
    dataset = lens_dataset(vlm, args.task, args.n, args.seed)
    result = lens(vlm, dataset, layers=layers, words=words, heads=heads, batch_size=args.batch_size,
                  progress=not args.json)
    result.save(out)
    summary = {**result.summary(), "out": str(out), "command": " ".join(command)}
    return summary, _text(result, vlm.name, args.task, out), 0


def _text(result: Any, model: str, task: str, out: Any) -> str:
    """Per layer the decodable share with its interval at object and background tokens, the first layers, where it
    wrote."""
    features = ("colour", "shape")
    table = result.decodable.set_index(["feature", "layer"])

    def cell(feature: str, layer: str, prefix: str) -> str:
        r = table.loc[(feature, layer)]
        return f"{r[prefix + 'share']:.2f} [{r[prefix + 'low']:.2f}, {r[prefix + 'high']:.2f}]"

    rows = [[layer, *(cell(f, layer, p) for f in features for p in ("", "background_"))] for layer in result.layers]
    header = ["layer", "colour: object", "colour: background", "shape: object", "shape: background"]
    chance = ", ".join(f"{f} {float(table.loc[f, 'chance'].iloc[0]):.2f}" for f in features)
    meta = result.meta
    first = ", ".join(f"{f} {result.first_layer(f) or 'none'}" for f in features)
    beyond = ", ".join(f"{f} {result.first_layer(f, 'background') or 'none'}" for f in features)
    lines = [
        f"{model}, {task}, {meta['n_examples']} examples, {meta['n_objects']} objects ({meta['seconds']:.1f} s)",
        (f"  share of objects whose word is decodable at their own image tokens (95% Wilson intervals, "
         f"n={meta['n_objects']}; chance: {chance}):"),
        *("  " + line for line in format_table(header, rows).splitlines()),
        f"  first layer above chance: {first}; above the background readout too: {beyond}",
        f"  wrote {out}/lens.csv, decodable.csv, head_lens.csv, objects.csv, lens.html, decodable.html, summary.json",
    ]
    return "\n".join(lines)
