"""Gemma-3 (``Gemma3ForConditionalGeneration``: SigLIP tower, average-pooling projector, Gemma-3 decoder).

Design: the processor expands each ``<start_of_image>`` in the prompt into ``\\n\\n<start_of_image>`` + ``N``
``<image_soft_token>`` + ``<end_of_image>\\n\\n`` with ``N = mm_tokens_per_image``. The image processor stretches the
image to the tower's square input (no aspect-preserving crop), SigLIP cuts it into ``p``-pixel patches and the
projector average-pools ``k x k`` patches, so the language model sees a fixed ``sqrt(N) x sqrt(N)`` grid in raster
order, each token covering ``k*p`` processed pixels; boxes map back to the original image by the per-axis stretch.
The soft tokens attend to each other bidirectionally only when ``token_type_ids`` (1 on image tokens) reach the
forward: the processor returns them and :meth:`Gemma3Adapter.forward_kwargs` derives them from ``input_ids`` when a
caller dropped them, since without them the model silently falls back to a causal mask. Local layers add a sliding
window on top of that mask; both are the model's own masking code, which vlmbind never replaces. Pan-and-scan crops
are not produced by :meth:`VLM.prepare` (the processor's default turns them off) and are refused with a clear error.
The processor reads a flat image list as one prompt's images, so images go in one list per prompt, and chat texts
are tokenized without the tokenizer's BOS because Gemma-3's chat template writes ``<bos>`` itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.errors import InputError
from ..core.tokens import ImageGrid, stretched_image_grids
from .base import ModelAdapter, register_adapter


@register_adapter
class Gemma3Adapter(ModelAdapter):
    """Gemma-3 vision-language models (4B / 12B / 27B ``-pt`` and ``-it``)."""

    family = "gemma3"
    display_name = "Gemma-3"
    image_layout = "pooled fixed grid, bidirectional image block"
    # the checkpoints' SigLIP tower takes 896 px (vision_config.image_size; every image is resized to it)
    typical_image_size = 896
    model_types = ("gemma3",)
    model_class_name = "Gemma3ForConditionalGeneration"
    vision_blocks = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.multi_modal_projector"
    # post-norms: what attention and the MLP add to the residual is the normed branch output (TransformerLens' names)
    attn_out = "post_attention_layernorm"
    mlp_out = "post_feedforward_layernorm"
    # the text the processor expands (to the boi token, the soft tokens and the eoi token)
    image_placeholder = "<start_of_image>"
    image_token_attr = "image_token_id"
    bidirectional_image = True
    token_inputs = ("token_type_ids",)
    transformer_lens_bridge = True

    def final_logit_softcap(self) -> float | None:
        """None: ``Gemma3ForConditionalGeneration``'s forward applies no final logit softcapping, whatever the text
        config's ``final_logit_softcapping`` says (only the text-only ``Gemma3ForCausalLM`` reads it)."""
        return None

    @property
    def tokens_per_side(self) -> int:
        """Side of the pooled image-token grid, ``sqrt(mm_tokens_per_image)``."""
        return int(round(int(self.config.mm_tokens_per_image) ** 0.5))

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """One ``T x T`` grid per image (``T = sqrt(mm_tokens_per_image)``), in prompt order.

        Args:
            inputs: processor outputs; ``pixel_values`` is ``n_images 3 S S`` (the stretched image).
            row: the batch row.
            roles: ``P`` roles of the row.
            image_ids: batch-global indices of this row's images.
            image_sizes: ``(width, height)`` of each original image.

        Returns:
            One :class:`ImageGrid` named ``"image"`` per image; ``positions`` ``T T``, ``boxes`` ``T T 4``.

        Raises:
            InputError: the row's image-token count is not one grid per image (e.g. pan-and-scan crops).
        """
        image_positions = np.flatnonzero(roles == "image")
        side = self.tokens_per_side
        n = side * side
        if len(image_positions) != n * len(image_ids):
            raise InputError(
                f"row {row}: {len(image_positions)} image tokens for {len(image_ids)} image(s) of {n} tokens each. "
                "vlmbind maps one pooled grid per Gemma-3 image; pan-and-scan crops (do_pan_and_scan=True) and "
                "truncated prompts are not supported: process images without pan-and-scan and without truncation."
            )
        height, width = (int(v) for v in inputs["pixel_values"].shape[-2:])
        patch = int(self.config.vision_config.patch_size)
        # the projector pools k x k patches of the (height // patch) patch grid; a remainder is cut by the conv
        kernel = (height // patch) // side
        return stretched_image_grids(image_positions, image_sizes, side, side, kernel * patch, (height, width))

    def processor_kwargs(self, chat: bool) -> dict[str, Any]:
        """No tokenizer BOS for chat texts: Gemma-3's chat template starts with ``<bos>`` itself."""
        return {"add_special_tokens": False} if chat else {}

    def forward_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``token_type_ids`` (``B P``, 1 on image tokens) when the inputs lack them.

        The processor returns them; without them Gemma-3 silently attends causally inside the image block.
        """
        if inputs.get("token_type_ids") is not None or "input_ids" not in inputs:
            return {}
        return {"token_type_ids": (inputs["input_ids"] == self.image_token_id).long()}

    def processor_images(self, rows: list[list[Any]]) -> list[list[Any]]:
        """One list of images per prompt: ``Gemma3Processor`` reads a flat list as the images of a single prompt."""
        return [list(row) for row in rows]
