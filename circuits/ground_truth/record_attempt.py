"""Record a training attempt on organism-vsm: its curves, its interchange accuracy by setting and its validation.

    python circuits/ground_truth/record_attempt.py CHECKPOINT LABEL --start "what it started from" [--strictness]

Writes ``results/organism-vsm_training/LABEL-attempt.json`` (the checkpoint's training state: config, evaluations,
wall time, the losses every 50 steps; and ``by_objects``: the planted heads' interchange accuracy on the interchange
table's fresh pairs, 64 per object count and entropy, seed 1000, each head of a multi-head variable also alone) and
``results/organism-vsm_training/N-validation/`` (``vlmbind validate`` as ``run.py`` runs it; N is LABEL's number).
The checkpoint gets organism-vsm's ``vlmbind_training.json`` beside its weights so that it loads as the organism.
With ``--strictness`` (minutes more) the record's ``interchange`` field is the interchange table's whole measurement
of the checkpoint (``interchange.py``'s, every unplanted head interchanged alone included). With
``--recipe-summary`` (a recipe run's ``recipe_summary.json``) the record's ``recipe`` field holds every stage's wall
time and last training evaluation, and the recipe's total wall time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import vlmbind as vb
from vlmbind.analysis.validate import validate
from vlmbind.core.io import write_json_atomic
from vlmbind.engine.vlm import TRAINING_FILE
from vlmbind.organisms.data import BatchBuilder
from vlmbind.organisms.siit import HeadInterchange, interchange_accuracy
from vlmbind.core.shipped import organism_dir
from vlmbind.core.sites import parse_heads
from vlmbind.stimuli import Canvas

sys.path.insert(0, str(Path(__file__).parent))
from interchange import fresh_pairs, measure  # noqa: E402  (the interchange table's pairs and measurement)

RUNS = Path(__file__).parent / "results" / "organism-vsm_training"


def by_objects(vlm, n_pairs: int = 64, seed: int = 1000) -> dict:
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    canvas = Canvas(image_size=int(vlm.training["image_size"]), grid=int(vlm.training["grid"]))
    accuracy = {}
    for variable, heads in vlm.training["planted"].items():
        for chosen in [heads] + ([[h] for h in heads] if len(heads) > 1 else []):
            accuracy[f"{variable}@{'+'.join(chosen)}"] = {
                f"{k}{e[0]}": interchange_accuracy(vlm.model, interchange, builder,
                                                   fresh_pairs(variable, n_pairs, seed, k, e, canvas),
                                                   parse_heads(chosen), last_positions="answer")
                for k in (2, 3, 4) for e in ("high", "low")}
    return {"measure": f"interchange accuracy of the planted heads on interchange.py's fresh pairs (seed {seed})",
            "n_per_cell": n_pairs, "accuracy": accuracy}


def recipe_record(summary: dict) -> dict:
    """A recipe run's summary without this machine's paths: stage, steps, wall time and last evaluation per stage."""
    stages = [{k: stage.get(k) for k in ("stage", "steps", "wall_time_s", "last_eval")} for stage in summary["stages"]]
    return {"organism": summary["organism"], "seed": summary["seed"], "threads": summary["threads"],
            "processes": summary.get("processes", 1), "stages": stages, "wall_time_s": summary["wall_time_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("label", help="N-name: the record is results/organism-vsm_training/N-name-attempt.json")
    p.add_argument("--start", required=True, help="what the attempt started from, in words")
    p.add_argument("--strictness", action="store_true", help="also measure the interchange table (strictness)")
    p.add_argument("--recipe-summary", help="the recipe run's recipe_summary.json: its stage times go in the record")
    args = p.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    shutil.copy(organism_dir("organism-vsm") / TRAINING_FILE, checkpoint / TRAINING_FILE)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    vlm = vb.load(str(checkpoint))
    number = args.label.split("-")[0]
    validate(vlm, n_pairs=24, seed=1000).save(RUNS / f"{number}-validation", figure=False)
    record = {"stage": args.label, "step": state["step"], "wall_time_s": state["wall_time_s"],
              "threads": state["threads"], "processes": state.get("processes", 1), "config": state["config"], "evals": state["evals"],
              "loss_every_50": state["losses"][::50], "siit_losses_every_50": state["siit_losses"][::50],
              "start": args.start, "by_objects": by_objects(vlm),
              "validation": f"{number}-validation/validation.json (vlmbind validate, 24 pairs, seed 1000, as run.py)",
              "command": "python circuits/ground_truth/record_attempt.py " + " ".join(argv or sys.argv[1:])}
    if args.recipe_summary:
        record["recipe"] = recipe_record(json.loads(Path(args.recipe_summary).read_text()))
    if args.strictness:
        record["interchange"] = measure(str(checkpoint), vlm.training["planted"], 64, 1000)
    write_json_atomic(record, RUNS / f"{args.label}-attempt.json")
    print(json.dumps(record["by_objects"]["accuracy"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
