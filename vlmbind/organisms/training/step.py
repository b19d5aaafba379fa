"""One training step: the behaviour loss (with the position code), the SIIT losses added by their weights, and the
optimiser step (two processes: each rank's part of it, summed), then the readouts' own step.

A :class:`Run` holds what the steps of one run work with; :func:`train_step` is one step of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...core.sites import parse_heads
from ..data import BatchBuilder, TaskMixture, answer_loss
from ..model import shared_image_features
from ..processes import RankSplit, behaviour_shares, sync_step
from ..siit.interchange import HeadInterchange
from ..siit.losses import siit_losses
from ..siit.pointing import POINT_LOSSES, PointProbe, PointSIITSpec, point_losses
from ..siit.readouts import GatherProbe, PositionProbe, SelectionProbe, position_code_loss
from ..siit.spec import SIIT_LOSSES, SIIT_PARTS, SIITSpec
from .checkpoints import (
    GATHER_PROBE_FILE,
    POINT_PROBE_FILE,
    PROBE_FILE,
    RETRIEVAL_PROBE_FILE,
    SELECTION_PROBE_FILE,
    load_probe,
    save_probe,
)
from .config import TrainConfig

# a SIIT run's per-step log, in this order; the strings are the step's draws, the rest are losses
LOG_KEYS = ("behaviour", "variable", "strict_head", "iit", "strict", "selection", "selection_attention",
            "retrieval_attention", "interchanged_selection", "strict_selection", "retrieval_readout", "gather_readout",
            "gather_interchange", "gather_selection", "selecting_interchange", "ablated", "ablation_strict",
            "necessity_ablated", "ablation_necessity", *POINT_LOSSES, "position")
LOGGED_LOSSES = tuple(k for k in LOG_KEYS if k not in ("variable", "strict_head", "ablated", "necessity_ablated"))


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on the matrices (not on biases and norms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.999), eps=1e-8,
    )


@dataclass
class Readouts:
    """The linear readouts a run trains beside the organism (never part of it), as its SIIT spec asks: the
    position code's, the ID-selection, ID-retrieval and gathered-positions readouts. Each has its own AdamW and its
    file beside every checkpoint."""

    position: PositionProbe | None = None
    selection: SelectionProbe | None = None
    retrieval: SelectionProbe | None = None
    gather: GatherProbe | None = None
    point: PointProbe | None = None
    trained: list[tuple[torch.nn.Module, torch.optim.Optimizer, str]] = field(default_factory=list)

    @classmethod
    def for_run(cls, config: TrainConfig, interchange: HeadInterchange | None, cells: int) -> Readouts:
        out = cls()
        position = config.position_spec
        if position is not None and getattr(position, "position_readout", "trained") == "trained":
            out.position = out._train(PositionProbe(config.model.hidden, cells, config.seed), config, PROBE_FILE)
        point = config.point_siit
        if point is not None and point.readout_weight > 0:
            out.point = out._train(PointProbe(point.planted(), interchange.d_head, cells, config.seed + 3), config,
                                   POINT_PROBE_FILE)
        siit = config.siit
        if siit is None:
            return out
        if siit.selection_weight > 0:
            out.selection = out._train(SelectionProbe(siit.heads("id_selection"), interchange.d_head, cells,
                                                      config.seed), config, SELECTION_PROBE_FILE)
        if siit.retrieval_readout_weight > 0:
            out.retrieval = out._train(SelectionProbe(siit.heads("id_retrieval"), interchange.d_head, cells,
                                                      config.seed + 1), config, RETRIEVAL_PROBE_FILE)
        if siit.gather_readout_weight > 0:
            out.gather = out._train(GatherProbe(parse_heads(list(siit.aggregation_heads)), interchange.d_head, cells,
                                                config.seed + 2), config, GATHER_PROBE_FILE)
        return out

    def _train(self, probe: Any, config: TrainConfig, file: str) -> Any:
        self.trained.append((probe, torch.optim.AdamW(probe.parameters(), lr=config.lr, weight_decay=0.0), file))
        return probe

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for module, _opt, _file in self.trained for p in module.parameters()]

    def to(self, device: torch.device) -> None:
        """Move every readout to ``device`` (in place: their optimisers keep their parameters)."""
        for module, _opt, _file in self.trained:
            module.to(device)

    def load(self, checkpoint: Path) -> None:
        for module, opt, file in self.trained:
            load_probe(checkpoint, module, opt, file)

    def save(self, directory: Path) -> None:
        for module, opt, file in self.trained:
            save_probe(directory, module, opt, file)

    def step(self, lr: float) -> None:
        """One AdamW step of every readout at the run's learning rate (their gradients come from the step's losses)."""
        for _module, opt, _file in self.trained:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)


@dataclass
class Run:
    """What the steps of one training run work with.

    Attributes:
        split: this process's part of each step when two processes train (None: the whole step).
        device: where the model, the readouts and every batch live.
        share_image_features: each distinct image of an optimiser step's forwards goes through the vision tower once.
        cells: image tokens per image (the grid's cells).
    """

    config: TrainConfig
    model: Any
    processor: Any
    optimizer: torch.optim.Optimizer
    mixture: TaskMixture
    builder: BatchBuilder
    interchange: HeadInterchange | None
    readouts: Readouts
    cells: int
    split: RankSplit | None = None
    share_image_features: bool = True
    device: torch.device = torch.device("cpu")

    @property
    def siit(self) -> SIITSpec | None:
        return self.config.siit

    @property
    def point_siit(self) -> PointSIITSpec | None:
        return self.config.point_siit

    @property
    def planting(self) -> SIITSpec | PointSIITSpec | None:
        """The run's SIIT spec, scene or pointing (None: behaviour only)."""
        return self.config.siit or self.config.point_siit

    @property
    def synced(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients the two processes add: the model's, then each readout's."""
        return [p for p in self.model.parameters() if p.requires_grad] + self.readouts.parameters()

    def images_shared(self) -> contextlib.AbstractContextManager:
        return shared_image_features(self.model) if self.share_image_features else contextlib.nullcontext()


def train_step(run: Run, step: int, lr: float) -> tuple[float, dict[str, Any]]:
    """Update ``step`` (0-based) at learning rate ``lr``: the step's loss (summed over its optimiser steps) and, for
    a SIIT run, its log entry (its draws and loss parts, in :data:`LOG_KEYS` order; else empty)."""
    siit, split = run.siit, run.split
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    parts: dict[str, Any] = {}
    # each image of a step's runs goes through the vision tower once per optimiser step
    if split is not None:
        with run.images_shared():
            loss = behaviour_loss(run, step, parts)
            if siit is not None:
                loss = siit_loss(run, step, split.siit_parts(), parts, loss)
            if run.point_siit is not None:
                loss = point_loss(run, step, split.siit_parts(), parts, loss)
        value = optimiser_step(run, loss, parts)
    elif siit is None or siit.single_loss:
        with run.images_shared():
            loss = behaviour_loss(run, step, parts)
            if siit is not None:  # added term by term onto the behaviour loss, as always
                loss = siit_loss(run, step, SIIT_PARTS, parts, loss)
            if run.point_siit is not None:
                loss = point_loss(run, step, SIIT_PARTS, parts, loss)
        value = optimiser_step(run, loss, parts)
    else:  # InterpBench's order, one optimiser step per loss; the readout probes step once, below
        value = 0.0
        for which in (("iit",), ("strict",)):
            with run.images_shared():
                part = siit_loss(run, step, which, parts)
            if part is not None:
                value += optimiser_step(run, part, parts)
        with run.images_shared():
            loss = behaviour_loss(run, step, parts)
        value += optimiser_step(run, loss, parts)
    logged = {} if run.planting is None else {k: parts[k] for k in LOG_KEYS if k in parts}  # the order they always had
    run.readouts.step(lr)
    return value, logged


def behaviour_loss(run: Run, step: int, parts: dict[str, Any]) -> torch.Tensor | None:
    """The task mixture's answer loss on the step's batch (this rank's rows, weighted by their share of the whole
    batch's loss), plus the weighted position code when the spec asks for one; None for a rank with no rows."""
    config, split, builder = run.config, run.split, run.builder
    position = config.position_spec
    position_layer = position.position_layer if position is not None else None
    examples = run.mixture.batch(step, config.batch_size)
    share = position_share = 1.0
    if split is not None:
        examples = [examples[i] for i in split.behaviour_rows(len(examples), run.planting)]
        batch = builder(examples) if examples else None
        share, position_share = behaviour_shares(split, batch, builder.image_token_id, config.loss_norm)
        if batch is None:
            return None
    else:
        batch = builder(examples)
    output = run.model(**batch.inputs, use_cache=False, output_hidden_states=position_layer is not None)
    loss = share * answer_loss(output.logits, batch.labels, config.loss_norm)
    parts["behaviour"] = float(loss.detach())
    if position_layer is not None:
        hidden = output.hidden_states[position_layer + 1]
        probe = run.readouts.position
        code = probe.loss(hidden, batch.inputs["input_ids"], builder.image_token_id) if probe is not None \
            else position_code_loss(hidden, batch.inputs["input_ids"], builder.image_token_id, run.cells)
        code = position_share * code
        parts["position"] = float(code.detach())
        loss = loss + position.position_weight * code
    return loss


def siit_loss(run: Run, step: int, which: Sequence[str], parts: dict[str, Any],
              total: torch.Tensor | None = None) -> torch.Tensor | None:
    """The SIIT losses of ``which`` parts added to ``total`` by their weights, in :data:`SIIT_LOSSES` order."""
    siit, readouts = run.siit, run.readouts
    extra = siit_losses(run.model, run.interchange, run.builder, siit, seed=run.config.seed, step=step,
                        canvas=run.mixture.canvas, loss_norm=run.config.loss_norm, selection=readouts.selection,
                        parts=which, retrieval=readouts.retrieval, gather=readouts.gather)
    parts.update(variable=extra["variable"], strict_head=extra["strict_head"])
    for name in ("ablated", "necessity_ablated"):
        if extra[name] is not None:
            parts[name] = extra[name]
    for name in SIIT_LOSSES:
        if extra[name] is not None:
            weighted = siit.weight(name) * extra[name]
            total = weighted if total is None else total + weighted
            parts[name] = float(extra[name].detach())
    return total


def point_loss(run: Run, step: int, which: Sequence[str], parts: dict[str, Any],
               total: torch.Tensor | None = None) -> torch.Tensor | None:
    """The pointing losses of ``which`` parts added to ``total`` by their weights."""
    spec = run.point_siit
    extra = point_losses(run.model, run.interchange, run.builder, spec, run.mixture, seed=run.config.seed, step=step,
                         loss_norm=run.config.loss_norm, parts=which, probe=run.readouts.point)
    weights = {"point_iit": spec.iit_weight, "point_strict": spec.strict_weight,
               "point_attention": spec.attention_weight, "point_readout": spec.readout_weight}
    if extra["strict_head"] is not None:
        parts["strict_head"] = extra["strict_head"]
    for name in POINT_LOSSES:
        if extra[name] is not None:
            weighted = weights[name] * extra[name]
            total = weighted if total is None else total + weighted
            parts[name] = float(extra[name].detach())
    return total


def optimiser_step(run: Run, loss: torch.Tensor | None, parts: dict[str, Any]) -> float:
    """Backward, (two processes: add the ranks' gradients and logged losses), clip, step; returns the loss."""
    if loss is not None:
        loss.backward()
    total = float(loss.detach()) if loss is not None else 0.0
    if run.split is not None:
        numbers = {k: v for k, v in parts.items() if k in LOGGED_LOSSES}
        summed, total = sync_step(run.split, run.synced, numbers, LOGGED_LOSSES, total)
        parts.update(summed)
    if run.config.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.config.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total
