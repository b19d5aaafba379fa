"""Single-head activation patching: the naive reference, an exact fast path, and attribution estimates (AtP,
integrated gradients, AtP*).

A :class:`PatchTask` is one clean prompt, the positions to patch, the counterfactual head outputs z for every layer
at those positions, and the two answer tokens. Each method returns, per head, the patched run's logit difference
``logit[a*] - logit[a]`` at the scored position, and the clean run's.

Design of the exact path (:func:`exact_diffs`). Patching head h of layer l at positions ``p >= p0`` cannot change
anything before ``p0`` nor anything below layer l, so:

1. the clean prompt runs once, with the image: its logits, the residual stream entering every layer, and the
   key/value cache of the prefix ``[0, p0)`` are kept;
2. the heads run in chunks, each experiment recomputing the suffix ``[p0, P)`` only, on the prefix cache, with
   its own head patched; the decoder layers below the chunk's lowest patched layer are skipped, that layer being
   fed the clean residual captured in step 1. Layout ``packed`` puts the experiments' suffixes side by side in one
   row over the shared prefix cache, a block mask keeping each copy to the prefix and itself, so the prefix's keys
   and values are never copied; layout ``batched`` gives each experiment a batch row on a shallow batch expansion of
   the cache (any attention implementation; chunked to a memory budget). For families whose text mask is plainly
   causal, layout ``single`` folds steps 1 and 2 into one forward when every experiment fits ``max_tokens``: the
   copies ride after the clean prompt under the same block mask (``auto`` picks it then).

Everything runs through the model's own forward, so the family's masks (Gemma-3's sliding windows, bidirectional
image blocks), GQA and rotary embeddings apply unchanged. Position ids that are not ``0..P-1`` (Qwen's 3-D M-RoPE)
are computed once for the full sequence and sliced, never left to the model's cached ``rope_deltas``. The prefix
must end after every image token and every bidirectional block (``adapter.bidirectional_positions``; for PaliGemma's
prefix LM, the whole prompt); when a patch position lies at or before one, the prefix is empty and the rows run the
whole sequence, one at a time. So do models with recurrent layers (Qwen3.5's Gated DeltaNet,
``adapter.recurrent_layers``): their cached state cannot be cut back to a prefix, nor shared by packed copies.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from ..core.choices import IG_STEPS
from ..core.errors import InputError
from .hooks import ATTENTION_IMPL, PROB_EDITS, HookSession, attention_implementation
from .interventions import PatchHeadEntries, PatchHeads

DEFAULT_MEMORY_BUDGET = 2 * 1024**3
_ABSENT = object()


@dataclass
class PatchTask:
    """One clean prompt to patch.

    Attributes:
        batch: the clean prompt, one row.
        positions: ``n`` sorted positions of the clean row to patch.
        values: layer -> ``n H D`` counterfactual head outputs at those positions.
        score_position: where the logits are read.
        a: the clean answer's token id.
        a_star: the counterfactual answer's token id.
    """

    batch: Any
    positions: np.ndarray
    values: dict[int, torch.Tensor]
    score_position: int
    a: int
    a_star: int

    @classmethod
    def from_counterfactual(cls, vlm: Any, clean: Any, counterfactual: Any, positions: Any, layers: Sequence[int],
                            a: int, a_star: int, *, counterfactual_positions: Any = None) -> PatchTask:
        """The task of patching ``clean`` (one row) at ``positions`` with the head outputs of ``counterfactual`` (one
        row) at ``counterfactual_positions`` (default: the same positions), for ``layers``; scored at the clean
        prompt's last position."""
        positions = np.asarray(positions)
        source = positions if counterfactual_positions is None else np.asarray(counterfactual_positions)
        z = vlm.capture(counterfactual, [vlm.adapter.z_site(l) for l in layers])
        values = {l: z[vlm.adapter.z_site(l)][0, source] for l in layers}
        return cls(clean, positions, values, clean.index[0].last_position, a, a_star)

    def __post_init__(self) -> None:
        if len(self.batch) != 1:
            raise InputError(f"a PatchTask holds one clean prompt, got a batch of {len(self.batch)}")
        self.positions = np.asarray(self.positions, dtype=np.int64)
        if self.positions.size == 0:
            raise InputError("a PatchTask needs at least one position to patch")


def check_task(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]]) -> None:
    """Raise :class:`InputError` unless ``task`` and ``heads`` fit ``vlm``: heads in range, positions inside the
    prompt, a score position inside it, and ``n H D`` values for every patched layer. A head of a layer whose
    ``o_proj`` input is not laid out head by head (:meth:`~vlmbind.adapters.base.ModelAdapter.head_layers`) raises
    that layer's :class:`~vlmbind.core.errors.HeadLayoutError`, whichever method runs: the gradient methods hook
    ``o_proj`` directly, so without this check hand-made values of the right shape would pass."""
    seq = task.batch.seq_len
    n_heads = vlm.n_heads
    bad = [(l, h) for l, h in heads if not (0 <= l < vlm.n_layers and 0 <= h < n_heads)]
    if bad:
        raise InputError(f"heads {bad[:5]} are outside the model's {vlm.n_layers} layers x {n_heads} heads")
    absent = vlm.adapter.absent_sites()
    for layer in sorted({l for l, _ in heads}):
        error = absent.get(vlm.adapter.z_site(layer))
        if error is not None:
            raise type(error)(f"cannot patch heads of layer {layer}: {error}")
    if task.positions.min() < 0 or task.positions.max() >= seq or not 0 <= task.score_position < seq:
        raise InputError(f"patch positions {task.positions.tolist()} and score position {task.score_position} must "
                         f"lie inside the prompt of {seq} tokens")
    vocab = vlm.model.get_output_embeddings().weight.shape[0]
    if not (0 <= task.a < vocab and 0 <= task.a_star < vocab):
        raise InputError(f"answer token ids {task.a}, {task.a_star} are outside the vocabulary of {vocab}")
    for layer in sorted({l for l, _ in heads}):
        want = (task.positions.size, n_heads, vlm.adapter.layer_d_head(layer))
        value = task.values.get(layer)
        if value is None or tuple(value.shape) != want:
            got = None if value is None else tuple(value.shape)
            raise InputError(f"counterfactual values of layer {layer} must have shape (positions, heads, d_head) = "
                             f"{want}, got {got}")


def _tick(progress: Callable[[int], Any] | None, done: int) -> None:
    if progress is not None and done:
        progress(done)


def _diff(logits: torch.Tensor, a: int, a_star: int) -> torch.Tensor:
    """``...`` logit difference a* - a of ``... V`` logits, in float32."""
    logits = logits.float()
    return logits[..., a_star] - logits[..., a]


def _values(task: PatchTask, layer: int, heads: Sequence[int]) -> torch.Tensor:
    """``len(heads) n D`` the counterfactual values each listed head writes."""
    return task.values[layer][:, list(heads)].permute(1, 0, 2)


# ----------------------------------------------------------------------------------------------------------------
# naive: one full forward per head
# ----------------------------------------------------------------------------------------------------------------
def naive_diffs(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]], *,
                progress: Callable[[int], Any] | None = None) -> tuple[float, np.ndarray]:
    """The reference: one full forward of the clean prompt per head, that head patched; ``progress`` (e.g. a tqdm
    bar's ``update``) is called with 1 after each head.

    Returns:
        ``(clean difference, len(heads) patched differences)``.
    """
    check_task(vlm, task, heads)
    at = [task.score_position]
    clean = float(_diff(vlm.logits(task.batch, at=at)[0, 0], task.a, task.a_star))
    out = np.zeros(len(heads))
    for i, (layer, head) in enumerate(heads):
        patch = PatchHeads(layer=layer, heads=[head], positions=task.positions,
                           values=task.values[layer][:, [head]][None])
        out[i] = float(_diff(vlm.logits(task.batch, [patch], at=at)[0, 0], task.a, task.a_star))
        _tick(progress, 1)
    return clean, out


# ----------------------------------------------------------------------------------------------------------------
# exact: prefix cache reuse, heads as batch rows, start at the patched layer
# ----------------------------------------------------------------------------------------------------------------
def prefix_end(vlm: Any, batch: Any, inputs: dict[str, Any], first_patch: int) -> int:
    """Where the reusable prefix ends: the first patched position if it lies after every image token and every
    position of a bidirectional block (``adapter.bidirectional_positions``: they attend to later positions, so a
    patch at or before the last of them changes them), else 0 (nothing reusable). Also 0 on a model with recurrent
    layers (``adapter.recurrent_layers``: the cache holds their state after the whole prompt, not after the
    prefix) or cross-attention layers (their cache holds the image's keys, which a cut to the prefix would drop):
    ``adapter.reuses_prefix_cache``."""
    if not vlm.adapter.reuses_prefix_cache():
        return 0
    index = batch.index[0]
    barrier = int(index.image_positions.max()) if index.image_positions.size else -1
    marked = vlm.adapter.bidirectional_positions(inputs)
    if marked.numel():
        barrier = max(barrier, int(marked.max()))
    return first_patch if first_patch > barrier else 0


def sequence_keys(inputs: dict[str, Any]) -> list[str]:
    """The per-token inputs (``input_ids`` and the family's token inputs), not the attention mask."""
    shape = inputs["input_ids"].shape
    return [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape == shape and k != "attention_mask"]


def _suffix_inputs(inputs: dict[str, Any], position_ids: torch.Tensor | None, start: int, rows: int,
                   cache: Any, keep: int) -> dict[str, Any]:
    """Model kwargs running positions ``[start, P)`` of the one-row ``inputs`` as ``rows`` identical rows on
    ``cache`` (the prefix's)."""
    seq = inputs["input_ids"].shape[1]
    out: dict[str, Any] = {k: inputs[k][:, start:].expand(rows, -1) for k in sequence_keys(inputs)}
    out["attention_mask"] = inputs["attention_mask"].expand(rows, -1)
    if position_ids is not None:
        sliced = position_ids[..., start:]
        out["position_ids"] = sliced.expand(*sliced.shape[:-2], rows, sliced.shape[-1])
    out["cache_position"] = torch.arange(start, seq, device=inputs["input_ids"].device)
    out["past_key_values"] = expand_cache(cache, rows)
    out["use_cache"] = True
    out["logits_to_keep"] = keep
    return out


def expand_cache(cache: Any, rows: int) -> Any:
    """A copy of a one-row key/value cache seen as ``rows`` rows: shallow per-layer copies whose tensors are
    ``expand``-ed views, so nothing is copied until a layer appends (the original cache is never modified;
    sliding-window layers keep their true length)."""
    new = copy.copy(cache)
    new.layers = []
    for layer in cache.layers:
        layer = copy.copy(layer)
        for name in ("keys", "values"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor) and value.ndim == 4:
                setattr(layer, name, value.expand(rows, -1, -1, -1))
        new.layers.append(layer)
    return new


@contextlib.contextmanager
def start_at_layer(adapter: Any, start: int, hidden: torch.Tensor) -> Iterator[None]:
    """Skip decoder layers ``< start`` (identity) and feed layer ``start`` the residual ``hidden`` (``B S d``) instead
    of what reaches it; everything is restored on exit, also after an error."""
    def skip(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    def inject(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    skipped = [adapter.layer(i) for i in range(start)]
    # another library (nnsight) may already keep its own instance-level forward on a layer: put that one back
    before = [layer.__dict__.get("forward", _ABSENT) for layer in skipped]
    handle = adapter.layer(start).register_forward_pre_hook(inject, with_kwargs=True)
    try:
        for layer in skipped:
            layer.forward = skip
        yield
    finally:
        for layer, previous in zip(skipped, before):
            if previous is _ABSENT:
                layer.__dict__.pop("forward", None)
            else:
                layer.__dict__["forward"] = previous
        handle.remove()


def _rows_per_chunk(vlm: Any, prefix: int, max_rows: int, memory_budget: int) -> int:
    """Rows per batched forward so that the materialised prefix cache stays under the budget."""
    a = vlm.adapter
    itemsize = next(vlm.model.parameters()).element_size()
    per_row = sum(a.cache_width(layer) for layer in range(a.n_layers)) * max(prefix, 1) * itemsize
    return int(max(1, min(max_rows, memory_budget // per_row)))


def packed_bytes(vlm: Any, prefix: int, suffix: int, blocks: int) -> int:
    """Bytes the attention of one packed row takes per layer: its additive mask (queries x keys), and under eager
    attention also the scores and probabilities of every head."""
    itemsize = next(vlm.model.parameters()).element_size()
    queries = blocks * suffix
    keys = prefix + queries
    eager = getattr(vlm.model.config, "_attn_implementation", None) == "eager"
    return queries * keys * itemsize * (1 + (2 * vlm.adapter.n_heads if eager else 0))


def _packed_per_chunk(vlm: Any, prefix: int, suffix: int, max_tokens: int, memory_budget: int) -> int:
    """Experiments per packed forward: at most ``max_tokens`` suffix tokens, and the packed row's attention
    (:func:`packed_bytes`) within ``memory_budget``; never fewer than one."""
    n = max(1, max_tokens // suffix)
    while n > 1 and packed_bytes(vlm, prefix, suffix, n) > memory_budget:
        n -= 1
    return n


def _chunks(heads: Sequence[tuple[int, int]], per_chunk: int) -> list[list[int]]:
    """Indices of ``heads`` in layer order, cut into chunks of at most ``per_chunk``."""
    order = sorted(range(len(heads)), key=lambda i: heads[i])
    return [order[c : c + per_chunk] for c in range(0, len(order), per_chunk)]


def _entries(task: PatchTask, chunk_heads: list[tuple[int, int]], block_positions: list[np.ndarray],
             rows: list[int]) -> list[PatchHeadEntries]:
    """One :class:`PatchHeadEntries` per layer: experiment ``i`` writes its head at ``block_positions[i]`` of row
    ``rows[i]``."""
    out = []
    n = task.positions.size
    for layer in sorted({layer for layer, _ in chunk_heads}):
        mine = [i for i, (l, _) in enumerate(chunk_heads) if l == layer]
        out.append(PatchHeadEntries(
            layer=layer,
            heads=[chunk_heads[i][1] for i in mine for _ in range(n)],
            rows=[rows[i] for i in mine for _ in range(n)],
            positions=np.concatenate([block_positions[i] for i in mine]),
            values=torch.cat([task.values[layer][:, chunk_heads[i][1]] for i in mine]),
        ))
    return out


def packable(vlm: Any) -> bool:
    """Whether the text model's attention takes a custom 4-D mask (sdpa and eager variants do), one per layer type
    when some layers slide (``adapter.mask_per_layer_type``: PaliGemma 2's forward would give its sliding layers
    the full layers' mask); never with recurrent layers, which no mask keeps the copies apart in."""
    cfg = vlm.adapter.text_config
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ())
    return (cfg._attn_implementation in ("sdpa", "eager", ATTENTION_IMPL)
            and (vlm.adapter.mask_per_layer_type or not sliding) and not vlm.adapter.recurrent_layers())


def _packed_masks(vlm: Any, cache: Any, start: int, suffix: int, blocks: int, device: Any) -> Any:
    """The attention mask of ``blocks`` copies of the suffix packed in one row after the prefix cache: each copy
    sees the prefix and, causally, itself, never another copy. One mask per layer type when some layers use a
    sliding window (their cache keeps only the window's last keys)."""
    cfg = vlm.adapter.text_config
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * vlm.n_layers)
    window = getattr(cfg, "sliding_window", None)
    q_pos = torch.arange(start, start + suffix, device=device).repeat(blocks)
    q_block = torch.arange(blocks, device=device).repeat_interleave(suffix)
    float_mask = cfg._attn_implementation != "sdpa"
    dtype = next(vlm.model.parameters()).dtype
    masks = {}
    for kind in dict.fromkeys(types):
        kept = int(cache.layers[types.index(kind)].keys.shape[-2])
        kv_pos = torch.cat([torch.arange(start - kept, start, device=device), q_pos])
        kv_block = torch.cat([torch.full((kept,), -1, device=device), q_block])
        allowed = ((kv_block[None] == -1) | (kv_block[None] == q_block[:, None])) & (kv_pos[None] <= q_pos[:, None])
        if kind == "sliding_attention" and window:
            allowed &= (q_pos[:, None] - kv_pos[None]) < window
        mask = allowed[None, None]
        if float_mask:
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
        masks[kind] = mask
    return masks if len(masks) > 1 else next(iter(masks.values()))


def _packed_inputs(vlm: Any, inputs: dict[str, Any], position_ids: torch.Tensor | None, start: int, blocks: int,
                   cache: Any) -> dict[str, Any]:
    """Model kwargs running ``blocks`` copies of positions ``[start, P)`` packed in one row on the prefix cache."""
    seq = inputs["input_ids"].shape[1]
    suffix = seq - start
    device = inputs["input_ids"].device
    out: dict[str, Any] = {k: inputs[k][:, start:].repeat(1, blocks) for k in sequence_keys(inputs)}
    if position_ids is None:
        position_ids = torch.arange(seq, device=device)[None]
    out["position_ids"] = position_ids[..., start:].repeat(*([1] * (position_ids.ndim - 1)), blocks)
    out["attention_mask"] = _packed_masks(vlm, cache, start, suffix, blocks, device)
    out["cache_position"] = torch.arange(start, start + suffix * blocks, device=device)
    out["past_key_values"] = expand_cache(cache, 1)
    out["use_cache"] = True
    return out


def single_pass_capable(vlm: Any) -> bool:
    """Whether the clean prompt's own attention mask is plainly causal (no bidirectional image block, no sliding
    window) and takes a custom mask, so the experiments can ride along in the clean forward itself."""
    cfg = vlm.adapter.text_config
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    return packable(vlm) and not vlm.adapter.bidirectional_image and types == {"full_attention"}


def _single_pass(vlm: Any, task: PatchTask, inputs: dict[str, Any], position_ids: torch.Tensor | None, start: int,
                 heads: list[tuple[int, int]], layers: list[int]) -> tuple[float, np.ndarray, dict[int, torch.Tensor]]:
    """The clean prompt and one copy of its suffix per experiment in ONE forward: the clean part is causal as
    usual, each copy sees the prefix and, causally, itself. Returns the clean difference, the patched ones and the
    clean z at the patch positions."""
    model = vlm.model
    seq = inputs["input_ids"].shape[1]
    suffix, n = seq - start, len(heads)
    device = inputs["input_ids"].device
    kwargs = {k: v for k, v in inputs.items() if k not in sequence_keys(inputs) and k != "attention_mask"}
    for key in sequence_keys(inputs):
        kwargs[key] = torch.cat([inputs[key], inputs[key][:, start:].repeat(1, n)], 1)
    if position_ids is None:
        position_ids = torch.arange(seq, device=device)[None]
    kwargs["position_ids"] = torch.cat(
        [position_ids, position_ids[..., start:].repeat(*([1] * (position_ids.ndim - 1)), n)], -1)
    total = seq + n * suffix
    block = torch.cat([torch.full((seq,), -1, device=device), torch.arange(n, device=device).repeat_interleave(suffix)])
    index = torch.arange(total, device=device)
    q, k = block[:, None], block[None, :]
    allowed = ((k == -1) & (q == -1) & (index[None] <= index[:, None])) | \
              ((k == -1) & (q >= 0) & (index[None] < start)) | \
              ((k == q) & (q >= 0) & (index[None] <= index[:, None]))
    mask = allowed[None, None]
    if vlm.adapter.text_config._attn_implementation != "sdpa":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    kwargs["attention_mask"] = mask
    # CPU indices: they may index hidden states on any device (under a multi-device map the last layer's device
    # is not the embeddings' one, and a CUDA index on another device raises)
    scored_at = torch.cat([torch.tensor([task.score_position]),
                           seq + (task.score_position - start) + suffix * torch.arange(n)])
    kwargs["logits_to_keep"] = scored_at
    local = task.positions - start
    blocks = [seq + local + j * suffix for j in range(n)]
    session = HookSession(vlm.adapter, vlm.sites([vlm.adapter.z_site(l) for l in layers]),
                          _entries(task, heads, blocks, [0] * n))
    with session:
        logits = model(**kwargs, use_cache=False).logits[0]
    diffs = _diff(logits, task.a, task.a_star).cpu().numpy()
    clean_z = {l: session.captured[vlm.adapter.z_site(l)][0][0, task.positions] for l in layers}
    return float(diffs[0]), diffs[1:], clean_z


def exact_diffs(
    vlm: Any,
    task: PatchTask,
    heads: Sequence[tuple[int, int]],
    *,
    max_tokens: int = 64,
    max_rows: int = 64,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    layout: str = "auto",
    progress: Callable[[int], Any] | None = None,
) -> tuple[float, np.ndarray]:
    """The naive numbers, fast (see the module docstring).

    Args:
        vlm: a loaded VLM.
        task: the clean prompt, patch positions, counterfactual values and answers.
        heads: ``(layer, head)`` pairs to patch, one experiment each.
        max_tokens: ``packed`` layout: most suffix tokens (experiments x suffix length) in one forward; 64 was
            fastest on CPU (smaller chunks start at higher layers, larger ones amortise the call); raise it on GPUs.
        max_rows: ``batched`` layout: most experiments in one forward.
        memory_budget: bytes one forward's extra memory may take: the materialised prefix cache (``batched``), or
            the packed row's attention mask and, under eager attention, its scores (``packed``, per layer).
        layout: ``single`` (the clean prompt and every experiment's suffix in one forward; families whose mask is
            plainly causal, when all experiments fit in ``max_tokens``), ``packed`` (the experiments' suffixes side
            by side in one row after the clean forward, a block mask keeping them apart; the prefix cache is
            shared, never copied), ``batched`` (one batch row per experiment; any attention implementation) or
            ``auto`` (single, else packed, else batched, whichever applies).
        progress: called with the number of heads each forward finished (e.g. a tqdm bar's ``update``).

    Returns:
        ``(clean difference, len(heads) patched differences)``.
    """
    if layout not in ("auto", "single", "packed", "batched"):
        raise InputError(f"layout must be auto, single, packed or batched, got {layout!r}")
    if layout == "packed" and not packable(vlm):
        raise InputError(f"layout 'packed' needs a custom-mask attention and, with sliding windows, a mask per layer "
                         f"type; {vlm.family} ({vlm.adapter.text_config._attn_implementation} attention) lacks one: "
                         "use 'batched' or 'auto'")
    if layout == "single" and not single_pass_capable(vlm):
        raise InputError(f"layout 'single' needs a plainly causal text mask and a custom-mask attention; "
                         f"{vlm.family} has a bidirectional image block, sliding windows or another attention: use "
                         "'packed' or 'auto'")
    check_task(vlm, task, heads)
    adapter, model = vlm.adapter, vlm.model
    inputs = vlm.model_inputs(task.batch)
    seq = inputs["input_ids"].shape[1]
    position_ids = adapter.position_ids(inputs)
    start = prefix_end(vlm, task.batch, inputs, int(task.positions.min()))
    if start == 0:
        if rows_without_prefix(vlm):
            with torch.no_grad():
                return _rows_without_prefix(vlm, task, heads, inputs, position_ids, max_rows, memory_budget,
                                            progress)
        return _exact_without_prefix(vlm, task, heads, progress)
    keep = seq - task.score_position
    if not 1 <= keep <= seq - start:
        raise InputError(f"score position {task.score_position} must lie at or after the first patched position")
    suffix = seq - start
    local = task.positions - start
    first_layer = min((layer for layer, _ in heads), default=0)
    fits = len(heads) * suffix <= max_tokens
    if layout == "auto":
        layout = "single" if single_pass_capable(vlm) and fits else "packed" if packable(vlm) else "batched"
    out = np.zeros(len(heads))
    if layout == "single":
        if not fits:
            raise InputError(f"layout 'single' runs every experiment in one forward: {len(heads)} heads x {suffix} "
                             f"suffix tokens exceed max_tokens={max_tokens}")
        layers = sorted({layer for layer, _ in heads})
        with torch.no_grad():
            clean, patched, clean_z = _single_pass(vlm, task, inputs, position_ids, start, list(heads), layers)
        for i, (l, h) in enumerate(heads):
            # patching a head with its own clean value is the identity: exactly the clean difference
            same = torch.equal(task.values[l][:, h].to(clean_z[l]), clean_z[l][:, h])
            out[i] = clean if same else patched[i]
        _tick(progress, len(heads))
        return clean, out
    with torch.no_grad():
        # One clean forward gives the clean logits, the residual entering every layer, and every layer's keys and
        # values. The cache is a plain one (no sliding-window layer drops keys; windows apply through the masks),
        # so its first `start` positions are exactly the prefix's cache.
        layers = sorted({layer for layer, _ in heads})
        sites = [f"blocks.{l}.hook_resid_pre" for l in range(first_layer, vlm.n_layers)]
        session = HookSession(adapter, vlm.sites(sites + [adapter.z_site(l) for l in layers]))
        with session:
            extra = {} if position_ids is None else {"position_ids": position_ids}
            full = model(**inputs, **extra, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=keep)
        clean = float(_diff(full.logits[0, 0], task.a, task.a_star))
        captured = {name: vals[0] for name, vals in session.captured.items()}
        resid = {l: captured[f"blocks.{l}.hook_resid_pre"][:, start:] for l in range(first_layer, vlm.n_layers)}
        # patching a head with its own clean value is the identity: exactly the clean difference, nothing to run
        clean_z = {l: captured[adapter.z_site(l)][0, task.positions] for l in layers}
        todo = [i for i, (l, h) in enumerate(heads)
                if not torch.equal(task.values[l][:, h].to(clean_z[l]), clean_z[l][:, h])]
        out[:] = clean
        _tick(progress, len(heads) - len(todo))
        cache = full.past_key_values
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :start], layer.values[:, :, :start]

        if layout == "packed":
            per_chunk = _packed_per_chunk(vlm, start, suffix, max_tokens, memory_budget)
        else:
            per_chunk = _rows_per_chunk(vlm, start, max_rows, memory_budget)
        for part in _chunks([heads[i] for i in todo], per_chunk):
            chunk = [todo[i] for i in part]
            chunk_heads = [heads[i] for i in chunk]
            low = chunk_heads[0][0]
            n = len(chunk)
            if layout == "packed":
                blocks = [local + k * suffix for k in range(n)]
                interventions = _entries(task, chunk_heads, blocks, [0] * n)
                hidden = resid[low].repeat(1, n, 1)
                kwargs = _packed_inputs(vlm, inputs, position_ids, start, n, cache)
                # logits only at each copy's scored position, never over the packed row
                scored_at = (task.score_position - start) + suffix * torch.arange(n, device=hidden.device)
                kwargs["logits_to_keep"] = scored_at
            else:
                interventions = _entries(task, chunk_heads, [local] * n, list(range(n)))
                hidden = resid[low].expand(n, -1, -1)
                kwargs = _suffix_inputs(inputs, position_ids, start, n, cache, keep)
            with start_at_layer(adapter, low, hidden), HookSession(adapter, (), interventions):
                logits = model(**kwargs).logits
            if layout == "packed":
                scored = logits[0]
            else:
                scored = logits[:, 0]
            out[chunk] = _diff(scored, task.a, task.a_star).cpu().numpy()
            _tick(progress, len(chunk))
    return clean, out


def rows_without_prefix(vlm: Any) -> bool:
    """Whether patches with no reusable prefix may run as batch rows on the sequence's tokens alone: the image's
    features enter the text model only at its input, which the skipped layers never read (no cross-attention layers
    reading the image's keys, no DeepStack injections into later layers, no recurrent state)."""
    adapter = vlm.adapter
    return adapter.reuses_prefix_cache() and not adapter.n_deepstack


def _rows_without_prefix(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]], inputs: dict[str, Any],
                         position_ids: torch.Tensor | None, max_rows: int, memory_budget: int,
                         progress: Callable[[int], Any] | None = None) -> tuple[float, np.ndarray]:
    """Patches at or before an image block, one batch row per head: the whole sequence runs from the chunk's lowest
    patched layer, fed the clean residual there, so the vision tower runs once (in the clean forward) and the rows
    need only the tokens and position ids."""
    adapter, model = vlm.adapter, vlm.model
    seq = inputs["input_ids"].shape[1]
    keep = seq - task.score_position
    layers = sorted({layer for layer, _ in heads})
    sites = [f"blocks.{l}.hook_resid_pre" for l in range(layers[0], vlm.n_layers)]
    session = HookSession(adapter, vlm.sites(sites + [adapter.z_site(l) for l in layers]))
    with session:
        extra = {} if position_ids is None else {"position_ids": position_ids}
        full = model(**inputs, **extra, use_cache=False, logits_to_keep=keep)
    clean = float(_diff(full.logits[0, 0], task.a, task.a_star))
    captured = {name: vals[0] for name, vals in session.captured.items()}
    clean_z = {l: captured[adapter.z_site(l)][0, task.positions] for l in layers}
    todo = [i for i, (l, h) in enumerate(heads)
            if not torch.equal(task.values[l][:, h].to(clean_z[l]), clean_z[l][:, h])]
    out = np.full(len(heads), clean)
    _tick(progress, len(heads) - len(todo))
    tokens = {k: v for k, v in inputs.items() if k in sequence_keys(inputs) or k == "attention_mask"}
    for part in _chunks([heads[i] for i in todo], _rows_per_chunk(vlm, seq, max_rows, memory_budget)):
        chunk = [todo[i] for i in part]
        chunk_heads = [heads[i] for i in chunk]
        low, n = chunk_heads[0][0], len(chunk)
        hidden = captured[f"blocks.{low}.hook_resid_pre"].expand(n, -1, -1)
        kwargs = _suffix_inputs(tokens, position_ids, 0, n, DynamicCache(), keep)
        interventions = _entries(task, chunk_heads, [task.positions] * n, list(range(n)))
        with start_at_layer(adapter, low, hidden), HookSession(adapter, (), interventions):
            logits = model(**kwargs).logits
        out[chunk] = _diff(logits[:, 0], task.a, task.a_star).cpu().numpy()
        _tick(progress, len(chunk))
    return clean, out


def _exact_without_prefix(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]],
                          progress: Callable[[int], Any] | None = None) -> tuple[float, np.ndarray]:
    """Patches at or before an image block: no prefix to reuse; each head runs the whole prompt, from its layer."""
    adapter = vlm.adapter
    layers = sorted({layer for layer, _ in heads})
    sites = [f"blocks.{l}.hook_resid_pre" for l in layers]
    at = [task.score_position]
    run = vlm.run(task.batch, sites=sites, logits_at=at)
    clean = float(_diff(run.logits[0, 0], task.a, task.a_star))
    out = np.zeros(len(heads))
    for i, (layer, head) in enumerate(heads):
        patch = PatchHeads(layer=layer, heads=[head], positions=task.positions,
                           values=task.values[layer][:, [head]][None])
        with start_at_layer(adapter, layer, run.cache[f"blocks.{layer}.hook_resid_pre"]):
            logits = vlm.logits(task.batch, [patch], at=at)
        out[i] = float(_diff(logits[0, 0], task.a, task.a_star))
        _tick(progress, 1)
    return clean, out


# ----------------------------------------------------------------------------------------------------------------
# attribution: gradient x activation difference, one forward-backward for every head
# ----------------------------------------------------------------------------------------------------------------
def _path_gradients(vlm: Any, task: PatchTask, layers: Sequence[int], alphas: Sequence[float]
                    ) -> tuple[float, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Run the clean prompt once per ``alpha`` with every listed layer's head outputs at the patch positions moved
    ``alpha`` of the way from the clean run's to the counterfactual's, and average the gradients of
    ``logit[a*] - logit[a]`` with respect to them.

    Returns:
        ``(clean difference, clean z per layer (n H*D at the positions), mean gradient per layer (n H*D))``; the
        clean difference and z come from an alpha-0 run (added first when 0 is not among ``alphas``).
    """
    adapter = vlm.adapter
    pos = torch.as_tensor(task.positions)
    inputs = vlm.model_inputs(task.batch)
    clean_z: dict[int, torch.Tensor] = {}
    sums: dict[int, torch.Tensor] = {}
    clean = None
    runs = ([0.0] if 0.0 not in alphas else []) + [float(a) for a in alphas]
    for alpha in runs:
        deltas: dict[int, torch.Tensor] = {}

        def hook_for(layer: int, alpha: float = alpha) -> Any:
            def hook(module: Any, args: tuple) -> tuple:
                x = args[0]
                if layer not in clean_z:
                    clean_z[layer] = x.detach()[0, pos]
                shift = torch.zeros_like(x)
                if alpha:
                    target = task.values[layer].reshape(len(pos), -1).to(x)
                    shift[0, pos] = alpha * (target - clean_z[layer].to(x))
                delta = torch.zeros_like(x, requires_grad=True)
                deltas[layer] = delta
                return (x + shift + delta, *args[1:])
            return hook

        handles = [adapter.o_proj_module(layer).register_forward_pre_hook(hook_for(layer)) for layer in layers]
        try:
            with torch.enable_grad():
                keep = torch.tensor([task.score_position], device=vlm.device)
                logits = vlm.model(**inputs, use_cache=False, logits_to_keep=keep).logits
                diff = _diff(logits[0, 0], task.a, task.a_star)
                grads = torch.autograd.grad(diff, [deltas[layer] for layer in layers])
        finally:
            for handle in handles:
                handle.remove()
        if alpha == 0.0 and clean is None:
            clean = float(diff.detach())
        if alpha in [float(a) for a in alphas]:
            for layer, grad in zip(layers, grads):
                g = grad[0, pos].float()
                sums[layer] = g if layer not in sums else sums[layer] + g
    return float(clean), clean_z, {layer: g / len(alphas) for layer, g in sums.items()}


def _estimates(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]], clean: float,
               clean_z: dict[int, torch.Tensor], grads: dict[int, torch.Tensor]) -> np.ndarray:
    """``clean + sum_positions (z* - z) . grad`` per head."""
    h = vlm.adapter.n_heads
    n = len(task.positions)
    effect: dict[int, np.ndarray] = {}
    for layer, grad in grads.items():
        z = clean_z[layer].reshape(n, h, -1).float()  # this layer's own head width (layer_d_head)
        g = grad.reshape(n, h, -1)
        effect[layer] = ((task.values[layer].to(z) - z) * g).sum((0, 2)).cpu().numpy()
    return np.array([clean + effect[layer][head] for layer, head in heads])


def attribution_diffs(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]]) -> tuple[float, np.ndarray]:
    """First-order estimate of every head's patched difference from one forward and one backward pass (AtP):
    ``clean + sum_positions (z* - z) . d(logit[a*] - logit[a]) / dz`` at the clean run.

    Returns:
        ``(clean difference, len(heads) estimated patched differences)``.
    """
    check_task(vlm, task, heads)
    layers = sorted({layer for layer, _ in heads})
    clean, clean_z, grads = _path_gradients(vlm, task, layers, [0.0])
    return clean, _estimates(vlm, task, heads, clean, clean_z, grads)


def integrated_gradients_diffs(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]], *,
                               steps: int = IG_STEPS) -> tuple[float, np.ndarray]:
    """Integrated-gradients estimate of every head's patched difference (EAP-IG style, on head outputs):
    ``clean + sum_positions (z* - z) . mean_k grad(z + alpha_k (z* - z))`` with ``alpha_k = (k + 1/2) / steps``,
    every scored layer's heads moved along the path together. With one layer the estimates add up (completeness)
    to the difference of patching all its heads at once, as ``steps`` grows. Costs ``steps + 1`` forward-backward
    passes per pair.

    Raises:
        InputError: ``steps`` is not an int >= 1, or the task does not fit the model.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"integrated gradients steps must be an int >= 1, got {steps!r}")
    check_task(vlm, task, heads)
    layers = sorted({layer for layer, _ in heads})
    alphas = [(k + 0.5) / steps for k in range(steps)]
    clean, clean_z, grads = _path_gradients(vlm, task, layers, alphas)
    return clean, _estimates(vlm, task, heads, clean, clean_z, grads)


# ----------------------------------------------------------------------------------------------------------------
# AtP*: attribution with the QK fix and GradDrop (Kramar et al. 2024)
# ----------------------------------------------------------------------------------------------------------------
def _layer_kwargs(vlm: Any, layers: Sequence[int]) -> Any:
    """A context recording the keyword arguments each of ``layers`` is called with (masks, position embeddings)."""
    kwargs: dict[int, dict[str, Any]] = {}

    def remember(layer: int) -> Any:
        def hook(module: Any, args: tuple, kw: dict) -> None:
            kwargs[layer] = {k: v for k, v in kw.items() if k != "hidden_states"}
        return hook

    handles = [vlm.adapter.layer(l).register_forward_pre_hook(remember(l), with_kwargs=True) for l in layers]
    return kwargs, handles


def _atp_star_pass(vlm: Any, task: PatchTask, layers: Sequence[int], drop: int | None
                   ) -> tuple[float, dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor],
                              dict[int, torch.Tensor], dict[int, dict[str, Any]]]:
    """One forward and backward of the clean prompt under vlmbind's eager attention, with the gradient through layer
    ``drop``'s attention and MLP outputs cut (None: no cut). Returns the logit difference, per scored layer the clean
    z at the patch positions and the metric's gradient there (AtP's), per layer the clean attention pattern, its
    gradient, the residual entering it and its call's keyword arguments."""
    adapter = vlm.adapter
    pos = torch.as_tensor(task.positions)
    inputs = vlm.model_inputs(task.batch)
    z: dict[int, torch.Tensor] = {}
    patterns: dict[int, torch.Tensor] = {}
    resid: dict[int, torch.Tensor] = {}

    def open_z(layer: int) -> Any:
        def hook(module: Any, args: tuple) -> tuple:
            x = args[0] + torch.zeros_like(args[0], requires_grad=True)
            z[layer] = x
            return (x, *args[1:])
        return hook

    def keep_pattern(layer: int) -> Any:
        def edit(weights: torch.Tensor) -> torch.Tensor:
            patterns[layer] = weights
            return weights
        return edit

    def keep_resid(layer: int) -> Any:
        def hook(module: Any, args: tuple, kw: dict) -> None:
            resid[layer] = (args[0] if args else kw["hidden_states"]).detach()
        return hook

    def cut(module: Any, args: tuple, kw: dict, output: Any) -> Any:
        hidden = args[0] if args else kw["hidden_states"]
        out = first_output(output)
        return with_first_output(output, hidden + (out - hidden).detach())

    every = list(range(vlm.n_layers))
    kwargs, handles = _layer_kwargs(vlm, every)
    handles += [adapter.o_proj_module(l).register_forward_pre_hook(open_z(l)) for l in layers]
    handles += [adapter.layer(l).register_forward_pre_hook(keep_resid(l), with_kwargs=True) for l in every]
    if drop is not None:
        handles.append(adapter.layer(drop).register_forward_hook(cut, with_kwargs=True))
    softmax_layers = [l for l in adapter.pattern_layers() if l not in adapter.cross_attention_layers()]
    modules = [adapter.attention_module(l) for l in softmax_layers]
    for layer, module in zip(softmax_layers, modules):
        setattr(module, PROB_EDITS, [keep_pattern(layer)])
    keep = torch.tensor([task.score_position], device=vlm.device)
    try:
        with torch.enable_grad(), attention_implementation(adapter, ATTENTION_IMPL):
            metric = _diff(vlm.model(**inputs, use_cache=False, logits_to_keep=keep).logits[0, 0], task.a, task.a_star)
            tracked = [l for l in softmax_layers if l in patterns and patterns[l].requires_grad]
            grads = torch.autograd.grad(metric, [z[l] for l in layers] + [patterns[l] for l in tracked],
                                        allow_unused=True)
            z_grads, grads = grads[:len(layers)], grads[len(layers):]
            pattern_grads = {l: (torch.zeros_like(patterns[l]) if g is None else g).detach()
                             for l, g in zip(tracked, grads)}
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            module.__dict__.pop(PROB_EDITS, None)
    clean_z = {l: z[l].detach()[0, pos] for l in layers}
    fixed_grads = {l: (torch.zeros_like(z[l]) if g is None else g)[0, pos].float() for l, g in zip(layers, z_grads)}
    clean_patterns = {l: patterns[l].detach() for l in pattern_grads}
    return float(metric.detach()), clean_z, fixed_grads, clean_patterns, pattern_grads, resid, kwargs


def atp_star_diffs(vlm: Any, task: PatchTask, heads: Sequence[tuple[int, int]], *, grad_drop: bool = True
                   ) -> tuple[float, np.ndarray]:
    """AtP* (Kramar et al. 2024) estimate of every head's patched difference. Two fixes to AtP:

    - **QK fix**: a head's change reaches later heads' attention patterns through their queries and keys, where a
      saturated softmax makes the gradient near zero. For each later self-attention layer, the linear change of its
      patterns when the head's write into the residual stream (at the patch positions) is added to the layer's
      input is replaced by the exact change, both times the metric's gradient with respect to those patterns; every
      other path stays AtP's. To first order the estimate is AtP's.
    - **GradDrop**: cancelling paths can hide an effect, so the estimate is computed again with the gradient through
      each layer's attention and MLP outputs cut in turn, and the head's score is the mean of the absolute values
      over the layers other than its own (a magnitude: AtP* ranks heads, it does not sign them).

    ``grad_drop=False`` gives the QK-fixed estimate alone, signed (one pass). Costs two forward-backward passes per
    layer (one without GradDrop) plus one call of each later layer per head. The QK fix looks one attention layer
    ahead: an effect that passes through two saturated softmaxes in turn is still underestimated by it.

    Returns:
        ``(clean difference, len(heads) clean + score)``.
    """
    check_task(vlm, task, heads)
    adapter = vlm.adapter
    layers = sorted({l for l, _ in heads})
    n, h = task.positions.size, vlm.n_heads
    pos = torch.as_tensor(task.positions)
    per_drop = []
    clean = None
    writes: dict[int, torch.Tensor] = {}
    changes: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    for drop in (range(vlm.n_layers) if grad_drop else [None]):
        diff, clean_z, fixed_grads, patterns, pattern_grads, resid, kwargs = _atp_star_pass(vlm, task, layers, drop)
        clean = diff if clean is None else clean
        if not changes:  # the exact pattern changes are forward quantities: the same for every cut
            with torch.no_grad():
                for layer in layers:
                    z = clean_z[layer].reshape(n, h, -1)
                    writes[layer] = head_writes(vlm, layer, z, task.values[layer])
                for layer, head in heads:
                    later = {}
                    for m in patterns:
                        if m <= layer:
                            continue
                        direction = torch.zeros_like(resid[m])
                        direction[0, pos] = writes[layer][head].to(direction)
                        exact = _pattern_of(vlm, m, resid[m] + direction, kwargs=kwargs[m]) - patterns[m]
                        with torch.enable_grad():
                            _, linear = torch.autograd.functional.jvp(
                                partial(_pattern_of, vlm, m, kwargs=kwargs[m]), resid[m], direction)
                        later[m] = exact - linear
                    changes[(layer, head)] = later
        out = np.zeros(len(heads))
        for i, (layer, head) in enumerate(heads):
            z = clean_z[layer].reshape(n, h, -1).float()
            g = fixed_grads[layer].reshape(n, h, -1)
            value = float(((task.values[layer].to(z) - z)[:, head] * g[:, head]).sum())
            value += sum(float((change.float() * pattern_grads[m].float()).sum())
                         for m, change in changes[(layer, head)].items())
            out[i] = value
        per_drop.append(out)
    if not grad_drop:
        return float(clean), clean + per_drop[0]
    drops = np.array(per_drop)
    own = np.array([[l == drop for l, _ in heads] for drop in range(vlm.n_layers)])
    score = np.where(own, 0.0, np.abs(drops)).sum(0) / max(vlm.n_layers - 1, 1)
    return float(clean), clean + score


def head_writes(vlm: Any, layer: int, clean_z: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``H n d_model``: what each head adds to the residual stream at the patch positions when it alone takes its
    value, through ``o_proj``, the family's post-norm and gate."""
    adapter = vlm.adapter
    n, h, d = clean_z.shape
    variants = clean_z[None].repeat(h, 1, 1, 1)
    index = torch.arange(h)
    variants[index, :, index] = values.to(clean_z).permute(1, 0, 2)
    o_proj = adapter.o_proj_module(layer)
    after = adapter.attn_out_module(layer)
    post = after if after is not adapter.attention_module(layer) else (lambda x: x)
    out = post(o_proj(variants.reshape(h, n, h * d))) - post(o_proj(clean_z.reshape(1, n, h * d)))
    gate = adapter.output_gate(layer, "attn", {})
    return out if gate is None else gate.to(out) * out


def _pattern_of(vlm: Any, layer: int, hidden: torch.Tensor, *, kwargs: dict[str, Any]) -> torch.Tensor:
    """Layer ``layer``'s attention pattern (``1 H P K``) when it reads ``hidden``, under vlmbind's eager attention."""
    adapter = vlm.adapter
    seen: dict[str, torch.Tensor] = {}

    def keep(weights: torch.Tensor) -> torch.Tensor:
        seen["p"] = weights
        return weights

    module = adapter.attention_module(layer)
    setattr(module, PROB_EDITS, [keep])
    try:
        with attention_implementation(adapter, ATTENTION_IMPL):
            adapter.layer(layer)(hidden, **kwargs)
    finally:
        module.__dict__.pop(PROB_EDITS, None)
    return seen["p"]


def first_output(output: Any) -> torch.Tensor:
    """The hidden states of a module's output (a tensor, or the first of a tuple or list)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_first_output(output: Any, value: torch.Tensor) -> Any:
    """``output`` with its hidden states replaced by ``value`` (the rest of a tuple or list kept)."""
    if isinstance(output, tuple):
        return (value, *output[1:])
    if isinstance(output, list):
        return [value, *output[1:]]
    return value


METHOD_FUNCTIONS = {"naive": naive_diffs, "exact": exact_diffs, "attribution": attribution_diffs,
                    "integrated_gradients": integrated_gradients_diffs, "atp_star": atp_star_diffs}
