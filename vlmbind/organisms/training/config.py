"""A training run's configuration (:class:`TrainConfig`, validated on construction) and its learning-rate schedule."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ...core.errors import TrainingError, close_matches
from ...stimuli.core import StimulusError
from ..data import REGIMES, TASKS, TaskMixture, TaskSpec, canvas_for
from ..model import OrganismSize, grid_side
from ..siit.pairs import draw_pairs
from ..siit.pointing import POINT_EVAL_STREAM, PointSIITSpec, draw_point_pairs
from ..siit.spec import SIIT_EVAL_STREAM, SIITSpec

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
        siit: a mechanism to plant by strict interchange-intervention training
            (:class:`~vlmbind.organisms.siit.spec.SIITSpec` or a mapping of its fields); None: behaviour only.
        point_siit: Point-to-Answer search heads to plant (:class:`~vlmbind.organisms.siit.pointing.PointSIITSpec`
            or a mapping of its fields; the ``p2a`` regime with a search or count task); None: none.
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
    point_siit: PointSIITSpec | None = None

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
        object.__setattr__(self, "point_siit", PointSIITSpec.from_value(self.point_siit))
        if self.point_siit is not None:
            if self.siit is not None:
                raise TrainingError("a run plants either scene heads (siit) or search heads (point_siit), not both")
            self.point_siit.check(self.model.layers, self.model.heads)
            if self.point_siit.attention_weight > 0 and self.attn_implementation != "eager":
                raise TrainingError("point_siit.attention_weight trains the search heads' attention patterns: set "
                                    "attn_implementation='eager'")
            draw_point_pairs(self.point_siit, self.mixture(), seed=0, stream=POINT_EVAL_STREAM, step=0, n=2)

    @property
    def position_spec(self) -> SIITSpec | PointSIITSpec | None:
        """The spec that asks for the image tokens' position code (``position_layer``), if one does."""
        for spec in (self.siit, self.point_siit):
            if spec is not None and spec.position_layer is not None:
                return spec
        return None

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
        if self.point_siit is None:
            del d["point_siit"]
        else:
            d["point_siit"] = self.point_siit.to_dict()
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
