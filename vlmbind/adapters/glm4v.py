"""GLM-4.1V and GLM-4.6V (``glm4v``, ``glm46v`` and the mixture-of-experts ``glm4v_moe``): a GLM ViT whose 14 px
patches a 2x2 conv downsample and a patch merger turn into language-model tokens, and a GLM-4 decoder with M-RoPE.

Design: the prompt asks for an image with ``<|begin_of_image|><|image|><|end_of_image|>`` (what GLM's chat template
writes per image) and the processor expands the one ``<|image|>`` into ``h*w/4`` copies, so each image is one
contiguous run of image tokens between two special tokens. The image processor resizes to multiples of 28 px within
its pixel bounds (it weighs an image as two frames, ``2 * h * w``), cuts 14 px patches ordered merge group by merge
group (``image_grid_thw = (1, h, w)`` patches), and the tower's ``downsample`` conv merges each 2x2 group, so the
language model sees an ``h/2 x w/2`` grid in raster order, each token covering 28 resized pixels; boxes map back to
the original image by the per-axis resize. Positions are 3-D (M-RoPE, ``get_rope_index``, which needs the
processor's ``mm_token_type_ids``): an image token at grid cell ``(r, c)`` gets ``(s, s + r, s + c)`` for the run's
start ``s``, and the text after the image resumes at ``s + max(h, w) / 2``; the rotary part is half of each head
(``partial_rotary_factor`` 0.5). Every decoder layer is full causal attention (no sliding window, no bidirectional
image block). ``glm4v`` and ``glm46v`` layers have sandwich norms: ``post_self_attn_layernorm`` and
``post_mlp_layernorm`` norm the attention and MLP outputs before the residual adds, so ``hook_attn_out`` /
``hook_mlp_out`` are those normed outputs (TransformerLens's names); ``glm4v_moe`` layers (GLM-4.5V, GLM-4.6V) are
plain pre-norm layers whose attention / MoE outputs are added as they are, and their ``hook_mlp_out`` is the MoE
block's output (the routed experts' weighted sum plus the shared expert). The three model types share every module
path and the rope index, but each loads with its own transformers class (:meth:`Glm4vAdapter.model_class_for`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from .base import register_adapter
from .qwen import _QwenVLAdapter


@register_adapter
class Glm4vAdapter(_QwenVLAdapter):
    """GLM-4.1V-9B (Thinking / Base) and GLM-4.6V-Flash (dense decoders), GLM-4.5V and GLM-4.6V (MoE decoders)."""

    family = "glm4v"
    display_name = "GLM-4.1V / GLM-4.6V"
    image_layout = "merged h/2 x w/2 grid of 28 px tokens, M-RoPE"
    model_types = ("glm4v", "glm46v", "glm4v_moe")
    model_class_name = "Glm4vForConditionalGeneration"
    # the transformers class each model type loads with (they share module paths; glm4v_moe's MLPs are MoE blocks)
    model_classes: ClassVar[dict[str, str]] = {
        "glm4v": "Glm4vForConditionalGeneration",
        "glm46v": "Glm46VForConditionalGeneration",
        "glm4v_moe": "Glm4vMoeForConditionalGeneration",
    }
    transformer_lens_bridge = True
    capability_notes = {
        "TransformerLens": "yes (glm4v checkpoints such as GLM-4.1V-9B; TransformerLens has no bridge for glm46v or "
                           "glm4v_moe)",
    }
    # the tower's merger: its rows are the image tokens' embeddings, in sequence order
    projector = "model.visual.merger"
    # sandwich norms (glm4v, glm46v): what attention and the MLP add to the residual is the normed output
    attn_out = "post_self_attn_layernorm"
    mlp_out = "post_mlp_layernorm"
    # the text the processor expands (the one <|image|> becomes the image's run of tokens)
    image_placeholder = "<|begin_of_image|><|image|><|end_of_image|>"
    # dynamic resolution (an image's own size, rounded to multiples of 28 px within the processor's pixel bounds):
    # no size is native; 448 is a common one, a 16 x 16 grid
    typical_image_size = 448

    @classmethod
    def model_class_for(cls, config: Any) -> str:
        """``Glm4vForConditionalGeneration``, ``Glm46VForConditionalGeneration`` or
        ``Glm4vMoeForConditionalGeneration``, as ``config.model_type`` says."""
        return cls.model_classes.get(getattr(config, "model_type", None), cls.model_class_name)

    def attn_out_module(self, layer: int) -> nn.Module:
        """The attention output's sandwich norm, or the attention module where the layer has none (glm4v_moe)."""
        block = self.layer(layer)
        return getattr(block, self.attn_out) if hasattr(block, self.attn_out) else self.attention_module(layer)

    def mlp_out_module(self, layer: int) -> nn.Module:
        """The MLP output's sandwich norm, or the MLP (a MoE block) where the layer has none (glm4v_moe)."""
        block = self.layer(layer)
        return getattr(block, self.mlp_out) if hasattr(block, self.mlp_out) else self.mlp_module(layer)
