"""Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``: a MoonViT tower, a 2x2 patch-merger MLP, a DeepSeek-V3 decoder).

Design: the chat template writes each image as ``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>``
and the processor expands the one ``<|media_pad|>`` into ``h*w/m^2`` of them. The image processor keeps the image's
own size unless it has more than ``max_patches`` patches (then both sides shrink by one factor, floored to whole
pixels), and pads the bottom and right edges with black to multiples of ``m*p`` pixels (``p``-pixel patches, an
``m x m`` merge kernel), so ``image_grid_thw = (1, h, w)`` counts patches of the padded image. The tower runs on the
patches in raster order with a 2-D RoPE and a learned position grid resampled to ``h x w``; after its final norm
each ``m x m`` group is concatenated and the projector maps it to one language-model token, so the language model
sees an ``h/m x w/m`` grid in raster order with ordinary 1-D positions, every token attending causally. A cell's box
is its ``m*p``-pixel square of the resized image, divided by the resize factor and clipped to the image (edge cells
include some padding).

The text model is DeepSeek-V3: multi-head latent attention (MLA) in every layer and mixture-of-experts MLPs (sigmoid
router, top-k of the routed experts plus shared experts) from layer ``first_k_dense_replace`` on, dense MLPs before.
MLA differs in kind from grouped-query attention: queries and keys have ``qk_nope_head_dim + qk_rope_head_dim``
dimensions (a rotary part whose key is shared by all heads) and values ``v_head_dim``, so a head's ``hook_z`` (the
``o_proj`` input, ``n_heads x v_head_dim``) and ``d_head`` are the value width while ``hook_pattern`` comes from
wider queries and keys. Every head's keys and values are expanded from one shared latent (``kv_a_proj_with_mqa``,
normed, then ``kv_b_proj``), which is also what the cache stores; cutting that cache back to a prefix is exact, so
the exact method reuses it as for any causal family. No module output carries one head's keys or values alone, so
path patching takes no receivers here (:meth:`KimiK25Adapter.path_channels`); senders and the direct path to the
logits work as everywhere.
"""

from __future__ import annotations

import numpy as np
from torch import nn
from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

from ..core.errors import SiteError, UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter


@register_adapter
class KimiK25Adapter(ModelAdapter):
    """Kimi-K2.5 (``moonshotai/Kimi-K2.5``) and checkpoints of the same architecture."""

    family = "kimi_k25"
    display_name = "Kimi-K2.5"
    image_layout = "merged h/2 x w/2 grid, padded to whole tokens"
    # native resolution: the processor keeps any image up to max_patches (16384 patches of 14 px, about 1792 px
    # square), so no size is native; 448 px is a whole number of 28 px tokens (16 x 16)
    typical_image_size = 448
    model_types = ("kimi_k25",)
    model_class_name = "Kimi_K25ForConditionalGeneration"
    vision_blocks = "model.vision_tower.layers"
    vision_attention = "attn"
    projector = "model.mm_projector"
    # the chat template's image block; the processor expands the pad token into one per merged patch group
    image_placeholder = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    image_token_attr = "image_token_id"
    # keys and values come from one shared latent (and one shared rotary key), so no module output is a head's k or
    # v input alone: path_channels and channel_module say so in place of these names
    qkv_proj: dict[str, str] = {}
    # TransformerLens bridges DeepseekV3ForCausalLM (the text model alone), not this class: the default "no" cell
    capability_notes = {
        "circuits": "yes (senders and their direct paths to the logits; no receiver heads: multi-head latent "
                    "attention expands every head's keys and values from one shared latent)",
    }

    @property
    def merge_size(self) -> int:
        """The tower's merge kernel side ``m`` (``m x m`` patches per language-model token)."""
        kernel = self.config.vision_config.merge_kernel_size
        if kernel[0] != kernel[1]:
            raise UnsupportedModelError(f"{self.display_name}: a {kernel[0]} x {kernel[1]} merge kernel is not square; "
                                        "vlmbind places square merge kernels only")
        return int(kernel[0])

    def cache_width(self, layer: int) -> int:
        """MLA caches one shared latent and one shared rotary key a position, not every head's keys and values."""
        return int(self.text_config.kv_lora_rank + self.text_config.qk_rope_head_dim)

    def layer_kind(self, layer: int) -> str:
        dense = layer < int(self.text_config.first_k_dense_replace or 0)
        return f"multi-head latent attention, {'dense MLP' if dense else 'mixture of experts'}"

    def path_channels(self, layer: int) -> tuple[str, ...]:
        """None: MLA expands every head's keys and values from one shared latent (and shares the rotary key), so no
        module output is one receiver channel alone, and path patching holds a receiver's other channels at their
        clean values by holding such outputs. Senders and their direct paths to the logits are unaffected."""
        return ()

    def channel_module(self, layer: int, channel: str) -> nn.Module:
        raise SiteError(f"layer {layer} of this {self.display_name} model: path patching takes no receiver heads "
                        f"(channel {channel!r}) under multi-head latent attention: every head's keys and values come "
                        "from one shared latent (kv_a_proj_with_mqa), so no module output is a receiver's k or v "
                        "alone, and path patching holds those to isolate any channel; use the senders' direct paths "
                        "(channel 'logits') or patch heads directly")

    def _resized(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((resized_h, resized_w), (padded_h, padded_w))`` of a ``width x height`` image under the processor's
        settings (its own ``navit_resize``)."""
        ip = self.processor.image_processor
        if not ip.do_resize:
            raise UnsupportedModelError(f"{self.display_name}: the image processor's do_resize=False skips the "
                                        "padding to whole tokens; set processor.image_processor.do_resize = True")
        if int(ip.merge_size) != self.merge_size:
            raise UnsupportedModelError(f"{self.display_name}: the image processor's merge_size={ip.merge_size} "
                                        f"differs from the model's merge kernel {self.merge_size}; set them equal")
        size = ip.size["max_height"] if isinstance(ip.size, dict) else ip.size.max_height
        return navit_resize(height, width, patch_size=int(ip.patch_size), merge_kernel_size=self.merge_size,
                            max_patches=int(ip.max_patches), max_size_per_side=int(size))

    def vision_row_tokens(self, inputs, image_id):
        # the tower's rows are the patches in raster order; token (r // m, c // m) merges patch (r, c)
        t, h, w = (int(v) for v in inputs["image_grid_thw"][image_id])
        m = self.merge_size
        rows, cols = np.divmod(np.arange(h * w), w)
        return np.tile((rows // m) * (w // m) + cols // m, t)

    def image_grids(self, inputs, row, roles, image_ids, image_sizes):
        image_positions = np.flatnonzero(roles == "image")
        thw = inputs["image_grid_thw"].cpu().numpy()
        patch = int(self.config.vision_config.patch_size)
        m = self.merge_size
        grids, cursor = [], 0
        for k, (image_id, (width, height)) in enumerate(zip(image_ids, image_sizes)):
            t, h, w = (int(v) for v in thw[image_id])
            (resized_h, resized_w), padded = self._resized(width, height)
            if padded != (h * patch, w * patch):
                raise UnsupportedModelError(
                    f"row {row}, image {k}: the processor gave a {h} x {w} patch grid, but its settings give a "
                    f"{width} x {height} image a {padded[0] // patch} x {padded[1] // patch} one; vlmbind cannot "
                    "place the image tokens (were the processor's settings overridden at call time?)")
            rows, cols = t * h // m, w // m
            n = rows * cols
            positions = image_positions[cursor : cursor + n].reshape(rows, cols)
            cursor += n
            boxes = grid_boxes(rows, cols, m * patch, m * patch, scale_x=resized_w / width, scale_y=resized_h / height,
                               image_size=(width, height))
            grids.append(ImageGrid("image", k, positions, boxes))
        if cursor != len(image_positions):
            raise RuntimeError(f"row {row}: {len(image_positions)} image tokens, grids account for {cursor}")
        return grids
