"""The organisms: small Qwen2.5-VL models trained here on the binding tasks, and the code that trains them.

Design: :mod:`.model` builds the architecture (the real HF class, the tiny models' tokenizer and processor, a fixed
image size whose 28 px cells match the stimuli grid); :mod:`.data` draws training examples from the stimuli
generators as a pure function of ``(seed, step, row)`` and turns them into batches without the processor;
:mod:`.training` runs AdamW on answer tokens with atomic, resumable safetensors checkpoints (:func:`train`; its
command line is :mod:`.cli`, ``python -m vlmbind.organisms``, and :mod:`.processes` splits a run over two processes);
:mod:`.recipes` holds the staged curricula of the shipped organisms; :mod:`.lora` fine-tunes any supported family
with LoRA adapters on the text attention projections (the PbP experiment on real checkpoints); :mod:`.siit` adds
strict interchange-intervention training to plant a known mechanism at chosen heads (``TrainConfig.siit``).
:mod:`vlmbind.core.shipped` knows where the trained weights live inside the package. Every name below loads on first
use (LoRA's peft among them).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..core.shipped import ORGANISM_NAMES, organism_dir, shipped_organisms

_LAZY = {
    "REGIMES": "data", "TASKS": "data", "BatchBuilder": "data", "TaskMixture": "data", "TaskSpec": "data",
    "TrainBatch": "data", "TrainingExample": "data", "answer_correct": "data", "answer_loss": "data",
    "canvas_for": "data", "training_canvas": "data", "LoraResult": "lora", "finetune_lora": "lora",
    "load_lora": "lora", "CELL_PX": "model", "OrganismSize": "model", "build_organism": "model",
    "grid_side": "model", "TrainConfig": "training.config", "lr_at": "training.config",
    "list_checkpoints": "training.checkpoints", "load_weights": "training.checkpoints",
    "TrainResult": "training.run", "train": "training.run",
    "run_recipe": "recipes", "stages": "recipes", "RECIPES": "recipes",
    "SIITSpec": "siit.spec", "VARIABLES": "siit.spec", "HeadInterchange": "siit.interchange",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ORGANISM_NAMES", "organism_dir", "shipped_organisms", *_LAZY]
