"""Interventions: frozen keyword-only dataclasses that say what to change in a forward, and check themselves.

Each edits one thing the hook layer (:mod:`vlmbind.engine.hooks`) exposes: per-head outputs ``z`` (the ``o_proj`` input,
``edit_z``), attention probabilities after the softmax (``edit_probs``) or attention scores before it
(``edit_scores``: steering and knockout); the last two need vlmbind's eager attention (``needs_pattern``).
Positions are batch positions; negatives count from the end (batches are left-padded).
:class:`AddToHeadRows` is :class:`AddToHeads` with one vector per batch row (the position-ID edit batches examples
with it); :class:`PatchHeadsWhere` writes another run's z out of place, so a loss can train through both runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..core.errors import HeadLayoutError, InterventionError, NoAttentionPatternError, NoImageTokensError

if TYPE_CHECKING:
    from ..adapters.base import ModelAdapter
    from ..core.tokens import TokenIndex


# ------------------------------------------------------------------------------------------------------------------
# Heads and positions
# ------------------------------------------------------------------------------------------------------------------
def as_int_list(values: Any, what: str) -> tuple[int, ...]:
    if isinstance(values, (int, np.integer)):
        return (int(values),)
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise InterventionError(f"{what} must be an int or a list of ints, got {values!r}") from None
    return out


def positions_tensor(positions: Any, batch: int, seq: int, what: str) -> torch.Tensor:
    """``B n`` long tensor of positions: a shared list becomes one row per example; negatives count from the end."""
    pos = torch.as_tensor(np.asarray(positions), dtype=torch.long)
    if pos.ndim == 0:
        pos = pos[None]
    if pos.ndim == 1:
        pos = pos[None].expand(batch, -1)
    if pos.ndim != 2 or pos.shape[0] != batch:
        raise InterventionError(
            f"{what}: positions must be a list shared by the batch or one list per example ({batch} rows), got shape "
            f"{tuple(pos.shape)}"
        )
    pos = torch.where(pos < 0, pos + seq, pos)
    if pos.numel() and (pos.min() < 0 or pos.max() >= seq):
        raise InterventionError(f"{what}: positions {positions!r} fall outside the sequence of length {seq}")
    return pos


@dataclass(frozen=True, kw_only=True)
class Intervention:
    """Base class. ``layer`` is a decoder layer, ``heads`` query-head indices."""

    layer: int
    heads: tuple[int, ...] | list[int] | int

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", as_int_list(self.heads, f"{type(self).__name__}.heads"))
        if not isinstance(self.layer, (int, np.integer)):
            raise InterventionError(f"{type(self).__name__}.layer must be an int, got {self.layer!r}")

    def check(self, adapter: ModelAdapter) -> None:
        name = type(self).__name__
        if not 0 <= self.layer < adapter.n_layers:
            raise InterventionError(
                f"{name}: layer {self.layer} is out of range, the model has layers 0..{adapter.n_layers - 1}"
            )
        bad = [h for h in self.heads if not 0 <= h < adapter.n_heads]
        if bad:
            raise InterventionError(
                f"{name}: heads {bad} are out of range, layer {self.layer} has heads 0..{adapter.n_heads - 1}"
            )
        # hybrid models: probabilities exist on softmax layers only, per-head z where the heads are the model's
        if self.needs_pattern() and self.layer not in adapter.pattern_layers():
            raise NoAttentionPatternError(
                f"{name}: {adapter.layer_error(self.layer, 'softmax attention patterns', adapter.pattern_layers())}")
        if not self.needs_pattern() and self.layer not in adapter.head_layers():
            heads = f"{adapter.n_heads} heads of {adapter.d_head}"
            raise HeadLayoutError(f"{name}: {adapter.layer_error(self.layer, heads, adapter.head_layers())}")

    def needs_pattern(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class PatchHeads(Intervention):
    """Replace heads' outputs z (o_proj input) at chosen positions with given values.

    Attributes:
        positions: ``n`` positions shared by the batch, or ``B n`` per example; negatives count from the end.
        values: ``B n h D`` (or broadcastable, e.g. ``n h D``) values for the ``h`` heads in ``heads`` order.
    """

    positions: Any
    values: torch.Tensor

    def edit_z(self, z: torch.Tensor, index: Sequence[TokenIndex] | None) -> torch.Tensor:
        b, p, _, d = z.shape
        pos = positions_tensor(self.positions, b, p, "PatchHeads").to(z.device)
        heads = torch.tensor(self.heads, device=z.device)
        values = torch.as_tensor(self.values).to(device=z.device, dtype=z.dtype)
        try:
            values = values.expand(b, pos.shape[1], len(self.heads), d)
        except RuntimeError:
            raise InterventionError(
                f"PatchHeads: values of shape {tuple(self.values.shape)} do not fit "
                f"(batch {b}, positions {pos.shape[1]}, heads {len(self.heads)}, d_head {d})"
            ) from None
        rows = torch.arange(b, device=z.device)[:, None, None]
        z[rows, pos[:, :, None], heads[None, None, :]] = values
        return z


@dataclass(frozen=True, kw_only=True)
class PatchHeadEntries(Intervention):
    """Write single (row, position, head) entries of z: many independent single-head patches of one layer in one
    forward, each in its own batch row or its own block of a packed sequence.

    Attributes:
        heads: ``k`` query head of each entry.
        rows: ``k`` batch row of each entry.
        positions: ``k`` position of each entry (non-negative).
        values: ``k D`` the value written at each entry.
    """

    rows: Any
    positions: Any
    values: torch.Tensor

    def check(self, adapter: ModelAdapter) -> None:
        super().check(adapter)
        k = len(self.heads)
        if len(self.rows) != k or len(self.positions) != k or tuple(self.values.shape[:1]) != (k,):
            raise InterventionError(
                f"PatchHeadEntries: heads ({k}), rows ({len(self.rows)}), positions ({len(self.positions)}) and "
                f"values ({tuple(self.values.shape)}) must describe the same number of entries"
            )

    def edit_z(self, z: torch.Tensor, index: Sequence[TokenIndex] | None) -> torch.Tensor:
        b, p, _, d = z.shape
        rows = torch.as_tensor(self.rows, dtype=torch.long, device=z.device)
        pos = torch.as_tensor(self.positions, dtype=torch.long, device=z.device)
        if rows.numel() and (rows.max() >= b or pos.max() >= p or pos.min() < 0):
            raise InterventionError(f"PatchHeadEntries: entries fall outside a batch of {b} rows x {p} positions")
        heads = torch.tensor(self.heads, dtype=torch.long, device=z.device)
        z[rows, pos, heads] = self.values.to(device=z.device, dtype=z.dtype)
        return z


@dataclass(frozen=True, kw_only=True)
class AblateHeads(Intervention):
    """Zero- or mean-ablate heads' outputs z.

    Attributes:
        mode: ``"zero"``, ``"mean"`` (one mean per head, or per position) or ``"role_mean"`` (one mean per head and
            token role: image tokens get the head's mean over image tokens, text tokens its mean over text tokens,
            and so on; tokens generated after the prompt are text; padding is left as it is).
        positions: positions to ablate (as in :class:`PatchHeads`); ``None`` ablates every position.
        means: for ``"mean"``: ``h D`` (one mean per head) or ``P h D`` (per position) mean z, e.g. from
            :meth:`VLM.head_means`; for ``"role_mean"``: role -> ``h D`` (``VLM.head_means(..., by_role=True)``).
    """

    mode: str = "zero"
    positions: Any = None
    means: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("zero", "mean", "role_mean"):
            raise InterventionError(f"AblateHeads.mode must be 'zero', 'mean' or 'role_mean', got {self.mode!r}")
        if self.mode == "mean" and self.means is None:
            raise InterventionError("AblateHeads(mode='mean') needs means: pass means=vlm.head_means(batch, layer)")
        if self.mode == "role_mean" and not isinstance(self.means, Mapping):
            raise InterventionError("AblateHeads(mode='role_mean') needs means as role -> (heads, d_head): pass "
                                    "means=vlm.head_means(batch, layer, heads, by_role=True)")

    def edit_z(self, z: torch.Tensor, index: Sequence[TokenIndex] | None) -> torch.Tensor:
        b, p, _, d = z.shape
        heads = torch.tensor(self.heads, device=z.device)
        if self.mode == "role_mean":
            return self._role_fill(z, index, heads)
        if self.mode == "zero":
            fill = torch.zeros(len(self.heads), d, dtype=z.dtype, device=z.device)
        else:
            fill = torch.as_tensor(self.means).to(device=z.device, dtype=z.dtype)
            if fill.shape[-2:] != (len(self.heads), d) or fill.ndim not in (2, 3):
                raise InterventionError(
                    f"AblateHeads: means must have shape (heads, d_head) = ({len(self.heads)}, {d}) or "
                    f"(positions, heads, d_head), got {tuple(fill.shape)}"
                )
        if self.positions is None:
            if fill.ndim == 3 and fill.shape[0] != p:
                raise InterventionError(f"AblateHeads: per-position means cover {fill.shape[0]} positions, batch has {p}")
            z[:, :, heads] = fill.expand(b, p, len(self.heads), d) if fill.ndim == 2 else fill[None].expand(b, -1, -1, -1)
            return z
        pos = positions_tensor(self.positions, b, p, "AblateHeads").to(z.device)
        rows = torch.arange(b, device=z.device)[:, None, None]
        if fill.ndim == 3:
            fill = fill[pos]  # B n h D
        else:
            fill = fill.expand(b, pos.shape[1], len(self.heads), d)
        z[rows, pos[:, :, None], heads[None, None, :]] = fill
        return z

    def _role_fill(self, z: torch.Tensor, index: Sequence[TokenIndex] | None, heads: torch.Tensor) -> torch.Tensor:
        """Each position's z of the heads replaced by the mean of its role (padding untouched)."""
        b, p, _, d = z.shape
        if index is None or len(index) != b:
            raise InterventionError("AblateHeads(mode='role_mean') needs the batch's TokenIndex (run it through "
                                    "VLM.run, VLM.generate or VLM.ablate)")
        roles = sorted(self.means)
        table = torch.stack([torch.as_tensor(self.means[r]) for r in roles]).to(device=z.device, dtype=z.dtype)
        if table.shape[1:] != (len(self.heads), d):
            raise InterventionError(f"AblateHeads: each role's mean must have shape (heads, d_head) = "
                                    f"({len(self.heads)}, {d}), got {tuple(table.shape[1:])}")
        code = np.full((b, p), -1, dtype=np.int64)
        for row, ti in enumerate(index):
            n = len(ti.roles)
            if p >= n:  # the prompt, then tokens appended by a full-sequence greedy decode
                row_roles = np.concatenate([ti.roles, np.full(p - n, "text", dtype=ti.roles.dtype)])
            elif p == 1:  # a decode step on the key/value cache: a generated token
                row_roles = np.array(["text"])
            else:
                raise InterventionError(f"AblateHeads(mode='role_mean'): a forward over {p} of the prompt's {n} "
                                        "positions cannot be matched to their roles; run full sequences or "
                                        "single-token decode steps")
            for role in set(row_roles.tolist()) - {"pad"}:
                if role not in self.means:
                    raise InterventionError(
                        f"AblateHeads(mode='role_mean'): row {row} has {role!r} tokens but the means cover only "
                        f"{roles}; compute them on a batch with the same kinds of tokens")
                code[row, row_roles == role] = roles.index(role)
        code_t = torch.as_tensor(code, device=z.device)
        selected = torch.zeros(b, p, dtype=torch.bool, device=z.device)
        if self.positions is None:
            selected[:] = True
        else:
            pos = positions_tensor(self.positions, b, p, "AblateHeads").to(z.device)
            selected[torch.arange(b, device=z.device)[:, None], pos] = True
        selected &= code_t >= 0
        fill = table[code_t.clamp_min(0)]  # B P h D
        sub = z[:, :, heads]
        z[:, :, heads] = torch.where(selected[:, :, None, None], fill, sub)
        return z


@dataclass(frozen=True, kw_only=True)
class PatchHeadsWhere(Intervention):
    """Replace heads' outputs z with another run's, where a mask says, by ``torch.where``: nothing is written in
    place, so gradients reach both the values (e.g. z captured with ``HookSession(detach=False)``) and the patched
    run's own z everywhere else (interchange training).

    Attributes:
        where: ``B P`` booleans, True at each row's positions to patch (every listed head at each of them).
        values: ``B P H D``, z of the whole layer (all ``H`` heads) from the other run; only the listed heads'
            slices at ``where`` are taken.
    """

    where: torch.Tensor
    values: torch.Tensor

    def edit_z(self, z: torch.Tensor, index: Sequence[TokenIndex] | None) -> torch.Tensor:
        b, p, n, _ = z.shape
        where = torch.as_tensor(self.where).to(device=z.device, dtype=torch.bool)
        if tuple(where.shape) != (b, p) or tuple(self.values.shape) != tuple(z.shape):
            raise InterventionError(
                f"PatchHeadsWhere: where {tuple(where.shape)} and values {tuple(self.values.shape)} must be "
                f"(batch, positions) = ({b}, {p}) and the layer's z {tuple(z.shape)}"
            )
        heads = torch.zeros(n, dtype=torch.bool, device=z.device)
        heads[list(self.heads)] = True
        mask = where[:, :, None, None] & heads[None, None, :, None]
        return torch.where(mask, self.values.to(device=z.device, dtype=z.dtype), z)


@dataclass(frozen=True, kw_only=True)
class AddToHeads(Intervention):
    """Add ``alpha * vector`` to heads' outputs z at chosen positions (VSM's position-ID edit).

    Attributes:
        positions: as in :class:`PatchHeads`.
        vector: ``D`` (same for every head) or ``h D``.
        alpha: scale; ``alpha = 0`` is the identity.
    """

    positions: Any
    vector: torch.Tensor
    alpha: float = 1.0

    def edit_z(self, z: torch.Tensor, index: Sequence[TokenIndex] | None) -> torch.Tensor:
        b, p, _, d = z.shape
        pos = positions_tensor(self.positions, b, p, "AddToHeads").to(z.device)
        heads = torch.tensor(self.heads, device=z.device)
        vec = torch.as_tensor(self.vector).to(device=z.device, dtype=z.dtype)
        if vec.shape[-1] != d or vec.ndim > 2 or (vec.ndim == 2 and vec.shape[0] != len(self.heads)):
            raise InterventionError(
                f"AddToHeads: vector must have shape (d_head,) = ({d},) or (heads, d_head), got {tuple(vec.shape)}"
            )
        rows = torch.arange(b, device=z.device)[:, None, None]
        idx = (rows, pos[:, :, None], heads[None, None, :])
        z[idx] = z[idx] + self.alpha * vec.expand(len(self.heads), d)
        return z


@dataclass(frozen=True, kw_only=True)
class ZeroImageAttention(Intervention):
    """Zero heads' attention to image tokens after the softmax (PbP's search-head ablation).

    Attributes:
        renormalize: if True, rescale each query's remaining attention to sum to one (queries that attended only to
            image tokens then attend nowhere); if False, leave the remaining weights as they are.
        query_positions: restrict the edit to these query positions (``None``: every query).
    """

    renormalize: bool = False
    query_positions: Any = None

    def needs_pattern(self) -> bool:
        return True

    def check(self, adapter: ModelAdapter) -> None:
        super().check(adapter)
        if not adapter.image_tokens_in_sequence:
            cross = adapter.cross_attention_layers()
            raise NoImageTokensError(
                f"ZeroImageAttention: no position of this {adapter.display_name} model's sequence holds image "
                f"features (the image reaches the language model through the cross-attention layers {cross} only). "
                "Every key of a cross-attention head is an image key: AblateHeads(mode='zero') on those heads "
                "removes their image attention")

    def edit_probs(self, weights: torch.Tensor, index: Sequence[TokenIndex]) -> torch.Tensor:
        b, _, q, k = weights.shape
        if index is None or len(index) != b:
            raise InterventionError("ZeroImageAttention needs the batch's TokenIndex (run it through VLM.run)")
        image = torch.zeros(b, k, dtype=torch.bool, device=weights.device)
        for row, ti in enumerate(index):
            image[row, torch.as_tensor(ti.image_positions[ti.image_positions < k], dtype=torch.long)] = True
        keep = (~image).to(weights.dtype)[:, None, None, :]  # B 1 1 K
        heads = torch.tensor(self.heads, device=weights.device)
        sub = weights[:, heads] * keep
        if self.renormalize:
            total = sub.sum(-1, keepdim=True)
            sub = torch.where(total > 0, sub / total.clamp_min(torch.finfo(sub.dtype).tiny), sub)
        if self.query_positions is not None:
            qpos = positions_tensor(self.query_positions, b, q, "ZeroImageAttention").to(weights.device)
            qmask = torch.zeros(b, q, dtype=torch.bool, device=weights.device)
            qmask[torch.arange(b, device=weights.device)[:, None], qpos] = True
            sub = torch.where(qmask[:, None, :, None], sub, weights[:, heads])
        weights = weights.clone()
        weights[:, heads] = sub
        return weights


@dataclass(frozen=True, kw_only=True)
class KeyScoreEdit(Intervention):
    """Base of the edits of heads' attention scores before the softmax, at chosen queries, by a set of keys.

    Positions are absolute: in a cached generation step the query rows are the newest positions (key length minus
    query length onwards); on a cross-attention layer the keys are the image keys (``TokenIndex.keys_covering``) and
    the query rows are the forward's own positions.

    Attributes:
        keys: key positions, one list per batch row (or one list shared by the batch).
        query_positions: the edited query positions, shared or one list per row (``None``: every query); a position
            the sequence has not reached yet applies from the generation step that reaches it.
    """

    keys: Any
    query_positions: Any = None

    def needs_pattern(self) -> bool:
        return True

    def key_mask(self, batch: int, n_keys: int, device: torch.device) -> torch.Tensor:
        """``B K`` bool: the keys named for each row."""
        name, rows = type(self).__name__, self.keys
        if len(rows) and isinstance(rows[0], (int, np.integer)):
            rows = [rows] * batch
        if len(rows) != batch:
            raise InterventionError(f"{name}: keys must be one list shared by the batch or one list per row "
                                    f"({batch} rows), got {len(rows)} lists")
        mask = torch.zeros(batch, n_keys, dtype=torch.bool, device=device)
        for row, keys in enumerate(rows):
            keys = torch.as_tensor(np.asarray(keys, dtype=np.int64).reshape(-1), device=device)
            if not len(keys):
                raise InterventionError(f"{name}: row {row} names no key")
            if keys.min() < 0 or keys.max() >= n_keys:
                raise InterventionError(f"{name}: row {row}'s keys {keys.tolist()} fall outside the {n_keys} keys "
                                        f"of layer {self.layer}")
            mask[row, keys] = True
        return mask

    def query_mask(self, batch: int, n_queries: int, offset: int, device: torch.device) -> torch.Tensor:
        """``B Q`` bool: the edited query rows of this forward (absolute position = ``offset`` + row)."""
        if self.query_positions is None:
            return torch.ones(batch, n_queries, dtype=torch.bool, device=device)
        seq = offset + n_queries
        pos = torch.as_tensor(np.asarray(self.query_positions), dtype=torch.long, device=device)
        pos = pos[None] if pos.ndim == 0 else pos
        pos = pos[None].expand(batch, -1) if pos.ndim == 1 else pos
        if pos.ndim != 2 or pos.shape[0] != batch:
            raise InterventionError(f"{type(self).__name__}: query_positions must be a list shared by the batch or one "
                                    f"list per row ({batch} rows), got shape {tuple(pos.shape)}")
        # negatives count from the end of this forward's sequence; positions past it wait for later steps
        pos = torch.where(pos < 0, pos + seq, pos) - offset
        edited = torch.zeros(batch, n_queries, dtype=torch.bool, device=device)
        inside = (pos >= 0) & (pos < n_queries)  # a cached step holds only the newest queries
        rows = torch.arange(batch, device=device)[:, None].expand_as(pos)
        edited[rows[inside], pos[inside]] = True
        return edited

    def kept(self, named: torch.Tensor, edited: torch.Tensor) -> torch.Tensor:
        """``B Q K`` bool: the scores left as they are (from ``named`` keys ``B 1 K`` and ``edited`` rows ``B Q 1``)."""
        raise NotImplementedError

    def edit_scores(self, scores: torch.Tensor, index: Any, cross: bool = False) -> torch.Tensor:
        """``scores`` (``B H Q K``, the attention mask already added) with the edited heads' dropped keys set to the
        lowest value."""
        b, _, q, k = scores.shape
        offset = 0 if cross else k - q
        named = self.key_mask(b, k, scores.device)[:, None, :]
        edited = self.query_mask(b, q, offset, scores.device)[:, :, None]
        self.check_causal(named, edited, offset, cross)
        keep = self.kept(named, edited)
        heads = torch.tensor(self.heads, device=scores.device)
        sub = scores[:, heads]
        scores = scores.clone()
        scores[:, heads] = torch.where(keep[:, None], sub, torch.full_like(sub, torch.finfo(sub.dtype).min))
        return scores

    def check_causal(self, named: torch.Tensor, edited: torch.Tensor, offset: int, cross: bool) -> None:
        """Steering needs keys the queries can see; a knockout of unseen keys changes nothing and is allowed."""


@dataclass(frozen=True, kw_only=True)
class SteerAttention(KeyScoreEdit):
    """Redirect heads' attention to chosen keys: at the chosen queries every other key's score is set to the lowest
    value before the softmax, so the heads attend only to the chosen keys, renormalised over them. Steering to every
    key is the identity, exactly (no score changes); keys after a query stay masked for it (causal attention), and a
    steered query that sees none of its keys is refused."""

    def kept(self, named: torch.Tensor, edited: torch.Tensor) -> torch.Tensor:
        return named | ~edited

    def check_causal(self, named: torch.Tensor, edited: torch.Tensor, offset: int, cross: bool) -> None:
        if cross:
            return
        k, q = named.shape[-1], edited.shape[1]
        query_abs = offset + torch.arange(q, device=named.device)
        seen = named & (torch.arange(k, device=named.device)[None, None, :] <= query_abs[None, :, None])
        blind = edited[:, :, 0] & ~seen.any(-1)
        if bool(blind.any()):
            row, query = (int(v) for v in torch.nonzero(blind)[0])
            raise InterventionError(
                f"SteerAttention: the query at position {offset + query} of row {row} sees none of the keys to steer "
                "to (they all come after it; attention is causal); steer queries that follow the keys")


@dataclass(frozen=True, kw_only=True)
class BlockAttention(KeyScoreEdit):
    """Knock out heads' attention to chosen keys (Geva et al.'s attention knockout): at the chosen queries their
    scores are set to the lowest value before the softmax, so the rest of the attention is renormalised. A query
    left with no key (all of its keys blocked) attends uniformly to the masked ones; avoid blocking a query's
    every key."""

    def kept(self, named: torch.Tensor, edited: torch.Tensor) -> torch.Tensor:
        return ~(named & edited)


@dataclass(frozen=True, kw_only=True)
class AddToHeadRows(AddToHeads):
    """:class:`AddToHeads` whose vector may differ per batch row.

    Attributes:
        positions: ``n`` positions shared by the batch, or ``B n`` per row; negatives count from the end.
        vector: ``B h D`` (row ``r`` adds ``alpha * vector[r]`` to the ``h`` heads), or ``D`` / ``h D`` as in
            ``AddToHeads``.
        alpha: scale; ``alpha = 0`` is the identity.
    """

    def edit_z(self, z: torch.Tensor, index: Any) -> torch.Tensor:
        """Add the scaled per-row vectors to ``z`` (``B P H D``) at the rows' positions."""
        vec = torch.as_tensor(self.vector)
        if vec.ndim != 3:
            return super().edit_z(z, index)
        b, p, _, d = z.shape
        if tuple(vec.shape) != (b, len(self.heads), d):
            raise InterventionError(
                f"AddToHeadRows: a per-row vector must have shape (batch, heads, d_head) = ({b}, {len(self.heads)}, "
                f"{d}), got {tuple(vec.shape)}"
            )
        pos = positions_tensor(self.positions, b, p, "AddToHeadRows").to(z.device)
        heads = torch.tensor(self.heads, device=z.device)
        vec = vec.to(device=z.device, dtype=z.dtype)
        rows = torch.arange(b, device=z.device)[:, None, None]
        idx = (rows, pos[:, :, None], heads[None, None, :])  # B n h
        z[idx] = z[idx] + (self.alpha * vec)[:, None].expand(b, pos.shape[1], len(self.heads), d)
        return z
