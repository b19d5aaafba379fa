"""LoRA fine-tuning of any supported family on the stimuli tasks (the PbP experiment on real checkpoints).

Design: the base model is loaded through :func:`vlmbind.load` and batches go through the family's own processor
(:meth:`vlmbind.engine.vlm.VLM.prepare`, left-padded), so a fine-tuned checkpoint sees its inputs exactly as evaluation
will show them. Each row's text is the prompt followed by `` answer`` and the tokenizer's eos; with left padding the
answer is the tail of every row, and the labels mark exactly those tokens (checked against the answer's own
tokenisation, so a tokenizer that merges across the prompt/answer boundary is an error, not a silent shift). peft
injects LoRA adapters into the text decoder's attention projections only: every ``nn.Linear`` inside each layer's
attention module as the family adapter declares it (``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, or a fused
projection), never the vision tower or the projector. Only adapter weights train; afterwards the adapters are removed
from the in-memory model (its base weights are untouched) and saved with safetensors (``adapter_model.safetensors``,
``adapter_config.json``) plus ``lora_run.json`` (hyper-parameters and the loss curve); :func:`load_lora` loads base
plus adapter back as a :class:`~vlmbind.engine.vlm.VLM` with the adapter merged.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core.errors import TrainingError
from ..engine.batches import Batch
from ..engine.loading import load
from ..engine.vlm import VLM
from ..stimuli.core import Dataset, Example
from .data import IGNORE_INDEX, TaskMixture, TrainingExample, answer_loss
from .training.config import cosine_lr

__all__ = ["LoraResult", "attention_target_regex", "finetune_lora", "load_lora", "lora_batch"]


@dataclass
class LoraResult:
    """What :func:`finetune_lora` did.

    Attributes:
        adapter_dir: where the adapter was saved (``adapter_model.safetensors``, ``adapter_config.json``).
        losses: training loss of every step.
        steps: optimiser steps.
        trainable_params: number of LoRA parameters.
        target_modules: the regular expression peft matched module names with.
        wall_time_s: training time.
    """

    adapter_dir: Path
    losses: list[float]
    steps: int
    trainable_params: int
    target_modules: str
    wall_time_s: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["adapter_dir"] = str(self.adapter_dir)
        return d


def attention_target_regex(vlm: VLM) -> str:
    """A regular expression (peft ``target_modules``) matching every Linear inside the text attention modules."""
    adapter = vlm.adapter
    names = sorted({name for name, m in adapter.attention_module(0).named_modules()
                    if isinstance(m, torch.nn.Linear) and name})
    if not names:
        raise TrainingError(f"{vlm.name}: the text attention module has no Linear projections to adapt")
    prefix = re.escape(f"{adapter.text_layers}.") + r"\d+" + re.escape(f".{adapter.attention}.")
    return prefix + "(?:" + "|".join(re.escape(n) for n in names) + ")"


def lora_batch(vlm: VLM, examples: Sequence[tuple[Any, str, str]]) -> tuple[Batch, torch.Tensor]:
    """A left-padded processor batch of ``prompt answer<eos>`` rows and its labels.

    Args:
        vlm: the model.
        examples: ``(image, prompt, answer)`` triples.

    Returns:
        The batch and ``B P`` labels: the answer and eos token ids, -100 elsewhere.

    Raises:
        TrainingError: a row does not end with the answer's own tokens (the tokenizer merged across the boundary).
    """
    tok = vlm.adapter.tokenizer
    eos = tok.eos_token or ""
    eos_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    texts = [f"{prompt} {answer}{eos}" for _, prompt, answer in examples]
    batch = vlm.prepare([im for im, _, _ in examples], texts, chat=False)  # raw text: prompt, answer, eos
    ids = batch.inputs["input_ids"]
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, (_, _, answer) in enumerate(examples):
        tail = list(tok(" " + answer, add_special_tokens=False)["input_ids"]) + eos_ids
        n = len(tail)
        if ids[i, -n:].tolist() != tail:
            raise TrainingError(f"row {i}: the answer {answer!r} does not tokenise the same after the prompt "
                                f"({ids[i, -n:].tolist()} vs {tail}); the labels would be misplaced")
        labels[i, -n:] = ids[i, -n:]
    return batch, labels


def _as_triples(examples: Sequence[Any]) -> list[tuple[Any, str, str]]:
    out = []
    for e in examples:
        if isinstance(e, Example):
            out.append((e.image, e.prompt, e.answer))
        elif isinstance(e, TrainingExample):
            out.append((e.image, e.prompt, e.answer))
        else:
            out.append(tuple(e))
    return out


def finetune_lora(
    model_dir_or_vlm: str | os.PathLike | VLM,
    data: Dataset | Sequence[Example] | TaskMixture,
    out_dir: str | os.PathLike,
    *,
    steps: int,
    lr: float = 1e-4,
    rank: int = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
    batch_size: int = 8,
    warmup: int = 0,
    weight_decay: float = 0.0,
    grad_clip: float | None = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> LoraResult:
    """Fine-tune LoRA adapters on the text attention projections and save them.

    Args:
        model_dir_or_vlm: a loaded :class:`VLM` or anything :func:`vlmbind.load` takes (a model directory, a hub id,
            a registered name). A passed VLM's model gets its adapters removed again afterwards: its weights are
            left as they were.
        data: a stimuli :class:`Dataset` (or list of examples), cycled in a seeded order, one epoch after another;
            or a :class:`TaskMixture`, whose step ``t`` batch is drawn as in training.
        out_dir: the adapter directory.
        steps: optimiser steps.
        lr: peak learning rate (cosine decay after ``warmup``).
        rank: LoRA rank.
        alpha: LoRA scale numerator (default ``2 * rank``).
        dropout: LoRA dropout.
        batch_size: examples per step.
        warmup: linear warm-up steps.
        weight_decay: AdamW weight decay on the adapter weights.
        grad_clip: global gradient-norm clip (None: off).
        seed: the data order and the adapter init.
        progress: show a tqdm bar.

    Returns:
        A :class:`LoraResult`.

    Raises:
        TrainingError: bad hyper-parameters, an empty data set, or a tokenizer that splits answers differently.
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise TrainingError(f"steps must be an int >= 1, got {steps!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise TrainingError(f"rank must be an int >= 1, got {rank!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise TrainingError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise TrainingError(f"lr must be a number > 0, got {lr!r}")
    vlm = model_dir_or_vlm if isinstance(model_dir_or_vlm, VLM) else load(model_dir_or_vlm)
    if isinstance(data, TaskMixture):
        def examples_at(step: int) -> list[tuple[Any, str, str]]:
            return _as_triples(data.batch(step, batch_size))
    else:
        pool = _as_triples(list(data))
        if not pool:
            raise TrainingError("the data set is empty: pass at least one example")
        orders: dict[int, np.ndarray] = {}

        def examples_at(step: int) -> list[tuple[Any, str, str]]:
            rows = []
            for k in range(step * batch_size, (step + 1) * batch_size):
                epoch, i = divmod(k, len(pool))
                if epoch not in orders:
                    orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(pool))
                rows.append(pool[int(orders[epoch][i])])
            return rows

    target = attention_target_regex(vlm)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                        target_modules=target, bias="none")
    torch.manual_seed(seed)
    was_training = vlm.model.training
    with warnings.catch_warnings():
        # peft asks transformers about gradient checkpointing through a name transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(vlm.model, config)
    out = Path(out_dir)
    losses: list[float] = []
    try:
        params = [p for p in peft_model.parameters() if p.requires_grad]
        n_trainable = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        peft_model.train()
        t0 = time.perf_counter()
        bar = tqdm(range(steps), disable=not progress, desc=f"LoRA r={rank}", unit="step", dynamic_ncols=True)
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, steps=steps, lr=lr, warmup=warmup)
            batch, labels = lora_batch(vlm, examples_at(step))
            inputs = vlm.model_inputs(batch)
            logits = peft_model(**inputs, use_cache=False).logits
            loss = answer_loss(logits, labels.to(logits.device), "example")
            loss.backward()
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        bar.close()
        wall = time.perf_counter() - t0
        out.mkdir(parents=True, exist_ok=True)
        peft_model.save_pretrained(out, safe_serialization=True)
        result = LoraResult(adapter_dir=out, losses=losses, steps=steps, trainable_params=n_trainable,
                            target_modules=target, wall_time_s=wall)
        run = {**result.to_dict(), "base": vlm.source, "base_name": vlm.name, "rank": rank,
               "alpha": config.lora_alpha, "dropout": dropout, "lr": lr, "batch_size": batch_size, "warmup": warmup,
               "weight_decay": weight_decay, "grad_clip": grad_clip, "seed": seed}
        (out / "lora_run.json").write_text(json.dumps(run, indent=1) + "\n")
    finally:
        # take the adapters out again: the caller's model keeps its original modules and weights
        peft_model.unload()
        vlm.model.train(was_training)
    return result


def load_lora(base: str | os.PathLike | VLM, adapter_dir: str | os.PathLike) -> VLM:
    """The base model with a saved LoRA adapter merged in, as a new :class:`VLM`.

    Args:
        base: the base model (anything :func:`vlmbind.load` takes, or a VLM, which is copied and left unchanged).
        adapter_dir: a directory written by :func:`finetune_lora`.

    Raises:
        TrainingError: ``adapter_dir`` holds no adapter.
    """
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise TrainingError(f"{str(adapter_dir)!r} holds no LoRA adapter (no adapter_config.json); pass the "
                            f"out_dir of finetune_lora")
    vlm = base if isinstance(base, VLM) else load(base)
    model = copy.deepcopy(vlm.model) if isinstance(base, VLM) else vlm.model
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return VLM(merged, vlm.processor, name=f"{vlm.name}+lora", source=f"{vlm.source} + {adapter_dir.resolve()}")
