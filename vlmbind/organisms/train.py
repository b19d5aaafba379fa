"""The organisms trainer: AdamW on answer tokens over a seeded task mixture, with atomic, resumable checkpoints.

Design: a run is a pure function of its :class:`TrainConfig`. The weights come from the seed (or from ``init_from``,
another checkpoint, for curricula); each step's batch is a function of ``(seed, step, row)``
(:class:`~vlmbind.organisms.data.TaskMixture`); the learning rate is a function of the step (linear warm-up, then
cosine). So a checkpoint only has to hold what changes: the weights, AdamW's moments, the step, the torch RNG state and
the loss history, and resuming from it continues the exact run an uninterrupted process would have made (tested
bit-for-bit on CPU). Every checkpoint is a complete model directory that ``vlmbind.load`` and ``from_pretrained`` read
(``model.safetensors``, ``config.json``, tokenizer and processor files), plus ``train_config.json``,
``trainer_state.json`` and the optimizer as ``optimizer.safetensors`` (tensors, keyed by parameter name) and
``optimizer.json`` (hyper-parameters). Nothing is pickled. A checkpoint is written into a temporary sibling directory
and moved into place with ``os.replace``, so a crash never leaves a half-written ``checkpoint-*``; an interrupt
(Ctrl-C) writes one at the last finished step before stopping.

Run from the shell: ``python -m vlmbind.organisms --config run.json --out runs/p2a [--resume] [--threads 2]`` (or
``python -m vlmbind.organisms.train ...``, which works the same but makes Python warn about the module already being
imported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from ..core.errors import TrainingError, VlmbindError, close_matches
from ..core.sites import parse_heads
from ..stimuli.core import StimulusError
from .data import (
    REGIMES,
    TASKS,
    BatchBuilder,
    TaskMixture,
    TaskSpec,
    TrainBatch,
    answer_correct,
    answer_loss,
    canvas_for,
)
from .model import OrganismSize, build_organism, grid_side, shared_image_features
from .processes import (RankSplit, behaviour_shares, check_processes, error_file, join, launch, leave,
                        sigterm_as_interrupt, stop_when_orphaned, sync_step)
from .siit import (
    SIIT_EVAL_STREAM,
    SIIT_PARTS,
    HeadInterchange,
    GatherProbe,
    PositionProbe,
    SelectionProbe,
    SIITSpec,
    answer_changes_per_set,
    draw_pairs,
    evaluating,
    evaluation_pairs,
    interchange_accuracy,
    position_code_accuracy,
    position_code_loss,
    selection_readout,
    siit_losses,
    unpatched_accuracy,
)

__all__ = ["TrainConfig", "TrainResult", "train", "list_checkpoints", "lr_at", "cosine_lr", "load_weights"]

CHECKPOINT_PREFIX = "checkpoint-"
# a SIIT run's per-step log, in this order; the strings are the step's draws, the rest are losses
LOG_KEYS = ("behaviour", "variable", "strict_head", "iit", "strict", "selection", "selection_attention",
            "retrieval_attention", "interchanged_selection", "strict_selection", "retrieval_readout", "gather_readout",
            "gather_interchange", "gather_selection", "selecting_interchange", "ablated", "ablation_strict",
            "necessity_ablated", "ablation_necessity", "position")
LOGGED_LOSSES = tuple(k for k in LOG_KEYS if k not in ("variable", "strict_head", "ablated", "necessity_ablated"))
LOSS_NORMS = ("example", "token")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that determines a training run (validated on construction).

    Attributes:
        regime: ``"direct"`` (answer only) or ``"p2a"`` (points, then the answer) for search and counting.
        tasks: task -> weight (share of batch rows); tasks: ``scene``, ``query``, ``search``, ``count``; a weight of
            0 leaves the task out.
        task_options: task -> options (``objects`` as ``[lo, hi]``, ``variants``, ``present``, ``colours``,
            ``shapes``; see :class:`~vlmbind.organisms.data.TaskSpec`).
        steps: training steps of the whole run (the schedule's length; one optimiser step each, three with
            ``siit.single_loss=False``).
        batch_size: examples per step.
        lr: peak learning rate.
        warmup: linear warm-up steps from 0 to ``lr``.
        final_lr_ratio: the cosine decays from ``lr`` to ``lr * final_lr_ratio`` at the last step.
        weight_decay: AdamW's decoupled weight decay on matrices (not on biases, norms).
        grad_clip: clip the global gradient norm to this (None: no clipping).
        loss_norm: ``"example"`` (every example weighs the same) or ``"token"`` (every answer token does).
        seed: weights (when not ``init_from``) and data.
        image_size: square image side in pixels, a multiple of 28 (168 -> a 6x6 token grid).
        model: the architecture's size (a mapping is converted).
        attn_implementation: ``"sdpa"`` (faster) or ``"eager"`` during training.
        init_from: a checkpoint or model directory whose weights start the run (same size; any image size).
        init_layers: with ``init_from``, grow the model: for each decoder layer of this run, the ``init_from`` layer
            it starts as, or None for a new layer that starts as the identity (fresh weights, its attention
            ``o_proj`` and MLP ``down_proj`` zero, so it adds nothing until trained). None: the same layers.
        checkpoint_every: write a checkpoint every this many steps (and at the end).
        keep_checkpoints: how many of the newest checkpoints to keep.
        eval_every: evaluate on the fixed evaluation set every this many steps (and at the end); 0: never.
        eval_size: evaluation examples per task and variant.
        siit: a mechanism to plant by strict interchange-intervention training (:class:`~vlmbind.organisms.siit.SIITSpec`
            or a mapping of its fields); None: behaviour only.
    """

    regime: str = "direct"
    tasks: Mapping[str, float] = field(default_factory=lambda: {"scene": 1.0})
    task_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 200
    final_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    loss_norm: str = "example"
    seed: int = 0
    image_size: int = 168
    model: OrganismSize = field(default_factory=OrganismSize)
    attn_implementation: str = "sdpa"
    init_from: str | None = None
    init_layers: tuple[int | None, ...] | None = None
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    eval_every: int = 250
    eval_size: int = 64
    siit: SIITSpec | None = None

    def __post_init__(self) -> None:
        if self.regime not in REGIMES:
            raise TrainingError(f"regime {self.regime!r} is not one of {REGIMES}."
                                f"{close_matches(str(self.regime), REGIMES)}")
        if not isinstance(self.tasks, Mapping) or not self.tasks:
            raise TrainingError(f"tasks must map task names to weights, e.g. {{'scene': 1.0}}; got {self.tasks!r}")
        for name, weight in self.tasks.items():
            if name not in TASKS:
                raise TrainingError(f"unknown task {name!r}.{close_matches(str(name), TASKS)} "
                                    f"Tasks: {', '.join(TASKS)}")
            if not _is_number(weight) or weight < 0:
                raise TrainingError(f"task {name!r}: weight must be a finite number >= 0, got {weight!r}")
        if not any(w > 0 for w in self.tasks.values()):
            raise TrainingError(f"every task weight is 0 in {dict(self.tasks)}; give at least one task a weight > 0")
        if not isinstance(self.task_options, Mapping):
            raise TrainingError(f"task_options must map task names to option mappings, got {self.task_options!r}")
        for name, options in self.task_options.items():
            if name not in self.tasks:
                raise TrainingError(f"task_options names {name!r}, which is not in tasks {list(self.tasks)}"
                                    f".{close_matches(str(name), self.tasks)}")
            if not isinstance(options, Mapping):
                raise TrainingError(f"task_options[{name!r}] must be a mapping, got {options!r}")
        # plain, JSON-shaped copies, in the canonical task order (the mixture's draws depend on the order)
        object.__setattr__(self, "tasks", {t: float(self.tasks[t]) for t in TASKS if t in self.tasks})
        object.__setattr__(self, "task_options", {t: json.loads(json.dumps(dict(self.task_options[t])))
                                                  for t in TASKS if t in self.task_options})
        for name in ("steps", "batch_size", "checkpoint_every", "keep_checkpoints", "eval_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise TrainingError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("warmup", "eval_every", "seed"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise TrainingError(f"{name} must be an int >= 0, got {value!r}")
        if not _is_number(self.lr) or self.lr <= 0:
            raise TrainingError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not _is_number(self.final_lr_ratio) or not 0 <= self.final_lr_ratio <= 1:
            raise TrainingError(f"final_lr_ratio must be in [0, 1], got {self.final_lr_ratio!r}")
        if not _is_number(self.weight_decay) or self.weight_decay < 0:
            raise TrainingError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.grad_clip is not None and (not _is_number(self.grad_clip) or self.grad_clip <= 0):
            raise TrainingError(f"grad_clip must be a number > 0 or None, got {self.grad_clip!r}")
        if self.loss_norm not in LOSS_NORMS:
            raise TrainingError(f"loss_norm {self.loss_norm!r} is not one of {LOSS_NORMS}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise TrainingError(f"attn_implementation {self.attn_implementation!r} is not one of "
                                f"{ATTN_IMPLEMENTATIONS}")
        grid_side(self.image_size)
        if isinstance(self.model, Mapping):
            try:
                object.__setattr__(self, "model", OrganismSize(**self.model))
            except TypeError as exc:
                names = [f.name for f in fields(OrganismSize)]
                raise TrainingError(f"model size: {exc}; fields: {', '.join(names)}") from None
        if not isinstance(self.model, OrganismSize):
            raise TrainingError(f"model must be an OrganismSize or a mapping, got {type(self.model).__name__}")
        if self.init_from is not None:
            if not isinstance(self.init_from, (str, os.PathLike)):
                raise TrainingError(f"init_from must be a directory path or None, got {self.init_from!r}")
            object.__setattr__(self, "init_from", os.fspath(self.init_from))
        if self.init_layers is not None:
            layers = list(self.init_layers) if isinstance(self.init_layers, (list, tuple)) else None
            if self.init_from is None or layers is None or len(layers) != self.model.layers or any(
                    v is not None and (not _is_int(v) or v < 0) for v in layers):
                raise TrainingError(f"init_layers must list, with init_from, one source layer index (or None for a "
                                    f"new identity layer) per decoder layer ({self.model.layers}), got "
                                    f"{self.init_layers!r}")
            object.__setattr__(self, "init_layers", tuple(layers))
        object.__setattr__(self, "siit", SIITSpec.from_value(self.siit))
        if self.siit is not None:
            self.siit.check(self.model.layers, self.model.heads)
            # the pairs are drawn like the scene task's examples: its pools unless the spec names its own
            scene = self.task_options.get("scene", {})
            pools = {pool: tuple(scene[pool]) for pool in ("colours", "shapes")
                     if getattr(self.siit, pool) is None and scene.get(pool)}
            object.__setattr__(self, "siit", replace(self.siit, **pools))
            canvas = canvas_for(self.image_size)
            for variable in self.siit.alignments:  # the pairs' generator checks the pools against the scenes
                try:
                    draw_pairs(self.siit, variable, seed=0, stream=SIIT_EVAL_STREAM, step=0, canvas=canvas, n=1)
                except StimulusError as exc:
                    raise TrainingError(f"siit {variable}: {exc}") from None
        self.mixture()  # the generators validate the task parameters against the canvas

    # ---- derived ------------------------------------------------------------------------------------------
    def task_specs(self) -> list[TaskSpec]:
        return [TaskSpec.from_options(t, w, self.task_options.get(t)) for t, w in self.tasks.items() if w > 0]

    def mixture(self) -> TaskMixture:
        """The run's example source."""
        return TaskMixture(self.task_specs(), regime=self.regime, image_size=self.image_size, seed=self.seed)

    # ---- serialisation ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model"] = self.model.to_dict()
        d["tasks"] = dict(self.tasks)
        d["task_options"] = {k: dict(v) for k, v in self.task_options.items()}
        if self.init_layers is None:  # configs that do not grow keep the keys they always had
            del d["init_layers"]
        else:
            d["init_layers"] = list(self.init_layers)
        if self.siit is None:  # behaviour-only configs keep the keys they always had
            del d["siit"]
        else:
            d["siit"] = self.siit.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """A config from :meth:`to_dict`'s output (or a hand-written JSON object).

        Raises:
            TrainingError: an unknown key (with close matches) or an invalid value.
        """
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                raise TrainingError(f"unknown TrainConfig field {key!r}.{close_matches(str(key), names)}")
        return cls(**dict(d))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TrainingError(f"cannot read a TrainConfig from {os.fspath(path)!r}: {exc}") from exc
        return cls.from_dict(data)


@dataclass
class TrainResult:
    """What a call to :func:`train` did.

    Attributes:
        out_dir: the run directory.
        checkpoint: the last checkpoint written (a loadable model directory).
        step: the step reached.
        losses: training loss of every step of the run so far (including resumed parts).
        evals: ``[{"step": s, "tasks": {"task/variant": {"loss": l, "accuracy": a}}}, ...]``.
        wall_time_s: training time of the whole run so far (all sessions).
        steps_per_s: speed of this session.
    """

    out_dir: Path
    checkpoint: Path
    step: int
    losses: list[float]
    evals: list[dict[str, Any]]
    wall_time_s: float
    steps_per_s: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"], d["checkpoint"] = str(self.out_dir), str(self.checkpoint)
        return d


def cosine_lr(step: int, *, steps: int, lr: float, warmup: int, final_ratio: float = 0.0) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up to ``lr`` over ``warmup`` updates, then a cosine
    decay to ``lr * final_ratio`` at update ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_at(config: TrainConfig, step: int) -> float:
    """The run's learning rate at update ``step`` (0-based); see :func:`cosine_lr`."""
    return cosine_lr(step, steps=config.steps, lr=config.lr, warmup=config.warmup, final_ratio=config.final_lr_ratio)


# --------------------------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------------------------
def list_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``out_dir``, oldest first (temporary directories are never listed)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        suffix = p.name[len(CHECKPOINT_PREFIX):]
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


@contextlib.contextmanager
def _quiet_hf() -> Iterator[None]:
    """Silence transformers' own progress bars (weight writing / loading) under the trainer's bar."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


_LAYER_KEY = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")


def grow_state_dict(source: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor],
                    layers: Sequence[int | None]) -> dict[str, torch.Tensor]:
    """A state dict for a model with ``len(layers)`` decoder layers: layer ``i`` is ``source``'s layer
    ``layers[i]``, or, for None, ``fresh``'s layer ``i`` with its ``o_proj`` and ``down_proj`` zeroed (a residual
    block that adds nothing). Everything outside the decoder layers comes from ``source``."""
    out: dict[str, torch.Tensor] = {}
    by_layer: dict[int, dict[str, str]] = {}
    for key in source:
        m = _LAYER_KEY.match(key)
        if m:
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = key
        else:
            out[key] = source[key]
    for key, value in fresh.items():
        m = _LAYER_KEY.match(key)
        if not m:
            continue
        i, rest = int(m.group(1)), m.group(2)
        origin = layers[i]
        if origin is None:
            zero = rest.endswith("self_attn.o_proj.weight") or rest.endswith("mlp.down_proj.weight")
            out[key] = torch.zeros_like(value) if zero else value.clone()
        else:
            if origin not in by_layer or rest not in by_layer[origin]:
                raise TrainingError(f"init_layers[{i}] = {origin}: the source has no decoder layer {origin} "
                                    f"(layers 0..{max(by_layer) if by_layer else -1})")
            out[key] = source[by_layer[origin][rest]]
    return out


def load_weights(model: torch.nn.Module, directory: str | os.PathLike,
                 layers: Sequence[int | None] | None = None) -> None:
    """Copy the weights of a saved organism (``from_pretrained`` layout) into ``model``; ``layers`` grows it (see
    :attr:`TrainConfig.init_layers`).

    Raises:
        TrainingError: the directory has no loadable weights, or they do not fit ``model``'s architecture.
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise TrainingError(f"{str(directory)!r} is not a saved model directory (no config.json); pass a "
                            f"checkpoint-* directory or a directory written by save_pretrained")
    cls = getattr(transformers, type(model).__name__)
    try:
        with _quiet_hf():
            source = cls.from_pretrained(directory, attn_implementation="eager")
    except (OSError, ValueError, RuntimeError) as exc:
        raise TrainingError(f"cannot load weights from {str(directory)!r}: {str(exc).splitlines()[0]}") from exc
    src, dst = source.state_dict(), model.state_dict()
    if layers is not None:
        src = grow_state_dict(src, dst, layers)
    missing = sorted(set(dst) - set(src))
    shapes = [k for k in dst if k in src and src[k].shape != dst[k].shape]
    if missing or shapes or set(src) - set(dst):
        detail = f"missing {missing[:3]}" if missing else f"shape mismatch at {shapes[:3]}" if shapes else \
            f"unexpected {sorted(set(src) - set(dst))[:3]}"
        raise TrainingError(f"weights in {str(directory)!r} do not fit this organism's size ({detail}); "
                            f"use the same model size as the run that wrote them")
    model.load_state_dict(src, strict=True)


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """AdamW's state as (tensors keyed ``param/name``, JSON with the groups' hyper-parameters and param names)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise TrainingError(f"optimizer state {key!r} is not a tensor; cannot save it as safetensors")
                tensors[f"{names[id(p)]}/{key}"] = value.detach().contiguous()
    return tensors, {"param_groups": groups}


def _load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                          meta: dict[str, Any]) -> None:
    index = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[id(p)] = len(index)
    by_name = {n: index[id(p)] for n, p in model.named_parameters() if id(p) in index}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, slot = key.rpartition("/")
        if name not in by_name:
            raise TrainingError(f"optimizer state for unknown parameter {name!r}; the checkpoint does not fit")
        state.setdefault(by_name[name], {})[slot] = value
    groups = []
    for g in meta["param_groups"]:
        hyper = {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [by_name[n] for n in g["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def _save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module, processor: Any,
                     optimizer: torch.optim.Optimizer, config: TrainConfig, state: dict[str, Any],
                     keep: int, extra: Any = None) -> Path:
    """Write ``checkpoint-{step}`` atomically (temporary sibling + ``os.replace``) and prune old ones."""
    final = out_dir / f"{CHECKPOINT_PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=out_dir))
    try:
        with _quiet_hf():
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
        tensors, meta = _optimizer_state(model, optimizer)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        _write_json(tmp / "optimizer.json", meta)
        _write_json(tmp / "train_config.json", config.to_dict())
        _write_json(tmp / "trainer_state.json", state)
        if extra is not None:
            extra(tmp)
        if final.exists():  # only when re-writing the same step: move the old one aside first
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=out_dir))
            os.replace(final, trash / final.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _read_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainingError(f"checkpoint {str(checkpoint)!r} has no readable trainer_state.json: {exc}") from exc


def _config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [f"{k}: {a.get(k)!r} (checkpoint) vs {b.get(k)!r} (now)" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


# --------------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------------
def _make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.999), eps=1e-8,
    )


def _evaluate_siit(model: torch.nn.Module, interchange: HeadInterchange, builder: BatchBuilder, spec: SIITSpec,
                   pairs: dict[str, list[Any]], batch_size: int) -> dict[str, dict[str, float]]:
    """Per variable on fixed pairs: the interchange accuracy of its aligned heads (beside the share of unpatched runs
    that already give the counterfactual answer), and how often interchanging one unaligned head at every prompt
    position changes the answer (the mean and the worst over every unaligned head)."""
    a = interchange.adapter
    sample = spec.unaligned(a.n_layers, a.n_heads)
    out = {}
    for variable, rows in pairs.items():
        iia = interchange_accuracy(model, interchange, builder, rows, spec.heads(variable), batch_size=batch_size,
                                   last_positions=spec.last_positions, span_positions=spec.span_positions)
        changes = answer_changes_per_set(model, interchange, builder, rows, [[h] for h in sample],
                                         batch_size=batch_size)
        out[variable] = {"interchange_accuracy": iia,
                         "counterfactual_unpatched": unpatched_accuracy(model, builder, rows, batch_size=batch_size),
                         "unaligned_changes": float(np.mean(changes)) if changes else 0.0,
                         "unaligned_changes_max": float(np.max(changes)) if changes else 0.0}
    return out


def _evaluate_position(model: torch.nn.Module, batches: dict[str, list[TrainBatch]], layer: int,
                       image_token_id: int, cells: int, probe: PositionProbe | None) -> float:
    """The position code's readout accuracy on the first evaluation batch of every task."""
    accuracies = []
    with evaluating(model):
        for chunks in batches.values():
            b = chunks[0]
            hidden = model(**b.inputs, use_cache=False, output_hidden_states=True).hidden_states[layer + 1]
            accuracies.append(probe.accuracy(hidden, b.inputs["input_ids"], image_token_id) if probe is not None
                              else position_code_accuracy(hidden, b.inputs["input_ids"], image_token_id, cells))
    return float(np.mean(accuracies))


PROBE_FILE = "position_probe.safetensors"
SELECTION_PROBE_FILE = "selection_probe.safetensors"
RETRIEVAL_PROBE_FILE = "retrieval_probe.safetensors"
GATHER_PROBE_FILE = "gather_probe.safetensors"


def _save_probe(directory: Path, probe: torch.nn.Module, optimizer: torch.optim.Optimizer,
                name: str = PROBE_FILE) -> None:
    tensors = {f"param.{n}": p.detach().clone() for n, p in probe.named_parameters()}
    by_id = {id(p): n for n, p in probe.named_parameters()}
    for p, st in optimizer.state.items():
        for key, value in st.items():
            tensors[f"state.{by_id[id(p)]}.{key}"] = torch.as_tensor(value).detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / name))


def _load_probe(directory: Path, probe: torch.nn.Module, optimizer: torch.optim.Optimizer,
                name: str = PROBE_FILE) -> None:
    path = directory / name
    if not path.is_file():
        raise TrainingError(f"checkpoint {str(directory)!r} has no {name}; it was not written by a run with "
                            f"this trained readout")
    tensors = load_file(str(path))
    with torch.no_grad():
        for n, p in probe.named_parameters():
            p.copy_(tensors[f"param.{n}"])
    for n, p in probe.named_parameters():
        st = {key.rsplit(".", 1)[1]: v for key, v in tensors.items() if key.startswith(f"state.{n}.")}
        if st:
            optimizer.state[p] = st


def _evaluate(model: torch.nn.Module, batches: dict[str, list[TrainBatch]], norm: str) -> dict[str, dict[str, float]]:
    """Teacher-forced loss and exact-match accuracy (equal to greedy decoding's) per ``task/variant``."""
    out = {}
    with evaluating(model):
        for key, chunks in batches.items():
            losses, correct, n = [], 0, 0
            for b in chunks:
                logits = model(**b.inputs, use_cache=False).logits
                losses.append(float(answer_loss(logits, b.labels, norm)) * len(b))
                correct += int(answer_correct(logits, b.labels).sum())
                n += len(b)
            out[key] = {"loss": sum(losses) / n, "accuracy": correct / n}
    return out


def train(
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    progress: bool = True,
    until: int | None = None,
    threads: int | None = None,
    share_image_features: bool = True,
    processes: int = 1,
) -> TrainResult:
    """Train an organism (or continue one) and write checkpoints into ``out_dir``.

    Args:
        config: the run.
        out_dir: the run directory; ``checkpoint-{step:06d}`` directories appear in it.
        resume: continue from the newest checkpoint in ``out_dir`` (its config must equal ``config``).
        progress: show a tqdm bar with the loss.
        until: stop after this step (a checkpoint is written there), as if interrupted; None: run to
            ``config.steps``.
        threads: ``torch.set_num_threads`` for this process (None: leave it). On an otherwise idle 2-core machine
            two threads train 1.2-1.5x faster than one (``benchmarks/training.py``); with another job on it, give
            each one thread (more threads than cores cost several times). Results can differ in the last bits
            between thread counts.
        share_image_features: send each distinct image of an optimiser step's runs (and of an evaluation) through
            the vision tower once (:func:`~vlmbind.organisms.model.shared_image_features`); False runs the vision
            tower in every forward, the plain path it must equal (up to the order of float sums).
        processes: 1, or 2 to train in two processes of ``threads`` threads each (default 1), each computing part
            of every step's summed loss (:mod:`~vlmbind.organisms.processes`): faster than one process on an
            idle 2-core machine (``benchmarks/two_processes.py``), and the same run up to the order of float sums.
            A run may change its process count when it resumes.

    Returns:
        A :class:`TrainResult`.

    Raises:
        TrainingError: ``resume`` without a checkpoint, a fresh run into a directory that has checkpoints, a config
            that differs from the checkpoint's, or ``init_from`` weights that do not fit.
    """
    if not isinstance(config, TrainConfig):
        raise TrainingError(f"config must be a TrainConfig, got {type(config).__name__}")
    if until is not None and (not _is_int(until) or until < 1):
        raise TrainingError(f"until must be an int >= 1 or None, got {until!r}")
    processes = check_processes(processes, config.siit)
    if processes == 2 and not share_image_features:
        raise TrainingError("share_image_features=False (the plain path, for comparisons) runs in one process; "
                            "pass processes=1 with it")
    if processes == 2:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        before = list_checkpoints(out)
        start = int(_read_state(before[-1])["step"]) if resume and before else 0
        t0 = time.perf_counter()
        launch(config.to_dict(), out, resume=resume, progress=progress, until=until, threads=threads)
        return _result_of(out, start, time.perf_counter() - t0)
    return _train_here(config, out_dir, resume=resume, progress=progress, until=until, threads=threads,
                       share_image_features=share_image_features)


def _result_of(out: Path, start: int, elapsed: float) -> TrainResult:
    """The :class:`TrainResult` of a run the training processes finished, read from its newest checkpoint."""
    checkpoint = list_checkpoints(out)[-1]
    state = _read_state(checkpoint)
    done = int(state["step"])
    return TrainResult(out_dir=out, checkpoint=checkpoint, step=done, losses=[float(v) for v in state["losses"]],
                       evals=list(state["evals"]), wall_time_s=float(state["wall_time_s"]),
                       steps_per_s=(done - start) / elapsed if done > start else 0.0)


def _train_here(config: TrainConfig, out_dir: str | os.PathLike, *, resume: bool, progress: bool,
                until: int | None, threads: int | None, share_image_features: bool,
                split: RankSplit | None = None) -> TrainResult | None:
    """:func:`train` in this process: the whole step, or (``split``) one rank's part of it (rank 1 returns None)."""
    if threads is not None:
        torch.set_num_threads(int(threads))
    writer = split is None or split.is_writer
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = list_checkpoints(out)
    model, processor = build_organism(seed=config.seed, image_size=config.image_size,
                                      attn_implementation=config.attn_implementation, **config.model.to_dict())
    optimizer = _make_optimizer(model, config)
    state: dict[str, Any] = {"step": 0, "losses": [], "evals": [], "wall_time_s": 0.0}
    if resume:
        if not existing:
            raise TrainingError(f"resume=True but {str(out)!r} has no checkpoint; start the run without resume")
        ckpt = existing[-1]
        state = _read_state(ckpt)
        diff = _config_diff(state.get("config", {}), config.to_dict())
        if diff:
            raise TrainingError(f"the config differs from the one checkpoint {ckpt.name} was trained with: "
                                f"{'; '.join(diff)}. Resume with the same config, or start a new run with "
                                f"init_from={str(ckpt)!r}")
        load_weights(model, ckpt)
        try:
            tensors = load_file(str(ckpt / "optimizer.safetensors"))
            meta = json.loads((ckpt / "optimizer.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TrainingError(f"checkpoint {str(ckpt)!r} has no readable optimizer state: {exc}") from exc
        _load_optimizer_state(model, optimizer, tensors, meta)
        torch.set_rng_state(torch.tensor(state["rng"]["torch"], dtype=torch.uint8))
    else:
        if existing:
            raise TrainingError(f"{str(out)!r} already holds checkpoints ({existing[-1].name}); pass resume=True "
                                f"to continue that run, or choose another out_dir")
        if config.init_from is not None:
            load_weights(model, config.init_from, config.init_layers)
    mixture = config.mixture()
    builder = BatchBuilder(processor)
    eval_batches: dict[str, list[TrainBatch]] = {}
    if config.eval_every:
        for key, examples in mixture.eval_set(config.eval_size).items():
            eval_batches[key] = [builder(examples[i : i + config.batch_size])
                                 for i in range(0, len(examples), config.batch_size)]
    siit = config.siit
    interchange = HeadInterchange(model, processor) if siit is not None else None
    position_layer = siit.position_layer if siit is not None else None
    cells = grid_side(config.image_size) ** 2
    probe = probe_optimizer = save_probe = None
    readouts: list[tuple[torch.nn.Module, torch.optim.Optimizer, str]] = []
    if position_layer is not None and siit.position_readout == "trained":
        probe = PositionProbe(config.model.hidden, cells, config.seed)
        probe_optimizer = torch.optim.AdamW(probe.parameters(), lr=config.lr, weight_decay=0.0)
        readouts.append((probe, probe_optimizer, PROBE_FILE))
    selection = None
    if siit is not None and siit.selection_weight > 0:
        selection = SelectionProbe(siit.heads("id_selection"), interchange.d_head, cells, config.seed)
        readouts.append((selection, torch.optim.AdamW(selection.parameters(), lr=config.lr, weight_decay=0.0),
                         SELECTION_PROBE_FILE))
    retrieval = gather = None
    if siit is not None and siit.retrieval_readout_weight > 0:
        retrieval = SelectionProbe(siit.heads("id_retrieval"), interchange.d_head, cells, config.seed + 1)
        readouts.append((retrieval, torch.optim.AdamW(retrieval.parameters(), lr=config.lr, weight_decay=0.0),
                         RETRIEVAL_PROBE_FILE))
    if siit is not None and siit.gather_readout_weight > 0:
        gather = GatherProbe(parse_heads(list(siit.aggregation_heads)), interchange.d_head, cells, config.seed + 2)
        readouts.append((gather, torch.optim.AdamW(gather.parameters(), lr=config.lr, weight_decay=0.0),
                         GATHER_PROBE_FILE))
    if readouts:
        if resume:
            for module, opt, name in readouts:
                _load_probe(existing[-1], module, opt, name)

        def save_probe(directory: Path) -> None:
            for module, opt, name in readouts:
                _save_probe(directory, module, opt, name)
    siit_eval = {} if siit is None or not config.eval_every else {
        v: evaluation_pairs(siit, v, seed=config.seed, canvas=mixture.canvas, n=config.eval_size)
        for v in sorted(siit.alignments)}

    start = int(state["step"])
    stop = config.steps if until is None else min(until, config.steps)
    losses: list[float] = [float(v) for v in state["losses"]]
    siit_log: list[dict[str, Any]] = list(state.get("siit_losses", []))
    evals: list[dict[str, Any]] = list(state["evals"])
    previous_time = float(state.get("wall_time_s", 0.0))
    checkpoint = existing[-1] if resume else None
    done = start

    def snapshot(step: int, elapsed: float) -> dict[str, Any]:
        return {"step": step, "config": config.to_dict(), "rng": {"torch": torch.get_rng_state().tolist()},
                "losses": losses, "evals": evals, "wall_time_s": previous_time + elapsed,
                **({"siit_losses": siit_log} if siit is not None else {}),
                "threads": torch.get_num_threads(), **({"processes": split.world} if split is not None else {}),
                "mixture": mixture.to_dict(),
                "versions": {"torch": torch.__version__, "transformers": _transformers_version()}}

    def images_shared() -> contextlib.AbstractContextManager:
        return shared_image_features(model) if share_image_features else contextlib.nullcontext()

    # the parameters whose gradients the two processes add: the model's, then each readout's
    synced = [p for p in model.parameters() if p.requires_grad] + \
        [p for module, _opt, _name in readouts for p in module.parameters()]

    model.train()
    bar = tqdm(total=config.steps, initial=start, disable=not (progress and writer), unit="step", dynamic_ncols=True,
               desc=f"organism {config.regime}")
    t0 = time.perf_counter()
    ema = None
    try:
        for step in range(start, stop):
            lr = lr_at(config, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            parts: dict[str, Any] = {}

            def behaviour_loss() -> torch.Tensor | None:
                examples = mixture.batch(step, config.batch_size)
                share = position_share = 1.0
                if split is not None:  # this rank's rows, weighted by their share of the whole batch's loss
                    examples = [examples[i] for i in split.behaviour_rows(len(examples), siit)]
                    batch = builder(examples) if examples else None
                    share, position_share = behaviour_shares(split, batch, builder.image_token_id,
                                                             config.loss_norm)
                    if batch is None:
                        return None
                else:
                    batch = builder(examples)
                output = model(**batch.inputs, use_cache=False, output_hidden_states=position_layer is not None)
                loss = share * answer_loss(output.logits, batch.labels, config.loss_norm)
                parts["behaviour"] = float(loss.detach())
                if position_layer is not None:
                    hidden = output.hidden_states[position_layer + 1]
                    code = probe.loss(hidden, batch.inputs["input_ids"], builder.image_token_id) \
                        if probe is not None \
                        else position_code_loss(hidden, batch.inputs["input_ids"], builder.image_token_id, cells)
                    code = position_share * code
                    parts["position"] = float(code.detach())
                    loss = loss + siit.position_weight * code
                return loss

            def siit_loss(which: tuple[str, ...], total: torch.Tensor | None = None) -> torch.Tensor | None:
                extra = siit_losses(model, interchange, builder, siit, seed=config.seed, step=step,
                                    canvas=mixture.canvas, loss_norm=config.loss_norm, selection=selection,
                                    parts=which, retrieval=retrieval, gather=gather)
                parts.update(variable=extra["variable"], strict_head=extra["strict_head"])
                for name in ("ablated", "necessity_ablated"):
                    if extra[name] is not None:
                        parts[name] = extra[name]
                for name, weight in (("iit", siit.iit_weight), ("strict", siit.strict_weight),
                                     ("selection", siit.selection_weight),
                                     ("selection_attention", siit.selection_attention_weight),
                                     ("retrieval_attention", siit.retrieval_attention_weight),
                                     ("interchanged_selection", siit.interchanged_selection_weight),
                                     ("strict_selection", siit.strict_selection_weight),
                                     ("retrieval_readout", siit.retrieval_readout_weight),
                                     ("gather_readout", siit.gather_readout_weight),
                                     ("gather_interchange", siit.gather_interchange_weight),
                                     ("gather_selection", siit.gather_selection_weight),
                                     ("selecting_interchange", siit.selecting_interchange_weight),
                                     ("ablation_strict", siit.ablation_strict_weight),
                                     ("ablation_necessity", siit.ablation_necessity_weight)):
                    if extra[name] is not None:
                        total = weight * extra[name] if total is None else total + weight * extra[name]
                        parts[name] = float(extra[name].detach())
                return total

            def step_on(loss: torch.Tensor | None) -> float:
                """Backward, (two processes: add the ranks' gradients and logged losses), clip, step."""
                if loss is not None:
                    loss.backward()
                total = float(loss.detach()) if loss is not None else 0.0
                if split is not None:
                    numbers = {k: v for k, v in parts.items() if k in LOGGED_LOSSES}
                    summed, total = sync_step(split, synced, numbers, LOGGED_LOSSES, total)
                    parts.update(summed)
                if config.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return total

            # each image of a step's runs goes through the vision tower once per optimiser step
            if split is not None:
                with images_shared():
                    loss = behaviour_loss()
                    if siit is not None:
                        loss = siit_loss(split.siit_parts(), loss)
                value = step_on(loss)
            elif siit is None or siit.single_loss:
                with images_shared():
                    loss = behaviour_loss()
                    if siit is not None:  # added term by term onto the behaviour loss, as always
                        loss = siit_loss(SIIT_PARTS, loss)
                value = step_on(loss)
            else:  # InterpBench's order, one optimiser step per loss; the readout probes step once, below
                value = 0.0
                for which in (("iit",), ("strict",)):
                    with images_shared():
                        part = siit_loss(which)
                    if part is not None:
                        value += step_on(part)
                with images_shared():
                    loss = behaviour_loss()
                value += step_on(loss)
            if siit is None:
                parts = {}
            else:  # the log's keys in the order they always had
                parts = {k: parts[k] for k in LOG_KEYS if k in parts}
            for _module, opt, _name in readouts:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                opt.zero_grad(set_to_none=True)
            if not math.isfinite(value):
                raise TrainingError(f"the loss became {value} at step {step + 1}; lower lr ({config.lr}) or "
                                    f"keep grad_clip on")
            losses.append(value)
            if parts:
                siit_log.append(parts)
            done = step + 1
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            postfix = {"loss": f"{ema:.3f}", "lr": f"{lr:.1e}"}
            if writer and config.eval_every and (done % config.eval_every == 0 or done == config.steps):
                with images_shared():
                    result = _evaluate(model, eval_batches, config.loss_norm)
                    entry: dict[str, Any] = {"step": done, "tasks": result}
                    if siit_eval:
                        entry["siit"] = _evaluate_siit(model, interchange, builder, siit, siit_eval,
                                                       config.batch_size)
                        entry.update(_evaluate_readouts(model, interchange, builder, siit, siit_eval,
                                                        mixture.canvas, selection, config.batch_size, retrieval,
                                                        gather))
                        if position_layer is not None:
                            entry["position_code_accuracy"] = _evaluate_position(
                                model, eval_batches, position_layer, builder.image_token_id, cells, probe)
                evals.append(entry)
                postfix["acc"] = " ".join(f"{k}={v['accuracy']:.2f}" for k, v in result.items())
                if siit_eval:
                    postfix["iia"] = " ".join(f"{v}={r['interchange_accuracy']:.2f}"
                                              for v, r in entry["siit"].items())
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if writer and (done % config.checkpoint_every == 0 or done == stop):
                checkpoint = _save_checkpoint(out, done, model, processor, optimizer, config,
                                              snapshot(done, time.perf_counter() - t0), config.keep_checkpoints,
                                              save_probe)
    except KeyboardInterrupt:
        if writer and done > start and (checkpoint is None or not checkpoint.name.endswith(f"{done:06d}")):
            _save_checkpoint(out, done, model, processor, optimizer, config,
                             snapshot(done, time.perf_counter() - t0), config.keep_checkpoints, save_probe)
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    if not writer:
        return None
    if checkpoint is None:  # nothing to do (already at the end) and nothing written before
        raise TrainingError(f"no steps left to run in {str(out)!r} (step {start} of {config.steps})")
    return TrainResult(out_dir=out, checkpoint=checkpoint, step=done, losses=losses, evals=evals,
                       wall_time_s=previous_time + elapsed, steps_per_s=(done - start) / elapsed if done > start
                       else 0.0)


def _evaluate_readouts(model: Any, interchange: HeadInterchange, builder: BatchBuilder, siit: SIITSpec,
                       pairs: dict[str, list[Any]], canvas: Any, selection: SelectionProbe | None,
                       batch_size: int, retrieval: SelectionProbe | None = None,
                       gather: GatherProbe | None = None) -> dict[str, Any]:
    """What the ID heads read in the evaluation pairs' source runs: ``selection`` (the readout's accuracy and the
    selecting heads' attention on the missing object), ``aggregation`` (the aggregation heads' attention on the
    described names, its readout's exact-set accuracy of their cells, and with ``gather_interchange_weight`` the
    interchange accuracy of the aggregation heads alone) and ``retrieval`` (the id_retrieval heads'
    attention on their object, and its readout's accuracy of the object's cell), each where trained."""
    out: dict[str, Any] = {}
    common = {"batch_size": batch_size, "last_positions": siit.last_positions, "span_positions": siit.span_positions}
    attend = siit.selection_attention_weight > 0
    if selection is not None or attend:
        out["selection"] = selection_readout(model, interchange, builder, pairs["id_selection"],
                                             siit.selecting_heads(), canvas, probe=selection, patterns=attend,
                                             **common)
    if (attend or gather is not None) and siit.aggregation_heads:
        out["aggregation"] = selection_readout(model, interchange, builder, pairs["id_selection"],
                                               parse_heads(list(siit.aggregation_heads)), canvas, probe=gather,
                                               patterns=attend, target="described", **common)
    if siit.gather_interchange_weight > 0:  # the aggregation heads alone: does the selection follow them?
        out.setdefault("aggregation", {})["interchange_accuracy"] = interchange_accuracy(
            model, interchange, builder, pairs["id_selection"], parse_heads(list(siit.aggregation_heads)), **common)
    if siit.retrieval_attention_weight > 0 or retrieval is not None:
        out["retrieval"] = selection_readout(model, interchange, builder, pairs["id_retrieval"],
                                             siit.heads("id_retrieval"), canvas, probe=retrieval,
                                             patterns=siit.retrieval_attention_weight > 0, target="patched",
                                             **common)
    return out


def _transformers_version() -> str:
    return transformers.__version__


# --------------------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vlmbind.organisms --config run.json --out DIR [--resume] [--until N] [--threads N] [--quiet]``."""
    parser = argparse.ArgumentParser(prog="python -m vlmbind.organisms", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a JSON TrainConfig (fields as in TrainConfig.to_dict)")
    parser.add_argument("--out", required=True, help="the run directory (checkpoints are written here)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--until", type=int, default=None, help="stop after this step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a busy machine)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--processes", type=int, default=1,
                        help="2: train in two processes of --threads threads each (faster on an idle 2-core machine)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a process that train() started
    parser.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--launcher", type=int, default=None, help=argparse.SUPPRESS)  # the starting process's pid
    args = parser.parse_args(argv)
    if args.rank is not None:
        return _worker(args)
    try:
        config = TrainConfig.from_json(args.config)
        with sigterm_as_interrupt():  # a scheduler's SIGTERM leaves a checkpoint to resume from, as a Ctrl-C does
            result = train(config, args.out, resume=args.resume, progress=not args.quiet, until=args.until,
                           threads=args.threads, processes=args.processes)
    except VlmbindError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in result.to_dict().items() if k not in ("losses", "evals")}
    summary["final_loss"] = result.losses[-1] if result.losses else None
    summary["last_eval"] = result.evals[-1] if result.evals else None
    print(json.dumps(summary, indent=1))
    return 0


def _worker(args: argparse.Namespace) -> int:
    """One of the two processes of ``train(processes=2)``: its error message goes to a file the launcher reads."""
    if args.rendezvous is None or args.processes != 2:
        print("error: --rank is for the processes train(processes=2) starts; run with --processes 2 instead",
              file=sys.stderr)
        return 2
    if args.rank == 0 and args.launcher is not None:
        stop_when_orphaned(args.launcher)  # rank 1 stops at its next exchange with a stopped rank 0
    try:
        config = TrainConfig.from_json(args.config)
        split = join(args.rank, args.rendezvous)
        _train_here(config, args.out, resume=args.resume, progress=not args.quiet, until=args.until,
                    threads=args.threads, share_image_features=True, split=split)
    except VlmbindError as exc:
        error_file(args.rendezvous, args.rank).write_text(str(exc))
        return 2
    finally:
        leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
