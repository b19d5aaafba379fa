"""Mistral3 (``Mistral3ForConditionalGeneration``: Mistral-Small-3.x vision, Pixtral tower, patch-merger projector).

Image tokens: the Pixtral image processor keeps each image's aspect ratio, shrinks it so that its longest edge is at
most ``size["longest_edge"]``, then rounds each side *up* to a multiple of ``patch_size * spatial_merge_size`` (a
slight stretch), and returns the resized ``(height, width)`` as ``image_sizes``. The processor expands each
``[IMG]`` of the prompt into ``H/m/p`` rows of ``W/m/p`` ``[IMG]`` tokens, each row followed by ``[IMG_BREAK]`` and
the last one by ``[IMG_END]`` instead. Only the ``[IMG]`` tokens receive image features (the break and end tokens
keep their learned embeddings: role ``special``, no cell), so the language model sees an ``H/(m p) x W/(m p)`` grid
in raster order, each token covering ``m p`` resized pixels.

What the language model receives: the Pixtral tower runs all images of a batch as one sequence (``1 N d``, each
image's patches in raster order, a block-diagonal mask keeping images apart, 2-D RoPE on the patch's row and
column); the projector (``model.multi_modal_projector``) RMS-normalises the chosen layer's rows, concatenates each
``m x m`` group of patches (``unfold``: channel-major, the group's patches in raster order) through
``patch_merger``, then applies a two-layer MLP. Its output (``N_tokens d_model``) is what replaces the ``[IMG]``
embeddings, in sequence order. A vision-block row (patch ``(i, j)`` of an image whose patch grid is ``h x w``) is
merged into token ``(i // m) * (w // m) + j // m``: :meth:`Mistral3Adapter.vision_row_tokens`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.errors import UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter


@register_adapter
class Mistral3Adapter(ModelAdapter):
    """Mistral-Small-3.1 / 3.2 vision (``mistralai/Mistral-Small-3.1-24B-Instruct-2503`` and the like)."""

    family = "mistral3"
    display_name = "Mistral3"
    image_layout = "variable h/2 x w/2 grid of 28 px tokens, [IMG_BREAK] / [IMG_END] closing each row"
    # Pixtral keeps an image's own resolution up to its longest_edge (1024-1540 px), so no size is native: 448 is a
    # 16 x 16 grid of 28 px tokens, as Qwen's
    typical_image_size = 448
    model_types = ("mistral3",)
    model_class_name = "Mistral3ForConditionalGeneration"
    vision_blocks = "model.vision_tower.transformer.layers"
    vision_attention = "attention"
    projector = "model.multi_modal_projector"
    image_placeholder = "[IMG]"
    image_token_attr = "image_token_id"
    transformer_lens_bridge = True

    @property
    def token_side(self) -> int:
        """Resized pixels per image token along each axis: ``patch_size * spatial_merge_size``."""
        return int(self.config.vision_config.patch_size) * int(self.config.spatial_merge_size)

    def extra_special_ids(self) -> list[int]:
        """The tokenizer's special added tokens plus ``[IMG_BREAK]`` and ``[IMG_END]``, which carry no image
        features whether or not a tokenizer marks them special."""
        ids = super().extra_special_ids()
        for name in ("image_break_token_id", "image_end_token_id"):
            value = getattr(self.processor, name, None)
            if value is not None:
                ids.append(int(value))
        return ids

    def processor_kwargs(self, chat: bool) -> dict[str, Any]:
        """No tokenizer BOS for chat texts: Mistral's chat template starts with ``<s>`` itself."""
        return {"add_special_tokens": False} if chat else {}

    def _check_processor(self) -> None:
        """The processor must cut images as the model merges them, or boxes and features would disagree."""
        patch = int(self.config.vision_config.patch_size)
        merge = int(self.config.spatial_merge_size)
        got = (int(getattr(self.processor, "patch_size", patch)), int(getattr(self.processor, "spatial_merge_size",
                                                                               merge)))
        if got != (patch, merge):
            raise UnsupportedModelError(
                f"the processor's patch_size / spatial_merge_size {got} differ from the model's {(patch, merge)}; "
                "load the processor and the model from the same checkpoint"
            )

    def _resized_hw(self, inputs: dict[str, torch.Tensor], image_id: int) -> tuple[int, int]:
        """``(height, width)`` of image ``image_id`` as the processor resized it (its ``image_sizes``)."""
        height, width = (int(v) for v in inputs["image_sizes"][image_id])
        return height, width

    def resized_size(self, inputs, image_id):
        height, width = self._resized_hw(inputs, image_id)
        return width, height

    def vision_row_tokens(self, inputs, image_id):
        # the tower's rows of one image are its patches in raster order; the merger joins m x m blocks of them
        height, width = self._resized_hw(inputs, image_id)
        patch = int(self.config.vision_config.patch_size)
        merge = int(self.config.spatial_merge_size)
        rows, cols = np.divmod(np.arange((height // patch) * (width // patch)), width // patch)
        return (rows // merge) * (width // patch // merge) + cols // merge

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """One ``image`` grid per image: the ``[IMG]`` tokens in raster order (``[IMG_BREAK]`` / ``[IMG_END]`` are
        role ``special`` already), boxes mapped back through the per-axis resize.

        Raises:
            UnsupportedModelError: the processor's patch or merge size differs from the model's, or the row's
                ``[IMG]`` count is not what the resized sizes imply.
        """
        self._check_processor()
        image_positions = np.flatnonzero(roles == "image")
        side = self.token_side
        grids, cursor = [], 0
        for k, (image_id, (width, height)) in enumerate(zip(image_ids, image_sizes)):
            resized_h, resized_w = self._resized_hw(inputs, image_id)
            rows, cols = resized_h // side, resized_w // side
            n = rows * cols
            if cursor + n > len(image_positions):
                raise UnsupportedModelError(
                    f"row {row}: image {k} needs {n} [IMG] tokens ({rows}x{cols}) but only "
                    f"{len(image_positions) - cursor} are left; the processor and the model disagree about the layout"
                )
            positions = image_positions[cursor : cursor + n].reshape(rows, cols)
            cursor += n
            boxes = grid_boxes(rows, cols, side, side, scale_x=resized_w / width, scale_y=resized_h / height,
                               image_size=(width, height))
            grids.append(ImageGrid("image", k, positions, boxes))
        if cursor != len(image_positions):
            raise UnsupportedModelError(f"row {row}: {len(image_positions)} [IMG] tokens, the grids account for "
                                        f"{cursor}; the processor and the model disagree about the layout")
        return grids
