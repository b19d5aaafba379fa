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

from ..errors import TrainingError
from ..models import TRAINING_FILE
from ..shipped import organism_dir
from .recipes import RECIPES, stages

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
    return {
        "organism": name,
        "regime": RECIPES[name],
        "seed": summary["seed"],
        "image_size": config["image_size"],
        "grid": config["image_size"] // 28,
        "tasks": config["tasks"],
        "task_options": config["task_options"],
        "stages": [{"stage": s, **fields} for s, fields in stages(RECIPES[name], summary["seed"])],
        "stage_results": summary["stages"],
        "wall_time_s": summary["wall_time_s"],
        "command": f"python -m vlmbind.organisms.recipes {name} --out runs/organisms/{name} --threads 1",
    }


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


def main(argv: list[str] | None = None) -> int:
    """``python -m vlmbind.organisms.ship NAME RUN_DIR [--results circuits/p2a_vs_direct/results/results.json]``."""
    parser = argparse.ArgumentParser(prog="python -m vlmbind.organisms.ship")
    parser.add_argument("name", choices=sorted(RECIPES))
    parser.add_argument("run_dir")
    parser.add_argument("--results", help="the PbP table's results.json, for the card's accuracy section")
    args = parser.parse_args(argv)
    record = training_record(args.name, args.run_dir)
    source = Path(json.loads((Path(args.run_dir) / "recipe_summary.json").read_text())["final_checkpoint"])
    config = json.loads((source / "config.json").read_text())
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    accuracies = None
    if args.results:
        results = json.loads(Path(args.results).read_text())
        rows = results["models"].get(args.name, {}).get("rows", {})
        accuracies = {label: row["accuracy"] for label, row in rows.items()}
    card = model_card(record, config, params, accuracies,
                      "python circuits/p2a_vs_direct/run.py" if accuracies else None)
    dest = ship(args.name, args.run_dir, card)
    print(f"shipped {args.name} to {dest}")
    return 0


def _prod(shape: Any) -> int:
    out = 1
    for v in shape:
        out *= int(v)
    return out


if __name__ == "__main__":
    import sys

    sys.exit(main())
