"""Molmo2 (``Molmo2ForConditionalGeneration``, transformers >= 5.23; the first Molmo exists only as remote code).

Design: the processor replaces each ``<|image|>`` with two grids of ``<im_patch>`` tokens: a low-res grid
(``<low_res_im_start>`` ... ``<im_end>``) from the whole image resized, without keeping its aspect ratio, to one
square crop, then a high-res grid (``<im_start>`` ... ``<im_end>``) from a canvas cut into overlapping crops. Each
grid row ends with an ``<im_col>`` token; ``<im_col>`` and the start/end tokens get no image feature (role
``special``), and the model *adds* one pooled feature to the embedding of every ``<im_patch>`` (role ``image``). Each
feature pools a ``pool_h x pool_w`` window of ViT patches (``image_token_pooling``); the processor's ``image_grids``
gives the pooled shapes ``(low_h, low_w, high_h, high_w)`` per image. The high-res crops overlap by
``overlap_margins`` patches, and the processor keeps each canvas patch from exactly one crop, so the kept patches form
the canvas's own patch grid and a high-res cell's box is a plain rectangle of the canvas. Boxes are derived here with
the image processor's own ``compute_crop_geometry`` and pooling padding (a patch count that is not a multiple of the
pool size is padded with ``-1`` slots, ``pad // 2`` before and the rest after, so edge cells pool fewer patches and
have smaller boxes), and checked against ``image_grids``. A box is the cell's geometric footprint; the resizes are
bilinear without antialiasing, so at a non-integer resize ratio a token also reads up to one original pixel across
its box edge.

The image block is bidirectional (``bidirectional_image = True``): the forward turns the processor's
``mm_token_type_ids`` (1 for ``<im_patch>``, ``<im_col>`` and the start/end tokens) into one block per row
(``block_sequence_ids`` of ``create_causal_mask``) on top of the causal mask, so the image tokens of a row, of every
image in it, attend to each other both ways while text stays causal and the block never sees later text. The
processor returns ``mm_token_type_ids``, so no extra forward argument is needed; without them the mask is silently
fully causal, and once a key/value cache holds tokens the forward ignores them (a cached prefix must end before or
after the image block and the suffix needs an explicit 4-D mask).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.models.molmo2.image_processing_molmo2 import compute_crop_geometry

from ..core.errors import InputError
from ..core.tokens import ImageGrid
from .base import ModelAdapter, register_adapter


def pooled_cell_boxes(
    n_patch_rows: int,
    n_patch_cols: int,
    pool_h: int,
    pool_w: int,
    patch_size: int,
    scale_x: float,
    scale_y: float,
) -> np.ndarray:
    """Original-image boxes of the cells of a patch grid pooled ``pool_h x pool_w`` as Molmo2's processor pools it.

    The processor pads the patch-index grid with ``-1`` to a multiple of the pool size, ``pad // 2`` before and the
    rest after (``arange_for_pooling``); padded slots pool nothing, so edge cells cover fewer patches.

    Args:
        n_patch_rows: patch rows of the processed image (the resized crop or the canvas).
        n_patch_cols: patch columns.
        pool_h: pooling window height in patches.
        pool_w: pooling window width in patches.
        patch_size: ViT patch size in processed pixels.
        scale_x: processed width / original width.
        scale_y: processed height / original height.

    Returns:
        ``rows cols 4`` float array of ``(x0, y0, x1, y1)`` in original-image pixels, with
        ``rows = ceil(n_patch_rows / pool_h)`` and ``cols = ceil(n_patch_cols / pool_w)``.
    """
    rows, cols = -(-n_patch_rows // pool_h), -(-n_patch_cols // pool_w)
    pad_top, pad_left = (rows * pool_h - n_patch_rows) // 2, (cols * pool_w - n_patch_cols) // 2
    r, c = np.arange(rows), np.arange(cols)
    # patch ranges [first, last) of each cell, clipped to the real patches, then to processed and original pixels
    y0 = np.clip(r * pool_h - pad_top, 0, n_patch_rows) * patch_size / scale_y
    y1 = np.clip((r + 1) * pool_h - pad_top, 0, n_patch_rows) * patch_size / scale_y
    x0 = np.clip(c * pool_w - pad_left, 0, n_patch_cols) * patch_size / scale_x
    x1 = np.clip((c + 1) * pool_w - pad_left, 0, n_patch_cols) * patch_size / scale_x
    boxes = np.zeros((rows, cols, 4))
    boxes[..., 0], boxes[..., 2] = x0[None, :], x1[None, :]
    boxes[..., 1], boxes[..., 3] = y0[:, None], y1[:, None]
    return boxes


@register_adapter
class Molmo2Adapter(ModelAdapter):
    """Molmo2: low-res then high-res pooled grids per image, ``<im_col>`` row separators, bidirectional image block."""

    family = "molmo2"
    display_name = "Molmo2"
    image_layout = "low-res + high-res pooled grids, column separators"
    # one crop of Molmo2ImageProcessor (its size, 378 px: the low-res view and each high-res crop)
    typical_image_size = 378
    model_types = ("molmo2",)
    model_class_name = "Molmo2ForConditionalGeneration"
    vision_blocks = "model.vision_tower.layers"
    vision_attention = "self_attn"
    # the pooling adapter (2x2 attention pooling + MLP); its output is ``N d_model``, one row per <im_patch> token
    projector = "model.multi_modal_projector"
    image_placeholder = "<|image|>"
    # config.image_token_id is an alias of image_patch_id (<im_patch>)
    image_token_attr = "image_token_id"
    bidirectional_image = True
    token_inputs = ("mm_token_type_ids",)

    def image_structure_ids(self) -> list[int]:
        """Ids of the image-structure tokens (``<im_patch>``, ``<im_col>``, start/end, ...) the processor marks as
        image in ``mm_token_type_ids``."""
        ids = getattr(self.processor, "image_token_ids", None) or []
        return [int(i) for i in ids if i is not None and i != self.tokenizer.unk_token_id]

    def roles(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Role of every position of one row: ``<im_patch>`` is ``image``; ``<im_col>``, ``<im_start>``,
        ``<low_res_im_start>``, ``<im_end>`` are ``special`` even where a tokenizer does not flag them as special."""
        roles = super().roles(input_ids, attention_mask)
        structure = np.isin(input_ids, self.image_structure_ids()) & (roles == "text")
        roles[structure] = "special"
        return roles

    def _processor_settings(self) -> dict[str, Any]:
        """The image processor's crop, patch, pooling and tiling settings (what ``image_grids`` depends on)."""
        ip = self.processor.image_processor
        size = ip.size
        crop_h = size["height"] if isinstance(size, dict) else size.height
        crop_w = size["width"] if isinstance(size, dict) else size.width
        if crop_h != crop_w:
            raise InputError(f"Molmo2's image processor needs a square crop size, got {crop_h}x{crop_w}")
        return dict(
            crop_size=int(crop_h), patch_size=int(ip.patch_size), pool_h=int(ip.pooling_size[0]),
            pool_w=int(ip.pooling_size[1]), max_crops=int(ip.max_crops), overlap_margins=list(ip.overlap_margins),
        )

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """The ``low_res`` and ``high_res`` grids of every image of batch row ``row``, in token order.

        Args:
            inputs: the processor's outputs for the batch (``image_grids`` is ``n_images 4``:
                ``low_h, low_w, high_h, high_w``).
            row: the batch row.
            roles: ``P`` roles of the row.
            image_ids: batch-global indices of this row's images.
            image_sizes: ``(width, height)`` of each original image.

        Returns:
            Two grids per image: ``low_res`` (``low_h low_w``) then ``high_res`` (``high_h high_w``).

        Raises:
            InputError: the processor's ``image_grids`` disagree with the geometry derived from its settings (it was
                called with other crop settings than its own), or the row's ``<im_patch>`` count does not match.
        """
        s = self._processor_settings()
        patch, crop = s["patch_size"], s["crop_size"]
        image_positions = np.flatnonzero(roles == "image")
        declared = inputs["image_grids"].cpu().numpy()
        grids: list[ImageGrid] = []
        cursor = 0
        for k, (image_id, (width, height)) in enumerate(zip(image_ids, image_sizes)):
            _, _, canvas_h, canvas_w = compute_crop_geometry(
                height, width, max_crops=s["max_crops"], overlap_margins=s["overlap_margins"], crop_size=crop,
                patch_size=patch,
            )
            # low-res: the whole image squashed to crop x crop; high-res: the whole image resized to the canvas
            low = pooled_cell_boxes(crop // patch, crop // patch, s["pool_h"], s["pool_w"], patch,
                                    crop / width, crop / height)
            high = pooled_cell_boxes(canvas_h // patch, canvas_w // patch, s["pool_h"], s["pool_w"], patch,
                                     canvas_w / width, canvas_h / height)
            expected = [*low.shape[:2], *high.shape[:2]]
            if [int(v) for v in declared[image_id]] != expected:
                raise InputError(
                    f"image {image_id} ({width}x{height}): the processor returned image_grids "
                    f"{declared[image_id].tolist()}, its settings give {expected}; call the processor without "
                    f"per-call crop settings (max_crops, size, pooling_size, overlap_margins) or set them on "
                    f"processor.image_processor"
                )
            for name, boxes in (("low_res", low), ("high_res", high)):
                n = boxes.shape[0] * boxes.shape[1]
                positions = image_positions[cursor : cursor + n]
                if len(positions) != n:
                    raise InputError(f"row {row}: {len(image_positions)} <im_patch> tokens, too few for the grids")
                grids.append(ImageGrid(name, k, positions.reshape(boxes.shape[:2]), boxes))
                cursor += n
        if cursor != len(image_positions):
            raise InputError(f"row {row}: {len(image_positions)} <im_patch> tokens, the grids account for {cursor}")
        return grids
