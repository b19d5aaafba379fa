"""The hook layer: capture activations at sites and apply interventions, on the real HF forward.

Design: a :class:`HookSession` registers plain PyTorch hooks for one forward (or generate) call and removes every one
of them in ``__exit__``, also when the forward raises. Interventions are frozen dataclasses; each knows how to check
itself against the model and batch, and which hook it needs:

* per-head output ``z`` (``blocks.{l}.attn.hook_z``): a forward pre-hook on ``o_proj``, whose input is the
  concatenation of the heads (``B P H*D``), never its output, which mixes heads;
* attention probabilities (``blocks.{l}.attn.hook_pattern``, :class:`ZeroImageAttention`): vlmbind registers an eager
  attention function (``vlmbind_eager``) with transformers' ``AttentionInterface``. It computes exactly what HF's
  eager attention computes (tested against ``output_attentions`` and against eager logits) and lets an intervention
  edit the probabilities after the softmax, before they weight the values. The text model switches to it only for
  the duration of a call that needs it, so the user's choice (eager or sdpa) stands otherwise;
* residual stream, attention and MLP outputs, vision blocks and the projector: forward (pre-)hooks on those modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from .errors import InterventionError
from .sites import Site

if TYPE_CHECKING:
    from .adapters.base import ModelAdapter
    from .tokens import TokenIndex

ATTENTION_IMPL = "vlmbind_eager"
_PROB_EDITS = "_vlmbind_prob_edits"


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, p, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, p, d).reshape(b, h * n_rep, p, d)


def vlmbind_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF eager attention (``B H P D`` query, ``B H_kv K D`` key / value) with an edit point after the softmax."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("attention sinks are not supported by vlmbind's eager attention")
    if scaling is None:
        scaling = module.head_dim**-0.5
    n_rep = query.shape[1] // key.shape[1]
    key_states = _repeat_kv(key, n_rep)
    value_states = _repeat_kv(value, n_rep)
    weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key_states.shape[-2]]
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    for edit in getattr(module, _PROB_EDITS, ()):
        weights = edit(weights)
    out = torch.matmul(weights, value_states).transpose(1, 2).contiguous()
    return out, weights


AttentionInterface.register(ATTENTION_IMPL, vlmbind_eager_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_IMPL, eager_mask)


# ------------------------------------------------------------------------------------------------------------------
# Heads and positions
# ------------------------------------------------------------------------------------------------------------------
def _as_int_list(values: Any, what: str) -> tuple[int, ...]:
    if isinstance(values, (int, np.integer)):
        return (int(values),)
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise InterventionError(f"{what} must be an int or a list of ints, got {values!r}") from None
    return out


def _positions_tensor(positions: Any, batch: int, seq: int, what: str) -> torch.Tensor:
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
        object.__setattr__(self, "heads", _as_int_list(self.heads, f"{type(self).__name__}.heads"))
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
        pos = _positions_tensor(self.positions, b, p, "PatchHeads").to(z.device)
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
        mode: ``"zero"`` or ``"mean"``.
        positions: positions to ablate (as in :class:`PatchHeads`); ``None`` ablates every position.
        means: for ``"mean"``: ``h D`` (one mean per head) or ``P h D`` (per position) mean z, e.g. from
            :meth:`VLM.head_means`.
    """

    mode: str = "zero"
    positions: Any = None
    means: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("zero", "mean"):
            raise InterventionError(f"AblateHeads.mode must be 'zero' or 'mean', got {self.mode!r}")
        if self.mode == "mean" and self.means is None:
            raise InterventionError("AblateHeads(mode='mean') needs means: pass means=vlm.head_means(batch, layer)")

    def edit_z(self, z: torch.Tensor, index: Sequence[TokenIndex] | None) -> torch.Tensor:
        b, p, _, d = z.shape
        heads = torch.tensor(self.heads, device=z.device)
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
        pos = _positions_tensor(self.positions, b, p, "AblateHeads").to(z.device)
        rows = torch.arange(b, device=z.device)[:, None, None]
        if fill.ndim == 3:
            fill = fill[pos]  # B n h D
        else:
            fill = fill.expand(b, pos.shape[1], len(self.heads), d)
        z[rows, pos[:, :, None], heads[None, None, :]] = fill
        return z


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
        pos = _positions_tensor(self.positions, b, p, "AddToHeads").to(z.device)
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
            qpos = _positions_tensor(self.query_positions, b, q, "ZeroImageAttention").to(weights.device)
            qmask = torch.zeros(b, q, dtype=torch.bool, device=weights.device)
            qmask[torch.arange(b, device=weights.device)[:, None], qpos] = True
            sub = torch.where(qmask[:, None, :, None], sub, weights[:, heads])
        weights = weights.clone()
        weights[:, heads] = sub
        return weights


# ------------------------------------------------------------------------------------------------------------------
# The session
# ------------------------------------------------------------------------------------------------------------------
def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    if hasattr(output, "pooler_output"):
        return output.pooler_output
    raise TypeError(f"cannot find the hidden states in a module output of type {type(output).__name__}")


@contextlib.contextmanager
def attention_implementation(adapter: ModelAdapter, impl: str | None) -> Iterator[None]:
    """Temporarily run the text model's attention with ``impl`` (no-op for None)."""
    if impl is None:
        yield
        return
    cfg = adapter.text_config
    before = cfg._attn_implementation
    cfg._attn_implementation = impl
    try:
        yield
    finally:
        cfg._attn_implementation = before


@dataclass
class HookSession:
    """Registers capture hooks and interventions for one call; removes them all on exit.

    Attributes:
        adapter: the model's adapter.
        sites: sites to capture.
        interventions: interventions to apply.
        index: the batch's TokenIndex rows (needed by attention edits).
        detach: store captures detached (set False to keep the graph, e.g. for attribution patching).
        to_cpu: move captures to CPU as they are taken.
        captured: site name -> list of tensors, one per forward call in the session (generate makes several).
    """

    adapter: ModelAdapter
    sites: Sequence[Site] = ()
    interventions: Sequence[Intervention] = ()
    index: Sequence[TokenIndex] | None = None
    detach: bool = True
    to_cpu: bool = False
    captured: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)
    _prob_modules: list[nn.Module] = field(default_factory=list)
    _stack: contextlib.ExitStack | None = None

    def needs_pattern(self) -> bool:
        return any(s.hook == "attn.hook_pattern" for s in self.sites) or any(
            i.needs_pattern() for i in self.interventions
        )

    def __enter__(self) -> HookSession:
        for intervention in self.interventions:
            intervention.check(self.adapter)
        self._stack = contextlib.ExitStack()
        try:
            if self.needs_pattern():
                self._stack.enter_context(attention_implementation(self.adapter, ATTENTION_IMPL))
            self._register()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._prob_modules:
            if hasattr(module, _PROB_EDITS):
                delattr(module, _PROB_EDITS)
        self._prob_modules.clear()
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    # -- registration -------------------------------------------------------------------------------------------
    def _store(self, site: str, value: torch.Tensor) -> None:
        if self.detach:
            value = value.detach()
        if self.to_cpu:
            value = value.cpu()
        self.captured.setdefault(site, []).append(value)

    def _register(self) -> None:
        a = self.adapter
        z_edits: dict[int, list[Intervention]] = {}
        prob_edits: dict[int, list[ZeroImageAttention]] = {}
        for intervention in self.interventions:
            if isinstance(intervention, ZeroImageAttention):
                prob_edits.setdefault(intervention.layer, []).append(intervention)
            else:
                z_edits.setdefault(intervention.layer, []).append(intervention)
        z_sites = {s.layer: s for s in self.sites if s.hook == "attn.hook_z"}

        for layer in sorted(set(z_edits) | set(z_sites)):
            self._handles.append(
                a.o_proj_module(layer).register_forward_pre_hook(
                    self._z_hook(layer, z_edits.get(layer, []), z_sites.get(layer))
                )
            )
        for layer, edits in prob_edits.items():
            module = a.attention_module(layer)
            index = self.index
            setattr(module, _PROB_EDITS, [lambda w, e=e: e.edit_probs(w, index) for e in edits])
            self._prob_modules.append(module)

        for site in self.sites:
            name = site.name
            if site.component == "lm":
                if site.hook == "hook_resid_pre":
                    self._handles.append(
                        a.layer(site.layer).register_forward_pre_hook(self._pre_capture(name), with_kwargs=True)
                    )
                elif site.hook == "hook_resid_post":
                    self._handles.append(a.layer(site.layer).register_forward_hook(self._post_capture(name)))
                elif site.hook == "hook_attn_out":
                    self._handles.append(a.attn_out_module(site.layer).register_forward_hook(self._post_capture(name)))
                elif site.hook == "hook_mlp_out":
                    self._handles.append(a.mlp_out_module(site.layer).register_forward_hook(self._post_capture(name)))
                elif site.hook == "attn.hook_pattern":
                    self._handles.append(
                        a.attention_module(site.layer).register_forward_hook(self._pattern_capture(name))
                    )
            elif site.component == "vision":
                self._handles.append(a.vision_block(site.layer).register_forward_hook(self._post_capture(name)))
            elif site.component == "projector":
                self._handles.append(a.projector_module().register_forward_hook(
                    self._post_capture(name, a.projector_output)))

    def _z_hook(self, layer: int, edits: list[Intervention], site: Site | None) -> Callable:
        n_heads, index = self.adapter.n_heads, self.index

        def hook(module: nn.Module, args: tuple) -> tuple | None:
            x = args[0]
            b, p, hd = x.shape
            if edits:
                z = x.reshape(b, p, n_heads, hd // n_heads).clone()
                for edit in edits:
                    z = edit.edit_z(z, index)
                x = z.reshape(b, p, hd)
            if site is not None:
                self._store(site.name, x.reshape(b, p, n_heads, hd // n_heads))
            return (x, *args[1:]) if edits else None

        return hook

    def _pre_capture(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._store(name, args[0] if args else kwargs["hidden_states"])

        return hook

    def _post_capture(self, name: str, attribute: str | None = None) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._store(name, getattr(output, attribute) if attribute else _first_tensor(output))

        return hook

    def _pattern_capture(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError(f"{name}: the attention module returned no weights")
            self._store(name, weights)

        return hook
