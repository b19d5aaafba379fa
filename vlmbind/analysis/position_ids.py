"""Position IDs (VSM): per chosen head, the mean output z at the prompt's last token over examples whose missing
object sits at each grid cell, and the checks the position-ID edit and the entropy repair share.

Design: a position ID ``d_c`` is, per chosen head, the mean output z of that head (the head's slice of the ``o_proj``
input, site ``blocks.{l}.attn.hook_z``) at the last prompt token over estimation examples whose missing object sits
at grid cell ``c`` (:func:`estimate_position_ids`); cells with fewer than ``min_count`` examples get no estimate, and
how many examples that dropped is reported.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

# the checks of arguments alone live in core, so that the command line runs them before importing torch
from ..core.checks import check_alphas, check_head_list, check_positive  # noqa: F401  (check_alphas: public here too)
from ..core.errors import InputError, TooFewEstimatesError

Cell = tuple[int, int]


# ------------------------------------------------------------------------------------------------------------------
# Input checks
# ------------------------------------------------------------------------------------------------------------------
def check_heads(vlm: Any, heads: Any) -> list[tuple[int, int]]:
    """``[(layer, head), ...]`` from pairs or ``"12.3,14.0"``, checked against the model.

    Raises:
        InputError: a malformed head, a head the model lacks, a repeated head, or no heads.
    """
    return check_head_list(heads, n_layers=vlm.n_layers, n_heads=vlm.n_heads)


def check_scene_examples(examples: Sequence[Any], what: str) -> None:
    if not examples:
        raise InputError(f"{what}: no examples; pass scene-description examples (vb.stimuli.scene_description)")
    bad = [e.id for e in examples if e.task != "scene" or "target" not in e.fields]
    if bad:
        raise InputError(f"{what}: examples {bad[:3]} are not scene-description examples with a target object; "
                         f"pass vb.stimuli.scene_description(...) examples")


def object_cell(obj: Any) -> Cell:
    return int(obj.row), int(obj.col)


def target_cell(example: Any) -> Cell:
    """The grid cell ``(row, col)`` of the example's missing (target) object."""
    return object_cell(example.objects[example.fields["target"]])


def chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ------------------------------------------------------------------------------------------------------------------
# Position IDs
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class PositionIDs:
    """Per-cell mean head outputs at the last prompt token.

    Attributes:
        heads: the heads, ``[(layer, head), ...]`` (the ``H`` axis).
        cells: the cells with an estimate, ``[(row, col), ...]`` in raster order (the ``C`` axis).
        vectors: ``C H D`` float64 mean z of each head over the examples whose missing object sits in the cell.
        counts: examples averaged per cell, in ``cells`` order.
        skipped_cells: cells seen fewer than ``min_count`` times -> their example count (no estimate).
        min_count: the fewest examples a cell needs for an estimate.
        z_norm: ``H`` mean L2 norm of each head's z at the last prompt token over all estimation examples (the
            scale an edit's ``|d_t - d_o|`` compares with).
        n_examples: estimation examples read.
    """

    heads: list[tuple[int, int]]
    cells: list[Cell]
    vectors: torch.Tensor
    counts: list[int]
    skipped_cells: dict[Cell, int]
    min_count: int
    z_norm: np.ndarray
    n_examples: int

    @property
    def n_skipped_examples(self) -> int:
        """Estimation examples dropped because their cell had fewer than ``min_count`` examples."""
        return int(sum(self.skipped_cells.values()))

    def has(self, cell: Cell) -> bool:
        """Whether ``cell`` has an estimate."""
        return tuple(cell) in self._index

    def vector(self, cell: Cell) -> torch.Tensor:
        """``H D`` position ID of ``cell``.

        Raises:
            InputError: the cell has no estimate.
        """
        cell = (int(cell[0]), int(cell[1]))
        if cell not in self._index:
            seen = self.skipped_cells.get(cell, 0)
            raise InputError(f"cell {cell} has no position-ID estimate ({seen} estimation examples, fewer than "
                             f"{self.min_count}); use more estimation examples")
        return self.vectors[self._index[cell]]

    def delta(self, t: Cell, o: Cell) -> torch.Tensor:
        """``H D`` edit direction ``d_t - d_o`` (float64)."""
        return self.vector(t) - self.vector(o)

    def subset(self, heads: Sequence[tuple[int, int]]) -> PositionIDs:
        """The IDs of some of the heads (each head's estimate is its own, so this equals estimating them alone).

        Raises:
            InputError: a head without an estimate here.
        """
        missing = [f"{l}.{h}" for l, h in heads if tuple((l, h)) not in self.heads]
        if missing:
            raise InputError(f"heads {missing} have no position-ID estimate here (estimated: "
                             f"{[f'{l}.{h}' for l, h in self.heads]})")
        idx = [self.heads.index(tuple(head)) for head in heads]
        return replace(self, heads=[self.heads[i] for i in idx], vectors=self.vectors[:, idx],
                       z_norm=self.z_norm[idx])

    @property
    def _index(self) -> dict[Cell, int]:
        return {c: i for i, c in enumerate(self.cells)}

    def summary(self) -> dict[str, Any]:
        return {
            "heads": [f"{l}.{h}" for l, h in self.heads], "n_examples": self.n_examples, "min_count": self.min_count,
            "cells": {f"{r},{c}": n for (r, c), n in zip(self.cells, self.counts)},
            "skipped_cells": {f"{r},{c}": n for (r, c), n in sorted(self.skipped_cells.items())},
            "skipped_examples": self.n_skipped_examples,
            "z_norm": {f"{l}.{h}": float(v) for (l, h), v in zip(self.heads, self.z_norm)},
        }


def last_position_z(vlm: Any, batch: Any, heads: list[tuple[int, int]]) -> torch.Tensor:
    """``B H D`` z of each head at each row's last prompt position (float64, CPU)."""
    sites = {l: vlm.adapter.z_site(l) for l in sorted({l for l, _ in heads})}
    cache = vlm.capture(batch, list(sites.values()))
    rows = torch.arange(len(batch))
    last = torch.as_tensor(batch.last_positions, dtype=torch.long)
    z = torch.stack([cache[sites[l]][rows, last.to(cache[sites[l]].device), h].cpu() for l, h in heads], 1)
    return z.to(torch.float64)


def estimated_cells(examples: Sequence[Any], min_count: int) -> set[Cell]:
    """The cells :func:`estimate_position_ids` gives an estimate from ``examples`` (those holding the missing object
    of at least ``min_count`` of them), read from the scenes alone, before any model runs."""
    counts = Counter(target_cell(e) for e in examples)
    return {cell for cell, n in counts.items() if n >= min_count}


def estimate_position_ids(vlm: Any, examples: Sequence[Any], heads: Any, *, min_count: int = 3,
                          batch_size: int = 32, progress: bool = False) -> PositionIDs:
    """Position ID of every cell: the mean z of each head at the last prompt token over the examples whose missing
    object sits in that cell.

    Args:
        vlm: a loaded VLM.
        examples: scene-description examples (``fields["target"]`` names the missing object).
        heads: ``[(layer, head), ...]`` or ``"12.3,14.0"``.
        min_count: cells with fewer examples get no estimate (reported in ``skipped_cells``).
        batch_size: examples per forward.
        progress: show a progress bar.

    Returns:
        :class:`PositionIDs` with ``vectors`` of shape ``C H D``.

    Raises:
        InputError: bad heads, no or non-scene examples, or no cell with ``min_count`` examples.
    """
    heads = check_heads(vlm, heads)
    examples = list(examples)
    check_scene_examples(examples, "estimate_position_ids")
    check_positive(min_count=min_count, batch_size=batch_size)
    sums: dict[Cell, torch.Tensor] = {}
    counts: Counter[Cell] = Counter()
    norm_sum = torch.zeros(len(heads), dtype=torch.float64)
    for chunk in tqdm(chunks(examples, batch_size), desc="position IDs", disable=not progress):
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk])
        z = last_position_z(vlm, batch, heads)
        norm_sum += z.norm(dim=-1).sum(0)
        for e, zr in zip(chunk, z):
            cell = target_cell(e)
            sums[cell] = sums[cell] + zr if cell in sums else zr.clone()
            counts[cell] += 1
    kept = sorted(c for c in counts if counts[c] >= min_count)
    if not kept:
        raise TooFewEstimatesError(f"no cell has {min_count} estimation examples (most: {max(counts.values())}); "
                                   "use more estimation examples or a lower min_count")
    return PositionIDs(
        heads=heads, cells=kept, vectors=torch.stack([sums[c] / counts[c] for c in kept]),
        counts=[counts[c] for c in kept], skipped_cells={c: n for c, n in counts.items() if n < min_count},
        min_count=min_count, z_norm=(norm_sum / len(examples)).numpy(), n_examples=len(examples),
    )
