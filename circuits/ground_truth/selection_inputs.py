"""Where the unplanted heads that break strictness act: on the planted heads' selection, or on the answer beside them.

    python circuits/ground_truth/selection_inputs.py [--model organism-vsm] [--pairs 64] [--seed 1000]
                                                     [--table circuits/ground_truth/results/interchange.json]
                                                     [--out circuits/ground_truth/results/selection_inputs.json]
                                                     [--readme]

On the interchange table's feature-retrieval pairs (same seed, every object count and entropy), each unplanted head
that moves more than 2% of the answers there (``results/interchange.json``) is interchanged alone at every prompt
position, as the table does. For the pairs whose answer changes and for the others, it reports where the planted
heads look at the last prompt token (their attention on the base's missing object's image token, from
``output_attentions`` of eager attention, unpatched and patched), where the head itself looks from the prompt's
text tokens (its attention mass on the image tokens, and on the objects' tokens among them), how many of the
changed pairs' sources gave the missing object another colour (not only another shape), and what the patched colour
word is: a described object's colour (the selection moved to a described object), the source's colour (the missing
object's new features reached the answer), a colour that is both (the source's colour is also a described
object's), or another.

The README's table is the record of organism-vsm after its fifth stage (``results/organism-vsm_training/stage-5/``),
when two layer-0 heads still broke strictness; the shipped organism has no such head (the interchange table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import vlmbind as vb
from vlmbind.analysis.ablation import wilson_interval
from vlmbind.analysis.validate import recorded_planted
from vlmbind.core.io import write_json_atomic
from vlmbind.organisms.data import IGNORE_INDEX, BatchBuilder
from vlmbind.organisms.siit import (
    HeadInterchange,
    evaluating,
    interchange_batch,
    last_prompt_index,
    target_cells,
    target_tokens,
)
from vlmbind.core.sites import parse_heads
from vlmbind.stimuli import Canvas

sys.path.insert(0, str(Path(__file__).parent))
from interchange import fresh_pairs, write_block  # noqa: E402  (the table's pairs: its shares must agree)

HERE = Path(__file__).parent
VARIABLE = "feature_retrieval"


def _colour_kind(patched: str, pair) -> str:
    described = {o.colour for i, o in enumerate(pair.clean.objects) if i != pair.clean.fields["target"]}
    source = pair.answer_counterfactual.split()[0]
    if patched == source:
        return "either" if patched in described else "source_colour"
    return "described_colour" if patched in described else "other"


def measure(name: str, heads: list[str], planted: dict[str, list[str]], n_pairs: int, seed: int) -> dict:
    vlm = vb.load(name)
    model, tokenizer = vlm.model, vlm.processor.tokenizer
    model.set_attn_implementation("eager")  # attention weights from HF's own eager path, the reference
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(model, vlm.processor)
    canvas = Canvas(image_size=int(vlm.training["image_size"]), grid=int(vlm.training["grid"]))
    readers = [h for v in ("id_selection", "feature_retrieval") for h in planted.get(v, [])]
    pairs = [p for k in (2, 3, 4) for e in ("high", "low") for p in fresh_pairs(VARIABLE, n_pairs, seed, k, e, canvas)]
    out: dict = {"model": name, "variable": VARIABLE, "n_pairs": len(pairs), "seed": seed, "readers": readers,
                 "heads": {}}
    for head in heads:
        (layer, index), = parse_heads([head])
        changed, kinds, recoloured = [], [], []
        attention = {r: {"plain": [], "patched": []} for r in readers}
        text_on_image, text_on_objects = [], []
        with evaluating(model):
            for i in range(0, len(pairs), 32):
                chunk = pairs[i : i + 32]
                batch = interchange_batch(builder, chunk, "clean")
                ids = batch.base.inputs["input_ids"]
                missing = target_tokens(ids, builder.image_token_id, target_cells(chunk, canvas, side="clean"))
                last = last_prompt_index(batch.prompt_mask)
                plain = model(**batch.base.inputs, use_cache=False, output_attentions=True)
                with interchange.capture([layer]):
                    model(**batch.source.inputs, use_cache=False)
                values = interchange.stored
                masks = interchange.mask([(layer, index)], batch.prompt_mask, tuple(values[layer].shape))
                with interchange.patch(masks, values):
                    patched = model(**batch.base.inputs, use_cache=False, output_attentions=True)
                image = ids == builder.image_token_id
                text = batch.prompt_mask & ~image
                objects = torch.zeros_like(image)
                for r, pair in enumerate(chunk):
                    cells = torch.tensor([o.row * canvas.shape[1] + o.col for o in pair.clean.objects])
                    rows_ids = ids[r : r + 1].expand(len(cells), -1)
                    objects[r, target_tokens(rows_ids, builder.image_token_id, cells)] = True
                pattern = plain.attentions[layer][:, index]  # B Q K, the interchanged head's own attention
                for r in range(len(chunk)):
                    rows_q = pattern[r][text[r]]
                    text_on_image.append(float(rows_q[:, image[r]].sum(-1).mean()))
                    text_on_objects.append(float(rows_q[:, objects[r]].sum(-1).mean()))
                answer = batch.base.labels[:, 1:] != IGNORE_INDEX
                a, b = plain.logits[:, :-1].argmax(-1), patched.logits[:, :-1].argmax(-1)
                moved = ((a != b) & answer).any(1)
                rows = torch.arange(len(chunk))
                for reader in readers:
                    (rl, rh), = parse_heads([reader])
                    for side, run in (("plain", plain), ("patched", patched)):
                        attention[reader][side] += run.attentions[rl][rows, rh, last, missing].tolist()
                for r, pair in enumerate(chunk):
                    t = pair.clean.fields["target"]
                    recoloured.append(pair.counterfactual.objects[t].colour != pair.clean.objects[t].colour)
                    changed.append(bool(moved[r]))
                    if moved[r]:
                        first = int(answer[r].nonzero()[0])  # the colour word's prediction
                        kinds.append(_colour_kind(tokenizer.decode(b[r, first]).strip(), pair))
        flags, recoloured = np.array(changed), np.array(recoloured)
        share = float(flags.mean())
        entry = {"changed": share, "changed_interval": list(wilson_interval(share, len(flags))),
                 "n_changed": int(flags.sum()),
                 "text_attention": {"on_image": float(np.mean(text_on_image)),
                                    "on_objects": float(np.mean(text_on_objects))},
                 "source_recoloured": {"changed": float(recoloured[flags].mean()) if flags.any() else None,
                                       "unchanged": float(recoloured[~flags].mean())},
                 "patched_colour": {k: kinds.count(k)
                                    for k in ("described_colour", "source_colour", "either", "other")},
                 "attention_on_missing": {}}
        for reader, sides in attention.items():
            plain_mass, patched_mass = np.array(sides["plain"]), np.array(sides["patched"])
            entry["attention_on_missing"][reader] = {
                group: {"plain": float(plain_mass[mask].mean()) if mask.any() else None,
                        "patched": float(patched_mass[mask].mean()) if mask.any() else None, "n": int(mask.sum())}
                for group, mask in (("changed", flags), ("unchanged", ~flags))}
        out["heads"][head] = entry
        print(name, head, json.dumps(entry), file=sys.stderr, flush=True)
    return out


BEGIN = ("<!-- selection_inputs: generated by selection_inputs.py from "
         "results/organism-vsm_training/stage-5/selection_inputs.json -->")
END = "<!-- /selection_inputs -->"


def markdown(document: dict) -> str:
    """The README's table, from ``selection_inputs.json``."""
    readers = document["readers"]
    head_cols = " | ".join(f"{r} on missing, changed: plain -> patched | {r}, unchanged" for r in readers)
    out = [f"Where the unplanted heads that move more than 2% of the feature-retrieval answers act, on the "
           f"{document['n_pairs']} pooled pairs of the interchange table ({document['model']}; each head interchanged "
           "alone at every prompt position): the share of answers it changes (Wilson 95%), what the patched colour "
           "word is on those pairs, and the planted heads' attention on the missing object's image token at the "
           "last prompt token, unpatched -> patched:", "",
           f"| head | answers changed [95%] | patched colour: described / source / either / other | source recoloured: "
           f"changed / unchanged | head's attention from text tokens: image / objects | {head_cols} |",
           "|---|---|---|---|---|" + "---|" * (2 * len(readers))]
    for head, e in document["heads"].items():
        lo, hi = e["changed_interval"]
        kinds = e["patched_colour"]
        cells = []
        for r in readers:
            for group in ("changed", "unchanged"):
                g = e["attention_on_missing"][r][group]
                cells.append("-" if g["plain"] is None else f"{g['plain']:.2f} -> {g['patched']:.2f} (n {g['n']})")
        out.append(f"| {head} | {e['changed']:.3f} [{lo:.3f}, {hi:.3f}] ({e['n_changed']} of {document['n_pairs']}) | "
                   f"{kinds['described_colour']} / {kinds['source_colour']} / {kinds['either']} / {kinds['other']} | "
                   f"{e['source_recoloured']['changed']:.2f} / {e['source_recoloured']['unchanged']:.2f} | "
                   f"{e['text_attention']['on_image']:.2f} / {e['text_attention']['on_objects']:.2f} | "
                   f"{' | '.join(cells)} |")
    return "\n".join(out)


def update_readme(document: dict, readme: Path = HERE / "README.md") -> None:
    write_block(markdown(document), BEGIN, END, readme)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-vsm")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--table", default=str(HERE / "results" / "interchange.json"),
                   help="the interchange table whose strictness breakers are measured")
    p.add_argument("--out", default=str(HERE / "results" / "selection_inputs.json"))
    p.add_argument("--readme", action="store_true", help="draw the README's table from --out")
    args = p.parse_args(argv)
    table = json.loads(Path(args.table).read_text())
    row = next(r for r in table["results"] if r["model"] == args.model)
    heads = row["variables"][VARIABLE]["unplanted_heads_above_0.02"]
    document = {"command": "python circuits/ground_truth/selection_inputs.py " + " ".join(argv or sys.argv[1:]),
                **measure(args.model, heads, recorded_planted("organism-vsm"), args.pairs, args.seed)}
    write_json_atomic(document, Path(args.out))
    if args.readme:
        update_readme(json.loads(Path(args.out).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
