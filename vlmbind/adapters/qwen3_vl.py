"""Qwen3-VL, dense (``qwen3_vl``) and mixture-of-experts (``qwen3_vl_moe``).

Image tokens are laid out as in Qwen2.5-VL (:mod:`vlmbind.adapters.qwen`): one run of ``<|image_pad|>`` per image
between ``<|vision_start|>`` and ``<|vision_end|>``, an ``h/m x w/m`` grid in raster order, but the patches are 16 px
(``vision_config.patch_size``), so with the 2x2 merge a token covers 32 resized pixels. The tower attends globally
(no windows), so its blocks see the merge groups in the processor's order, group by group, groups in raster order.
Position ids are 3-D (M-RoPE, with the height / width frequencies interleaved) from ``get_rope_index``, which needs
the processor's ``mm_token_type_ids``.

What the language model receives at the image tokens:

* ``projector.hook_out`` is the main merger's output (``model.visual.merger``, the tower's ``pooler_output``): the
  rows that replace the image tokens' embeddings, i.e. ``blocks.0.hook_resid_pre`` at the image positions, in
  sequence order.
* DeepStack adds more: vision block ``deepstack_visual_indexes[i]`` goes through its own merger
  (``model.visual.deepstack_merger_list.{i}``) and the text model adds that to the image tokens' residual stream
  right after decoder layer ``i``, outside any module. So for ``i < len(deepstack_visual_indexes)``,
  ``blocks.{i}.hook_resid_post`` (the layer's output) lacks injection ``i`` and ``blocks.{i+1}.hook_resid_pre``
  holds it: their difference is the injection at the image positions and zero elsewhere. HF's ``hidden_states``
  are the layers' outputs, so they equal ``hook_resid_post``, not the next ``hook_resid_pre``, at those layers (as in
  TransformerLens's bridge, whose ``blocks.{i}.hook_resid_pre`` is also the layer's input). Injection ``i`` is the
  site ``deepstack.{i}.hook_out``: the output of merger ``i`` (:meth:`Qwen3VLAdapter.deepstack_merger_module`),
  ``N d_model``, laid out as ``projector.hook_out`` (image tokens in sequence order). Like the projector's, it is
  captured only: no intervention writes it.

Mixture of experts: attention is the dense model's, so per-head z, patterns and head interventions are unchanged.
``blocks.{l}.hook_mlp_out`` is the output of the sparse MoE block (``mlp``): the sum of the top-k routed experts'
outputs weighted by the renormalised router probabilities (Qwen3-VL-MoE has no shared expert), which is exactly what
the block adds to the residual stream. Single experts and the router have no site.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from ..core.errors import SiteError
from .base import get_module, register_adapter
from .qwen import _QwenVLAdapter


@register_adapter
class Qwen3VLAdapter(_QwenVLAdapter):
    family = "qwen3_vl"
    display_name = "Qwen3-VL"
    image_layout = "merged h/2 x w/2 grid of 32 px tokens, M-RoPE, DeepStack"
    # Qwen3-VL's grounding answers (JSON) give coordinates relative to the image, 0-1000 (Qwen2.5-VL's: resized px)
    point_frames = {"json": "permille"}
    capability_notes = {"capture": "yes (and each DeepStack injection: deepstack.{i}.hook_out)"}
    model_types = ("qwen3_vl",)
    model_class_name = "Qwen3VLForConditionalGeneration"
    transformer_lens_bridge = True
    # the main merger: its rows are the image tokens' embeddings, in sequence order (no window permutation)
    projector = "model.visual.merger"
    deepstack_mergers: ClassVar[str] = "model.visual.deepstack_merger_list"

    @property
    def n_deepstack(self) -> int:
        """One injection per DeepStack vision layer (``deepstack_visual_indexes``)."""
        return len(self.deepstack_vision_layers)

    @property
    def deepstack_vision_layers(self) -> list[int]:
        """For each DeepStack injection ``i`` (added after text layer ``i``), the vision block whose output its merger
        reads."""
        return [int(i) for i in self.config.vision_config.deepstack_visual_indexes]

    def deepstack_merger_module(self, injection: int) -> nn.Module:
        """The merger whose output (``N d_model``) the text model adds to the image tokens after layer
        ``injection``.

        Raises:
            SiteError: there is no such injection on this model.
        """
        n = self.n_deepstack
        if not 0 <= injection < n:
            raise SiteError(f"DeepStack injection {injection} does not exist: this model has injections 0..{n - 1} "
                            f"(after text layers 0..{n - 1})")
        return get_module(self.model, self.deepstack_mergers)[injection]

    def declared_paths(self) -> dict[str, nn.Module]:
        return {**super().declared_paths(), "deepstack_mergers": get_module(self.model, self.deepstack_mergers)}


@register_adapter
class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    family = "qwen3_vl_moe"
    display_name = "Qwen3-VL-MoE"
    image_layout = "merged h/2 x w/2 grid of 32 px tokens, M-RoPE, DeepStack; MoE MLPs"
    model_types = ("qwen3_vl_moe",)
    model_class_name = "Qwen3VLMoeForConditionalGeneration"
    transformer_lens_bridge = True

