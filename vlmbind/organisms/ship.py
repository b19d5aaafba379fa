"""Turn a finished recipe run into a shipped organism: weights, tokenizer and processor files, the training record
(``vlmbind_training.json``: regime, image size, task pools, stages, wall time) and a model card (``README.md``).

Only what ``from_pretrained`` needs is copied (no optimizer state), through a temporary directory and a rename, so a
half-copied organism is never loadable.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import TrainingError
from ..models import TRAINING_FILE
from .recipes import RECIPES, stages
from .shipped import organism_dir

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
