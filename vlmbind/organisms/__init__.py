"""The organisms: small Qwen2.5-VL models trained here on the binding tasks, and the code that trains them.

Design: :mod:`.model` builds the architecture (the real HF class, the tiny models' tokenizer and processor, a fixed
image size whose 28 px cells match the stimuli grid); :mod:`.data` draws training examples from the stimuli
generators as a pure function of ``(seed, step, row)`` and turns them into batches without the processor;
:mod:`.train` runs AdamW on answer tokens with atomic, resumable safetensors checkpoints; :mod:`.lora` fine-tunes any
supported family with LoRA adapters on the text attention projections (the PbP experiment on real checkpoints).
"""

from .data import REGIMES, TASKS, BatchBuilder, TaskMixture, TaskSpec, TrainBatch, TrainingExample, answer_correct, \
    answer_loss, canvas_for
from .lora import LoraResult, finetune_lora, load_lora
from .model import CELL_PX, OrganismSize, build_organism, grid_side
from .train import TrainConfig, TrainResult, list_checkpoints, load_weights, lr_at, train

__all__ = [
    "REGIMES", "TASKS", "BatchBuilder", "TaskMixture", "TaskSpec", "TrainBatch", "TrainingExample", "answer_correct",
    "answer_loss", "canvas_for", "LoraResult", "finetune_lora", "load_lora", "CELL_PX", "OrganismSize",
    "build_organism", "grid_side", "TrainConfig", "TrainResult", "list_checkpoints", "load_weights", "lr_at", "train",
]
