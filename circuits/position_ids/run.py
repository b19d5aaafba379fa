"""VSM's position-ID circuit on a model: locate ID-retrieval, ID-selection and feature-retrieval heads, check where
the top heads look, test whether the last token carries a position ID at all, ablate, and edit.

    python circuits/position_ids/run.py [--model organism-p2a] [--pairs 32] [--n-eval 64] [--seed 0] [--out DIR]

On a real checkpoint pass its directory or hub id (``--model Qwen/Qwen2.5-VL-7B-Instruct``); stimuli then use the
default canvas (224 px, 3x3 grid) unless the model records its own.

The "last-token test" patches ALL heads of layers 0..k at the last prompt token from the id_selection
counterfactual (objects j and t swapped) into the clean run, for each k below the last layer. If the last token
carried the missing object's position ID into later feature retrieval, this would switch the answer to j; a model
that names the missing object from features alone (subtracting the described colours and shapes) is unmoved.
Patching every layer is left out on purpose: it makes the last token's state the counterfactual's, whose answer is t.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import vlmbind as vb
from vlmbind.analysis.mediation import scene_task
from vlmbind.analysis.overview import object_attention
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.engine.hooks import PatchHeads
from vlmbind.core.io import write_json_atomic

S = vb.stimuli
HERE = Path(__file__).parent


def last_token_test(vlm: vb.VLM, pairs: list) -> list[dict]:
    """Mean logit-difference change and share of flipped answers when layers 0..k are patched at the last token."""
    rows = []
    for k in range(vlm.n_layers - 1):
        changes, flips = [], 0
        for pair in pairs:
            task = scene_task(vlm, pair, range(vlm.n_layers))
            clean = vlm.logits(task.batch)[0, task.score_position]
            patches = [PatchHeads(layer=l, heads=list(range(vlm.n_heads)), positions=task.positions,
                                  values=task.values[l][None]) for l in range(k + 1)]
            patched = vlm.logits(task.batch, patches)[0, task.score_position]
            changes.append(float((patched[task.a_star] - patched[task.a]) - (clean[task.a_star] - clean[task.a])))
            flips += int(patched.argmax()) == task.a_star
        rows.append({"layers": f"0..{k}", "mean_change": float(np.mean(changes)), "flipped": flips / len(pairs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-p2a")
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ablation-seeds", type=int, default=5, help="random-k draws (from the heads outside the top-k)")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    vlm = vb.load(args.model)
    out = Path(args.out)
    kwargs = training_defaults(vlm, "scene", {"n_objects": 3})
    summary: dict = {"model": vlm.name, "pairs": args.pairs, "seed": args.seed}
    scores = {}
    for condition in ("id_retrieval", "id_selection", "feature_retrieval"):
        pairs = S.scene_pairs(args.pairs, condition, args.seed, **kwargs)
        scores[condition] = vb.locate(vlm, pairs)
        scores[condition].save(out / condition)
        summary[condition] = {"top": [(f"{l}.{h}", float(scores[condition].scores[l, h]))
                                      for l, h in scores[condition].top(5)],
                              "max_abs": float(np.abs(scores[condition].scores).max())}
    scenes = S.scene_description(args.n_eval, args.seed + 1000,
                                 **training_defaults(vlm, "scene", {"n_objects": (2, 4)}))
    top = sorted({h for c in ("id_selection", "feature_retrieval") for h in scores[c].top(3)})
    summary["where_heads_look"] = object_attention(vlm, list(scenes)[:32], top).to_dict(orient="records")
    summary["last_token_test"] = last_token_test(vlm, list(S.scene_pairs(args.pairs, "id_selection", args.seed,
                                                                        **kwargs)))
    summary["ablation"] = {}
    for c in ("id_selection", "feature_retrieval"):
        study = vb.ablation_study(vlm, scenes, scores[c], k=min(5, vlm.n_layers * vlm.n_heads // 2),
                                  seeds=tuple(range(args.ablation_seeds)))
        study.save(out / f"ablation_{c}")
        summary["ablation"][c] = study.summary()["accuracy"]
    edit = vb.edit_study(vlm, scores["id_selection"].top(3), [0, 1, 2, 4, 8], n_estimate=4 * args.n_eval,
                         n_eval=args.n_eval, seed=args.seed)
    edit.save(out / "edit")
    summary["edit_efficacy"] = edit.summary()["efficacy"]
    summary["edit_control"] = edit.summary()["control_efficacy"]
    write_json_atomic(summary, out / "summary.json")
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
