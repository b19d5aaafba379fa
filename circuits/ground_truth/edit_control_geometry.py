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
from ``c`` to ``t`` and whether ``c`` shares ``t``'s row or column? Per arm (edit, empty-cell control, random
direction) it also splits the answers into ``t``, the missing object, the other described object and no object of
the scene. It runs the same ``edit_studies`` call as
``vlmbind validate`` (same seed, estimation and evaluation scenes, ``answer`` positions), with more evaluation
scenes; the first 64 are validate's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

import vlmbind as vb
from vlmbind.analysis.ablation import wilson_interval
from vlmbind.analysis.edits import edit_studies
from vlmbind.analysis.validate import validate
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.core.io import write_json_atomic
from vlmbind.core.sites import parse_heads
from vlmbind.stimuli import scene_description

HERE = Path(__file__).parent
N_ESTIMATE = inspect.signature(validate).parameters["n_estimate"].default  # validate's estimation scenes


def share(hits: int, n: int) -> dict:
    rate = hits / n if n else float("nan")
    low, high = wilson_interval(rate, n) if n else (float("nan"), float("nan"))
    return {"hits": hits, "n": n, "rate": rate, "ci95": [low, high]}


def landing(records: list[dict], scenes: dict, alpha: float) -> dict:
    """Counts for the control rows at ``alpha``: names t, names a described object, lands on the nearest one, and
    names t by where the empty cell lies relative to t."""
    rows = [r for r in records if r["alpha"] == alpha and r["arm"] == "control"]
    tally: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # (figure, group) -> [hits, n]

    def count(figure: str, group: str, hit: bool) -> None:
        tally[figure, group][0] += hit
        tally[figure, group][1] += 1

    ties = 0
    for r in rows:
        scene, c, t = scenes[r["id"]], np.asarray(r["c"], dtype=float), np.asarray(r["t"], dtype=float)
        hit = r["outcome"] == "switch"
        count("control_names_t", "", hit)
        count("control_names_described", "", bool(r["described"]))
        count("control_names_t_by_distance_to_t", str(int(np.ceil(np.hypot(*(c - t))))), hit)
        line = "same_row" if c[0] == t[0] else "same_column" if c[1] == t[1] else "neither"
        count("control_names_t_by_line_through_t", line, hit)
        distance = {scene.objects[j].name: float(np.hypot(scene.objects[j].row - c[0], scene.objects[j].col - c[1]))
                    for j in scene.fields["described"]}
        if len(set(np.round(list(distance.values()), 6))) < len(distance):
            ties += 1  # both described objects equally near: no nearer one
            continue
        nearest = min(distance, key=distance.get)
        if r["described"]:
            count("described_answers_on_nearest", "", r["parsed"] == nearest)
        count("names_t_when_t_nearest" if nearest == r["t_name"] else "names_t_when_other_nearest", "", hit)
    edit = [r for r in records if r["alpha"] == alpha and r["arm"] == "edit"]
    out = {"edit_efficacy": share(sum(r["outcome"] == "switch" for r in edit), len(edit)),
           "answers": {arm: answers([r for r in records if r["alpha"] == alpha and r["arm"] == arm])
                       for arm in dict.fromkeys(r["arm"] for r in records)}}
    for (figure, group), (hits, n) in sorted(tally.items(), key=lambda kv: (kv[0][0], _group_order(kv[0][1]))):
        if group:
            out.setdefault(figure, {})[group] = share(hits, n)
        else:
            out[figure] = share(hits, n)
    out["scenes_with_equally_near_objects"] = ties
    return out


def answers(rows: list[dict]) -> dict:
    """What one arm's answers name: ``t``, the missing object (``original``), the other described object, or no
    object of the scene (``absent``: another colour-shape pair, or no parse)."""
    def kind(r: dict) -> str:
        if r["outcome"] == "switch":
            return "t"
        if r["outcome"] == "original":
            return "original"
        return "other_described" if r["described"] else "absent"
    kinds = [kind(r) for r in rows]
    return {k: share(kinds.count(k), len(kinds)) for k in ("t", "original", "other_described", "absent")}


def _group_order(group: str) -> tuple:
    return (0, int(group), "") if group.isdigit() else (1, 0, group)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-vsm")
    p.add_argument("--n-eval", type=int, default=512)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--out", default=str(HERE / "results" / "edit_control_geometry.json"))
    args = p.parse_args(argv)
    vlm = vb.load(args.model)
    selection = parse_heads(vlm.training["planted"]["id_selection"])
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
