"""Turn a finished recipe run into a shipped organism: weights, tokenizer and processor files, the training record
(``vlmbind_training.json``: regime, image size, task pools, stages, wall time) and a model card (``README.md``).

Only what ``from_pretrained`` needs is copied (no optimizer state), through a temporary directory and a rename, so a
half-copied organism is never loadable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ..core.errors import TrainingError
from ..core.io import write_text_atomic
from ..core.shipped import organism_dir
from ..engine.vlm import TRAINING_FILE
from .recipes import RECIPES, recipe_stages
from .siit.spec import DEFAULT_ABLATION_MODES, implied_edges

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "processor_config.json", "chat_template.jinja")


def training_record(name: str, run_dir: str | Path) -> dict[str, Any]:
    """The training facts of a finished recipe run (from its ``recipe_summary.json`` and the last stage's state)."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "recipe_summary.json"
    if not summary_path.is_file():
        raise TrainingError(f"{run_dir} has no recipe_summary.json: run python -m vlmbind.organisms.recipes first")
    summary = json.loads(summary_path.read_text())
    last = Path(summary["final_checkpoint"])
    config = json.loads((last / "train_config.json").read_text())
    grown = RECIPES[name] == "vsm"
    recipe = recipe_stages(name, summary["seed"])
    record = {
        "organism": name,
        "regime": config["regime"],
        "seed": summary["seed"],
        "image_size": config["image_size"],
        "grid": config["image_size"] // 28,
        "tasks": config["tasks"],
        "task_options": config["task_options"],
        "stages": [{"stage": s, **_portable(fields)} for s, fields in recipe],
        "stage_results": summary["stages"],
        "wall_time_s": summary["wall_time_s"],
        "command": f"python -m vlmbind.organisms.recipes {name} --out runs/organisms/{name} "
                   f"--threads {summary.get('threads') or 1}"
                   + (" --processes 2" if summary.get("processes", 1) == 2 else ""),
    }
    if grown:
        record["grown_from"] = {"organism": "organism-p2a", "init_layers": recipe[0][1].get("init_layers")}
    if config.get("siit"):
        # the heads each condition should find, named as the conditions (machine-readable ground truth)
        record["planted"] = {v: list(h) for v, h in config["siit"]["alignments"].items()}
        edges = implied_edges(config["siit"])
        if edges:
            record["planted_edges"] = edges
        record["siit"] = config["siit"]
    point = config.get("point_siit")
    if point:
        record["point_siit"] = point
        if max(point["iit_weight"], point["strict_weight"], point["attention_weight"], point["readout_weight"]) > 0:
            record["planted"] = {"search": list(point["heads"])}
    if RECIPES[name] == "search":
        record["started_from"] = "organism-p2a"
    return record


def _portable(fields: dict[str, Any]) -> dict[str, Any]:
    """A stage's fields with the start's path (machine-specific) replaced by what it names."""
    out = dict(fields)
    if out.get("init_from") and Path(out["init_from"]).parent == organism_dir("organism-p2a").parent:
        out["init_from"] = Path(out["init_from"]).name
    return out


def ship(name: str, run_dir: str | Path, card: str, *, dest: Path | None = None) -> Path:
    """Copy the final checkpoint of ``run_dir`` into the package as organism ``name`` with a model card."""
    record = training_record(name, run_dir)
    source = Path(json.loads((Path(run_dir) / "recipe_summary.json").read_text())["final_checkpoint"])
    dest = dest or organism_dir(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for f in MODEL_FILES:
            if (source / f).is_file():
                shutil.copy2(source / f, tmp / f)
        (tmp / TRAINING_FILE).write_text(json.dumps(record, indent=1) + "\n")
        (tmp / "README.md").write_text(card)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def model_card(record: dict[str, Any], config: dict[str, Any], params: int,
               accuracies: dict[str, float] | None = None, table_command: str | None = None) -> str:
    """The organism's model card (markdown): architecture, data, curriculum, seed, wall time, accuracies."""
    text = config.get("text_config", {})
    vision = config.get("vision_config", {})
    lines = [
        f"# {record['organism']}",
        "",
        f"A small Qwen2.5-VL trained by vlmbind on the binding tasks, {record['regime']} regime for search and "
        "counting answers (scene description and the binding query are answered directly in both regimes). "
        "Random-initialised and trained from scratch on synthetic stimuli; a model organism for interpretability, "
        "not a general VLM.",
        "",
        "## Architecture",
        "",
        f"- `Qwen2_5_VLForConditionalGeneration`, {params:,} parameters",
        f"- text: {text.get('num_hidden_layers')} layers, hidden {text.get('hidden_size')}, "
        f"{text.get('num_attention_heads')} heads ({text.get('num_key_value_heads')} KV heads)",
        f"- vision: {vision.get('depth')} blocks, hidden {vision.get('hidden_size')}, 2x2 merger",
        f"- input: {record['image_size']} px images -> a {record['grid']}x{record['grid']} grid of image tokens "
        "(28 px each); the stimuli put one object per token cell",
        "",
        "## Data",
        "",
    ]
    for task, weight in record["tasks"].items():
        lines.append(f"- {task} (share {weight}): {json.dumps(record['task_options'].get(task, {}))}")
    lines += ["", "## Curriculum", "", "| stage | image px | steps | lr | tasks | wall time (s) |", "|---|---|---|---|---|---|"]
    results = {s["stage"]: s for s in record["stage_results"]}
    for stage in record["stages"]:
        wall = results.get(stage["stage"], {}).get("wall_time_s")
        lines.append(f"| {stage['stage']} | {stage['image_size']} | {stage['steps']} | {stage['lr']} | "
                     f"{', '.join(stage['tasks'])} | {wall:.0f} |" if wall is not None else
                     f"| {stage['stage']} | {stage['image_size']} | {stage['steps']} | {stage['lr']} | "
                     f"{', '.join(stage['tasks'])} | |")
    lines += [
        "",
        f"Seed {record['seed']}; batch 32; AdamW, warm-up then cosine decay; loss on answer tokens only. Total training "
        f"wall time {record['wall_time_s'] / 60:.1f} min on 2 CPU cores (both organisms trained at once, one thread "
        "each).",
        "",
        f"Reproduce: `{record['command']}`, then `python -m vlmbind.organisms.ship {record['organism']} "
        f"runs/organisms/{record['organism']}`.",
    ]
    if accuracies:
        lines += ["", "## Accuracy (greedy, fresh stimuli)", "", "| task | accuracy |", "|---|---|"]
        lines += [f"| {k} | {100 * v:.1f}% |" for k, v in accuracies.items()]
        if table_command:
            lines += ["", f"Measured with `{table_command}`."]
    return "\n".join(lines) + "\n"


def edge_table(edges: list[dict[str, str]]) -> list[str]:
    """The model card's lines declaring the edges the planted pipeline implies (none: no lines)."""
    if not edges:
        return []
    return ["", "## Planted edges", "",
            "The pipeline implies these head-to-head edges (`vlmbind circuit` scores every edge by path patching; "
            "`vlmbind validate` ranks these among them). Each follows from what the stages below train: the "
            "gathering head reads the cells the retrieval head wrote at the names through its values; the selecting "
            "head needs the gathered cells to choose where to look, so they enter its query; the feature head looks "
            "at the selected cell, so the selection enters its query.", "",
            "| sender | receiver | through | sender at | receiver at |", "|---|---|---|---|---|",
            *[f"| {e['sender']} | {e['receiver']} | {e['channel']} | {e['sender_at']} | {e['receiver_at']} |"
              for e in edges]]


def planted_card(record: dict[str, Any], config: dict[str, Any], params: int,
                 validation: dict[str, Any] | None = None, validation_command: str | None = None) -> str:
    """The model card of a grown organism (organism-vsm, or its behaviour-only twin organism-vsm-natural)."""
    text = config.get("text_config", {})
    planted = record.get("planted")
    results = {s["stage"]: s for s in record["stage_results"]}
    lines = [f"# {record['organism']}", ""]
    if planted:
        lines += [
            "A small Qwen2.5-VL with a **planted** mechanism: variables of VSM's pipeline for scene description (the "
            "table below says which) were trained into chosen heads by strict interchange-intervention training "
            "(SIIT). It exists to check interpretability methods against a known answer. That a method finds these "
            "heads shows the method can find such a mechanism when it is there; it is not evidence that pretrained "
            "VLMs work this way, and the rest of the model may still solve the task in other ways too (SIIT's "
            "strictness loss asks every other head to be inert, and the validation below says how far it got). "
            "Variables not in the table were not planted: the methods should find nothing there.",
            "", "## Planted heads", "", "| condition that should find it | heads | the variable |", "|---|---|---|"]
        at_name = ("at its name's last prompt token" if record.get("siit", {}).get("span_positions") == "last"
                   else "at its prompt tokens")
        meaning = {"id_retrieval": f"each described object's position (grid cell), {at_name}",
                   "id_selection": "the missing object's position, at the last prompt token and the answer positions",
                   "feature_retrieval": "the missing object's colour and shape, at the last prompt token and the "
                                        "answer positions"}
        lines += [f"| {v} | {', '.join(h)} | {meaning.get(v, '')} |" for v, h in planted.items()]
        lines += edge_table(record.get("planted_edges") or [])
        siit = record.get("siit", {})
        lines += ["", f"SIIT weights: behaviour 1, IIT {siit.get('iit_weight')}, strictness {siit.get('strict_weight')} "
                  f"(one unplanted head interchanged per step at every prompt position); {siit.get('pairs')} "
                  f"counterfactual pairs per step with {siit.get('objects')} objects, object counts "
                  f"{siit.get('skip_objects')} held out for validation, entropies {siit.get('entropies')}; swap "
                  f"pairs exchange the target with a random described object, feature sources give it a new "
                  f"colour-shape conjunction."]
        if siit.get("position_layer") is not None:
            readout = ("a linear readout trained beside the organism" if siit.get("position_readout") == "trained"
                       else "a fixed random linear readout")
            where = ("in the decoder's input" if siit["position_layer"] == -1
                     else f"after decoder layer {siit['position_layer']}")
            lines += ["", f"A position code was trained in too: {where} every "
                      f"image token's grid cell must be read from its residual stream by {readout} (weight "
                      f"{siit.get('position_weight')}). A head can only copy a position the image tokens carry."]
        if siit.get("selection_weight") or siit.get("selection_attention_weight"):
            lines += ["", "The ID-selection heads were told how to get the position (the stages with a readout and "
                      "an attention weight below): in the source run of the ID-selection pairs, a linear readout "
                      "trained beside the organism must read the missing "
                      f"object's cell from their output (weight {siit.get('selection_weight', 0)}), and their "
                      "attention must fall on that object's image token (cross-entropy, weight "
                      f"{siit.get('selection_attention_weight', 0)}). The IIT loss alone had left their interchange "
                      "accuracy at the rate of the unpatched model."]
        if siit.get("aggregation_heads"):
            gather = ", ".join(siit["aggregation_heads"])
            lines += ["", f"The ID-retrieval head was told where to look, and {gather} how to pass its positions on "
                      "(stages 6 and after): the ID-retrieval head's attention, at each described object's last prompt "
                      "token, must fall on that object's image token and a readout must give its cell from the "
                      f"head's output; {gather} (an ID-selection head that gathers) must attend to the described "
                      "names from the last prompt token and a readout must give the set of described cells from its "
                      f"output; and with {gather} alone interchanged from an ID-selection source (weight "
                      f"{siit.get('gather_interchange_weight', 0):g}) the model must name the object the source's "
                      "names leave unclaimed while the selecting heads attend to it (weight "
                      f"{siit.get('gather_selection_weight', 0):g}). Without that run every loss could be met by a "
                      "selection that ignores the retrieved positions."]
        if siit.get("selecting_interchange_weight"):
            lines[-1] += (" With the selecting heads (the ID-selection heads that do not gather) alone interchanged "
                          "from the same source, the model must name that object too (weight "
                          f"{siit['selecting_interchange_weight']:g}): without it the answer followed the gathering "
                          "head alone.")
        if siit.get("ablation_strict_weight") or siit.get("ablation_necessity_weight"):
            most = siit.get("ablation_strict_heads") or sum(len(h) for h in planted.values())
            modes = ", ".join(siit.get("ablation_strict_modes", DEFAULT_ABLATION_MODES))
            lines += ["", "Ablation was trained in too (the last stage): with 1 to "
                      f"{most} random unplanted heads ablated ({modes}, drawn each step) the answer must stay "
                      f"(weight {siit.get('ablation_strict_weight', 0):g}), and with one planted variable's heads "
                      "ablated it must lose its probability (the unlikelihood of each answer token, weight "
                      f"{siit.get('ablation_necessity_weight', 0):g}). So that the planted heads are needed and "
                      "random others are not is part of the plant, as the interchange behaviour is: an ablation "
                      "study that finds it shows it reads necessity right, not that necessity arises by itself."]
    else:
        lines += [
            "The negative control of organism-vsm: the same architecture, start, data, seed and steps, trained on "
            "the behaviour loss only. Nothing was planted; what the methods report here is what they report where the "
            "planted mechanism is absent."]
    lines += [
        "", "## Architecture and training", "",
        f"- `Qwen2_5_VLForConditionalGeneration`, {params:,} parameters; text: {text.get('num_hidden_layers')} layers, "
        f"hidden {text.get('hidden_size')}, {text.get('num_attention_heads')} heads "
        f"({text.get('num_key_value_heads')} KV heads)",
        _start_line(record.get("grown_from", {}).get("init_layers")),
        f"- {record['image_size']} px images, a {record['grid']}x{record['grid']} grid of image tokens, organism-p2a's "
        f"stimulus domain; tasks: {', '.join(f'{t} (share {w})' for t, w in record['tasks'].items())}",
        *[f"- stage {stage['stage']}: {_stage_steps(stage)}, batch {stage['batch_size']}, lr {stage['lr']}, "
          f"{stage.get('attn_implementation', 'sdpa')} attention"
          + (_stage_siit(stage["siit"]) if stage.get("siit") else ", behaviour loss only")
          + f"; wall time {(results.get(stage['stage'], {}).get('wall_time_s') or 0) / 60:.1f} min on one CPU thread"
          for stage in record["stages"]],
        f"- seed {record['seed']}; total wall time {record['wall_time_s'] / 60:.1f} min"]
    params = (validation or {}).get("params", {})
    stimuli = (f"{params.get('n_pairs')} pairs per condition, seed {params.get('seed')}, {params.get('n_objects')} "
               f"objects per scene ({params.get('entropy')} entropy); ablation on {params.get('n_eval')} scenes.")
    return "\n".join(lines + _card_tail(record, validation, "fresh pairs", stimuli, validation_command)) + "\n"


def _card_tail(record: dict[str, Any], validation: dict[str, Any] | None, heading: str, stimuli: str,
               validation_command: str | None) -> list[str]:
    """A card's last lines: how to reproduce the organism, then its validation (where one is given)."""
    lines = ["", f"Reproduce: `{record['command']}`, then `python -m vlmbind.organisms.ship {record['organism']} "
             f"runs/organisms/{record['organism']}`."]
    if validation:
        lines += ["", f"## Validation ({heading})", "", stimuli, "", *validation_lines(validation)]
        if validation_command:
            lines += ["", f"Measured with `{validation_command}`."]
    return lines


def search_card(record: dict[str, Any], config: dict[str, Any], params: int,
                validation: dict[str, Any] | None = None, validation_command: str | None = None) -> str:
    """The model card of organism-search (planted search heads) or its twin organism-search-natural."""
    text = config.get("text_config", {})
    planted = (record.get("planted") or {}).get("search")
    spec = record.get("point_siit") or {}
    results = {s["stage"]: s for s in record["stage_results"]}
    options = record["task_options"]
    tasks = ", ".join(f"{t} (share {w}, {json.dumps(options.get(t, {}))})" for t, w in record["tasks"].items())
    lines = [f"# {record['organism']}", ""]
    if planted:
        lines += [
            f"A small Qwen2.5-VL with a **planted** search head: at each point of a Point-to-Answer trace, "
            f"{'head ' + planted[0] + ' attends' if len(planted) == 1 else 'heads ' + ', '.join(planted) + ' attend'} "
            "to the object being pointed at and carries its cell, and the point written follows it (interchanging "
            "its output at a point's steps moves the point to the source's object). "
            "Trained in by strict interchange-intervention training (SIIT, `vlmbind.organisms.siit.pointing`) to "
            "check the search-head methods (attention_swap mediation, attention-centroid tracking, ablation) "
            "against a known answer. It is not evidence that pretrained VLMs point this way.",
            "", f"Losses beside the behaviour loss (weight 1): interchange {spec.get('iit_weight')}, strictness "
            f"{spec.get('strict_weight')} (one other head patched the same way must leave the answer alone), "
            f"attention on the pointed object {spec.get('attention_weight')} (at each step that writes one of the "
            f"point's tokens), a readout of the pointed cell from the heads' output {spec.get('readout_weight')}"
            + (f", the image tokens' cell readable after layer {spec['position_layer']} "
               f"{spec.get('position_weight')}" if spec.get("position_layer") is not None else "")
            + f"; {spec.get('pairs')} pairs a step, {spec.get('trace_share')} of them within one counting trace "
            "(the rest across displays)."]
    else:
        lines += ["The negative control of organism-search: the same start, data, seed and steps without the SIIT "
                  "losses (the behaviour loss and the image tokens' position code). Nothing was planted; what the "
                  "methods report here is what they report where the planted search head is absent."]
    lines += [
        "", "## Architecture and training", "",
        f"- `Qwen2_5_VLForConditionalGeneration`, {params:,} parameters; text: {text.get('num_hidden_layers')} layers, "
        f"hidden {text.get('hidden_size')}, {text.get('num_attention_heads')} heads "
        f"({text.get('num_key_value_heads')} KV heads)",
        "- organism-p2a's vision tower, projector and token embeddings under a new language model (every decoder "
        f"layer new, starting as the identity), RoPE base {text.get('rope_parameters', {}).get('rope_theta')}",
        f"- {record['image_size']} px images, a {record['grid']}x{record['grid']} grid of image tokens; tasks: "
        f"{tasks}",
        *[f"- stage {stage['stage']}: {_stage_steps(stage)}, batch {stage['batch_size']}, lr {stage['lr']}, "
          f"{stage.get('attn_implementation', 'sdpa')} attention; wall time "
          f"{(results.get(stage['stage'], {}).get('wall_time_s') or 0) / 60:.1f} min"
          for stage in record["stages"]],
        f"- seed {record['seed']}; total wall time {record['wall_time_s'] / 60:.1f} min on 2 CPU cores"]
    last = (record["stage_results"][-1].get("last_eval") or {}) if record["stage_results"] else {}
    if last.get("tasks"):
        n = record["stages"][-1].get("eval_size")
        lines += ["", f"Last evaluation (step {last['step']}, {n} fresh displays per task and variant, the whole "
                  "answer teacher-forced: every point and the answer right): "
                  + ", ".join(f"{k} {v['accuracy']:.2f}" for k, v in last["tasks"].items()) + "."]
    params = (validation or {}).get("params", {})
    stimuli = (f"{params.get('n_pairs')} attention_swap pairs from the model's own counting traces, seed "
               f"{params.get('seed')}; tracking on {params.get('n_points')} points; ablation on "
               f"{params.get('n_eval')} displays.")
    return "\n".join(lines + _card_tail(record, validation, "fresh counting displays", stimuli,
                                        validation_command)) + "\n"


def _start_line(init_layers: list[int | None] | None) -> str:
    if init_layers is not None and all(layer is None for layer in init_layers):
        return ("- started from organism-p2a's vision tower, projector and token embeddings under a new language "
                "model: every decoder layer new, starting as the identity (attention output and MLP down-projection "
                "zero)")
    return (f"- grown from organism-p2a: decoder layers {init_layers} (None: a new layer that started as the "
            "identity)")


def _stage_steps(stage: dict[str, Any]) -> str:
    if stage.get("until") and stage["until"] != stage["steps"]:
        return f"{stage['until']} steps of a {stage['steps']}-step schedule"
    return f"{stage['steps']} steps"


def _stage_siit(siit: dict[str, Any]) -> str:
    out = f", SIIT weights IIT {siit.get('iit_weight', 1.0)} / strictness {siit.get('strict_weight', 0.4)}"
    out += f", {siit.get('pairs')} pairs a step from entropies {siit.get('entropies')}"
    out += ", gradients through the source run" if siit.get("source_grad") else ", no gradient through the source run"
    if siit.get("selection_weight") or siit.get("selection_attention_weight"):
        out += (f", ID-selection readout {siit.get('selection_weight', 0)} / attention "
                f"{siit.get('selection_attention_weight', 0)}")
    for name, label in (("gather_interchange_weight", "gathering interchange"),
                        ("selecting_interchange_weight", "selecting interchange"),
                        ("ablation_strict_weight", "strictness under ablation"),
                        ("ablation_necessity_weight", "necessity under ablation")):
        if siit.get(name):
            out += f", {label} {siit[name]:g}"
            if name == "ablation_strict_weight":
                out += (f" (1-{siit.get('ablation_strict_heads') or 'as many as planted'} heads; "
                        f"{' / '.join(siit.get('ablation_strict_modes', DEFAULT_ABLATION_MODES))})")
    if siit.get("strict_head_weights"):
        by_weight: dict[float, list[str]] = {}
        for head, weight in siit["strict_head_weights"].items():
            by_weight.setdefault(weight, []).append(head)
        out += ", strictness drawing " + ", ".join(f"{' '.join(h)} {w:g} times as often" for w, h in by_weight.items())
    return out


def validation_lines(validation: dict[str, Any]) -> list[str]:
    """Markdown lines from a ``validation.json``: the exact method's ranks per condition, ablation, edit, probes."""
    lines = ["| condition | method | heads | ranks | AUROC | top heads |", "|---|---|---|---|---|---|"]
    for r in validation["methods"]:
        auroc = "-" if r["auroc"] is None else f"{r['auroc']:.3f}"
        lines.append(f"| {r['condition']} | {r['method']} | {' '.join(r['heads']) or '-'} | "
                     f"{' '.join(map(str, r['planted_ranks'])) or '-'} | {auroc} | {' '.join(r['top_heads'])} |")
    scored = validation.get("params", {}).get("ablation_scored")
    for mode, arms in validation.get("summary", {}).get("ablation", {}).items():
        matched = (f", random-k from the top-k's layers {arms['random_same_layers']:.2f} (lowest "
                   f"{arms['random_same_layers_min']:.2f})") if "random_same_layers" in arms else ""
        lines.append(f"\nAblation ({mode}{f', {scored}s right' if scored else ''}): clean {arms['clean']:.2f}, top-k {arms['top']:.2f}, random-k "
                     f"{arms['random']:.2f} (lowest {arms['random_min']:.2f}, {arms['random_seeds']} seeds){matched}, "
                     f"bottom-k {arms['bottom']:.2f}.")
    summary = validation.get("summary", {})
    edits = summary.get("edit_by_heads") or ([summary["edit"]] if summary.get("edit") else [])
    for edit in edits:
        at = f" at {edit['heads']}" if len(edits) > 1 else ""
        chance = (f"; {edit['control_described']:.2f} of its answers named a described object, which gives "
                  f"{edit['control_chance']:.2f} by chance") if edit.get("control_chance") is not None else ""
        random = (f"; a random direction of the edit's size: {edit['random_control']:.2f}"
                  if edit.get("random_control") is not None else "")
        lines.append(f"\nPosition-ID edit{at}: efficacy {edit['efficacy']:.2f} at alpha {edit['alpha']:g} "
                     f"(control {edit['control']:.2f}{chance}{random}, n={edit['n']}).")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m vlmbind.organisms.ship NAME RUN_DIR [--results circuits/p2a_vs_direct/results/results.json]``."""
    parser = argparse.ArgumentParser(prog="python -m vlmbind.organisms.ship")
    parser.add_argument("name", choices=sorted(RECIPES))
    parser.add_argument("run_dir", nargs="?", help="the recipe's output (not needed with --redraw-card)")
    parser.add_argument("--results", help="the PbP table's results.json, for the card's accuracy section")
    parser.add_argument("--validation", help="a validation.json (vlmbind validate) for a grown organism's card")
    parser.add_argument("--redraw-card", action="store_true",
                        help="only draw the shipped grown organism's card again, from its files and --validation")
    args = parser.parse_args(argv)
    if args.redraw_card:
        if RECIPES[args.name] not in ("vsm", "search"):
            parser.error("--redraw-card is for the planted organisms and their twins (organism-vsm, organism-search, "
                         "...)")
        validation = json.loads(Path(args.validation).read_text()) if args.validation else None
        write_text_atomic(shipped_card(args.name, validation), organism_dir(args.name) / "README.md")
        print(f"redrew the card of {args.name}")
        return 0
    if args.run_dir is None:
        parser.error("run_dir is required (the recipe's output directory)")
    record = training_record(args.name, args.run_dir)
    source = Path(json.loads((Path(args.run_dir) / "recipe_summary.json").read_text())["final_checkpoint"])
    config = json.loads((source / "config.json").read_text())
    params = parameter_count(source)
    accuracies = None
    if args.results:
        results = json.loads(Path(args.results).read_text())
        rows = results["models"].get(args.name, {}).get("rows", {})
        accuracies = {label: row["accuracy"] for label, row in rows.items()}
    if RECIPES[args.name] == "search":
        validation = json.loads(Path(args.validation).read_text()) if args.validation else None
        card = search_card(record, config, params, validation,
                           "python circuits/ground_truth/run.py" if validation else None)
    elif RECIPES[args.name] == "vsm":
        validation = json.loads(Path(args.validation).read_text()) if args.validation else None
        card = planted_card(record, config, params, validation,
                            "python circuits/ground_truth/run.py" if validation else None)
    else:
        card = model_card(record, config, params, accuracies,
                          "python circuits/p2a_vs_direct/run.py" if accuracies else None)
    dest = ship(args.name, args.run_dir, card)
    print(f"shipped {args.name} to {dest}")
    return 0


def shipped_card(name: str, validation: dict[str, Any] | None,
                 validation_command: str | None = "python circuits/ground_truth/run.py") -> str:
    """The card of a shipped grown organism, drawn again from the files beside its weights and a validation."""
    directory = organism_dir(name)
    record = json.loads((directory / TRAINING_FILE).read_text())
    config = json.loads((directory / "config.json").read_text())
    params = parameter_count(directory)
    card = search_card if RECIPES[name] == "search" else planted_card
    return card(record, config, params, validation, validation_command if validation else None)


def parameter_count(directory: Path) -> int:
    """Parameters in ``directory/model.safetensors``, read from the tensor shapes (nothing loaded)."""
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape: Any) -> int:
    out = 1
    for v in shape:
        out *= int(v)
    return out


if __name__ == "__main__":
    import sys

    sys.exit(main())
