"""Gemma-4 (``Gemma4ForConditionalGeneration``: a Gemma-4 vision encoder pooling its patches, a Gemma-4 decoder).

Design: the image processor keeps the aspect ratio. It resizes each image to the largest ``H x W`` whose sides are
multiples of ``k * p`` (``p``-pixel patches, pooled ``k x k``: 16 px and 3 in the checkpoints) and whose patches fit
the budget of ``max_soft_tokens * k^2`` (280 soft tokens by default), so the number of image tokens varies with the
image's shape (a square is fed at 768 px, 16 x 16 tokens). The encoder reads the patches (padded to the budget,
padding marked by position ``-1`` in ``image_position_ids``), pools each ``k x k`` block into one token in raster
order and drops the padding; ``model.embed_vision`` projects them (``projector.hook_out``, one row per image token
of the batch, in sequence order). The processor expands each ``<|image|>`` of the prompt into ``<|image>`` + the
image's ``(H / kp) * (W / kp)`` soft tokens + ``<image|>``; each cell's box maps back to the original image by the
per-axis scale of the resize. The decoder interleaves sliding-window and full-attention layers
(``text_config.layer_types``, 5 : 1 in the checkpoints). Where ``use_bidirectional_attention == "vision"`` (the
31B and 26B-A4B checkpoints) the sliding layers let an image's soft tokens attend to each other both ways, the
full layers stay causal; the block comes from ``mm_token_type_ids`` (1 on image tokens), which the processor returns
and :meth:`Gemma4Adapter.forward_kwargs` restores when a caller dropped it. Full-attention layers have their own
head width (``global_head_dim``: 512 against 256 in the checkpoints; :meth:`Gemma4Adapter.layer_d_head`) and, with
``attention_k_eq_v``, one key projection that also gives the values (no ``v_proj``: path patching has no ``v``
channel there). Every decoder layer ends by scaling the whole residual stream by its ``layer_scalar``
(:meth:`Gemma4Adapter.residual_scale`), so ``hook_resid_post = layer_scalar * (hook_resid_pre + hook_attn_out +
hook_mlp_out)``; path patching adds a sender's write unscaled and is refused. The 26B-A4B's MoE block runs beside
the dense MLP and both go through ``post_feedforward_layernorm``, so ``hook_mlp_out`` holds their sum. Final logits
are soft-capped (30 in the checkpoints). Checkpoints with per-layer embeddings or KV sharing (E2B, E4B) are refused
by name (:meth:`Gemma4Adapter.refuse_unsupported`); audio and video inputs are not used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.errors import InputError, UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter


@register_adapter
class Gemma4Adapter(ModelAdapter):
    """Gemma-4 vision-language models (31B and 26B-A4B, ``-it`` and base)."""

    family = "gemma4"
    display_name = "Gemma-4"
    image_layout = "aspect-kept pooled grid (variable count), bidirectional image block on sliding layers"
    # a square image at the processor's default budget of 280 soft tokens: 16 x 16 tokens of 48 px
    typical_image_size = 768
    model_types = ("gemma4",)
    model_class_name = "Gemma4ForConditionalGeneration"
    vision_blocks = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.embed_vision"
    # post-norms: what attention and the MLP add to the residual is the normed branch output (TransformerLens' names)
    attn_out = "post_attention_layernorm"
    mlp_out = "post_feedforward_layernorm"
    # the text the processor expands (to the boi token, the soft tokens and the eoi token)
    image_placeholder = "<|image|>"
    image_token_attr = "image_token_id"
    bidirectional_image = True
    token_inputs = ("mm_token_type_ids",)
    transformer_lens_bridge = True
    capability_notes = {
        "capture": "yes (the 31B and 26B-A4B checkpoints; E2B and E4B, with per-layer embeddings and KV sharing, are "
                   "refused by name)",
        "circuits": "no: every layer rescales the residual stream (its layer scalar), which path patching does "
                    "not model; refused by name",
        "vision-token sites": "no: the encoder's rows include padding patches that reach no image token",
    }

    def __init__(self, model: torch.nn.Module, processor: Any):
        self.refuse_unsupported(model.config)
        super().__init__(model, processor)

    # ---- what vlmbind supports ----------------------------------------------------------------------------------
    @classmethod
    def refuse_unsupported(cls, config: Any) -> None:
        """Refuse a config whose language model has per-layer embeddings or KV sharing (the E2B and E4B checkpoints).

        Per-layer embeddings feed every decoder layer a projection of the merged input embeddings (the image reaches
        every layer, not only the first, and each layer adds a third branch to the residual stream), and KV-shared
        layers read the keys and values an earlier layer computed (a run started above that layer has none): the
        exact patching method, ``hook_mlp_out`` and the residual decomposition would be wrong or fail on them.

        Raises:
            UnsupportedModelError: the config has ``hidden_size_per_layer_input > 0`` or ``num_kv_shared_layers > 0``.
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config.text_config
        per_layer = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
        shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
        if per_layer or shared:
            raise UnsupportedModelError(
                f"this Gemma-4 checkpoint has per-layer embeddings (hidden_size_per_layer_input={per_layer}) and/or "
                f"KV sharing (num_kv_shared_layers={shared}), as the E2B and E4B models do; vlmbind supports Gemma-4 "
                "language models without them (google/gemma-4-31B-it, google/gemma-4-26B-A4B-it): their per-layer "
                "inputs carry the image into every layer and their shared layers read another layer's keys, which "
                "the exact patching method and the residual decomposition do not model"
            )

    @classmethod
    def model_class_for(cls, config: Any) -> str:
        """``Gemma4ForConditionalGeneration``, after refusing an unsupported config before any weight loads."""
        cls.refuse_unsupported(config)
        return super().model_class_for(config)

    # ---- per-layer facts ----------------------------------------------------------------------------------------
    # the text config is heterogeneous: head_dim and num_key_value_heads are per layer, and HF refuses to read them
    # from the global config, so they come from the attention modules
    @property
    def d_head(self) -> int:
        """Layer 0's head width (a sliding-window layer's, ``head_dim``)."""
        return self.layer_d_head(0)

    def layer_d_head(self, layer: int) -> int:
        """Layer ``layer``'s head width: ``global_head_dim`` on full-attention layers, ``head_dim`` on sliding ones."""
        return int(self.attention_module(layer).head_dim)

    @property
    def n_kv_heads(self) -> int:
        """Layer 0's key / value heads (the full-attention layers may have fewer: ``num_global_key_value_heads``)."""
        return self.n_heads // int(self.attention_module(0).num_key_value_groups)

    def residual_scale(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s ``layer_scalar`` (shape ``1``), by which it multiplies the residual stream at its end."""
        return self.layer(layer).layer_scalar

    # ---- tokens -------------------------------------------------------------------------------------------------
    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """One grid per image, in prompt order, shaped by that image's resize.

        Args:
            inputs: processor outputs; ``image_position_ids`` (``n_images max_patches 2``) holds each patch's
                ``(x, y)`` in patches, ``-1`` on padding.
            row: the batch row.
            roles: ``P`` roles of the row.
            image_ids: batch-global indices of this row's images.
            image_sizes: ``(width, height)`` of each original image.

        Returns:
            One :class:`ImageGrid` named ``"image"`` per image; ``positions`` ``rows cols``, ``boxes`` ``rows cols 4``.

        Raises:
            InputError: the row's image tokens are not one pooled grid per image (e.g. a truncated prompt).
        """
        image_positions = np.flatnonzero(roles == "image")
        patch = int(self.config.vision_config.patch_size)
        kernel = int(self.config.vision_config.pooling_kernel_size)
        all_patches = inputs["image_position_ids"].cpu().numpy()
        grids, cursor = [], 0
        for k, (image_id, (width, height)) in enumerate(zip(image_ids, image_sizes)):
            patches = all_patches[image_id]
            patches = patches[(patches >= 0).all(-1)]
            cols_p, rows_p = (int(v) + 1 for v in patches.max(0))  # the resized image, in patches (x, y)
            rows, cols = rows_p // kernel, cols_p // kernel
            positions = image_positions[cursor : cursor + rows * cols]
            if len(positions) != rows * cols:
                break
            cursor += rows * cols
            boxes = grid_boxes(rows, cols, kernel * patch, kernel * patch, scale_x=cols_p * patch / width,
                               scale_y=rows_p * patch / height, image_size=(width, height))
            grids.append(ImageGrid("image", k, positions.reshape(rows, cols), boxes))
        if len(grids) != len(image_ids) or cursor != len(image_positions):
            raise InputError(
                f"row {row}: {len(image_positions)} image tokens do not make one pooled grid for each of its "
                f"{len(image_ids)} image(s) (the processor's resize gives {cursor} tokens for the first {len(grids)}); "
                "prepare prompts with vlm.prepare and without truncation"
            )
        return grids

    def processor_kwargs(self, chat: bool) -> dict[str, Any]:
        """No tokenizer BOS for chat texts: Gemma-4's chat template starts with ``<bos>`` itself."""
        return {"add_special_tokens": False} if chat else {}

    def processor_images(self, rows: list[list[Any]]) -> list[list[Any]]:
        """One list of images per prompt: ``Gemma4Processor`` reads a flat list as the images of a single prompt."""
        return [list(row) for row in rows]

    def forward_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``mm_token_type_ids`` (``B P``, 1 on image tokens) when the inputs lack them.

        The processor returns them; without them Gemma-4 silently attends causally inside the image block.
        """
        if inputs.get("mm_token_type_ids") is not None or "input_ids" not in inputs:
            return {}
        return {"mm_token_type_ids": (inputs["input_ids"] == self.image_token_id).long()}
