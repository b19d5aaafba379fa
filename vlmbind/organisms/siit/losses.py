"""A step's SIIT losses: the IIT loss with the readout and attention losses computed in its runs, the strictness
loss with its selection loss, and the ablation losses (strictness and necessity).

The runs are made, and the losses built, in one fixed order: a step's draws and its gradients' sums depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...core.errors import TrainingError
from ...core.sites import parse_heads
from ...stimuli.core import Canvas
from ...stimuli.scenes import CounterfactualPair
from ..data import BatchBuilder, answer_loss, answer_unlikelihood
from .interchange import HeadInterchange, ablated_logits, interchange_logits, patched_logits
from .pairs import (
    InterchangeBatch,
    described_cells,
    described_name_tokens,
    draw_pairs,
    interchange_batch,
    last_prompt_positions,
    own_cells,
    patched_cells,
    step_rng,
    target_cells,
    target_tokens,
)
from .readouts import GatherProbe, SelectionProbe
from .spec import SIIT_LOSSES, SIIT_PARTS, SIIT_STREAM, SIITSpec


def attention_on_targets(patterns: Mapping[int, torch.Tensor], heads: Sequence[tuple[int, int]],
                         positions: Sequence[Sequence[int]],
                         targets: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
    """The heads' attention on each row's target token (``targets``: one position per row) or summed over the row's
    target positions (a list per row), at each of the row's positions (heads, then rows)."""
    if isinstance(targets, torch.Tensor):
        return torch.cat([patterns[layer][r, head, list(pos), int(targets[r])]
                          for layer, head in heads for r, pos in enumerate(positions)])
    return torch.cat([patterns[layer][r, head][list(pos)][:, list(targets[r])].sum(-1)
                      for layer, head in heads for r, pos in enumerate(positions)])


def selection_attention_loss(patterns: Mapping[int, torch.Tensor], heads: Sequence[tuple[int, int]],
                             positions: Sequence[Sequence[int]],
                             targets: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
    """Mean over heads, rows and the rows' positions of ``-log`` the attention on the row's target(s)."""
    return -torch.log(attention_on_targets(patterns, heads, positions, targets).clamp_min(1e-9)).mean()


def _selection_attention(spec: SIITSpec, patterns: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
                         missing: torch.Tensor, described: Sequence[Sequence[int]]) -> torch.Tensor:
    """The ID-selection attention loss: the selecting heads on the missing object's image token, the aggregation
    heads on the described objects' names (one mean over every head, row and position)."""
    gather = parse_heads(list(spec.aggregation_heads))
    parts = [attention_on_targets(patterns, spec.selecting_heads(), positions, missing)]
    if gather:
        parts.append(attention_on_targets(patterns, gather, positions, described))
    return -torch.log(torch.cat(parts).clamp_min(1e-9)).mean()


def siit_losses(model: Any, interchange: HeadInterchange, builder: BatchBuilder, spec: SIITSpec, *, seed: int,
                step: int, canvas: Canvas, loss_norm: str = "example",
                selection: SelectionProbe | None = None, parts: Sequence[str] = SIIT_PARTS,
                retrieval: SelectionProbe | None = None, gather: GatherProbe | None = None) -> dict[str, Any]:
    """The step's IIT and strictness losses (tensors in the graph) and what they were computed on.

    ``parts`` picks which to compute (``iit`` with its readout and attention losses, ``strict``); a step's variable,
    pairs and strictness heads depend only on ``seed`` and ``step``, so computing them in two calls (one optimiser
    step each, ``single_loss=False``) sees the same draws as one call.

    Returns:
        ``{"variable": v, "strict_head": "l.h[,l.h...]", "ablated": "mode:l.h[,l.h...]",
        "necessity_ablated": "mode:l.h[,l.h...]"}`` and a loss under each name of
        :data:`~vlmbind.organisms.siit.spec.SIIT_LOSSES` (``iit``, ``strict``, ``selection``, ...): None when its
        weight is 0 or its part is not asked for; the ID-selection and ID-retrieval ones also on steps of another
        variable, and ``selection`` without a ``selection`` probe; the readouts without their ``retrieval`` /
        ``gather`` probe.
    """
    unknown = sorted(set(parts) - set(SIIT_PARTS))
    if unknown or not parts:
        raise TrainingError(f"siit_losses parts must be a non-empty subset of {SIIT_PARTS}, got {list(parts)!r}")
    rng = step_rng(seed, SIIT_STREAM, step)
    variables = sorted(spec.alignments)
    variable = variables[int(rng.integers(len(variables)))]
    pairs = draw_pairs(spec, variable, seed=seed, stream=SIIT_STREAM, step=step, canvas=canvas)
    out: dict[str, Any] = {"variable": variable, "strict_head": None, "ablated": None, "necessity_ablated": None,
                           **dict.fromkeys(SIIT_LOSSES)}
    if spec.iit_weight > 0 and "iit" in parts:
        out.update(_iit_losses(model, interchange, builder, spec, variable, pairs, canvas, loss_norm,
                               selection, retrieval, gather))
    out.update(_strict_losses(model, interchange, builder, spec, pairs, canvas, loss_norm, rng, "strict" in parts))
    return out


def _iit_losses(model: Any, interchange: HeadInterchange, builder: BatchBuilder, spec: SIITSpec, variable: str,
                pairs: Sequence[CounterfactualPair], canvas: Canvas, loss_norm: str, selection: SelectionProbe | None,
                retrieval: SelectionProbe | None, gather: GatherProbe | None) -> dict[str, torch.Tensor]:
    """The IIT loss, and the losses read in its runs: the interchanged run's selection, the source run's readouts
    and attention, and the second and third interchanges from the same source run."""
    out = {}
    batch = interchange_batch(builder, pairs, "counterfactual", spec.last_positions, spec.span_positions)
    attend = (variable == "id_selection" and spec.selection_attention_weight > 0) or \
        (variable == "id_retrieval" and spec.retrieval_attention_weight > 0)
    judge = variable == "id_retrieval" and spec.interchanged_selection_weight > 0
    selecting_layers = sorted({l for l, _ in spec.selecting_heads()}) if "id_selection" in spec.alignments else []
    logits = interchange_logits(model, interchange, batch, spec.heads(variable), batch.positions,
                                source_grad=spec.source_grad, patterns=attend,
                                base_patterns=selecting_layers if judge else ())
    out["iit"] = answer_loss(logits, batch.base.labels, loss_norm)
    if judge:
        own = target_tokens(batch.base.inputs["input_ids"], builder.image_token_id, own_cells(pairs, canvas))
        out["interchanged_selection"] = _selection_at_last_token(spec, interchange.base_patterns, batch, own)
    # interchange.stored / patterns still hold the source run's, in the graph (source_grad)
    source_ids = batch.source.inputs["input_ids"]
    if variable == "id_selection" and (selection is not None and spec.selection_weight > 0 or attend):
        cells = target_cells(pairs, canvas)
        if selection is not None and spec.selection_weight > 0:
            out["selection"] = selection.loss(interchange.stored, batch.positions, cells)
        if attend:
            out["selection_attention"] = _selection_attention(
                spec, interchange.patterns, batch.positions, target_tokens(source_ids, builder.image_token_id, cells),
                described_name_tokens(builder, pairs, spec.span_positions))
    if variable == "id_retrieval" and retrieval is not None and spec.retrieval_readout_weight > 0:
        out["retrieval_readout"] = retrieval.loss(interchange.stored, batch.positions, patched_cells(pairs, canvas))
    if variable == "id_selection" and gather is not None and spec.gather_readout_weight > 0:
        out["gather_readout"] = gather.loss(interchange.stored, batch.positions, described_cells(pairs, canvas))
    if variable == "id_selection" and spec.gather_interchange_weight > 0:
        # the aggregation heads alone, from the same source run: the selection must follow the gathered cells
        judge_gather = spec.gather_selection_weight > 0
        gathered = patched_logits(model, interchange, batch, parse_heads(list(spec.aggregation_heads)),
                                  batch.positions, interchange.stored,
                                  base_patterns=selecting_layers if judge_gather else ())
        out["gather_interchange"] = answer_loss(gathered, batch.base.labels, loss_norm)
        if judge_gather:
            unclaimed = target_tokens(batch.base.inputs["input_ids"], builder.image_token_id,
                                      target_cells(pairs, canvas))
            out["gather_selection"] = _selection_at_last_token(spec, interchange.base_patterns, batch, unclaimed)
    if variable == "id_selection" and spec.selecting_interchange_weight > 0:
        # the selecting heads alone, from the same source run: the answer must follow them, not only the gatherers
        selected = patched_logits(model, interchange, batch, spec.selecting_heads(), batch.positions,
                                  interchange.stored)
        out["selecting_interchange"] = answer_loss(selected, batch.base.labels, loss_norm)
    if variable == "id_retrieval" and attend:
        tokens = target_tokens(source_ids, builder.image_token_id, patched_cells(pairs, canvas))
        out["retrieval_attention"] = selection_attention_loss(interchange.patterns, spec.heads(variable),
                                                              batch.positions, tokens)
    return out


def _selection_at_last_token(spec: SIITSpec, patterns: Mapping[int, torch.Tensor], batch: InterchangeBatch,
                             targets: torch.Tensor) -> torch.Tensor:
    """The selecting heads' attention loss at the last prompt token of a base run, on one target token per row."""
    return selection_attention_loss(patterns, spec.selecting_heads(), last_prompt_positions(batch.prompt_mask),
                                     targets)


def _strict_losses(model: Any, interchange: HeadInterchange, builder: BatchBuilder, spec: SIITSpec,
                   pairs: Sequence[CounterfactualPair], canvas: Canvas, loss_norm: str, rng: np.random.Generator,
                   compute: bool) -> dict[str, Any]:
    """The strictness loss (and the selection loss read in its run) and the ablation losses, on the base scenes
    answered as they are. Their draws are made whether or not they are computed (``compute``: the ``strict``
    part), so a step's random stream is the same in either call of a step split in two."""
    out: dict[str, Any] = {}
    a = interchange.adapter
    clean_batch = None

    def clean() -> InterchangeBatch:
        nonlocal clean_batch
        if clean_batch is None:
            clean_batch = interchange_batch(builder, pairs, "clean", spec.last_positions, spec.span_positions)
        return clean_batch

    if spec.strict_weight > 0:
        heads = spec.draw_strict_heads(rng, a.n_layers, a.n_heads)
        out["strict_head"] = ",".join(f"{l}.{h}" for l, h in heads)
        if compute:
            batch = clean()
            where = batch.prompt_mask if spec.strict_positions == "all" else batch.positions
            hold = spec.strict_selection_weight > 0
            logits = interchange_logits(model, interchange, batch, heads, where, source_grad=spec.source_grad,
                                        base_patterns=sorted({l for l, _ in spec.selecting_heads()}) if hold else ())
            out["strict"] = answer_loss(logits, batch.base.labels, loss_norm)
            if hold:
                missing = target_tokens(batch.base.inputs["input_ids"], builder.image_token_id,
                                        target_cells(pairs, canvas, side="clean"))
                out["strict_selection"] = _selection_at_last_token(spec, interchange.base_patterns, batch, missing)
    if spec.ablation_strict_weight > 0:
        # drawn after the strictness heads, so that runs without this loss keep their draws
        heads, mode = spec.draw_ablated_heads(rng, a.n_layers, a.n_heads)
        out["ablated"] = f"{mode}:" + ",".join(f"{l}.{h}" for l, h in heads)
        if compute:
            logits = ablated_logits(model, interchange, clean().base, heads, mode)
            out["ablation_strict"] = answer_loss(logits, clean().base.labels, loss_norm)
    if spec.ablation_necessity_weight > 0:
        _variable, heads, mode = spec.draw_necessary_heads(rng)  # after every other draw of the step
        out["necessity_ablated"] = f"{mode}:" + ",".join(f"{l}.{h}" for l, h in heads)
        if compute:
            logits = ablated_logits(model, interchange, clean().base, heads, mode)
            out["ablation_necessity"] = answer_unlikelihood(logits, clean().base.labels, loss_norm)
    return out
