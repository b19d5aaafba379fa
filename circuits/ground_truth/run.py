"""Ground truth: every method of vlmbind scored against the mechanism planted in organism-vsm, its behaviour-only twin
organism-vsm-natural (scored against organism-vsm's heads) and organism-p2a (no reference), and the measurements that
say how far the plant goes.

    python circuits/ground_truth/run.py                              # every part -> results/, then the README
    python circuits/ground_truth/run.py --parts interchange,single_heads
    python circuits/ground_truth/run.py --parts validate --reuse     # table.csv again from the saved validations
    python circuits/ground_truth/run.py --parts scene_accuracy --n 16 --out runs/quick   # a quick look elsewhere

Parts, each with the models, sample size and seed of the saved results (``--models``, ``--n``, ``--seed`` override
them), and what each writes under ``--out``:

- ``validate``: ``vlmbind validate`` on each model (``--n`` pairs per condition) -> ``<model>/`` (validation.json,
  methods.csv, scores.csv, ablation.csv, edit.csv, probes.csv), and the headline rows of all of them -> ``table.csv``
  and ``table.json``;
- ``interchange``: for each planted variable, object count 2-4 (3 was held out of training) and entropy, the share
  of ``--n`` fresh pairs whose base run, with the planted heads interchanged from the source at the variable's
  positions, gives the high-level counterfactual answer, beside the share the unpatched run gives; a variable's
  heads each interchanged alone; and, over all settings pooled, the share of answers each unplanted head moves when
  interchanged alone at every prompt position (strictness asks <= 0.02) -> ``interchange.json``;
- ``scene_accuracy``: scene description per object count and entropy -> ``scene_accuracy.json``;
- ``single_heads``: scene description with each head ablated alone, on validate's ablation scenes ->
  ``single_heads.json``;
- ``random_k_draws``: validate's random-k ablation arm over 100 draws instead of five (uniform over the unplanted
  heads; in a 28-head model with four heads in layer 0, a set of four takes two or more of them about one draw in
  nine, and such a set can break the task) -> ``random_k_draws.json``;
- ``edit_control_geometry``: validate's position-ID edit call with more evaluation scenes (validate's are the first
  of them): where the empty-cell control's answers land -> ``edit_control_geometry.json``;
- ``edit_alpha_sweep``: the same edit on a fine alpha grid, the alpha chosen on one seed by a rule fixed before the
  run and measured again on another -> ``edit_alpha_sweep.json``;
- ``edges``: every head-to-head edge scored by exact path patching (``vlmbind circuit``'s defaults) on validate's
  first ``--n`` id_selection pairs, by EAP, EAP-IG and AtP*, and by the product of its heads' best exact node scores
  in the saved validation, each against organism-vsm's declared edges, with the faithfulness curve of the exact
  ranking and of the declared circuit -> ``<model>/circuit/`` (edges.csv, faithfulness.csv, summary.json) and
  ``edges.json``;
- ``atp_star``: on validate's first ``--n`` id_selection pairs, AtP, its magnitude alone, AtP* with the QK fix alone
  and AtP* (QK fix and GradDrop), each scored against the planted ID-selection heads -> ``atp_star.json``;
- ``steering``: ``vlmbind steer``'s defaults (a described object, the last prompt token and every answer position)
  on ``--n`` fresh scenes, for each planted head alone and the two ID-selection heads together, beside as many random
  heads (five draws), and every head's gaze -> ``<model>/steer/<heads>/`` and ``steering.json``;
- ``steering_points``: on organism-p2a's and organism-search's search and counting traces (``--n`` fresh displays
  each), the two heads whose attention at the last prompt token falls most on the object the answer points at first
  (gaze, measured on the same displays), each alone and together, and organism-search's planted search heads,
  steered to a distractor while the first point is written, beside random heads -> ``steering_points.json``;
- ``lens``: ``vlmbind lens``'s defaults on ``--n`` scene-description scenes: per layer the share of objects whose colour
  and shape word decodes at their own image tokens, beside background tokens -> ``lens.json``;
- ``relevancy``: ``vlmbind relevancy``'s defaults on organism-p2a's query task (``--n`` examples): each map's
  deletion / insertion AUC against random maps, the knockout of its top cells against random cells, and its mass on
  the object asked about -> ``relevancy.json``;
- ``search``: organism-search and its twin on ``--n`` fresh displays per task: answer and whole-trace accuracy on
  search and counting; on ``--n`` fresh pointing pairs, the share whose patched point moves to the source's object
  with organism-search's planted heads interchanged at its two steps (by pair kind), and the share of answers each
  other head changes when interchanged alone there; whole-trace counting accuracy with each head zero-ablated alone
  (validate's ablation displays); and for organism-p2a, organism-search and its twin, linear probes of every image
  token's grid row and column after each decoder layer -> ``search.json``;
- ``benchmark``: ``vlmbind benchmark``'s defaults (``--n`` pairs per condition): every method on organism-vsm,
  organism-search and their twins -> ``benchmark/`` (benchmark.json, benchmark.csv and each validation's files).

At the default ``--out`` the README's tables are rendered again from the results (``tables.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import vlmbind as vb
from vlmbind.analysis.ablation import ablation_study, wilson_interval
from vlmbind.analysis.benchmark import benchmark
from vlmbind.analysis.edits import edit_studies
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.analysis.lens import lens, lens_dataset
from vlmbind.analysis.mediation import scene_task
from vlmbind.analysis.relevancy import relevancy, relevancy_dataset
from vlmbind.analysis.search_validation import validate_search
from vlmbind.analysis.steering import steer
from vlmbind.analysis.tracking import tracking_dataset
from vlmbind.analysis.validate import (
    ValidationResult,
    held_out_objects,
    rank_metrics,
    recorded_edges,
    recorded_planted,
    score_edges,
    validate,
)
from vlmbind.core.io import write_json_atomic, write_text_atomic
from vlmbind.core.shipped import planted_organisms
from vlmbind.core.sites import parse_heads
from vlmbind.engine.patching import atp_star_diffs, attribution_diffs
from vlmbind.organisms.data import BatchBuilder, TaskMixture, TaskSpec, training_canvas
from vlmbind.organisms.siit.evaluation import answer_changes_per_set, interchange_accuracy, unpatched_accuracy
from vlmbind.organisms.siit.interchange import HeadInterchange
from vlmbind.organisms.siit.pointing import PointSIITSpec, evaluation_point_pairs, point_interchange
from vlmbind.stimuli import scene_description, scene_pairs

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PLANTED = "organism-vsm"  # the organism whose recorded heads are the reference
REFERENCES = {"organism-vsm-natural": PLANTED}  # a model with nothing planted, scored against another's heads
TWINS = ("organism-vsm", "organism-vsm-natural")
SEARCH = "organism-search"  # the organism whose planted search heads are the reference of the search part
SEARCH_TWINS = (SEARCH, "organism-search-natural")
N_ESTIMATE = inspect.signature(validate).parameters["n_estimate"].default  # validate's position-ID estimation scenes
POOLS = {"colours": ("red", "green", "blue", "yellow"), "shapes": ("square", "circle", "triangle", "star")}
PAIR_OPTIONS = {"id_selection": {"swap": "random"}, "id_retrieval": {"swap": "random"},
                "feature_retrieval": {"recolour": "any"}}
SINGLE_HEAD_MODES = ("zero", "image_attention")
RANDOM_K_DRAWS, RANDOM_K_MODES = 100, ("zero", "mean", "role_mean", "image_attention")
GEOMETRY_ALPHA = 1.0
SWEEP_ALPHAS, CONFIRM_SEED = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5), 2000


def _tables():
    """This circuit's tables.py (the README's tables, rendered from results), loaded by path."""
    spec = importlib.util.spec_from_file_location("ground_truth_tables", HERE / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _tables()


class Run(NamedTuple):
    """What one part is asked to do: its models, sample size and seed, where to write, and the command recorded."""
    models: list[str]
    n: int
    seed: int
    out: Path
    command: str
    reuse: bool = False

    def one_model(self) -> str:
        if len(self.models) != 1:
            raise SystemExit(f"this part measures one model, not {len(self.models)}: pass --models with one")
        return self.models[0]


# --- the stimuli the parts share ------------------------------------------------------------------------------------

def setting_seed(seed: int, objects: int, entropy: str) -> int:
    """Each object count and entropy of a per-setting table draws from its own seed."""
    return seed + 7 * objects + (entropy == "low")


def setting_scenes(vlm, n: int, seed: int, objects: int, entropy: str):
    return scene_description(n, setting_seed(seed, objects, entropy),
                             **training_defaults(vlm, "scene", {"n_objects": objects, "entropy": entropy}))


def validation_scenes(vlm, n: int, seed: int):
    """validate's ablation scenes: the object count the planting held out, high entropy, at ``seed + 2``."""
    return scene_description(n, seed + 2, **training_defaults(
        vlm, "scene", {"n_objects": held_out_objects(vlm), "entropy": "high"}))


def setting_pairs(vlm, variable: str, n: int, seed: int, objects: int, entropy: str) -> list:
    canvas = training_canvas(vlm.training)
    return list(scene_pairs(n, variable, setting_seed(seed, objects, entropy), n_objects=objects, entropy=entropy,
                            canvas=canvas, **PAIR_OPTIONS[variable], **POOLS))


def planted_heads(vlm) -> list[tuple[int, int]]:
    return [h for heads in vlm.training["planted"].values() for h in parse_heads(heads)]


# --- validate -------------------------------------------------------------------------------------------------------

def headline(result: ValidationResult) -> list[dict]:
    """One row per (condition, method) plus the ablation, edit and probe figures of the model."""
    rows = []
    for r in result.methods:
        planted = " ".join(f"{x['score']:+.3f}±{x['stderr']:.3f}" for x in result.scores
                           if x["condition"] == r["condition"] and x["method"] == r["method"] and x["reference"])
        rows.append({"model": result.model, "reference": result.reference, "part": "mediation",
                     "planted_score": planted, "unplanted_max_abs": r["unplanted_max_abs"],
                     "condition": r["condition"], "method": r["method"], "heads": " ".join(r["heads"]),
                     "n": r["n_pairs"], "ranks": " ".join(map(str, r["planted_ranks"])),
                     "recall_at_k": r["recall_at_k"], "auroc": r["auroc"], "ratio": r["ratio"],
                     "top_heads": " ".join(r["top_heads"]), "seconds": round(r["seconds"], 2)})
    for mode, arms in result.ablation_summary().items():
        for arm in ("clean", "top", "random", "random_min", "random_same_layers", "random_same_layers_min", "bottom"):
            if arm not in arms:
                continue
            rows.append({"model": result.model, "reference": result.reference, "part": "ablation",
                         "condition": mode, "method": arm, "value": arms[arm],
                         "n": next(a["n"] for a in result.ablation if a["mode"] == mode),
                         "seeds": arms["random_seeds"] if arm.startswith("random") else None})
    for heads in result.edit_heads():
        best = result.edit_summary(heads)["alpha"]
        at = [r for r in result.edit if r.get("heads", heads) == heads]
        for r in at:
            if r["arm"] != "edit" or r["alpha"] == 0:
                continue
            control, random = (next((c["efficacy"] for c in at if c["arm"] == arm and c["alpha"] == r["alpha"]), None)
                               for arm in ("control", "random_direction"))
            rows.append({"model": result.model, "reference": result.reference, "part": "edit",
                         "condition": "id_selection" + (" (best)" if r["alpha"] == best else ""),
                         "method": f"alpha {r['alpha']:g}", "value": r["efficacy"], "control": control,
                         "random_control": random, "n": r["n"], "heads": heads})
    for p in result.probes:
        rows.append({"model": result.model, "reference": result.reference, "part": "probe", "condition": p["target"],
                     "method": "logistic", "heads": p["head"], "value": p["accuracy"], "chance": p["chance"],
                     "n": p["n_test"]})
    return rows


def run_validate(run: Run) -> None:
    rows = []
    for name in run.models:
        if run.reuse and (run.out / name / "validation.json").is_file():
            rows += headline(ValidationResult.load(run.out / name))
            continue
        source = REFERENCES.get(name)
        result = validate(vb.load(name), reference=recorded_planted(source) if source else None,
                          reference_source=source, n_pairs=run.n, seed=run.seed, progress=True)
        result.save(run.out / name, figure=False)  # 5 MB of plotly.js each; `vlmbind export` draws it
        rows += headline(result)
        print(f"{name}: done in {sum(result.seconds.values()):.0f} s", file=sys.stderr)
    table = pd.DataFrame(rows)
    write_text_atomic(table.to_csv(index=False), run.out / "table.csv")
    write_json_atomic({"command": run.command, "rows": json.loads(table.to_json(orient="records"))},
                      run.out / "table.json")


# --- interchange ----------------------------------------------------------------------------------------------------

def measure_interchange(name: str, planted: dict[str, list[str]], n_pairs: int, seed: int) -> dict:
    vlm = vb.load(name)
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    taken = {h for heads in planted.values() for h in parse_heads(heads)}
    free = [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads) if (l, h) not in taken]
    out = {"model": name, "planted": planted, "n_pairs": n_pairs, "seed": seed, "variables": {}}
    for variable, heads in planted.items():
        rows, pooled = [], []
        for objects, entropy in tables.SETTINGS:
            pairs = setting_pairs(vlm, variable, n_pairs, seed, objects, entropy)
            pooled += pairs
            rows.append({"objects": objects, "entropy": entropy, "n": len(pairs),
                         "interchange_accuracy": interchange_accuracy(vlm.model, interchange, builder, pairs,
                                                                      parse_heads(heads), last_positions="answer"),
                         "unpatched": unpatched_accuracy(vlm.model, builder, pairs)})
            if len(heads) > 1:  # which of a variable's heads the answer follows: each interchanged alone
                rows[-1]["alone"] = {h: interchange_accuracy(vlm.model, interchange, builder, pairs,
                                                             parse_heads([h]), last_positions="answer")
                                     for h in heads}
            print(name, variable, rows[-1], file=sys.stderr, flush=True)
        shares = answer_changes_per_set(vlm.model, interchange, builder, pooled, [[head] for head in free])
        changes = {f"{l}.{h}": share for (l, h), share in zip(free, shares)}
        worst = max(changes, key=changes.get)
        out["variables"][variable] = {"settings": rows, "unplanted_changes": changes,
                                      "unplanted_changes_max": changes[worst], "unplanted_worst_head": worst,
                                      "unplanted_heads_above_0.02": sorted(h for h, v in changes.items() if v > 0.02),
                                      "n_pooled": len(pooled)}
    return out


def run_interchange(run: Run) -> None:
    planted = recorded_planted(PLANTED)
    write_json_atomic({"command": run.command,
                       "results": [measure_interchange(m, planted, run.n, run.seed) for m in run.models]},
                      run.out / "interchange.json")


# --- scene description, whole and with single heads ablated ---------------------------------------------------------

def measure_scene_accuracy(name: str, n: int, seed: int) -> dict:
    vlm = vb.load(name)
    rows = []
    for objects, entropy in tables.SETTINGS:
        accuracy = vb.evaluate(vlm, setting_scenes(vlm, n, seed, objects, entropy)).accuracy
        rows.append({"objects": objects, "entropy": entropy, "n": n, "accuracy": accuracy})
        print(name, rows[-1], file=sys.stderr, flush=True)
    return {"model": name, "n": n, "seed": seed, "settings": rows}


def measure_single_heads(name: str, n: int, seed: int) -> dict:
    """Each head ablated alone. A head the task needs is not thereby a head that carries a planted variable:
    necessity (ablation) and the variable (interchange, mediation) are different questions."""
    vlm = vb.load(name)
    scenes = validation_scenes(vlm, n, seed)
    out = {"model": name, "n": n, "seed": seed, "clean": vb.evaluate(vlm, scenes).accuracy,
           "planted": (vlm.training or {}).get("planted"), "modes": {}}
    for mode in SINGLE_HEAD_MODES:
        rows = {}
        for layer in range(vlm.n_layers):
            for head in range(vlm.n_heads):
                with vlm.ablate([(layer, head)], mode=mode):
                    rows[f"{layer}.{head}"] = vb.evaluate(vlm, scenes).accuracy
        out["modes"][mode] = rows
        print(name, mode, rows, file=sys.stderr, flush=True)
    return out


def run_scene_accuracy(run: Run) -> None:
    write_json_atomic({"command": run.command,
                       "results": [measure_scene_accuracy(m, run.n, run.seed) for m in run.models]},
                      run.out / "scene_accuracy.json")


def run_single_heads(run: Run) -> None:
    write_json_atomic({"command": run.command,
                       "results": [measure_single_heads(m, run.n, run.seed) for m in run.models]},
                      run.out / "single_heads.json")


# --- random-k over many draws ---------------------------------------------------------------------------------------

def draws_summary(arms: list[dict]) -> dict:
    """Mean accuracy over draws with its standard error, the lowest draw, and the means over the draws that take at
    most one layer-0 head and over those that take two or more."""
    accuracy = np.array([a["accuracy"] for a in arms])
    layer0 = np.array([sum(h.startswith("0.") for h in a["heads"]) for a in arms])
    groups = {"at_most_one_layer0_head": layer0 <= 1, "two_or_more_layer0_heads": layer0 >= 2}
    return {"draws": len(arms), "mean": float(accuracy.mean()),
            "se": float(accuracy.std(ddof=1) / np.sqrt(len(arms))) if len(arms) > 1 else None,
            "lowest": float(accuracy.min()),
            **{name: {"draws": int(mask.sum()), "mean": float(accuracy[mask].mean()) if mask.any() else None}
               for name, mask in groups.items()}}


def run_random_k_draws(run: Run, draws: int = RANDOM_K_DRAWS, modes: tuple[str, ...] = RANDOM_K_MODES) -> None:
    name = run.one_model()
    vlm = vb.load(name)
    planted = planted_heads(vlm)
    # ablation_study ranks heads by score: the planted ones are its top-k, every other head the pool it draws from
    frame = pd.DataFrame([{"layer": l, "head": h, "score": 1.0 if (l, h) in planted else 0.0}
                          for l in range(vlm.n_layers) for h in range(vlm.n_heads)])
    dataset = validation_scenes(vlm, run.n, run.seed)
    record = {"model": name, "planted": [f"{l}.{h}" for l, h in planted], "n_eval": run.n,
              "scenes": f"scene_description({run.n}, {run.seed + 2}), {held_out_objects(vlm)} objects, high entropy",
              "modes": {}, "command": run.command}
    for mode in modes:
        study = ablation_study(vlm, dataset, frame, k=len(planted), mode=mode, seeds=tuple(range(draws)),
                               random_from="rest")
        random = [{"seed": a["seed"], "heads": list(a["heads"]), "accuracy": a["accuracy"]}
                  for a in study.arms if a["arm"] == "random"]
        top = next(a["accuracy"] for a in study.arms if a["arm"] == "top")
        record["modes"][mode] = {"top": top, "random": draws_summary(random), "draws": random}
        print(mode, json.dumps({"top": top, **draws_summary(random)}), file=sys.stderr, flush=True)
    write_json_atomic(record, run.out / "random_k_draws.json")


# --- the position-ID edit's controls ---------------------------------------------------------------------------------

def share(hits: int, n: int) -> dict:
    rate = hits / n if n else float("nan")
    low, high = wilson_interval(rate, n) if n else (float("nan"), float("nan"))
    return {"hits": hits, "n": n, "rate": rate, "ci95": [low, high]}


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


def landing(records: list[dict], scenes: dict, alpha: float) -> dict:
    """Where the empty-cell control rows at ``alpha`` land. The control adds ``alpha * (d_c - d_o)``, ``c`` a random
    empty cell, and counts answers naming the object at the edit's target cell ``t``; with three objects, a push that
    lands on a described object at random names ``t`` half the time. Counted here: names t, names a described object,
    lands on the described object nearer to ``c`` (Euclidean, in grid cells; equally near scenes left out), and names
    t by the distance from ``c`` to ``t`` and whether ``c`` shares ``t``'s row or column."""
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


def run_edit_control_geometry(run: Run, alpha: float = GEOMETRY_ALPHA) -> None:
    name = run.one_model()
    vlm = vb.load(name)
    selection = parse_heads(vlm.training["planted"]["id_selection"])
    head_sets = [selection] + ([[h] for h in selection] if len(selection) > 1 else [])
    stimulus = training_defaults(vlm, "scene", {"n_objects": 3, "entropy": "high"})
    studies = edit_studies(vlm, head_sets, [alpha], n_estimate=N_ESTIMATE, n_eval=run.n, seed=run.seed,
                           n_objects=3, entropy="high", positions="answer")
    scenes = {s.id: s for s in scene_description(N_ESTIMATE + run.n, run.seed, **stimulus)}
    record = {"model": name, "alpha": alpha, "seed": run.seed, "n_estimate": N_ESTIMATE,
              "n_eval": run.n, "objects": 3, "entropy": "high", "positions": "answer",
              "by_heads": {" ".join(f"{l}.{h}" for l, h in heads): landing(study.records, scenes, alpha)
                           for heads, study in zip(head_sets, studies)},
              "command": run.command}
    write_json_atomic(record, run.out / "edit_control_geometry.json")


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


def run_edit_alpha_sweep(run: Run, alphas: tuple[float, ...] = SWEEP_ALPHAS, confirm_seed: int = CONFIRM_SEED) -> None:
    """Choose on ``run.seed``'s scenes the alpha with the largest efficacy minus empty-cell control (ties: the
    smaller alpha), then measure it and alpha 1 on ``confirm_seed``'s (another estimation and evaluation set)."""
    name = run.one_model()
    vlm = vb.load(name)
    heads = parse_heads(vlm.training["planted"]["id_selection"])
    choose = sweep(vlm, heads, list(alphas), run.seed, run.n)
    margins = {a: arms["edit"]["t"]["rate"] - arms["control"]["t"]["rate"] for a, arms in choose["by_alpha"].items()}
    chosen = max(margins, key=lambda a: (margins[a], -float(a)))
    confirm = sweep(vlm, heads, sorted({float(chosen), 1.0}), confirm_seed, run.n)
    record = {"model": name, "heads": " ".join(f"{l}.{h}" for l, h in heads), "objects": 3, "entropy": "high",
              "positions": "answer", "rule": "largest edit efficacy minus empty-cell control on the choose seed; "
              "ties: the smaller alpha", "chosen_alpha": float(chosen), "choose": choose, "confirm": confirm,
              "command": run.command}
    write_json_atomic(record, run.out / "edit_alpha_sweep.json")


# --- the parts and the command line ---------------------------------------------------------------------------------

# --- edges ------------------------------------------------------------------------------------------------------------

def best_node_scores(result: ValidationResult, n_layers: int, n_heads: int) -> np.ndarray:
    """Each head's largest mean exact score over the validated conditions."""
    best = np.full((n_layers, n_heads), -np.inf)
    for r in result.scores:
        if r["method"] == "exact":
            best[r["layer"], r["head"]] = max(best[r["layer"], r["head"]], r["score"])
    return best


def run_edges(run: Run) -> None:
    declared = recorded_edges(PLANTED)
    results = []
    for name in run.models:
        vlm = vb.load(name)
        kwargs = training_defaults(vlm, "scene", {"n_objects": held_out_objects(vlm), "entropy": "high"})
        pairs = list(scene_pairs(run.n, "id_selection", run.seed, **kwargs))
        node = best_node_scores(ValidationResult.load(run.out / name), vlm.n_layers, vlm.n_heads)
        rows, found = score_edges(vlm, declared, pairs, node, progress=True)
        found.save(run.out / name / "circuit", figure=False)  # `vlmbind export` draws it
        results.append({"model": name, "reference": REFERENCES.get(name), "rows": rows})
        print(f"{name}: edges in {rows[0]['seconds']:.0f} s", file=sys.stderr)
    write_json_atomic({"command": run.command, "declared": declared, "results": results}, run.out / "edges.json")


def run_atp_star(run: Run) -> None:
    planted = [tuple(h) for h in parse_heads(recorded_planted(PLANTED)["id_selection"])]
    results = []
    for name in run.models:
        vlm = vb.load(name)
        kwargs = training_defaults(vlm, "scene", {"n_objects": held_out_objects(vlm), "entropy": "high"})
        pairs = list(scene_pairs(run.n, "id_selection", run.seed, **kwargs))
        heads = [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads)]
        shape = (vlm.n_layers, vlm.n_heads)
        scores: dict[str, list[np.ndarray]] = defaultdict(list)
        seconds: dict[str, float] = defaultdict(float)
        variants = {"atp": partial(attribution_diffs), "atp_qk_fix": partial(atp_star_diffs, grad_drop=False),
                    "atp_star": partial(atp_star_diffs)}
        for pair in pairs:
            task = scene_task(vlm, pair, range(vlm.n_layers))
            for method, compute in variants.items():
                start = time.perf_counter()
                clean, patched = compute(vlm, task, heads)
                seconds[method] += time.perf_counter() - start
                scores[method].append((patched - clean).reshape(shape))
        means = {m: np.mean(v, 0) for m, v in scores.items()}
        means["atp_magnitude"] = np.mean(np.abs(scores["atp"]), 0)
        seconds["atp_magnitude"] = seconds["atp"]
        rows = [{"method": m, **rank_metrics(means[m], planted),
                 "planted_scores": [float(means[m][h]) for h in planted], "seconds": seconds[m]}
                for m in ("atp", "atp_magnitude", "atp_qk_fix", "atp_star")]
        results.append({"model": name, "reference": REFERENCES.get(name), "n_pairs": len(pairs), "rows": rows})
        print(f"{name}: AtP variants in {sum(seconds.values()):.0f} s", file=sys.stderr)
    write_json_atomic({"command": run.command, "heads": [f"{l}.{h}" for l, h in planted], "results": results},
                      run.out / "atp_star.json")


def run_steering(run: Run) -> None:
    planted = recorded_planted(PLANTED)
    head_sets = [*(h for heads in planted.values() for h in heads), ",".join(planted["id_selection"])]
    results = []
    for name in run.models:
        vlm = vb.load(name)
        rows = []
        for heads in head_sets:
            found = steer(vlm, heads, "described", n=run.n, seed=run.seed)
            found.save(run.out / name / "steer" / heads.replace(",", "_"), figure=False)  # `vlmbind export` draws
            gaze = found.gaze.assign(excess=found.gaze["gaze"] - found.gaze["chance"])
            order = gaze.sort_values("excess", ascending=False, kind="stable").reset_index(drop=True)
            ranks = {f"{int(r['layer'])}.{int(r['head'])}": i + 1 for i, r in order.iterrows()}
            rows.append({**found.summary(), "gaze_ranks": {h: ranks[h] for h in heads.split(",")},
                         "gaze": {h: float(gaze.set_index(["layer", "head"]).loc[tuple(map(int, h.split("."))), "gaze"])
                                  for h in heads.split(",")}})
            print(f"{name} {heads}: efficacy {rows[-1]['efficacy']:.3f}, random heads "
                  f"{rows[-1]['random_heads_efficacy']:.3f} ({found.seconds:.0f} s)", file=sys.stderr)
        results.append({"model": name, "reference": REFERENCES.get(name), "rows": rows})
    write_json_atomic({"command": run.command, "planted": planted, "results": results}, run.out / "steering.json")


def run_steering_points(run: Run) -> None:
    results = []
    for name in run.models:
        vlm = vb.load(name)
        planted = (vlm.training.get("planted") or {}).get("search", [])
        for task in ("search", "count"):
            # the gaze comes from the unsteered forward: any head gives it; the heads then steered are chosen by it
            gaze = steer(vlm, "0.0", task=task, n=run.n, seed=run.seed, n_random=0).gaze
            gaze = gaze.assign(excess=gaze["gaze"] - gaze["chance"]).sort_values("excess", ascending=False,
                                                                                 kind="stable")
            top = [f"{int(r['layer'])}.{int(r['head'])}" for _, r in gaze.head(2).iterrows()]
            rows = []
            for heads in [*(h for h in planted if h not in top), *top, ",".join(top)]:
                found = steer(vlm, heads, task=task, n=run.n, seed=run.seed)
                by_head = gaze.set_index(["layer", "head"])["gaze"]
                rows.append({**found.summary(), "gaze": {h: float(by_head.loc[tuple(map(int, h.split(".")))])
                                                         for h in heads.split(",")}})
                print(f"{name} {task} {heads}: first point moved {rows[-1]['efficacy']:.3f}, random heads "
                      f"{rows[-1]['random_heads_efficacy']:.3f} ({found.seconds:.0f} s)", file=sys.stderr)
            results.append({"model": name, "task": task, "planted": planted, "rows": rows})
    write_json_atomic({"command": run.command, "results": results}, run.out / "steering_points.json")


def run_lens(run: Run) -> None:
    results = []
    for name in run.models:
        vlm = vb.load(name)
        found = lens(vlm, lens_dataset(vlm, "scene", run.n, run.seed))
        summary = found.summary()
        results.append({"model": name, "n_examples": summary["n_examples"], "n_objects": summary["n_objects"],
                        "seconds": summary["seconds"], "decodable": found.decodable.to_dict("records")})
        print(f"{name}: lens in {summary['seconds']:.0f} s", file=sys.stderr)
    write_json_atomic({"command": run.command, "results": results}, run.out / "lens.json")


def run_relevancy(run: Run) -> None:
    results = []
    for name in run.models:
        vlm = vb.load(name)
        found = relevancy(vlm, relevancy_dataset(vlm, "query", run.n, run.seed), seed=run.seed)
        results.append({"model": name, "summary": found.summary(),
                        "scores": found.scores().to_dict("records")})
        print(f"{name}: relevancy in {found.seconds:.0f} s", file=sys.stderr)
    write_json_atomic({"command": run.command, "results": results}, run.out / "relevancy.json")


class Part(NamedTuple):
    run: Callable[[Run], None]
    models: tuple[str, ...]
    n: int
    seed: int


def record_mixture(vlm, seed: int) -> TaskMixture:
    """The task mixture an organism was trained on (its training record's tasks and options), drawing with ``seed``."""
    training = vlm.training
    specs = [TaskSpec.from_options(t, w, training["task_options"].get(t)) for t, w in training["tasks"].items() if w > 0]
    return TaskMixture(specs, regime=training["regime"], image_size=training["image_size"], seed=seed)


def measure_search(name: str, heads: list[str], n: int, seed: int) -> dict:
    vlm = vb.load(name)
    out = {"model": name, "heads": heads, "n": n, "seed": seed, "tasks": {}}
    for task in ("search", "count"):
        options = {"present": 0.5} if task == "search" else {}
        dataset = tracking_dataset(vlm, task, n, seed, **options)
        result = vb.evaluate(vlm, dataset)
        exact = [r["output"].strip() == e.answer for r, e in zip(result.records, dataset)]
        out["tasks"][task] = {"n": len(exact), "answer_accuracy": result.accuracy,
                              "trace_accuracy": float(np.mean(exact)), "objects": dataset.params.get(
                                  "objects", dataset.params.get("n_objects"))}
        print(name, task, out["tasks"][task], file=sys.stderr, flush=True)
    spec = PointSIITSpec(heads=tuple(heads))
    pairs = evaluation_point_pairs(spec, record_mixture(vlm, seed), seed=seed, n=n)
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    grid = training_canvas(vlm.training).shape[1]
    planted = point_interchange(vlm.model, interchange, builder, pairs, spec.planted(), grid)
    kinds = [p.kind for p in pairs]
    out["interchange"] = {kind: {"n": kinds.count(kind),
                                 "moved": float(np.mean([m for m, k in zip(planted["moved"], kinds) if k == kind]))}
                          for kind in sorted(set(kinds))}
    out["interchange"]["all"] = {"n": len(pairs), "moved": float(np.mean(planted["moved"]))}
    changes = {}
    for layer, head in spec.unaligned(vlm.n_layers, vlm.n_heads):
        found = point_interchange(vlm.model, interchange, builder, pairs, [(layer, head)], grid)
        changes[f"{layer}.{head}"] = float(np.mean(found["changed"]))
    worst = max(changes, key=changes.get)
    out["unplanted_changes"] = changes
    out["unplanted_changes_max"] = {"head": worst, "share": changes[worst], "n": len(pairs)}
    # every head zero-ablated alone on counting displays, a display right when its whole trace is: a head the
    # traces need is not thereby a head that carries the pointed cell
    displays = tracking_dataset(vlm, "count", n, seed + 2)
    for example in displays:
        example.fields["scorer"] = "exact"
    out["single_heads"] = {"n": len(displays), "clean": vb.evaluate(vlm, displays).accuracy, "zero": {}}
    for layer in range(vlm.n_layers):
        for head in range(vlm.n_heads):
            with vlm.ablate([(layer, head)], mode="zero"):
                out["single_heads"]["zero"][f"{layer}.{head}"] = vb.evaluate(vlm, displays).accuracy
    print(name, out["interchange"], out["unplanted_changes_max"], file=sys.stderr, flush=True)
    return out


def position_probes(name: str, n: int, seed: int) -> list[dict]:
    """Per decoder layer (0: the decoder's input), the held-out accuracy of linear probes (standardised logistic
    regression, a quarter of the displays held out) reading every image token's grid row and column from the
    residual stream, on ``n`` counting displays."""
    vlm = vb.load(name)
    builder = BatchBuilder(vlm.processor)
    dataset = list(tracking_dataset(vlm, "count", n, seed, objects=(1, 4)))
    batch = builder([(e.image, e.prompt, e.answer) for e in dataset])
    with torch.no_grad():
        hidden = vlm.model(**batch.inputs, output_hidden_states=True, use_cache=False).hidden_states
    image = batch.inputs["input_ids"] == builder.image_token_id
    side = training_canvas(vlm.training).shape[1]
    cells = np.tile(np.arange(side * side), len(dataset))
    train = np.repeat(np.arange(len(dataset)) < (3 * len(dataset)) // 4, side * side)
    rows = []
    for layer, states in enumerate(hidden):
        x = states[image].float().numpy()
        row = {"model": name, "layer": layer, "n_train": int(train.sum()), "n_test": int((~train).sum())}
        for target, y in (("row", cells // side), ("column", cells % side)):
            probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(x[train], y[train])
            row[target] = float(probe.score(x[~train], y[~train]))
        rows.append(row)
    return rows


def run_search(run: Run) -> None:
    heads = recorded_planted(SEARCH)["search"]
    probes = [r for m in ("organism-p2a", *run.models) for r in position_probes(m, run.n, run.seed)]
    write_json_atomic({"command": run.command, "planted": heads,
                       "results": [measure_search(m, heads, run.n, run.seed) for m in run.models],
                       "position_probes": probes}, run.out / "search.json")


def run_benchmark(run: Run) -> None:
    organisms = {name: twin for name, twin in planted_organisms().items() if name in run.models}
    scene = partial(_scene_validation, n_pairs=run.n, seed=run.seed)
    search = partial(_search_validation, n_pairs=run.n, seed=run.seed)
    validations = {name: (search if "search" in recorded_planted(name) else scene) for name in organisms}
    result = benchmark(organisms, validations, out=run.out / "benchmark", figures=False)
    result.params = {"n_pairs": run.n, "seed": run.seed, "command": run.command}
    result.save(run.out / "benchmark")


def _scene_validation(vlm, reference, source, **options) -> ValidationResult:
    edges = recorded_edges(source) if source is not None else None
    methods = [m for m in inspect.signature(validate).parameters["methods"].default if m != "naive"]
    return validate(vlm, reference=reference, reference_source=source, reference_edges=edges, methods=methods,
                    **options)


def _search_validation(vlm, reference, source, **options) -> ValidationResult:
    methods = [m for m in inspect.signature(validate_search).parameters["methods"].default if m != "naive"]
    return validate_search(vlm, reference=reference, reference_source=source, methods=methods, **options)


PARTS = {
    "validate": Part(run_validate, (*TWINS, "organism-p2a"), n=24, seed=1000),
    "interchange": Part(run_interchange, TWINS, n=64, seed=1000),
    "scene_accuracy": Part(run_scene_accuracy, TWINS, n=128, seed=1005),
    "single_heads": Part(run_single_heads, TWINS, n=64, seed=1000),
    "random_k_draws": Part(run_random_k_draws, (PLANTED,), n=64, seed=1000),
    "edit_control_geometry": Part(run_edit_control_geometry, (PLANTED,), n=512, seed=1000),
    "edit_alpha_sweep": Part(run_edit_alpha_sweep, (PLANTED,), n=512, seed=1000),
    "edges": Part(run_edges, TWINS, n=24, seed=1000),
    "atp_star": Part(run_atp_star, TWINS, n=24, seed=1000),
    "steering": Part(run_steering, TWINS, n=64, seed=1000),
    "steering_points": Part(run_steering_points, ("organism-p2a", SEARCH), n=64, seed=1000),
    "lens": Part(run_lens, (*TWINS, "organism-p2a"), n=32, seed=1000),
    "relevancy": Part(run_relevancy, ("organism-p2a",), n=64, seed=1),
    "search": Part(run_search, SEARCH_TWINS, n=64, seed=1000),
    "benchmark": Part(run_benchmark, (*TWINS[:1], SEARCH), n=16, seed=1000),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--models", help="comma-separated; default: each part's own")
    p.add_argument("--n", type=int, help="pairs or scenes; default: each part's own")
    p.add_argument("--seed", type=int, help="default: each part's own")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--reuse", action="store_true", help="validate: load a model's saved result instead of running it")
    args = p.parse_args(argv)
    names = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    for name in names:
        part = PARTS[name]
        # the command that gives this part's file alone
        command = " ".join(["python circuits/ground_truth/run.py --parts", name]
                           + ([f"--models {','.join(models)}"] if models else [])
                           + [f"--{flag} {value}" for flag, value in (("n", args.n), ("seed", args.seed))
                              if value is not None])
        args.out.mkdir(parents=True, exist_ok=True)
        part.run(Run(models=models or list(part.models), n=part.n if args.n is None else args.n,
                     seed=part.seed if args.seed is None else args.seed, out=args.out, command=command,
                     reuse=args.reuse))
    if args.out.resolve() == RESULTS.resolve():
        tables.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
