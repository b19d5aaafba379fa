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
* cross-attention layers (Llama-3.2-Vision) have ``cross_attn.hook_z`` / ``cross_attn.hook_pattern`` in place of
  ``attn.*``: the same hooks on the layer's cross-attention module and its ``o_proj`` (the adapter points
  ``attention_module`` / ``o_proj_module`` there), and their attention and MLP outputs reach the residual stream
  through tanh gates (``adapter.output_gate``), which ``hook_attn_out`` / ``hook_mlp_out`` include (in general they
  are ``adapter.residual_write``: Qwen4-Exp's hyper-connections write each output into several residual streams);
* hybrid models (Qwen3.5's linear-attention layers) lack some sites on some layers
  (``adapter.absent_sites``): a session asking for one raises its named error before any hook is registered;
* residual stream, attention and MLP outputs, vision blocks and the projector: forward (pre-)hooks on those modules;
* DeepStack injections (``deepstack.{i}.hook_out``): the text model adds them between layers outside any module, so
  the capture is a forward hook on the merger that computes them (its output is exactly what is added).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from ..core.sites import Site
from .interventions import (  # noqa: F401  (re-exported: they were defined here before interventions.py)
    AblateHeads,
    AddToHeads,
    BlockAttention,
    Intervention,
    KeyScoreEdit,
    PatchHeadEntries,
    PatchHeads,
    SteerAttention,
    ZeroImageAttention,
)

if TYPE_CHECKING:
    from ..adapters.base import ModelAdapter
    from ..core.tokens import TokenIndex

__all__ = ["AblateHeads", "AddToHeads", "BlockAttention", "HookSession", "Intervention", "PatchHeadEntries",
           "PatchHeads", "SteerAttention", "ZeroImageAttention", "LastQuerySession", "attention_implementation",
           "ATTENTION_IMPL"]

ATTENTION_IMPL = "vlmbind_eager"
# per-head outputs and attention probabilities, of self-attention and of a cross-attention layer
Z_HOOKS = ("attn.hook_z", "cross_attn.hook_z")
PATTERN_HOOKS = ("attn.hook_pattern", "cross_attn.hook_pattern")
PROB_EDITS = "_vlmbind_prob_edits"
# callables on the scores (``B H Q K``, mask added) before the softmax: attention steering
SCORE_EDITS = "_vlmbind_score_edits"
# callables (query, key, value) -> (query, key, value) applied to the per-query-head states (keys and values repeated
# over each group): the point where path attribution reads one head's own query, key and value
STATE_EDITS = "_vlmbind_state_edits"


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
    for edit in getattr(module, STATE_EDITS, ()):
        query, key_states, value_states = edit(query, key_states, value_states)
    weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key_states.shape[-2]]
    for edit in getattr(module, SCORE_EDITS, ()):
        weights = edit(weights)
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    for edit in getattr(module, PROB_EDITS, ()):
        weights = edit(weights)
    out = torch.matmul(weights, value_states).transpose(1, 2).contiguous()
    return out, weights


AttentionInterface.register(ATTENTION_IMPL, vlmbind_eager_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_IMPL, eager_mask)


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
        return any(s.hook in PATTERN_HOOKS for s in self.sites) or any(
            i.needs_pattern() for i in self.interventions
        )

    def __enter__(self) -> HookSession:
        for intervention in self.interventions:
            intervention.check(self.adapter)
        absent = self.adapter.absent_sites()
        for site in self.sites:
            if site.name in absent:
                raise type(absent[site.name])(f"site {site.name!r}: {absent[site.name]}")
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
            for attribute in (PROB_EDITS, SCORE_EDITS):
                if hasattr(module, attribute):
                    delattr(module, attribute)
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
        score_edits: dict[int, list[KeyScoreEdit]] = {}
        for intervention in self.interventions:
            if isinstance(intervention, ZeroImageAttention):
                prob_edits.setdefault(intervention.layer, []).append(intervention)
            elif isinstance(intervention, KeyScoreEdit):
                score_edits.setdefault(intervention.layer, []).append(intervention)
            else:
                z_edits.setdefault(intervention.layer, []).append(intervention)
        z_sites = {s.layer: s for s in self.sites if s.hook in Z_HOOKS}

        for layer in sorted(set(z_edits) | set(z_sites)):
            self._handles.append(
                a.o_proj_module(layer).register_forward_pre_hook(
                    self._z_hook(layer, z_edits.get(layer, []), z_sites.get(layer))
                )
            )
        for layer, edits in prob_edits.items():
            module = a.attention_module(layer)
            index = self.index
            setattr(module, PROB_EDITS, [lambda w, e=e: e.edit_probs(w, index) for e in edits])
            self._prob_modules.append(module)
        cross_layers = set(a.cross_attention_layers()) if score_edits else set()
        for layer, steers in score_edits.items():
            module = a.attention_module(layer)
            cross = layer in cross_layers
            setattr(module, SCORE_EDITS, [lambda s, e=e, c=cross: e.edit_scores(s, self.index, c) for e in steers])
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
                elif site.hook in ("hook_attn_out", "hook_mlp_out"):
                    kind = site.hook.removeprefix("hook_").removesuffix("_out")
                    module = a.attn_out_module(site.layer) if kind == "attn" else a.mlp_out_module(site.layer)
                    layer_kwargs: dict[str, Any] = {}
                    sources: dict[int, Any] = {}
                    self._handles.append(a.layer(site.layer).register_forward_pre_hook(
                        self._remember_kwargs(layer_kwargs), with_kwargs=True))
                    for i, source in enumerate(a.write_sources(site.layer, kind)):
                        self._handles.append(source.register_forward_hook(self._remember_output(sources, i)))
                    self._handles.append(module.register_forward_hook(
                        self._gated_capture(name, site.layer, kind, layer_kwargs, sources)))
                elif site.hook in PATTERN_HOOKS:
                    self._handles.append(
                        a.attention_module(site.layer).register_forward_hook(self._pattern_capture(name))
                    )
            elif site.component == "vision":
                self._handles.append(a.vision_block(site.layer).register_forward_hook(self._post_capture(name)))
            elif site.component == "projector":
                self._handles.append(a.projector_module().register_forward_hook(self._projector_capture(name)))
            elif site.component == "deepstack":
                self._handles.append(a.deepstack_merger_module(site.layer).register_forward_hook(
                    self._post_capture(name)))

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

    @staticmethod
    def _remember_kwargs(into: dict[str, Any]) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            into.clear()
            into.update(kwargs)

        return hook

    @staticmethod
    def _remember_output(into: dict[int, Any], key: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            into[key] = output

        return hook

    def _gated_capture(self, name: str, layer: int, kind: str, layer_kwargs: dict[str, Any],
                       sources: dict[int, Any]) -> Callable:
        """Capture what a module's output adds to the residual stream (``adapter.residual_write``: the output times
        the gate it passes, if any), given the outputs of the layer's ``adapter.write_sources`` in this forward."""
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            value = _first_tensor(output)
            outputs = [sources[i] for i in sorted(sources)]
            self._store(name, self.adapter.residual_write(layer, kind, value, layer_kwargs, outputs))

        return hook

    def _post_capture(self, name: str, attribute: str | None = None) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._store(name, getattr(output, attribute) if attribute else _first_tensor(output))

        return hook

    def _projector_capture(self, name: str) -> Callable:
        """The projector's features of each of its calls that makes image-token rows
        (``adapter.projector_call_has_image_rows``)."""
        adapter = self.adapter
        capture = self._post_capture(name, adapter.projector_output)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if adapter.projector_call_has_image_rows(args):
                capture(module, args, output)

        return hook

    def _pattern_capture(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError(f"{name}: the attention module returned no weights")
            self._store(name, weights)

        return hook


class LastQuerySession(HookSession):
    """A HookSession that stores only the newest query row of each attention pattern, on the CPU in float32.

    The prefill step's pattern is ``B H P P`` (its last row predicts the first new token); each cached step's is
    ``B H 1 K``. Keeping ``B H K`` per step makes the capture linear in the trace length.
    """

    def _store(self, site: str, value: torch.Tensor) -> None:
        super()._store(site, value[:, :, -1, :].detach().to("cpu", torch.float32))
