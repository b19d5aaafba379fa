"""The organisms' training recipes: staged curricula, run stage after stage with ``init_from``.

Why staged: at 168 px (a 6x6 token grid) a model trained from scratch learns colour quickly but shape only after many
thousand steps, and the binding query task does not start from scratch in a mixture; both are learned quickly from a
model that already describes scenes (measured while planning). So each organism first learns scene description at
112 px (4x4 grid), then the full mixture at 112 px, then the full mixture at 168 px. Weights do not depend on the
image size (Qwen2.5-VL's vision tower uses rotary positions), so a stage may change it.

Both organisms follow the same recipe and differ only in the regime of the search and counting answers (Direct vs
Point-to-Answer), as in PbP. Search trains with one target among 1-12 objects and is tested up to the grid's capacity;
counting trains on 5-10 objects and is tested on 11-15.

``python -m vlmbind.organisms.recipes organism-p2a --out runs/organism-p2a [--threads 1] [--processes 2]`` runs (or
resumes) one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..core.errors import TrainingError
from ..core.shipped import organism_dir
from ..engine.vlm import TRAINING_FILE
from .processes import sigterm_as_interrupt
from .training.checkpoints import CHECKPOINT_PREFIX
from .training.config import TrainConfig
from .training.run import train

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("square", "circle", "triangle", "star")
_POOLS = {"colours": list(COLOURS), "shapes": list(SHAPES)}
_MIX = {"scene": 0.3, "query": 0.3, "count": 0.2, "search": 0.2}


def _options(search_objects: tuple[int, int]) -> dict[str, dict[str, Any]]:
    return {
        "scene": {"objects": [2, 4], **_POOLS},
        "query": {"objects": [3, 4], **_POOLS},
        "count": {"objects": [5, 10], **_POOLS},
        "search": {"objects": list(search_objects)},
    }


def stages(regime: str, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """``[(stage name, TrainConfig fields), ...]`` of one organism."""
    common = {"regime": regime, "seed": seed, "batch_size": 32, "checkpoint_every": 500, "eval_every": 500,
              "eval_size": 32, "weight_decay": 0.01}
    return [
        ("1-scene-112", {**common, "image_size": 112, "tasks": {"scene": 1.0},
                         "task_options": {"scene": {"objects": [2, 4], **_POOLS}},
                         "steps": 2500, "lr": 1e-3, "warmup": 200}),
        ("2-mix-112", {**common, "image_size": 112, "tasks": dict(_MIX), "task_options": _options((1, 12)),
                       "steps": 3000, "lr": 7e-4, "warmup": 100}),
        ("3-mix-168", {**common, "image_size": 168, "tasks": dict(_MIX), "task_options": _options((1, 12)),
                       "steps": 4000, "lr": 5e-4, "warmup": 100, "final_lr_ratio": 0.05}),
    ]


# organism-vsm: organism-p2a's vision tower, projector and embeddings under a fresh 6 x 4 language model (24 heads),
# trained on scene description with VSM's ID-selection and feature-retrieval steps planted by SIIT from the first step;
# organism-vsm-natural: the same stages, data, seed and steps, behaviour loss only. See docs/ground_truth.md.
VSM_PLANT = {"id_selection": ["2.1"], "feature_retrieval": ["4.2"]}
# after stage 6 inserts a layer after layer 0: VSM's three steps, the heads each condition should find
VSM_GROWN_PLANT = {"id_retrieval": ["1.0"], "id_selection": ["2.3", "3.1"], "feature_retrieval": ["5.2"]}
VSM_GROWN_PLANT_LINK = {"id_retrieval": ["1.0"], "id_selection": ["2.3", "3.1"]}
VSM_SIIT = {"alignments": VSM_PLANT, "iit_weight": 1.0, "strict_weight": 0.4, "pairs": 8, "objects": [2, 4],
            "skip_objects": [3], "entropies": ["high", "low"], "colours": list(COLOURS), "shapes": list(SHAPES),
            "strict_positions": "all", "swap": "random", "recolour": "any", "position_layer": 0,
            "position_weight": 1.0, "position_readout": "trained", "last_positions": "answer"}


def vsm_stages(planted: bool, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """The stages of organism-vsm (``planted``) or organism-vsm-natural: same start, data, seed and steps.

    1. SIIT from step one on the fresh language model, no gradients through the source run; the schedule is
       3,000 steps and the stage stops at 1,250 (``until``), where feature retrieval had started to take.
    2. Gradients through the source run: feature retrieval is planted, ID selection is not (its interchange
       accuracy stays at the unpatched rate).
    3. Two losses on the ID-selection head in the source run (a readout of the missing object's cell from its output
       and a cross-entropy on its attention landing on that object's image token; eager attention): ID selection
       takes, on two-object and low-entropy scenes; on high-entropy ones, where the described features alone also
       name the missing object, the later layers still often read the features the head copies with the position.
    4. The same losses from stage 3's weights with the IIT loss weighing 2, strictness 1, 12 pairs a step, and
       high-entropy pairs drawn twice as often: the position then moves the answer on high-entropy and held-out
       scenes too.
    5. Strictness 3, with the strictness loss drawing head 0.1 16 times, 0.0 8 times and 0.2, 0.3 twice as often
       as any other unaligned head: after stage 4, interchanging heads 0.0 and 0.1 at the prompt's text tokens
       still changed some feature-retrieval answers (they feed the ID-selection head's choice of object; see
       docs/ground_truth.md); entropies drawn evenly.
    """
    common = {"regime": "p2a", "seed": seed, "batch_size": 16, "image_size": 168, "tasks": {"scene": 1.0},
              "task_options": {"scene": {"objects": [2, 4], **_POOLS}}, "final_lr_ratio": 0.1,
              "weight_decay": 0.01, "grad_clip": 1.0, "loss_norm": "example",
              "model": {"layers": 6, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": None,
                        "vision_depth": 2, "vision_hidden": 64, "vision_heads": 4},
              "checkpoint_every": 250, "keep_checkpoints": 2, "eval_every": 250, "eval_size": 32}
    first = {**common, "steps": 3000, "until": 1250, "lr": 1e-3, "warmup": 150, "attn_implementation": "sdpa",
             "init_from": str(organism_dir("organism-p2a")), "init_layers": [None] * 6}
    second = {**common, "steps": 2500, "lr": 7e-4, "warmup": 50, "attn_implementation": "sdpa"}
    third = {**common, "steps": 2000, "lr": 7e-4, "warmup": 50, "attn_implementation": "eager"}
    fourth = {**common, "steps": 1500, "lr": 3e-4, "warmup": 50, "attn_implementation": "eager"}
    fifth = {**common, "steps": 1000, "lr": 3e-4, "warmup": 50, "attn_implementation": "eager"}
    if planted:
        first["siit"] = {**VSM_SIIT, "source_grad": False}
        second["siit"] = {**VSM_SIIT, "source_grad": True}
        third["siit"] = {**VSM_SIIT, "source_grad": True, "selection_weight": 1.0,
                         "selection_attention_weight": 1.0}
        fourth["siit"] = {**third["siit"], "iit_weight": 2.0, "strict_weight": 1.0, "pairs": 12,
                          "entropies": ["high", "high", "low"]}
        fifth["siit"] = {**fourth["siit"], "strict_weight": 3.0, "entropies": ["high", "low"],
                         "strict_head_weights": {"0.0": 8.0, "0.1": 16.0, "0.2": 2.0, "0.3": 2.0}}
    suffix = "siit" if planted else "natural"
    return [(f"1-fresh-lm-{suffix}", first), (f"2-source-grad-{suffix}", second),
            (f"3-selection-{suffix}", third), (f"4-robust-{suffix}", fourth), (f"5-strict-{suffix}", fifth),
            *_grown_stages(common, planted, suffix)]


def _grown_stages(common: dict[str, Any], planted: bool, suffix: str) -> list[tuple[str, dict[str, Any]]]:
    """Stages 6-12: a seventh decoder layer inserted after layer 0 and the ID-retrieval step planted in it.

    6. Layers [0, new, 1, 2, 3, 4, 5]: the new layer's head 1.0 must attend from each described object's last prompt
       token to that object's image token and carry its cell (a readout of the cell from its output), weights 1,
       with the IIT loss at 0.01 and no strictness, so the old heads are left alone (they move one layer down:
       ID selection 2.1 -> 3.1, feature retrieval 4.2 -> 5.2).
    7. Head 2.3 learns to gather the described objects' positions from head 1.0 at the last prompt token (a
       readout of their cells from its output) while 3.1 keeps its attention on the missing object: the link
       between ID retrieval and ID selection.
    8. Every variable at once with the full IIT and strictness losses of stage 5, plus the gathering interchange
       (on ID-selection pairs, 2.3 alone patched from the source must make the model name the swapped object and
       3.1 attend to it), weights 2.
    9. and 10. The gathering interchange at weight 4, 1,500 steps twice (10 continues 9 with a fresh schedule).
    11. Stage 10's losses plus the selecting interchange at weight 4 (on ID-selection pairs, 3.1 alone patched from
        the source must make the model name the swapped object), 1,500 steps: after stage 10 the answer followed
        the gathering head alone and the selecting head was not needed.
    12. Stage 11's losses plus ablation: strictness under ablation (1 to 4 unaligned heads zeroed, mean- or
        role-mean-ablated, the answer must stay; weight 2) and necessity under ablation (one aligned variable's heads
        ablated, the answer must lose its probability; weight 1), 1,500 steps: after stage 11 random sets of
        unplanted heads, under zero and mean ablation, broke answers that the planted heads' ablation should.
    """
    grown = {**common, "model": {**common["model"], "layers": 7}, "lr": 1e-3, "warmup": 50,
             "attn_implementation": "eager"}
    sixth = {**grown, "steps": 1500, "init_layers": [0, None, 1, 2, 3, 4, 5]}
    seventh = {**grown, "steps": 1000}
    eighth = {**grown, "steps": 1000}
    ninth = {**grown, "steps": 1500}
    tenth = {**grown, "steps": 1500}
    eleventh = {**grown, "steps": 1500}
    twelfth = {**grown, "steps": 1500}
    if planted:
        link = {**VSM_SIIT, "iit_weight": 0.01, "strict_weight": 0.0, "pairs": 12, "source_grad": True,
                "span_positions": "last", "retrieval_attention_weight": 1.0, "retrieval_readout_weight": 1.0}
        sixth["siit"] = {**link, "alignments": {"id_retrieval": ["1.0"]}}
        seventh["siit"] = {**link, "alignments": VSM_GROWN_PLANT_LINK, "selection_attention_weight": 1.0,
                           "gather_readout_weight": 1.0, "aggregation_heads": ["2.3"]}
        eighth["siit"] = {**seventh["siit"], "alignments": VSM_GROWN_PLANT, "iit_weight": 2.0, "strict_weight": 3.0,
                          "strict_head_weights": {"0.0": 8.0, "0.1": 16.0, "0.2": 2.0, "0.3": 2.0},
                          "selection_weight": 1.0, "interchanged_selection_weight": 2.0,
                          "strict_selection_weight": 1.0, "gather_interchange_weight": 2.0,
                          "gather_selection_weight": 2.0}
        ninth["siit"] = {**eighth["siit"], "gather_interchange_weight": 4.0, "gather_selection_weight": 4.0}
        tenth["siit"] = dict(ninth["siit"])
        eleventh["siit"] = {**tenth["siit"], "selecting_interchange_weight": 4.0}
        twelfth["siit"] = {**eleventh["siit"], "ablation_strict_weight": 2.0, "ablation_strict_heads": 4,
                           "ablation_strict_modes": ["zero", "mean", "role_mean"],
                           "ablation_necessity_weight": 1.0}
    return [(f"6-grown-retrieval-{suffix}", sixth), (f"7-gather-{suffix}", seventh),
            (f"8-gathering-interchange-{suffix}", eighth), (f"9-gathering-heavier-{suffix}", ninth),
            (f"10-gathering-heavier-continued-{suffix}", tenth), (f"11-selecting-interchange-{suffix}", eleventh),
            (f"12-ablation-necessity-{suffix}", twelfth)]


# organism-search: organism-p2a's vision tower under a fresh 4 x 4 language model, with PbP's search head planted by
# SIIT at every point's steps of its Point-to-Answer traces; organism-search-natural: the same stages without the
# SIIT losses.
SEARCH_PLANT = ["2.1"]
SEARCH_OPTIONS = {"search": {"objects": [1, 8]},
                  "count": {"objects": [1, 4], "colours": list(COLOURS), "shapes": list(SHAPES)}}


def search_stages(planted: bool, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """The stages of organism-search (``planted``) or organism-search-natural: same start, data, seed and steps.

    Starts, as organism-vsm does, from organism-p2a's vision tower, projector and token embeddings under a fresh
    language model (4 layers x 4 heads, every layer new): organism-p2a's own language model already points through
    heads of its own (2.0 and 2.1 gaze most at the pointed object), which a planted head would have had to displace
    and its twin would have kept. Search on 1-8 objects (one target, present half
    the time) and counting 1-4 objects, Point-to-Answer, at 168 px. The image tokens must carry their grid cell after
    decoder layer 0 (a linear readout trained beside the organism, in both organisms: it is a property of the image
    tokens, not of a head): linear probes read organism-p2a's image tokens' row after layer 0 and barely their
    column, as the tiny language model's M-RoPE gives the column its lowest frequencies, under 0.004 rad a cell, so
    the new language model turns them faster (RoPE base 10: 0.1-0.2 rad a cell). The planted search head is 2.1, in
    the middle of the stack.
    """
    fields = {"regime": "p2a", "seed": seed, "batch_size": 16, "image_size": 168,
              "tasks": {"search": 0.5, "count": 0.5}, "task_options": SEARCH_OPTIONS,
              "steps": 5000, "lr": 1e-3, "warmup": 150, "final_lr_ratio": 0.1, "weight_decay": 0.01,
              "grad_clip": 1.0, "attn_implementation": "eager", "init_from": str(organism_dir("organism-p2a")),
              "model": {"rope_theta": 10.0}, "init_layers": [None] * 4, "checkpoint_every": 250, "keep_checkpoints": 2, "eval_every": 500,
              "eval_size": 32}
    point = {"heads": list(SEARCH_PLANT), "position_layer": 0, "position_weight": 1.0}
    if planted:
        point.update(iit_weight=1.0, strict_weight=2.0, attention_weight=1.0, readout_weight=1.0, pairs=8,
                     trace_share=0.5)
    else:  # the position code alone: no interchange, strictness, attention or readout loss
        point.update(iit_weight=0.0, strict_weight=0.0, attention_weight=0.0, readout_weight=0.0)
    fields["point_siit"] = point
    return [(f"1-search-{'siit' if planted else 'natural'}", fields)]


RECIPES = {"organism-p2a": "p2a", "organism-direct": "direct", "organism-vsm": "vsm", "organism-vsm-natural": "vsm",
           "organism-search": "search", "organism-search-natural": "search"}


def recipe_stages(name: str, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """The stages of organism ``name``'s recipe.

    Raises:
        TrainingError: no such recipe.
    """
    if name not in RECIPES:
        raise TrainingError(f"unknown organism recipe {name!r}; recipes: {', '.join(RECIPES)}")
    if RECIPES[name] == "vsm":
        return vsm_stages(name == "organism-vsm", seed)
    if RECIPES[name] == "search":
        return search_stages(name == "organism-search", seed)
    return stages(RECIPES[name], seed)


def stage_config(fields: dict[str, Any], init_from: str | None = None) -> tuple[TrainConfig, int | None]:
    """A stage's :class:`TrainConfig` and where it stops (``until``: a stage may end before its schedule does)."""
    fields = dict(fields)
    until = fields.pop("until", None)
    if init_from is not None:
        fields["init_from"] = init_from
    return TrainConfig.from_dict(fields), until


def _finished(stage_dir: Path, steps: int) -> Path | None:
    ckpt = stage_dir / f"{CHECKPOINT_PREFIX}{steps:06d}"
    return ckpt if ckpt.is_dir() else None


def run_recipe(name: str, out: str | Path, *, threads: int | None = 1, seed: int = 0,
               progress: bool = True, start_from: str | Path | None = None, processes: int = 1,
               device: str = "cpu") -> dict[str, Any]:
    """Run (or resume) every stage of organism ``name`` into ``out/<stage>``; returns a summary with wall times.

    ``start_from``: a shipped organism of the same recipe (its directory): the stages its training record lists as
    done are taken from it (their results copied from the record) and the next stage starts from its weights, so a
    recipe that grew new stages continues from the last release instead of training the first stages again.
    A stage found finished in ``out`` must have been trained with the recipe's configuration (bar where it started).
    ``processes=2`` trains each stage in two processes of ``threads`` threads each, ``device="cuda"`` on a GPU in one
    (:func:`~.training.run.train`).

    Raises:
        TrainingError: no such recipe; ``start_from`` is not a release of this recipe; a finished stage in ``out``
            was trained with another configuration.
    """
    if name not in RECIPES:
        raise TrainingError(f"unknown organism recipe {name!r}; recipes: {', '.join(RECIPES)}")
    out = Path(out)
    recipe = recipe_stages(name, seed)
    taken = _taken_stages(name, recipe, Path(start_from), seed) if start_from is not None else {}
    out.mkdir(parents=True, exist_ok=True)
    previous: Path | None = Path(start_from) if taken else None
    summary: dict[str, Any] = {"organism": name, "regime": recipe[0][1]["regime"], "seed": seed,
                               "threads": threads, "processes": processes, "device": device, "stages": []}
    if taken:
        summary["started_from"] = str(start_from)
    for stage, fields in recipe:
        if stage in taken:
            summary["stages"].append({**taken[stage], "taken_from": str(start_from)})
            continue
        config, until = stage_config(fields, str(previous) if previous else fields.get("init_from"))
        stage_dir = out / stage
        done = _finished(stage_dir, until or config.steps)
        start = time.time()
        if done is None:
            resume = stage_dir.is_dir() and any(stage_dir.glob(f"{CHECKPOINT_PREFIX}*"))
            result = train(config, stage_dir, resume=resume, progress=progress, threads=threads, until=until,
                           processes=processes, device=device)
            done = result.checkpoint
            info = {"wall_time_s": result.wall_time_s, "last_eval": result.evals[-1] if result.evals else None}
        else:
            _check_finished(done, config, stage)
            state = json.loads((done / "trainer_state.json").read_text())
            info = {"wall_time_s": state.get("wall_time_s"), "last_eval": (state.get("evals") or [None])[-1]}
        summary["stages"].append({"stage": stage, "checkpoint": str(done), "steps": until or config.steps,
                                  "session_s": round(time.time() - start, 1), **info})
        previous = done
    summary["final_checkpoint"] = str(previous)
    summary["wall_time_s"] = sum(s["wall_time_s"] or 0 for s in summary["stages"])
    (out / "recipe_summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _taken_stages(name: str, recipe: list[tuple[str, dict[str, Any]]], start: Path, seed: int) -> dict[str, Any]:
    """The stage results a release of ``name``'s recipe already holds (checked against the recipe)."""
    path = start / TRAINING_FILE
    if not path.is_file():
        raise TrainingError(f"{start} has no {TRAINING_FILE}: --start-from takes a shipped organism's directory")
    record = json.loads(path.read_text())
    done = [s["stage"] for s in record.get("stage_results", [])]
    if record.get("organism") != name or record.get("seed") != seed:
        raise TrainingError(f"{start} holds {record.get('organism')} (seed {record.get('seed')}), not {name} "
                            f"(seed {seed}); start from a release of the same organism")
    names = [stage for stage, _ in recipe]
    if not done or names[:len(done)] != done or len(done) >= len(names):
        raise TrainingError(f"{start} has stages {done}; the recipe of {name} is {names}: nothing to continue")
    for stage, fields in zip(record["stages"], recipe):
        mine = {k: v for k, v in fields[1].items() if k != "init_from"}
        if {k: v for k, v in stage.items() if k not in ("stage", "init_from")} != mine:
            raise TrainingError(f"stage {stage['stage']} of {start} was trained with another configuration than "
                                f"the recipe's; run the whole recipe instead")
    return {s["stage"]: s for s in record["stage_results"]}


def _check_finished(checkpoint: Path, config: TrainConfig, stage: str) -> None:
    saved = json.loads((checkpoint / "train_config.json").read_text())
    mine = json.loads(json.dumps(config.to_dict(), default=str))
    differ = sorted(k for k in set(saved) | set(mine) if k != "init_from" and saved.get(k) != mine.get(k))
    if differ:
        raise TrainingError(f"{checkpoint} (stage {stage}) was trained with other {', '.join(differ)} than the "
                            "recipe; remove it or use another --out")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmbind.organisms.recipes")
    parser.add_argument("name", choices=sorted(RECIPES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--processes", type=int, default=1,
                        help="2: each stage in two processes of --threads threads each (faster on an idle 2 cores)")
    parser.add_argument("--device", default="cpu", help="where to train: cpu (default) or cuda[:N], one process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--start-from", help="a shipped organism of this recipe: continue after the stages it holds")
    args = parser.parse_args(argv)
    try:
        with sigterm_as_interrupt():  # a scheduler's SIGTERM leaves the stage's checkpoint, as a Ctrl-C does
            summary = run_recipe(args.name, args.out, threads=args.threads, seed=args.seed,
                                 progress=not args.quiet, start_from=args.start_from, processes=args.processes,
                                 device=args.device)
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
