"""Qwen4-Exp (``qwen4_exp``): Qwen3.5's vision tower on a hybrid MoE language model whose residual stream is several
hyper-connected streams, with sparse (QSA-indexed) softmax attention and per-layer n-gram embeddings.

Design: image tokens are laid out as in Qwen3.5 (:mod:`vlmbind.adapters.qwen3_5`): one run of ``<|image_pad|>`` per
image between ``<|vision_start|>`` and ``<|vision_end|>``, an ``h/2 x w/2`` grid of 32 px tokens in raster order, the
tower attending globally, 3-D M-RoPE positions from ``get_rope_index``; ``projector.hook_out`` is the merger's output.
What differs is the language model:

* **Hyper-connections.** The residual stream is ``hc_count`` streams of ``d_model`` side by side (``B P
  hc_count*d_model``; the embeddings enter every stream). Each decoder layer runs two sub-blocks, attention then the
  MLP; each first mixes the streams into its (normed) input with weights read from them
  (``attn_hyper_connection`` / ``mlp_hyper_connection``, which play the role of the pre-norms), and its output ``o``
  is added to stream ``k`` times a weight ``w_k`` computed from the same streams. So ``hook_resid_pre`` /
  ``hook_resid_post`` are the layer's input and output (HF's hidden states), and ``hook_attn_out`` /
  ``hook_mlp_out`` are what each sub-block writes, ``(w_1 o, ..., w_n o)`` (:meth:`Qwen4ExpAdapter.residual_write`):
  ``resid_post = resid_pre + attn_out + mlp_out``. No single multiplier maps an output to its write (the weights
  depend on the residual stream at each position), so what needs one, a head's write without the run it sits in
  (AtP*, a named head in the head lens, which reads none by default here), is refused by name
  (:meth:`Qwen4ExpAdapter.output_gate`), and so is path patching, which holds later outputs but not their weights
  (``vlmbind circuit``). The final ``hyper_connection_mixer`` folds the streams into one ``d_model`` vector
  (with its own norm) before the unembedding: it is the final norm the logit lens decodes through.
* **Layer kinds**, as ``text_config.layer_types`` says: ``linear_attention`` layers are Gated DeltaNet, as in
  Qwen3.5 (a recurrent state, no patterns; ``attn.hook_z`` is ``out_proj``'s input where the value heads are the
  attention heads' ``n_heads x d_head``, not in the released checkpoints). ``indexed_attention`` layers (the
  checkpoints' ``full_attention``) are Qwen3.5's gated softmax attention behind a QSA indexer: per query it scores the
  complete blocks of ``indexer_compress_ratio`` visible keys (mean-pooled indexer keys against its own indexer
  queries) and keeps the best ``indexer_budget / indexer_compress_ratio`` blocks plus the unfinished block at the end,
  masking every other key before the softmax. The selection is part of the mask HF hands the attention function, so
  ``attn.hook_pattern`` (vlmbind's eager attention, or HF's ``output_attentions``) is exactly zero on the keys it
  dropped, and head patches change later selections as they change the residual stream.
* **PLE.** Some DeltaNet layers (``ple_layer_ids``, one-based) first add a per-layer embedding of the token's hashed
  bigram and trigram (gated per stream by the residual stream, through a short dilated convolution over positions).
  It sits inside the layer, before the attention sub-block, so on those layers ``hook_attn_out`` holds the PLE's
  write plus the attention's: what the layer adds before its MLP. Its convolution and n-gram context live in the
  layer's cache beside the DeltaNet state.
* **MoE.** Every MLP is a sparse MoE block (top-k routed experts plus a gated shared expert); ``hook_mlp_out`` is its
  whole output, written into the streams.

The DeltaNet and PLE states after the whole prompt are no prefix's, so the exact locate method reuses no prefix cache
(:meth:`~vlmbind.adapters.base.ModelAdapter.recurrent_layers`): each head runs the prompt from its own layer up, fed
the clean residual streams there, which gives the naive numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..core.errors import UnsupportedModelError
from .base import register_adapter
from .qwen3_5 import Qwen35MoeAdapter


@register_adapter
class Qwen4ExpAdapter(Qwen35MoeAdapter):
    """Qwen4-Exp (``Qwen/Qwen4-Exp``) and checkpoints of the same architecture."""

    family = "qwen4_exp"
    display_name = "Qwen4-Exp"
    image_layout = ("merged h/2 x w/2 grid of 32 px tokens, M-RoPE; hybrid Gated DeltaNet / QSA-indexed attention LM, "
                    "hyper-connections, PLE, MoE MLPs")
    model_types = ("qwen4_exp",)
    model_class_name = "Qwen4ExpForConditionalGeneration"
    transformer_lens_bridge = False
    # the hyper-connection mixer folds the residual streams into the vector the unembedding reads
    final_norm = "hyper_connection_mixer"
    capability_notes = {
        "capture": "yes (residual sites are the hc_count hyper-connection streams side by side, B P hc_count*d_model; "
                   "hook_attn_out / hook_mlp_out are what each sub-block writes into them, hook_attn_out with the "
                   "n-gram write on PLE layers; hook_pattern on indexed-attention layers only, zero on the keys the "
                   "QSA indexer drops; hook_z on DeltaNet layers only where their value heads are the attention "
                   "heads' n_heads x d_head, not in the released checkpoints)",
        "head patching": "yes (DeltaNet layers as for hook_z)",
        "ablation": "yes (image_attention on indexed-attention layers only; zero and mean as for hook_z)",
        "exact locate": "yes (no prefix-cache reuse: the DeltaNet and PLE states are recurrent; every head reruns the "
                        "prompt from its layer. AtP*, which needs a head's write alone, is refused by name)",
        "circuits": "no: hyper-connections weigh each write by the residual stream it lands in, which path "
                    "patching cannot hold; refused by name",
    }

    @property
    def n_residual_streams(self) -> int:
        return int(self.text_config.hc_count)

    def ple_layers(self) -> list[int]:
        """The (0-based) layers that add a per-layer n-gram embedding before their attention sub-block."""
        return [int(layer_id) - 1 for layer_id in self.text_config.ple_layer_ids]

    def hyper_connection(self, layer: int, kind: str) -> nn.Module:
        """The hyper-connection of layer ``layer``'s attention (``kind="attn"``) or MLP (``"mlp"``) sub-block: it
        mixes the streams into the sub-block's input and weighs the sub-block's output per stream."""
        return getattr(self.layer(layer), f"{kind}_hyper_connection")

    def write_sources(self, layer: int, kind: str) -> tuple[nn.Module, ...]:
        """The PLE module (attention sub-block of a PLE layer), then the sub-block's hyper-connection."""
        ple = (self.layer(layer).ple,) if kind == "attn" and layer in self.ple_layers() else ()
        return (*ple, self.hyper_connection(layer, kind))

    def residual_write(self, layer: int, kind: str, output: torch.Tensor, layer_kwargs: dict[str, Any],
                       sources: Sequence[Any] = ()) -> torch.Tensor:
        """``output`` (``B P d_model``) times each stream's weight, the streams side by side (``B P
        hc_count*d_model``), as the decoder layer computes it; plus the PLE's write on a PLE layer's attention.

        Raises:
            UnsupportedModelError: the outputs of :meth:`write_sources` are missing (they are this forward's).
        """
        if len(sources) != len(self.write_sources(layer, kind)):
            raise UnsupportedModelError(
                f"layer {layer}'s {kind} write on {self.display_name} needs the outputs of its hyper-connection (and "
                "PLE) in the same forward: capture it as a hook_attn_out / hook_mlp_out site")
        *ple, (_, _, weights) = sources
        written = (output.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
        return ple[0] + written if ple else written

    def output_gate(self, layer: int, kind: str, layer_kwargs: dict[str, Any]) -> torch.Tensor | None:
        """Refused: the hyper-connections give no multiplier that maps an output to its write.

        Raises:
            UnsupportedModelError: always; what asks for a write outside the run it lands in (a head's write alone:
                AtP*, attribution path patching, the head lens, circuit runs) cannot be served.
        """
        raise UnsupportedModelError(
            f"{self.display_name} writes layer {layer}'s {kind} output into {self.n_residual_streams} residual streams "
            "with weights read from those streams at each position (hyper-connections): no fixed gate maps an "
            "output to its write, so a head's write alone (AtP*, attribution path patching, the head lens, circuit "
            f"runs) is not available; capture blocks.{layer}.hook_{kind}_out, or patch heads and compare runs")

    def declared_paths(self) -> dict[str, nn.Module]:
        paths = super().declared_paths()
        paths["attn_hyper_connection"] = self.hyper_connection(0, "attn")
        paths["mlp_hyper_connection"] = self.hyper_connection(0, "mlp")
        if self.pattern_layers():
            paths["indexer"] = self.attention_module(self.pattern_layers()[0]).indexer
        if self.ple_layers():
            paths["ple"] = self.layer(self.ple_layers()[0]).ple
        return paths
