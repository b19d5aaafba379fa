"""Where the position-ID edit's empty-cell control lands: on the described object nearest to the empty cell?

    python circuits/ground_truth/edit_control_geometry.py [--model organism-vsm] [--n-eval 512] [--alpha 1]
                                                          [--seed 1000]
                                                          [--out circuits/ground_truth/results/edit_control_geometry.json]

The control adds ``alpha * (d_c - d_o)`` at the ID-selection heads, ``c`` a random empty cell, and counts answers that
name the object at the edit's target cell ``t``. With three objects a scene has two described objects; if the push
towards ``c`` lands on a described object at random, half of those answers name ``t``. This script asks whether the
landing follows the geometry instead: for each control answer that names a described object, is it the one nearest to
``c`` (Euclidean distance in grid cells; scenes where both are equally near are left out)? And how often does the
control name ``t`` when ``t`` is the nearer one, against when the other described object is, and by the distance
from ``c`` to ``t`` and whether ``c`` shares ``t``'s row or column? It runs the same ``edit_studies`` call as ``vlmbind validate`` (same seed, estimation and
evaluation scenes, ``answer`` positions), with more evaluation scenes; the first 64 are validate's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import numpy as np

import vlmbind as vb
from vlmbind.analysis.ablation import wilson_interval
from vlmbind.analysis.edits import edit_studies
from vlmbind.analysis.validate import validate
from vlmbind.evaluate import training_defaults
from vlmbind.io import write_json_atomic
from vlmbind.stimuli import scene_description

HERE = Path(__file__).parent
N_ESTIMATE = inspect.signature(validate).parameters["n_estimate"].default  # validate's estimation scenes


def share(hits: int, n: int) -> dict:
    rate = hits / n if n else float("nan")
    low, high = wilson_interval(rate, n) if n else (float("nan"), float("nan"))
    return {"hits": hits, "n": n, "rate": rate, "ci95": [low, high]}


def landing(records: list[dict], scenes: dict, alpha: float) -> dict:
    """Counts for the control rows at ``alpha``: names t, names a described object, lands on the nearest one."""
    rows = [r for r in records if r["alpha"] == alpha and r["arm"] == "control"]
    named_t = described = nearest_hits = nearest_n = 0
    when_t_nearest, when_other_nearest, ties = [0, 0], [0, 0], 0
    for r in rows:
        scene, c = scenes[r["id"]], np.asarray(r["c"], dtype=float)
        distance = {scene.objects[j].name: float(np.hypot(*(np.array([scene.objects[j].row, scene.objects[j].col]) - c)))
                    for j in scene.fields["described"]}
        nearest = min(distance, key=distance.get)
        tie = len(set(np.round(list(distance.values()), 6))) < len(distance)
        hit = r["outcome"] == "switch"
        named_t += hit
        described += bool(r["described"])
        if tie:
            ties += 1
            continue
        if r["described"]:
            nearest_hits += r["parsed"] == nearest
            nearest_n += 1
        counts = when_t_nearest if nearest == r["t_name"] else when_other_nearest
        counts[0] += hit
        counts[1] += 1
    by_distance = {}  # names t, by the distance from the empty cell c to t (grid cells, rounded up)
    for r in rows:
        key = str(int(np.ceil(np.hypot(*(np.asarray(r["c"], dtype=float) - np.asarray(r["t"], dtype=float))))))
        hits, n = by_distance.get(key, (0, 0))
        by_distance[key] = (hits + (r["outcome"] == "switch"), n + 1)
    by_line = {}  # names t, by whether c lies in t's row, t's column, or neither
    for r in rows:
        key = "same_row" if r["c"][0] == r["t"][0] else "same_column" if r["c"][1] == r["t"][1] else "neither"
        hits, n = by_line.get(key, (0, 0))
        by_line[key] = (hits + (r["outcome"] == "switch"), n + 1)
    edit = [r for r in records if r["alpha"] == alpha and r["arm"] == "edit"]
    return {"edit_efficacy": share(sum(r["outcome"] == "switch" for r in edit), len(edit)),
            "control_names_t": share(named_t, len(rows)),
            "control_names_described": share(described, len(rows)),
            "described_answers_on_nearest": share(nearest_hits, nearest_n),
            "names_t_when_t_nearest": share(*when_t_nearest),
            "names_t_when_other_nearest": share(*when_other_nearest),
            "scenes_with_equally_near_objects": ties,
            "control_names_t_by_distance_to_t": {k: share(*by_distance[k]) for k in sorted(by_distance, key=int)},
            "control_names_t_by_line_through_t": {k: share(*by_line[k]) for k in sorted(by_line)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-vsm")
    p.add_argument("--n-eval", type=int, default=512)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--out", default=str(HERE / "results" / "edit_control_geometry.json"))
    args = p.parse_args(argv)
    vlm = vb.load(args.model)
    selection = [tuple(int(x) for x in h.split(".")) for h in vlm.training["planted"]["id_selection"]]
    head_sets = [selection] + ([[h] for h in selection] if len(selection) > 1 else [])
    stimulus = training_defaults(vlm, "scene", {"n_objects": 3, "entropy": "high"})
    studies = edit_studies(vlm, head_sets, [args.alpha], n_estimate=N_ESTIMATE, n_eval=args.n_eval, seed=args.seed,
                           n_objects=3, entropy="high", positions="answer")
    scenes = {s.id: s for s in scene_description(N_ESTIMATE + args.n_eval, args.seed, **stimulus)}
    record = {"model": args.model, "alpha": args.alpha, "seed": args.seed, "n_estimate": N_ESTIMATE,
              "n_eval": args.n_eval, "objects": 3, "entropy": "high", "positions": "answer",
              "by_heads": {" ".join(f"{l}.{h}" for l, h in heads): landing(study.records, scenes, args.alpha)
                           for heads, study in zip(head_sets, studies)},
              "command": "python circuits/ground_truth/edit_control_geometry.py " + " ".join(argv or sys.argv[1:])}
    write_json_atomic(record, Path(args.out))
    print(json.dumps(record["by_heads"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
