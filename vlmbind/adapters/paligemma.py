"""PaliGemma and PaliGemma 2 (``PaliGemmaForConditionalGeneration``: SigLIP tower, linear projector, Gemma / Gemma-2).

Design: the processor writes ``<image>`` * ``image_seq_length`` + ``<bos>`` + prompt + ``\\n`` (the prompt's
``<image>`` placeholders say how many images; it inserts the BOS itself). The image processor stretches the image to
the tower's square input, SigLIP cuts it into ``p``-pixel patches and the projector is one linear map per patch, so
the language model sees the ``S/p x S/p`` patch grid in raster order, one token a patch; boxes map back to the
original image by the per-axis stretch, and vision-block row ``i`` is image token ``i``.

The mask is a prefix LM: every position with ``token_type_ids == 0`` (image, BOS, prompt, ``\\n``) attends to every
other one, before or after it, and only positions marked 1 (an answer appended after the prompt) are causal.
HF builds it from ``token_type_ids`` on the first forward only (with a filled cache it is causal), so:
:meth:`PaliGemmaAdapter.forward_kwargs` supplies all-zero ids when a caller dropped them (else the prompt would
silently run causally), appended tokens get 1 (``appended_token_values``, as HF's generation does), and
:meth:`PaliGemmaAdapter.bidirectional_positions` reports the whole prefix, so the exact patching method reuses no
cached prefix for a patch inside it. Positions are 1-indexed (:meth:`PaliGemmaAdapter.position_ids`). The
processor's training ``labels`` never reach the forward. Gemma-2 text models (PaliGemma 2) have post-norms, which
the attention / MLP output sites point at; Gemma ones (PaliGemma 1) do not, so there they are the modules' outputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.errors import InputError
from ..core.tokens import ImageGrid, stretched_image_grids
from .base import ModelAdapter, get_module, register_adapter


@register_adapter
class PaliGemmaAdapter(ModelAdapter):
    """PaliGemma (Gemma text model) and PaliGemma 2 (Gemma-2) checkpoints, ``-pt`` and ``-mix``."""

    family = "paligemma"
    display_name = "PaliGemma (2)"
    image_layout = "one token per SigLIP patch, raster grid; prefix-LM mask (image + prompt bidirectional)"
    # the -224 checkpoints, the most used (the processor resizes to the tower's 224, 448 or 896 px either way)
    typical_image_size = 224
    model_types = ("paligemma",)
    model_class_name = "PaliGemmaForConditionalGeneration"
    vision_blocks = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.multi_modal_projector"
    image_placeholder = "<image>"
    image_token_attr = "image_token_id"
    bidirectional_image = True
    # the forward hands one custom 4-D mask to full and sliding layers alike: the packed exact layout is refused
    mask_per_layer_type = False
    token_inputs = ("token_type_ids",)
    capability_notes = {"exact locate": "yes (a patch inside the bidirectional prefix reruns the prompt from its "
                                        "layer; no packed layout under sliding windows)"}
    # an appended token is answer (suffix), causal: 1, as HF's own generation appends
    appended_token_values = {"token_type_ids": 1}
    # the processor also returns training labels (the prompt masked to -100); the forward would compute a loss
    dropped_inputs = ("labels",)

    @classmethod
    def default_attn_implementation(cls, config: Any) -> str:
        """Eager for Gemma-2 text models (PaliGemma 2): HF's Gemma-2 has no sdpa, which cannot soft-cap logits."""
        return "eager" if config.text_config.model_type == "gemma2" else "sdpa"

    # ---- post-norms (Gemma-2) or none (Gemma) -----------------------------------------------------------------
    def _has_post_norms(self, layer: int) -> bool:
        return hasattr(self.layer(layer), "post_feedforward_layernorm")

    def attn_out_module(self, layer: int) -> nn.Module:
        """Gemma-2's ``post_attention_layernorm`` (the normed attention branch); in Gemma that name is the MLP's
        pre-norm, so there it is the attention module itself."""
        if self._has_post_norms(layer):
            return get_module(self.layer(layer), "post_attention_layernorm")
        return self.attention_module(layer)

    def mlp_out_module(self, layer: int) -> nn.Module:
        if self._has_post_norms(layer):
            return get_module(self.layer(layer), "post_feedforward_layernorm")
        return self.mlp_module(layer)

    # ---- tokens -----------------------------------------------------------------------------------------------
    def vision_row_tokens(self, inputs: dict[str, torch.Tensor], image_id: int) -> np.ndarray:
        """Vision-block row ``i`` is the projector's row ``i``: image token ``i`` (raster order, no pooling)."""
        side = int(inputs["pixel_values"].shape[-1]) // int(self.config.vision_config.patch_size)
        return np.arange(side * side)

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """One ``S/p x S/p`` grid per image, in prompt order.

        Args:
            inputs: processor outputs; ``pixel_values`` is ``n_images 3 S S`` (the stretched image).
            row: the batch row.
            roles: ``P`` roles of the row.
            image_ids: batch-global indices of this row's images.
            image_sizes: ``(width, height)`` of each original image.

        Returns:
            One :class:`ImageGrid` named ``"image"`` per image; ``positions`` ``T T``, ``boxes`` ``T T 4``.

        Raises:
            InputError: the row's image-token count is not one grid per image (e.g. a truncated prompt).
        """
        image_positions = np.flatnonzero(roles == "image")
        height, width = (int(v) for v in inputs["pixel_values"].shape[-2:])
        patch = int(self.config.vision_config.patch_size)
        rows, cols = height // patch, width // patch
        n = rows * cols
        if len(image_positions) != n * len(image_ids):
            raise InputError(
                f"row {row}: {len(image_positions)} image tokens for {len(image_ids)} image(s) of {n} tokens each; "
                "vlmbind maps one patch grid per PaliGemma image: do not truncate the prompt."
            )
        return stretched_image_grids(image_positions, image_sizes, rows, cols, patch, (height, width))

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """All-zero ``token_type_ids`` (the whole prompt is the prefix) when the inputs lack them: without them
        PaliGemma silently runs a causal mask."""
        if inputs.get("token_type_ids") is not None or "input_ids" not in inputs:
            return {}
        return {"token_type_ids": torch.zeros_like(inputs["input_ids"])}

    def bidirectional_positions(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prefix of row 0: its non-padding positions with ``token_type_ids == 0`` (all of them when the ids are
        missing, as :meth:`forward_kwargs` then fills them)."""
        ids = inputs.get("token_type_ids")
        if ids is None:
            ids = torch.zeros_like(inputs["input_ids"])
        prefix = ids[0] == 0
        if inputs.get("attention_mask") is not None:
            prefix &= inputs["attention_mask"][0].bool()
        return torch.nonzero(prefix).flatten()

    def position_ids(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``1..P`` per row, what PaliGemma's forward uses without a cache (its positions are 1-indexed), so a run
        on part of the sequence gets the same ones."""
        ids = inputs["input_ids"]
        return (torch.arange(ids.shape[1], device=ids.device) + 1)[None].expand(ids.shape[0], -1)
