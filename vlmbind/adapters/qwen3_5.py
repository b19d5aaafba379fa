"""Qwen3.5 (``qwen3_5``): Qwen3-VL's vision side without DeepStack, and a hybrid language model.

Image tokens are laid out as in Qwen3-VL (:mod:`vlmbind.adapters.qwen3_vl`): one run of ``<|image_pad|>`` per image,
an ``h/2 x w/2`` grid of 32 px tokens in raster order, the tower attending globally, 3-D M-RoPE positions from
``get_rope_index``. ``projector.hook_out`` is the merger's output (``model.visual.merger``), which the language model
receives at the image tokens; nothing else is injected between layers.

The language model mixes two token mixers, as ``text_config.layer_types`` says:

* ``full_attention`` (``self_attn``, :class:`Qwen3_5Attention`): softmax attention whose per-head output is gated by
  a per-head sigmoid before ``o_proj``. ``attn.hook_z`` is ``o_proj``'s input (after the gate), head-major as usual;
  patterns, vlmbind's eager attention and the ``image_attention`` ablation apply.
* ``linear_attention`` (``linear_attn``, :class:`Qwen3_5GatedDeltaNet`): a gated delta rule, a recurrent state per
  value head and no attention probabilities. Its ``out_proj`` input is per value head too: head ``h`` is the slice
  ``[h*dv, (h+1)*dv)``, the head's delta-rule output after a gated RMSNorm over that head alone (norm and gate act
  within the head). So ``attn.hook_z`` is ``out_proj``'s input and per-head patching / zero / mean ablation reach
  the output only through that head, where the value heads are the model's ``n_heads x d_head``
  (``linear_num_value_heads == num_attention_heads`` and ``linear_value_head_dim == head_dim``; the checkpoints have
  twice as many value heads of half the width, and :class:`~vlmbind.core.errors.HeadLayoutError` refuses those layers'
  heads). ``attn.hook_pattern`` and ``image_attention`` raise :class:`~vlmbind.core.errors.NoAttentionPatternError`
  there (:meth:`~vlmbind.adapters.base.ModelAdapter.pattern_layers`).

The DeltaNet layers' cache holds their state after the whole prompt, which no slice rewinds to a prefix, so the
exact locate method reuses no prefix cache (:meth:`~vlmbind.adapters.base.ModelAdapter.recurrent_layers`): every head
runs the whole prompt from its own layer up, which still gives the naive numbers.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from .base import get_module, register_adapter
from .qwen import _QwenVLAdapter

LINEAR = "linear_attention"


@register_adapter
class Qwen35Adapter(_QwenVLAdapter):
    family = "qwen3_5"
    display_name = "Qwen3.5"
    image_layout = "merged h/2 x w/2 grid of 32 px tokens, M-RoPE; hybrid Gated DeltaNet / attention LM"
    # as Qwen3-VL's: grounding answers give coordinates relative to the image, 0-1000
    point_frames = {"json": "permille"}
    capability_notes = {
        "capture": "yes (hook_pattern on full-attention layers only; hook_z on DeltaNet layers only where their value "
                   "heads are the attention heads' n_heads x d_head, not in the released checkpoints)",
        "head patching": "yes (DeltaNet layers as for hook_z)",
        "ablation": "yes (image_attention on full-attention layers only; zero and mean as for hook_z)",
        "exact locate": "yes (no prefix-cache reuse: the DeltaNet state is recurrent; every head reruns the prompt "
                        "from its layer)",
        "circuits": "yes (receivers on full-attention layers only: DeltaNet layers have no heads)",
    }
    model_types = ("qwen3_5",)
    model_class_name = "Qwen3_5ForConditionalGeneration"
    transformer_lens_bridge = True
    projector = "model.visual.merger"
    # the DeltaNet mixer and its output projection, in place of `attention` / `o_proj` on linear layers
    linear_attention: ClassVar[str] = "linear_attn"
    linear_o_proj: ClassVar[str] = "out_proj"

    def is_linear(self, layer: int) -> bool:
        return self.layer_kind(layer) == LINEAR

    @property
    def d_head(self) -> int:
        return int(self.text_config.head_dim)

    def attention_module(self, layer: int) -> nn.Module:
        return get_module(self.layer(layer), self.linear_attention if self.is_linear(layer) else self.attention)

    def o_proj_module(self, layer: int) -> nn.Module:
        return get_module(self.attention_module(layer), self.linear_o_proj if self.is_linear(layer) else self.o_proj)

    def o_proj_path(self, layer: int) -> str:
        if self.is_linear(layer):
            return f"{self.text_layers}.{layer}.{self.linear_attention}.{self.linear_o_proj}"
        return super().o_proj_path(layer)

    def pattern_layers(self) -> list[int]:
        return [layer for layer in range(self.n_layers) if not self.is_linear(layer)]

    def recurrent_layers(self) -> list[int]:
        return [layer for layer in range(self.n_layers) if self.is_linear(layer)]

    def head_layers(self) -> list[int]:
        cfg = self.text_config
        same = (int(cfg.linear_num_value_heads), int(cfg.linear_value_head_dim)) == (self.n_heads, self.d_head)
        return list(range(self.n_layers)) if same else self.pattern_layers()

    def declared_paths(self) -> dict[str, nn.Module]:
        linear = self.recurrent_layers()
        full = self.pattern_layers()
        paths = super().declared_paths()
        if linear:
            paths["linear_attention"] = self.attention_module(linear[0])
            paths["linear_o_proj"] = self.o_proj_module(linear[0])
        if full:
            paths["attention"] = self.attention_module(full[0])
            paths["o_proj"] = self.o_proj_module(full[0])
        return paths


@register_adapter
class Qwen35MoeAdapter(Qwen35Adapter):
    """Qwen3.5-MoE: the same layers with a sparse MoE block (routed experts plus a gated shared expert) for the MLP;
    ``blocks.{l}.hook_mlp_out`` is that block's whole output."""

    family = "qwen3_5_moe"
    display_name = "Qwen3.5-MoE"
    image_layout = "merged h/2 x w/2 grid of 32 px tokens, M-RoPE; hybrid Gated DeltaNet / attention LM; MoE MLPs"
    model_types = ("qwen3_5_moe",)
    model_class_name = "Qwen3_5MoeForConditionalGeneration"
