"""What SIIT reads from the organism beside its answers: the position code of the image tokens (through a fixed
readout or a trained :class:`PositionProbe`) and the linear readouts of the ID heads' outputs (:class:`SelectionProbe`,
:class:`GatherProbe`), all trained beside the organism and never part of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ...core.errors import TrainingError

POSITION_READOUT_SEED = 7
# cosine logits times this: bounded, so the loss cannot blow the residual stream up (raw residuals of norm ~25
# gave a cross-entropy of 6 and wrecked the behaviour of a trained organism in its first steps)
POSITION_LOGIT_SCALE = 10.0


def position_readout(hidden: int, cells: int) -> torch.Tensor:
    """The fixed ``hidden x cells`` readout of the position code (unit columns, from a fixed seed, never trained)."""
    g = torch.Generator().manual_seed(POSITION_READOUT_SEED)
    w = torch.randn(hidden, cells, generator=g, device="cpu")  # the generator's device, whatever the default
    return w / w.norm(dim=0, keepdim=True)


def _image_cells(input_ids: torch.Tensor, image_token_id: int, cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The image tokens' mask and each one's grid cell (image tokens are in raster order, ``cells`` per image)."""
    mask = input_ids == image_token_id
    counts = mask.sum(1)
    if bool((counts % cells).any()):
        raise TrainingError(f"rows hold {counts.tolist()} image tokens, not a multiple of the grid's {cells} cells")
    return mask, torch.cat([torch.arange(int(c)) % cells for c in counts])


def _position_logits(h: torch.Tensor, cells: int) -> torch.Tensor:
    unit = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return POSITION_LOGIT_SCALE * unit @ position_readout(h.shape[-1], cells).to(h.device, h.dtype)


def position_code_loss(hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                       cells: int) -> torch.Tensor:
    """Cross-entropy of every image token's grid cell read from ``hidden_states`` (``B P D``, one decoder layer's
    output) through :func:`position_readout` (cosine logits, scaled by :data:`POSITION_LOGIT_SCALE`)."""
    mask, target = _image_cells(input_ids, image_token_id, cells)
    return torch.nn.functional.cross_entropy(_position_logits(hidden_states[mask], cells),
                                             target.to(hidden_states.device))


def position_code_accuracy(hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                           cells: int) -> float:
    """Share of image tokens whose cell the fixed readout gets right."""
    mask, target = _image_cells(input_ids, image_token_id, cells)
    pred = _position_logits(hidden_states[mask], cells).argmax(-1)
    return float((pred == target.to(pred.device)).float().mean())


class PositionProbe(torch.nn.Module):
    """A linear readout of every image token's grid cell, trained beside the organism (never part of it)."""

    def __init__(self, hidden: int, cells: int, seed: int):
        super().__init__()
        self.cells = cells
        self.linear = torch.nn.Linear(hidden, cells)
        g = torch.Generator().manual_seed(POSITION_READOUT_SEED + int(seed))
        with torch.no_grad():
            self.linear.weight.normal_(0.0, hidden ** -0.5, generator=g)
            self.linear.bias.zero_()

    def loss(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
        mask, target = _image_cells(input_ids, image_token_id, self.cells)
        return torch.nn.functional.cross_entropy(self.linear(hidden_states[mask]), target.to(hidden_states.device))

    def accuracy(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int) -> float:
        mask, target = _image_cells(input_ids, image_token_id, self.cells)
        with torch.no_grad():
            pred = self.linear(hidden_states[mask]).argmax(-1)
        return float((pred == target.to(pred.device)).float().mean())


class SelectionProbe(torch.nn.Module):
    """A linear readout of the missing object's grid cell from the ``id_selection`` heads' outputs (their ``o_proj``
    input slices, concatenated), trained beside the organism (never part of it)."""

    def __init__(self, heads: Sequence[tuple[int, int]], d_head: int, cells: int, seed: int):
        super().__init__()
        self.heads, self.d_head, self.cells = list(heads), int(d_head), int(cells)
        self.linear = torch.nn.Linear(len(self.heads) * self.d_head, self.cells)
        g = torch.Generator().manual_seed(POSITION_READOUT_SEED + 1000 + int(seed))
        with torch.no_grad():
            self.linear.weight.normal_(0.0, (len(self.heads) * self.d_head) ** -0.5, generator=g)
            self.linear.bias.zero_()

    def features(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]]) -> torch.Tensor:
        """``N x (heads * d_head)``: the heads' outputs at every row's positions (rows repeated per position)."""
        rows = [r for r, pos in enumerate(positions) for _ in pos]
        cols = [q for pos in positions for q in pos]
        parts = [stored[l][rows, cols, h * self.d_head : (h + 1) * self.d_head] for l, h in self.heads]
        return torch.cat(parts, dim=-1)

    def _targets(self, targets: torch.Tensor, positions: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.cat([targets[r].repeat(len(pos)) for r, pos in enumerate(positions)])

    def loss(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
             targets: torch.Tensor) -> torch.Tensor:
        logits = self.linear(self.features(stored, positions))
        return torch.nn.functional.cross_entropy(logits, self._targets(targets, positions).to(logits.device))

    def accuracy(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
                 targets: torch.Tensor) -> float:
        with torch.no_grad():
            pred = self.linear(self.features(stored, positions)).argmax(-1)
        return float((pred == self._targets(targets, positions).to(pred.device)).float().mean())


class GatherProbe(SelectionProbe):
    """A linear readout of the set of the described objects' cells (one logit per cell, multi-label) from the
    aggregation heads' outputs, trained beside the organism (never part of it)."""

    def loss(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
             targets: torch.Tensor) -> torch.Tensor:
        logits = self.linear(self.features(stored, positions))
        per_cell = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, self._targets(targets, positions).to(logits.device, logits.dtype), reduction="none")
        return per_cell.sum(-1).mean()  # the set's negative log-likelihood, as a cross-entropy is a cell's

    def accuracy(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
                 targets: torch.Tensor) -> float:
        """The share of (row, position)s where the cells with a positive logit are exactly the described ones."""
        with torch.no_grad():
            pred = self.linear(self.features(stored, positions)) > 0
        return float((pred == self._targets(targets, positions).to(pred.device).bool()).all(-1).float().mean())

    def _targets(self, targets: torch.Tensor, positions: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.cat([targets[r][None].expand(len(pos), -1) for r, pos in enumerate(positions)])
