"""Link by link, how far a position written at a described object's name travels towards the selection.

    python circuits/ground_truth/retrieval_links.py CHECKPOINT [--retrieval 0.2] [--aggregation 1.3]
                                                   [--selection 2.1] [--pairs 64] [--seed 4242] [--into CURVE.json]

On fresh id_retrieval pairs (2-4 objects, random swaps; the swapped object j sits at the missing object t's cell in
the source), the ``--retrieval`` head's output at j's name is taken from the source, as the IIT loss does, and the
script reports, from eager attention (``output_attentions``) and the heads' ``o_proj`` inputs:

- ``retrieval_attention``: the retrieval head's attention on j's image token from the first and the last token of
  j's name, per entropy, and from the same tokens on the other objects that share that token's word (j's colour at
  the first token, its shape at the last; only low-entropy scenes have them), and from the last token on the objects
  that share j's colour (``last_same_colour``): a head that reads one token of the name cannot tell those objects
  apart, and at the colour word no head can (the shape comes later);
- ``relative_change``: how much the patch moves the retrieval head's output at the name, the aggregation head's
  output at the last prompt token and the residual stream entering the selecting head's layer there (norm of the
  change over the unpatched norm, mean over pairs): a selection by the retrieved positions can only read what
  reaches that residual stream;
- ``attention_<selection>_on_t`` / ``_on_j``: the selecting head's attention at the last prompt token on t's and j's
  image tokens, unpatched and patched (the high-level model moves it from t to j).

A checkpoint directory needs the organism's ``vlmbind_training.json`` beside its weights to load. ``--into`` writes
the figures as the ``after`` field of an attempt's curve file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import vlmbind as vb
from vlmbind.core.io import write_json_atomic
from vlmbind.organisms.data import BatchBuilder
from vlmbind.organisms.siit import HeadInterchange, evaluating, interchange_batch, last_prompt_index, target_tokens
from vlmbind.core.sites import parse_heads
from vlmbind.stimuli import Canvas, scene_pairs

POOLS = {"colours": ("red", "green", "blue", "yellow"), "shapes": ("square", "circle", "triangle", "star")}


def _cell(obj, canvas: Canvas) -> int:
    return obj.row * canvas.shape[1] + obj.col


def _relative(new: torch.Tensor, old: torch.Tensor) -> float:
    return float((new - old).norm() / old.norm().clamp_min(1e-12))


def measure(checkpoint: str, retrieval: str, aggregation: str, selection: str, n_pairs: int, seed: int,
            batch_size: int = 32) -> dict:
    vlm = vb.load(checkpoint)
    model = vlm.model
    model.set_attn_implementation("eager")
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(model, vlm.processor)
    canvas = Canvas(image_size=int(vlm.training["image_size"]), grid=int(vlm.training["grid"]))
    (rl, rh), (al, ah), (sl, sh) = parse_heads([retrieval, aggregation, selection])
    d = interchange.d_head

    def head(x: torch.Tensor, h: int) -> torch.Tensor:
        return x[..., h * d:(h + 1) * d]

    attention = {f"{e}_{which}": [] for e in ("high", "low") for which in ("first", "last")}
    lookalike = {"first": [], "last": [], "last_same_colour": []}
    change = {"retrieval_output_at_name": [], "aggregation_output_at_last": [], "residual_into_selection_layer": []}
    on = {k: {"unpatched": [], "patched": []} for k in ("t", "j")}
    for entropy in ("high", "low"):
        pairs = list(scene_pairs(n_pairs // 2, "id_retrieval", seed + (entropy == "low"), n_objects=(2, 4),
                                 canvas=canvas, swap="random", entropy=entropy, **POOLS))
        with evaluating(model), torch.no_grad():
            for i in range(0, len(pairs), batch_size):
                chunk = pairs[i:i + batch_size]
                batch = interchange_batch(builder, chunk, "counterfactual", "answer")
                ids = batch.base.inputs["input_ids"]
                rows, last = torch.arange(len(chunk)), last_prompt_index(batch.prompt_mask)
                t = target_tokens(ids, builder.image_token_id,
                                  torch.tensor([_cell(p.clean.objects[p.clean.fields["target"]], canvas) for p in chunk]))
                j = target_tokens(ids, builder.image_token_id,
                                  torch.tensor([_cell(p.clean.objects[p.patch["object"]], canvas) for p in chunk]))
                with interchange.capture([rl], patterns=True):
                    model(**batch.source.inputs, use_cache=False)
                source, source_pattern = interchange.stored[rl].clone(), interchange.patterns[rl]
                j_in_source = target_tokens(ids, builder.image_token_id, torch.tensor(
                    [_cell(p.counterfactual.objects[p.patch["object"]], canvas) for p in chunk]))
                for r, (p, pos) in enumerate(zip(chunk, batch.positions)):
                    attention[f"{entropy}_first"].append(float(source_pattern[r, rh, pos[0], j_in_source[r]]))
                    attention[f"{entropy}_last"].append(float(source_pattern[r, rh, pos[-1], j_in_source[r]]))
                    oj = p.counterfactual.objects[p.patch["object"]]
                    image = torch.nonzero(ids[r] == builder.image_token_id).flatten()
                    for which, q, word in (("first", pos[0], "colour"), ("last", pos[-1], "shape"),
                                           ("last_same_colour", pos[-1], "colour")):
                        alike = [image[_cell(o, canvas)] for k, o in enumerate(p.counterfactual.objects)
                                 if k != p.patch["object"] and getattr(o, word) == getattr(oj, word)]
                        if alike:
                            lookalike[which].append(float(source_pattern[r, rh, q, alike].sum()))
                runs = {}
                for kind in ("unpatched", "patched"):
                    masks = interchange.mask([(rl, rh)], batch.positions if kind == "patched" else
                                             [[] for _ in chunk], tuple(source.shape))
                    with interchange.patch(masks, {rl: source}), interchange.capture(sorted({rl, al})):
                        out = model(**batch.base.inputs, use_cache=False, output_attentions=True,
                                    output_hidden_states=True)
                    runs[kind] = ({k: v.clone() for k, v in interchange.stored.items()}, out)
                    pattern = out.attentions[sl][rows, sh, last]
                    on["t"][kind] += pattern[rows, t].tolist()
                    on["j"][kind] += pattern[rows, j].tolist()
                (plain, plain_out), (patched, patched_out) = runs["unpatched"], runs["patched"]
                for r, pos in enumerate(batch.positions):
                    change["retrieval_output_at_name"].append(
                        _relative(head(patched[rl][r, pos], rh), head(plain[rl][r, pos], rh)))
                    change["aggregation_output_at_last"].append(
                        _relative(head(patched[al][r, last[r]], ah), head(plain[al][r, last[r]], ah)))
                    change["residual_into_selection_layer"].append(
                        _relative(patched_out.hidden_states[sl][r, last[r]], plain_out.hidden_states[sl][r, last[r]]))
    mean = lambda v: float(np.mean(v))  # noqa: E731
    return {
        "measure": f"{n_pairs} fresh id_retrieval pairs (seed {seed} high entropy, {seed + 1} low, 2-4 objects, "
                   f"random swaps): head {retrieval}'s output at the swapped object j's name taken from the source "
                   f"(where j sits at the missing object t's cell); eager attention (output_attentions)",
        "heads": {"retrieval": retrieval, "aggregation": aggregation, "selection": selection},
        "retrieval_attention": {k: mean(v) for k, v in attention.items()},
        "retrieval_attention_on_lookalikes": {k: mean(v) for k, v in lookalike.items()},
        "names_with_a_lookalike": {k: len(v) for k, v in lookalike.items()},
        "relative_change": {k: mean(v) for k, v in change.items()},
        f"attention_{selection}_on_t": {k: mean(v) for k, v in on["t"].items()},
        f"attention_{selection}_on_j": {k: mean(v) for k, v in on["j"].items()},
        "n_pairs": len(on["t"]["patched"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--retrieval", default="0.2")
    p.add_argument("--aggregation", default="1.3")
    p.add_argument("--selection", default="2.1")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--seed", type=int, default=4242)
    p.add_argument("--into", default=None, help="an attempt's curve JSON: the figures become its 'after' field")
    args = p.parse_args(argv)
    if args.pairs < 2 or args.pairs % 2:
        print(f"error: --pairs must be an even number >= 2 (half per entropy), got {args.pairs}", file=sys.stderr)
        return 2
    try:
        result = measure(args.checkpoint, args.retrieval, args.aggregation, args.selection, args.pairs, args.seed)
    except vb.VlmbindError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.into:
        curve = json.loads(Path(args.into).read_text())
        curve["after"] = result
        write_json_atomic(curve, args.into, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
