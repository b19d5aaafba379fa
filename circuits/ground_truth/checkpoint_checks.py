"""Quick checks of organism-vsm training checkpoints: ID selection on held-out three-object scenes, feature
retrieval, and how often single heads (the layer-0 heads that kept a side path, and two controls) change the answer
on feature-retrieval pairs (for the first two also by where they are interchanged and by the scene's object count,
32 pairs each). Used to follow a stage while it trains; the checkpoints themselves stay outside git.

    python circuits/ground_truth/checkpoint_checks.py LABEL=CHECKPOINT_DIR [...] [--out results/...json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import vlmbind as vb
from vlmbind.core.io import write_json_atomic
from vlmbind.organisms.data import BatchBuilder
from vlmbind.organisms.siit import (HeadInterchange, answer_changes, answer_changes_per_set,
                                   interchange_accuracy)
from vlmbind.core.sites import parse_heads
from vlmbind.stimuli import Canvas, scene_pairs

HERE = Path(__file__).parent
POOLS = {"colours": ("red", "green", "blue", "yellow"), "shapes": ("square", "circle", "triangle", "star")}
HEADS = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (5, 3)]


def feature_pairs(canvas: Canvas) -> list:
    """The 96 feature-retrieval check pairs: 16 per object count (2-4) and entropy."""
    pairs = []
    for objects in (2, 3, 4):
        for entropy in ("high", "low"):
            pairs += list(scene_pairs(16, "feature_retrieval", 3000 + 7 * objects + (entropy == "low"),
                                      n_objects=objects, entropy=entropy, canvas=canvas, recolour="any", **POOLS))
    return pairs


def check(path: str) -> dict:
    vlm = vb.load(path)
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    canvas = Canvas(image_size=168, grid=6)
    # the checkpoint's own planted heads (the organism grew a layer at stage 6); stages 1-5 planted 2.1 and 4.2
    planted = (vlm.training or {}).get("planted") or {"id_selection": ["2.1"], "feature_retrieval": ["4.2"]}
    selection, retrieval = parse_heads(planted["id_selection"]), parse_heads(planted["feature_retrieval"])
    out: dict = {"id_selection_3_objects": {}, "n_id_selection": 64, "planted": planted}
    for entropy in ("high", "low"):
        pairs = list(scene_pairs(64, "id_selection", 2000 + (entropy == "low"), n_objects=3, entropy=entropy,
                                 canvas=canvas, swap="random", **POOLS))
        out["id_selection_3_objects"][entropy] = interchange_accuracy(vlm.model, interchange, builder, pairs, selection,
                                                                      last_positions="answer")
    pairs = feature_pairs(canvas)
    out["n_feature_retrieval"] = len(pairs)
    out["feature_retrieval"] = interchange_accuracy(vlm.model, interchange, builder, pairs, retrieval,
                                                    last_positions="answer")
    shares = answer_changes_per_set(vlm.model, interchange, builder, pairs, [[head] for head in HEADS])
    out["answer_changes"] = {f"{l}.{h}": share for (l, h), share in zip(HEADS, shares)}
    out["answer_changes_by_position"] = {
        f"{l}.{h}": {where: answer_changes(vlm.model, interchange, builder, pairs, [(l, h)], positions=where)
                     for where in ("image", "text", "last")} for l, h in HEADS[:2]}
    by_count = {objects: [p for p in pairs if len(p.clean.objects) == objects] for objects in (2, 3, 4)}
    out["answer_changes_by_objects"] = {
        f"{l}.{h}": {str(objects): answer_changes(vlm.model, interchange, builder, chunk, [(l, h)])
                     for objects, chunk in by_count.items()} for l, h in HEADS[:2]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", help="LABEL=DIR (a checkpoint with the shipped vlmbind_training.json)")
    p.add_argument("--out", default=str(HERE / "results" / "organism-vsm_training" / "checkpoint_checks.json"))
    args = p.parse_args(argv)
    out = Path(args.out)
    document = json.loads(out.read_text()) if out.is_file() else {"checks": {}}
    for item in args.checkpoints:
        label, _, path = item.partition("=")
        document["checks"][label] = check(path)
        print(label, json.dumps(document["checks"][label]), file=sys.stderr, flush=True)
        write_json_atomic(document, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
