"""A step's counterfactual pairs, their rows, and the targets the SIIT losses read from them.

A step's pairs are a pure function of ``(seed, stream, step)``; :func:`interchange_batch` turns pairs into base and
source rows teacher-forced with one answer, with each row's patch positions (the variable's positions in the
high-level model); the cell and token targets say where a variable's value lies in a pair's scenes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...core.errors import TrainingError
from ...stimuli.core import Canvas
from ...stimuli.scenes import CounterfactualPair, scene_pairs
from ..data import IGNORE_INDEX, BatchBuilder
from .spec import SIIT_EVAL_STREAM, SPAN_POSITIONS, VARIABLES, SIITSpec


def step_rng(seed: int, stream: int, step: int) -> np.random.Generator:
    """The random stream of one step (a pure function of seed, stream and step)."""
    return np.random.default_rng([int(seed), stream, int(step)])


def draw_pairs(spec: SIITSpec, variable: str, *, seed: int, stream: int, step: int, canvas: Canvas,
               n: int | None = None) -> list[CounterfactualPair]:
    """The pairs of ``variable``'s condition for one step (a pure function of seed, stream and step)."""
    rng = step_rng(seed, stream, step)
    entropy = spec.entropies[int(rng.integers(len(spec.entropies)))]
    pair_seed = int(rng.integers(2**62))
    counts = spec.object_counts
    objects: int | tuple[int, int] = spec.objects if not spec.skip_objects else counts[int(rng.integers(len(counts)))]
    return list(scene_pairs(n or spec.pairs, variable, pair_seed, n_objects=objects, entropy=entropy,
                            canvas=canvas, colours=spec.colours, shapes=spec.shapes, swap=spec.swap,
                            recolour=spec.recolour))


def evaluation_pairs(spec: SIITSpec, variable: str, *, seed: int, canvas: Canvas, n: int,
                     stream: int = SIIT_EVAL_STREAM) -> list[CounterfactualPair]:
    """``n`` pairs of ``variable``'s condition spread evenly over every object count and entropy the spec trains on
    (a training step draws one setting; an evaluation set drawn like one step covers one setting only)."""
    settings = [(k, e) for k in spec.object_counts for e in spec.entropies]
    out: list[CounterfactualPair] = []
    for i, (objects, entropy) in enumerate(settings):
        share = n // len(settings) + (1 if i < n % len(settings) else 0)
        if share:
            rng = step_rng(seed, stream, 10_000 * (VARIABLES.index(variable) + 1) + i)
            out += list(scene_pairs(share, variable, int(rng.integers(2**62)), n_objects=objects, entropy=entropy,
                                    canvas=canvas, colours=spec.colours, shapes=spec.shapes, swap=spec.swap,
                                    recolour=spec.recolour))
    return out


# ----------------------------------------------------------------------------------------------------------------
# pairs -> rows
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class InterchangeBatch:
    """Base and source rows of counterfactual pairs, teacher-forced with one answer per pair.

    Attributes:
        base, source: :class:`~vlmbind.organisms.data.TrainBatch` es with identical token ids outside the image
            (same prompt, same answer text); only the images differ.
        positions: per row, the patch positions (the variable's positions in the high-level model).
        prompt_mask: ``B P`` True on the prompt's tokens (image included), False on the answer and padding.
    """

    base: Any
    source: Any
    positions: list[list[int]]
    prompt_mask: torch.Tensor = field(repr=False)


def patch_positions(builder: BatchBuilder, pair: CounterfactualPair) -> list[int]:
    """The row positions a pair patches in a :class:`BatchBuilder` row: the last prompt token, or the tokens of the
    pair's text span (``patch["text"]`` at ``patch["occurrence"]``, counted from the end when negative).

    Raises:
        TrainingError: the span's text does not occur in the prompt, or no token covers it.
    """
    prompt = pair.clean.prompt
    if pair.patch["kind"] == "last":
        return [len(builder.prefix) + len(builder._encode(prompt)) - 1]
    return _span_tokens(builder, pair.id, prompt, pair.patch["text"], int(pair.patch.get("occurrence", -1)))


def _span_tokens(builder: BatchBuilder, pair_id: str, prompt: str, text: str, occurrence: int) -> list[int]:
    """Row positions of the tokens covering ``text`` at ``occurrence`` (negative: from the end) in ``prompt``."""
    offset = len(builder.prefix)
    starts = [i for i in range(len(prompt)) if prompt.startswith(text, i)]
    if not starts or not -len(starts) <= occurrence < len(starts):
        raise TrainingError(f"pair {pair_id!r}: {text!r} does not occur in the prompt {prompt!r} (occurrence "
                            f"{occurrence})")
    start = starts[occurrence]
    end = start + len(text)
    enc = builder.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(builder._encode(prompt)):
        raise TrainingError(f"pair {pair_id!r}: the tokenizer's offsets belong to another tokenisation")
    covered = [offset + k for k, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    if not covered:
        raise TrainingError(f"pair {pair_id!r}: no token covers {text!r}")
    return covered


def described_name_tokens(builder: BatchBuilder, pairs: Sequence[CounterfactualPair],
                          span_positions: str = "name") -> list[list[int]]:
    """Per pair, the row positions of every described object's name in the prompt (each named once: the
    conjunctions of a scene are distinct), or with ``span_positions="last"`` of each name's last token: where
    ``id_retrieval`` heads write the described objects' positions."""
    out = []
    for p in pairs:
        names = [p.clean.objects[k].name for k in p.clean.fields["described"]]
        spans = [_span_tokens(builder, p.id, p.clean.prompt, name, -1) for name in names]
        out.append(sorted({q for span in spans for q in (span[-1:] if span_positions == "last" else span)}))
    return out


def interchange_batch(builder: BatchBuilder, pairs: Sequence[CounterfactualPair], answer: str,
                      last_positions: str = "prompt", span_positions: str = "name") -> InterchangeBatch:
    """Rows for ``pairs``: base = the clean scene, source = the counterfactual scene, both teacher-forced with
    ``answer`` (``"counterfactual"``: a*, the IIT target; ``"clean"``: a, the strictness target). A last-token pair
    patches the last prompt token, and with ``last_positions="answer"`` also every answer position that predicts a
    token; a span pair patches its span's tokens, or with ``span_positions="last"`` the span's last token (see
    :class:`SIITSpec`)."""
    if answer not in ("counterfactual", "clean"):
        raise TrainingError(f"answer must be 'counterfactual' or 'clean', got {answer!r}")
    if span_positions not in SPAN_POSITIONS:
        raise TrainingError(f"span_positions must be one of {SPAN_POSITIONS}, got {span_positions!r}")
    texts = [p.answer_counterfactual if answer == "counterfactual" else p.answer for p in pairs]
    base = builder([(p.clean.image, p.clean.prompt, t) for p, t in zip(pairs, texts)])
    source = builder([(p.counterfactual.image, p.counterfactual.prompt, t) for p, t in zip(pairs, texts)])
    if not torch.equal(base.inputs["input_ids"], source.inputs["input_ids"]):
        raise TrainingError("base and source rows differ outside the image; interchange pairs need the same prompt")
    first_answer = (base.labels != IGNORE_INDEX).int().argmax(1)  # the first answer token of each row
    prompt_mask = torch.arange(base.labels.shape[1])[None] < first_answer[:, None]
    positions = [patch_positions(builder, p) for p in pairs]
    if span_positions == "last":
        positions = [pos[-1:] if p.patch["kind"] == "span" else pos for p, pos in zip(pairs, positions)]
    if last_positions == "answer":
        for r, p in enumerate(pairs):
            if p.patch["kind"] == "last":
                predicting = (torch.nonzero(base.labels[r] != IGNORE_INDEX).flatten() - 1).tolist()
                positions[r] = sorted(set(positions[r]) | set(predicting))
    return InterchangeBatch(base, source, positions, prompt_mask)


# ----------------------------------------------------------------------------------------------------------------
# where a variable's value lies: grid cells and token positions
# ----------------------------------------------------------------------------------------------------------------
def target_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas, side: str = "counterfactual") -> torch.Tensor:
    """Per pair, the grid cell (raster index) of the missing object in the source (``counterfactual``) or base
    (``clean``) scene: the value of the ``id_selection`` variable there."""
    cells = []
    for p in pairs:
        example = p.counterfactual if side == "counterfactual" else p.clean
        o = example.objects[example.fields["target"]]
        cells.append(o.row * canvas.shape[1] + o.col)
    return torch.tensor(cells, dtype=torch.long)


def patched_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas) -> torch.Tensor:
    """Per ``id_retrieval`` pair, the grid cell of the patched described object (``patch["object"]``) in the source
    scene: the ``id_retrieval`` variable's value at that object's name tokens there."""
    return _patched_object_cells(pairs, canvas, "counterfactual")


def own_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas) -> torch.Tensor:
    """Per ``id_retrieval`` pair, the grid cell of the patched described object in the base scene: the object the
    high-level model selects once that object's name carries the source's position."""
    return _patched_object_cells(pairs, canvas, "clean")


def _patched_object_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas, side: str) -> torch.Tensor:
    cells = []
    for p in pairs:
        if p.patch.get("kind") != "span" or "object" not in p.patch:
            raise TrainingError(f"pair {p.id!r} patches no described object's span; id_retrieval pairs do")
        o = getattr(p, side).objects[int(p.patch["object"])]
        cells.append(o.row * canvas.shape[1] + o.col)
    return torch.tensor(cells, dtype=torch.long)


def described_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas, side: str = "counterfactual") -> torch.Tensor:
    """``pairs x cells``: 1 at the grid cells of the described objects in the source (``counterfactual``) or base
    (``clean``) scene, the positions the ``id_retrieval`` heads write at their names."""
    out = torch.zeros(len(pairs), canvas.shape[0] * canvas.shape[1])
    for r, p in enumerate(pairs):
        example = p.counterfactual if side == "counterfactual" else p.clean
        for k in example.fields["described"]:
            o = example.objects[k]
            out[r, o.row * canvas.shape[1] + o.col] = 1.0
    return out


def target_tokens(input_ids: torch.Tensor, image_token_id: int, cells: torch.Tensor) -> torch.Tensor:
    """Per row, the sequence position of the image token of grid cell ``cells[row]`` (one image per row, its tokens
    in raster order)."""
    out = []
    for r in range(input_ids.shape[0]):
        positions = torch.nonzero(input_ids[r] == image_token_id).flatten()
        if int(cells[r]) >= len(positions):
            raise TrainingError(f"row {r}: cell {int(cells[r])} but only {len(positions)} image tokens")
        out.append(positions[int(cells[r])])
    return torch.stack(out)


def last_prompt_index(prompt_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last prompt token (the first index of the largest running count: the last True)."""
    return prompt_mask.long().cumsum(1).argmax(1)


def last_prompt_positions(prompt_mask: torch.Tensor) -> list[list[int]]:
    """Per row, ``[index of the last prompt token]``."""
    return [[int(i)] for i in last_prompt_index(prompt_mask)]
