"""The position-ID edit's dose-response: efficacy and both controls over a fine alpha grid, alpha chosen on one seed
and measured on another.

    python circuits/ground_truth/edit_alpha_sweep.py [--model organism-vsm] [--alphas 0.5,0.6,0.7,0.8,0.9,1,1.25,1.5]
                                                     [--choose-seed 1000] [--confirm-seed 2000] [--n-eval 512]
                                                     [--out circuits/ground_truth/results/edit_alpha_sweep.json]

``vlmbind validate`` sweeps alpha over 0, 0.5, 1, 2, 4, 8 and reports the edit at the alpha of highest efficacy beside
its empty-cell control there. Between 0.5 and 1 the organism's edit goes from 0.09 to 0.98, so that grid cannot say
where the edit and its control part. This script runs validate's ``edit_studies`` call at both planted ID-selection
heads (3 objects, high entropy, ``answer`` positions, validate's estimation size) on a finer grid, in two steps fixed
before any number was seen:

1. choose: on ``--choose-seed`` scenes, every alpha of the grid; the chosen alpha is the one with the largest edit
   efficacy minus empty-cell control (ties: the smaller alpha);
2. confirm: on ``--confirm-seed`` scenes (another estimation and evaluation set), the chosen alpha and alpha 1.

Per alpha and arm (edit, empty-cell control, random direction) it saves the share of answers naming the edit's target
``t``, the missing object, the other described object, and no object of the scene, each with a Wilson interval.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import vlmbind as vb
from vlmbind.analysis.edits import edit_studies
from vlmbind.analysis.validate import validate
from vlmbind.core.io import write_json_atomic
from vlmbind.core.sites import parse_heads

sys.path.insert(0, str(Path(__file__).parent))
from edit_control_geometry import answers  # noqa: E402  (a sibling script)

HERE = Path(__file__).parent
N_ESTIMATE = inspect.signature(validate).parameters["n_estimate"].default  # validate's estimation scenes


def sweep(vlm, heads, alphas: list[float], seed: int, n_eval: int) -> dict:
    start = time.perf_counter()
    study = edit_studies(vlm, [heads], alphas, n_estimate=N_ESTIMATE, n_eval=n_eval, seed=seed, n_objects=3,
                         entropy="high", positions="answer")[0]
    by_alpha = {}
    for alpha in alphas:
        rows = [r for r in study.records if r["alpha"] == alpha]
        by_alpha[f"{alpha:g}"] = {arm: answers([r for r in rows if r["arm"] == arm])
                                  for arm in dict.fromkeys(r["arm"] for r in rows)}
    return {"seed": seed, "n_estimate": N_ESTIMATE, "n_eval": n_eval, "by_alpha": by_alpha,
            "seconds": time.perf_counter() - start}


def margin(arms: dict) -> float:
    return arms["edit"]["t"]["rate"] - arms["control"]["t"]["rate"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-vsm")
    p.add_argument("--alphas", default="0.5,0.6,0.7,0.8,0.9,1,1.25,1.5")
    p.add_argument("--choose-seed", type=int, default=1000)
    p.add_argument("--confirm-seed", type=int, default=2000)
    p.add_argument("--n-eval", type=int, default=512)
    p.add_argument("--out", default=str(HERE / "results" / "edit_alpha_sweep.json"))
    args = p.parse_args(argv)
    alphas = [float(a) for a in args.alphas.split(",")]
    vlm = vb.load(args.model)
    heads = parse_heads(vlm.training["planted"]["id_selection"])
    choose = sweep(vlm, heads, alphas, args.choose_seed, args.n_eval)
    margins = {a: margin(arms) for a, arms in choose["by_alpha"].items()}
    chosen = max(margins, key=lambda a: (margins[a], -float(a)))
    confirm_alphas = sorted({float(chosen), 1.0})
    confirm = sweep(vlm, heads, confirm_alphas, args.confirm_seed, args.n_eval)
    record = {"model": args.model, "heads": " ".join(f"{l}.{h}" for l, h in heads), "objects": 3, "entropy": "high",
              "positions": "answer", "rule": "largest edit efficacy minus empty-cell control on the choose seed; "
              "ties: the smaller alpha", "chosen_alpha": float(chosen), "choose": choose, "confirm": confirm,
              "command": "python circuits/ground_truth/edit_alpha_sweep.py " + " ".join(argv or sys.argv[1:])}
    write_json_atomic(record, Path(args.out))
    for name, part in (("choose", choose), ("confirm", confirm)):
        print(f"{name} (seed {part['seed']}, n={part['n_eval']}):")
        for a, arms in part["by_alpha"].items():
            print(f"  alpha {a}: " + "  ".join(f"{arm} t={v['t']['rate']:.2f} orig={v['original']['rate']:.2f} "
                                               f"other={v['other_described']['rate']:.2f} "
                                               f"absent={v['absent']['rate']:.2f}" for arm, v in arms.items()))
    print(f"chosen alpha: {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
