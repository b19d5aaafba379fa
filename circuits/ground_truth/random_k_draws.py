"""Random-k ablation over many draws: how much does validate's five-draw random-k mean owe to the draw?

    python circuits/ground_truth/random_k_draws.py [--model organism-vsm] [--draws 100]
                                                   [--modes zero,mean,role_mean,image_attention]
                                                   [--out circuits/ground_truth/results/random_k_draws.json]

``vlmbind validate`` compares the planted heads ablated together with five random sets of as many heads drawn from
the others. In a 28-head model with four heads in layer 0, a set of four takes two or more layer-0 heads about one
draw in nine, and such a set can break the task, so the mean of five draws moves with the draw. This script ablates
the same evaluation scenes as validate (seed 1000 + 2, 64 scenes, 3 objects, high entropy) with ``--draws`` random
sets (seeds 0..draws-1, uniform over the heads outside the planted ones; not validate's five draws, which follow
its ranking of those heads) and reports the mean accuracy over draws with its standard error, the lowest draw, and the mean over the
draws that take at most one layer-0 head and over those that take two or more.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

import vlmbind as vb
from vlmbind.analysis.ablation import ablation_study
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.core.io import write_json_atomic
from vlmbind.core.sites import parse_heads
from vlmbind.stimuli import scene_description

HERE = Path(__file__).parent
SEED, N_EVAL = 1000, 64  # validate's defaults: its ablation scenes are scene_description(N_EVAL, SEED + 2)


def summary(arms: list[dict]) -> dict:
    accuracy = np.array([a["accuracy"] for a in arms])
    layer0 = np.array([sum(h.startswith("0.") for h in a["heads"]) for a in arms])
    groups = {"at_most_one_layer0_head": layer0 <= 1, "two_or_more_layer0_heads": layer0 >= 2}
    return {"draws": len(arms), "mean": float(accuracy.mean()),
            "se": float(accuracy.std(ddof=1) / np.sqrt(len(arms))) if len(arms) > 1 else None,
            "lowest": float(accuracy.min()),
            **{name: {"draws": int(mask.sum()), "mean": float(accuracy[mask].mean()) if mask.any() else None}
               for name, mask in groups.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-vsm")
    p.add_argument("--draws", type=int, default=100)
    p.add_argument("--modes", default="zero,mean,role_mean,image_attention")
    p.add_argument("--out", default=str(HERE / "results" / "random_k_draws.json"))
    args = p.parse_args(argv)
    vlm = vb.load(args.model)
    planted = [h for heads in vlm.training["planted"].values() for h in parse_heads(heads)]
    frame = pd.DataFrame([{"layer": l, "head": h, "score": 1.0 if (l, h) in planted else 0.0}
                          for l in range(vlm.n_layers) for h in range(vlm.n_heads)])
    kwargs = training_defaults(vlm, "scene", {"n_objects": 3, "entropy": "high"})
    dataset = scene_description(N_EVAL, SEED + 2, **kwargs)
    record = {"model": args.model, "planted": [f"{l}.{h}" for l, h in planted], "n_eval": N_EVAL,
              "scenes": f"scene_description({N_EVAL}, {SEED + 2}), 3 objects, high entropy", "modes": {},
              "command": "python circuits/ground_truth/random_k_draws.py " + " ".join(argv or sys.argv[1:])}
    for mode in args.modes.split(","):
        study = ablation_study(vlm, dataset, frame, k=len(planted), mode=mode, seeds=tuple(range(args.draws)),
                               random_from="rest")
        random = [{"seed": a["seed"], "heads": list(a["heads"]), "accuracy": a["accuracy"]}
                  for a in study.arms if a["arm"] == "random"]
        top = next(a["accuracy"] for a in study.arms if a["arm"] == "top")
        record["modes"][mode] = {"top": top, "random": summary(random), "draws": random}
        print(mode, json.dumps({"top": top, **summary(random)}))
    write_json_atomic(record, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
