"""What a run evaluates every ``eval_every`` steps: the tasks on a fixed evaluation set, and for a SIIT run the
interchange accuracy and strictness on fixed pairs, what the ID heads' readouts and attention read, and the position
code's accuracy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...core.sites import parse_heads
from ..data import BatchBuilder, TrainBatch, answer_correct, answer_loss
from ..model import evaluating
from ..siit.evaluation import (
    answer_changes_per_set,
    interchange_accuracy,
    selection_readout,
    unpatched_accuracy,
)
from ..siit.interchange import HeadInterchange
from ..siit.pairs import evaluation_pairs
from ..siit.pointing import evaluation_point_pairs, point_interchange, pointed_attention_mean
from ..siit.readouts import GatherProbe, PositionProbe, SelectionProbe, position_code_accuracy
from ..siit.spec import SIITSpec
from .step import Run


@dataclass
class EvaluationSets:
    """A run's fixed evaluation data: batches per ``task/variant``, and for a SIIT run pairs per variable."""

    batches: dict[str, list[TrainBatch]]
    pairs: dict[str, list[Any]]

    @classmethod
    def of_run(cls, run: Run) -> EvaluationSets:
        config, siit = run.config, run.siit
        if not config.eval_every:
            return cls({}, {})
        batches = {key: [run.builder(examples[i : i + config.batch_size])
                         for i in range(0, len(examples), config.batch_size)]
                   for key, examples in run.mixture.eval_set(config.eval_size).items()}
        pairs = {} if siit is None else {
            v: evaluation_pairs(siit, v, seed=config.seed, canvas=run.mixture.canvas, n=config.eval_size)
            for v in sorted(siit.alignments)}
        if run.point_siit is not None and run.point_siit.plants:
            pairs["search"] = evaluation_point_pairs(run.point_siit, run.mixture, seed=config.seed, n=config.eval_size)
        return cls(batches, pairs)


def evaluate(run: Run, sets: EvaluationSets, step: int) -> dict[str, Any]:
    """The evaluation entry of ``step``: ``{"step": s, "tasks": {"task/variant": {"loss", "accuracy"}}}``, and for
    a SIIT run ``siit`` (per variable), the readouts' entries and ``position_code_accuracy``."""
    config, siit = run.config, run.siit
    with run.images_shared():
        entry: dict[str, Any] = {"step": step, "tasks": evaluate_tasks(run.model, sets.batches, config.loss_norm)}
        if run.point_siit is not None:
            if run.point_siit.plants:
                entry["siit"] = {"search": evaluate_pointing(run, sets.pairs["search"])}
            if run.point_siit.position_layer is not None:
                entry["position_code_accuracy"] = evaluate_position(
                    run.model, sets.batches, run.point_siit.position_layer, run.builder.image_token_id, run.cells,
                    run.readouts.position)
        elif sets.pairs:
            entry["siit"] = evaluate_siit(run.model, run.interchange, run.builder, siit, sets.pairs,
                                          config.batch_size)
            readouts = run.readouts
            entry.update(evaluate_readouts(run.model, run.interchange, run.builder, siit, sets.pairs,
                                           run.mixture.canvas, readouts.selection, config.batch_size,
                                           readouts.retrieval, readouts.gather))
            if siit.position_layer is not None:
                entry["position_code_accuracy"] = evaluate_position(
                    run.model, sets.batches, siit.position_layer, run.builder.image_token_id, run.cells,
                    readouts.position)
    return entry


def evaluate_tasks(model: torch.nn.Module, batches: dict[str, list[TrainBatch]],
                   norm: str) -> dict[str, dict[str, float]]:
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


def evaluate_siit(model: torch.nn.Module, interchange: HeadInterchange, builder: BatchBuilder, spec: SIITSpec,
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


def evaluate_pointing(run: Run, pairs: list[Any]) -> dict[str, float]:
    """On fixed pointing pairs: the search heads' interchange accuracy (the base writes the source's point), the
    share of pairs whose answer one unaligned head changes (mean and worst over every unaligned head), and the
    search heads' attention on the pointed object (and the readout's accuracy, where trained)."""
    spec, a = run.point_siit, run.interchange.adapter
    grid = run.mixture.canvas.shape[1]
    common = {"batch_size": run.config.batch_size}
    planted = point_interchange(run.model, run.interchange, run.builder, pairs, spec.planted(), grid, **common)
    changes = [float(np.mean(point_interchange(run.model, run.interchange, run.builder, pairs, [h], grid,
                                               **common)["changed"]))
               for h in spec.unaligned(a.n_layers, a.n_heads)]
    return {"interchange_accuracy": float(np.mean(planted["moved"])),
            "unaligned_changes": float(np.mean(changes)), "unaligned_changes_max": float(np.max(changes)),
            **pointed_attention_mean(run.model, run.interchange, run.builder, pairs, spec.planted(), grid,
                                     run.readouts.point, **common)}


def evaluate_position(model: torch.nn.Module, batches: dict[str, list[TrainBatch]], layer: int,
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


def evaluate_readouts(model: Any, interchange: HeadInterchange, builder: BatchBuilder, siit: SIITSpec,
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
