"""SIIT's measures on fixed pairs: interchange accuracy, how often an interchange changes the answer (strictness),
the unpatched rate of the counterfactual answer, and what the ID heads' readouts and attention read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...core.errors import TrainingError
from ...stimuli.core import Canvas
from ...stimuli.scenes import CounterfactualPair
from ..data import IGNORE_INDEX, BatchBuilder, answer_correct
from ..model import evaluating
from .interchange import HeadInterchange, interchange_logits, patched_logits
from .losses import attention_on_targets
from .pairs import (
    described_cells,
    described_name_tokens,
    interchange_batch,
    last_prompt_index,
    patched_cells,
    target_cells,
    target_tokens,
)
from .readouts import GatherProbe, SelectionProbe

CHANGE_POSITIONS = ("all", "aligned", "image", "text", "last")
READOUT_TARGETS = ("missing", "patched", "described")


def interchange_accuracy(model: Any, interchange: HeadInterchange, builder: BatchBuilder,
                         pairs: Sequence[CounterfactualPair], heads: Sequence[tuple[int, int]], *,
                         target: str = "counterfactual", positions: str = "aligned", batch_size: int = 32,
                         last_positions: str = "prompt", span_positions: str = "name") -> float:
    """Share of pairs whose base run, with ``heads`` interchanged from the source, gives ``target``'s answer on every
    answer token (``counterfactual``: interchange accuracy; ``clean``: the answer did not move, strictness).

    ``positions``: ``aligned`` (the pairs' patch positions) or ``all`` (every prompt position).
    """
    correct = []
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            batch = interchange_batch(builder, pairs[i : i + batch_size], target, last_positions, span_positions)
            where = batch.positions if positions == "aligned" else batch.prompt_mask
            logits = interchange_logits(model, interchange, batch, heads, where)
            correct += answer_correct(logits, batch.base.labels).tolist()
    return float(np.mean(correct)) if correct else float("nan")


def answer_changes(model: Any, interchange: HeadInterchange, builder: BatchBuilder, pairs: Sequence[CounterfactualPair],
                   heads: Sequence[tuple[int, int]], *, positions: str = "all", batch_size: int = 32) -> float:
    """Share of pairs whose answer changes when ``heads`` are interchanged from the source: any answer token's argmax
    differs from the unpatched run's (both teacher-forced with the clean answer). Strictness asks this to be ~0 for
    every head outside the alignment, whatever the model answers unpatched.

    ``positions``: ``all`` (every prompt position), ``aligned`` (the pairs' patch positions), or, to say where a
    head's effect enters, ``image`` (the image tokens), ``text`` (the prompt's other tokens) or ``last`` (the last
    prompt token).
    """
    return answer_changes_per_set(model, interchange, builder, pairs, [heads], positions=positions,
                                  batch_size=batch_size)[0]


def answer_changes_per_set(model: Any, interchange: HeadInterchange, builder: BatchBuilder,
                           pairs: Sequence[CounterfactualPair], head_sets: Sequence[Sequence[tuple[int, int]]], *,
                           positions: str = "all", batch_size: int = 32) -> list[float]:
    """:func:`answer_changes` of each head set, with one unpatched and one source run per batch for all of them (the
    same numbers as one call per set)."""
    if positions not in CHANGE_POSITIONS:
        raise TrainingError(f"positions must be one of {CHANGE_POSITIONS}, got {positions!r}")
    changed: list[list[bool]] = [[] for _ in head_sets]
    layers = sorted({l for heads in head_sets for l, _ in heads})
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            batch = interchange_batch(builder, pairs[i : i + batch_size], "clean")
            ids, where = batch.base.inputs["input_ids"], batch.prompt_mask
            if positions == "aligned":
                where = batch.positions
            elif positions in ("image", "text"):
                where = where & ((ids == builder.image_token_id) == (positions == "image"))
            elif positions == "last":
                last = last_prompt_index(where)
                where = torch.zeros_like(where)
                where[torch.arange(len(last)), last] = True
            plain = model(**batch.base.inputs, use_cache=False).logits[:, :-1].argmax(-1)
            with interchange.capture(layers):
                model(**batch.source.inputs, use_cache=False)
            values = interchange.stored
            answer = batch.base.labels[:, 1:] != IGNORE_INDEX
            for heads, out in zip(head_sets, changed):
                patched = patched_logits(model, interchange, batch, heads, where, values)
                out += ((plain != patched[:, :-1].argmax(-1)) & answer).any(1).tolist()
    return [float(np.mean(c)) if c else float("nan") for c in changed]


def unpatched_accuracy(model: Any, builder: BatchBuilder, pairs: Sequence[CounterfactualPair], *,
                       target: str = "counterfactual", batch_size: int = 32) -> float:
    """Share of pairs whose base run, unpatched, already gives ``target``'s answer: what an interchange accuracy must
    be read against (when the counterfactual answer can be guessed from the base alone, e.g. the one colour a scene
    does not use, a model can reach it without the source)."""
    correct = []
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            batch = interchange_batch(builder, pairs[i : i + batch_size], target)
            correct += answer_correct(model(**batch.base.inputs, use_cache=False).logits, batch.base.labels).tolist()
    return float(np.mean(correct)) if correct else float("nan")


def selection_readout(model: Any, interchange: HeadInterchange, builder: BatchBuilder,
                      pairs: Sequence[CounterfactualPair], heads: Sequence[tuple[int, int]], canvas: Canvas, *,
                      probe: SelectionProbe | None = None, patterns: bool = False, batch_size: int = 32,
                      last_positions: str = "answer", target: str = "missing",
                      span_positions: str = "name") -> dict[str, float]:
    """On the source runs' patch positions: the share where ``probe`` reads the target cell from its heads
    (``accuracy``), and with ``patterns`` the heads' mean attention on the target (``attention_mass``).

    ``target``: ``missing`` (the missing object's cell and image token: ``id_selection`` pairs), ``patched`` (the
    patched described object's: ``id_retrieval`` pairs) or ``described`` (attention summed over the described
    objects' names: aggregation heads, with a :class:`GatherProbe` reading their cells)."""
    if target not in READOUT_TARGETS:
        raise TrainingError(f"target must be one of {READOUT_TARGETS}, got {target!r}")
    if (target == "described") != isinstance(probe, GatherProbe) and probe is not None:
        raise TrainingError("a GatherProbe reads the described objects' cells (target 'described'), and only it")
    hits, mass, total, attended = 0.0, 0.0, 0, 0
    layers = sorted({l for l, _ in heads} | ({l for l, _ in probe.heads} if probe is not None else set()))
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            batch = interchange_batch(builder, chunk, "counterfactual", last_positions, span_positions)
            with interchange.capture(layers, patterns=patterns):
                model(**batch.source.inputs, use_cache=False)
            n = sum(len(p) for p in batch.positions)
            cells = None if target == "described" else (
                target_cells(chunk, canvas) if target == "missing" else patched_cells(chunk, canvas))
            if probe is not None:
                read = described_cells(chunk, canvas) if cells is None else cells
                hits += probe.accuracy(interchange.stored, batch.positions, read) * n
            if patterns:
                goal = described_name_tokens(builder, chunk, span_positions) if cells is None else \
                    target_tokens(batch.source.inputs["input_ids"], builder.image_token_id, cells)
                mass += float(attention_on_targets(interchange.patterns, heads, batch.positions, goal).sum())
                attended += n * len(heads)
            total += n
    out = {}
    if probe is not None:
        out["accuracy"] = hits / total if total else float("nan")
    if patterns:
        out["attention_mass"] = mass / attended if attended else float("nan")
    return out
