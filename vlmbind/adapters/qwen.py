"""Qwen2-VL and Qwen2.5-VL.

Image tokens: one contiguous run of ``<|image_pad|>`` per image between ``<|vision_start|>`` and ``<|vision_end|>``.
The processor resizes each image to ``h*p x w*p`` pixels (``image_grid_thw = (1, h, w)`` patches of ``p`` pixels) and
the merger joins ``m x m`` patches, so the language model sees an ``h/m x w/m`` grid in raster order, each token
covering ``m*p`` resized pixels. Position ids are 3-D (M-RoPE) and need ``mm_token_type_ids``, which the processor
returns; without them the model silently falls back to 1-D positions.
"""

from __future__ import annotations

import numpy as np
from transformers.vision_utils import get_vision_window_index

from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter


class _QwenVLAdapter(ModelAdapter):
    vision_blocks = "model.visual.blocks"
    projector = "model.visual.merger"
    vision_attention = "attn"
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    mrope = True
    token_inputs = ("mm_token_type_ids",)
    # dynamic resolution: the processor keeps an image's own size (within min_pixels / max_pixels, about 56 to 1000
    # px), so no size is native; 448 is a common one and a multiple of both 28 and 32 px tokens (16 x 16 or 14 x 14)
    typical_image_size = 448

    @property
    def n_vision_layers(self) -> int:
        return int(self.config.vision_config.depth)

    def position_ids(self, inputs):
        """``3 B P`` M-RoPE positions of the full sequence (``get_rope_index``), so that a suffix run never relies on
        the model's cached ``rope_deltas``, which an unrelated call may have replaced."""
        position_ids, _ = self.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
            attention_mask=inputs.get("attention_mask"),
        )
        return position_ids

    def resized_size(self, inputs, image_id):
        _, h, w = (int(v) for v in inputs["image_grid_thw"][image_id])
        patch = int(self.config.vision_config.patch_size)
        return w * patch, h * patch

    def vision_row_tokens(self, inputs, image_id):
        # the processor orders an image's patches merge-group by merge-group, the groups in raster order
        t, h, w = (int(v) for v in inputs["image_grid_thw"][image_id])
        merge = int(self.config.vision_config.spatial_merge_size)
        return np.repeat(np.arange(t * h * w // merge**2), merge**2)

    def image_grids(self, inputs, row, roles, image_ids, image_sizes):
        image_positions = np.flatnonzero(roles == "image")
        thw = inputs["image_grid_thw"].cpu().numpy()
        patch = int(self.config.vision_config.patch_size)
        merge = int(self.config.vision_config.spatial_merge_size)
        grids, cursor = [], 0
        for k, (image_id, (width, height)) in enumerate(zip(image_ids, image_sizes)):
            t, h, w = (int(v) for v in thw[image_id])
            rows, cols = t * h // merge, w // merge
            n = rows * cols
            positions = image_positions[cursor : cursor + n].reshape(rows, cols)
            cursor += n
            boxes = grid_boxes(
                rows, cols, merge * patch, merge * patch,
                scale_x=(w * patch) / width, scale_y=(h * patch) / height, image_size=(width, height),
            )
            grids.append(ImageGrid("image", k, positions, boxes))
        if cursor != len(image_positions):
            raise RuntimeError(f"row {row}: {len(image_positions)} image tokens, grids account for {cursor}")
        return grids


@register_adapter
class Qwen25VLAdapter(_QwenVLAdapter):
    family = "qwen2_5_vl"
    display_name = "Qwen2.5-VL"
    image_layout = "merged h/2 x w/2 grid, M-RoPE"
    # grounding answers are JSON with absolute coordinates in the resized image
    point_frames = {"json": "resized"}
    model_types = ("qwen2_5_vl",)
    model_class_name = "Qwen2_5_VLForConditionalGeneration"
    transformer_lens_bridge = True
    # the merger runs on window-permuted patches; the tower un-permutes its output, so read the tower's
    # pooler_output (what the language model receives, in raster order), not the merger's
    projector = "model.visual"
    projector_output = "pooler_output"

    def vision_row_tokens(self, inputs, image_id):
        # the blocks see the merge groups in window order (windows of window_size px, raster inside each)
        vision = self.config.vision_config
        merge = int(vision.spatial_merge_size)
        window_index, _ = get_vision_window_index(inputs["image_grid_thw"][image_id: image_id + 1].cpu(), merge,
                                                  int(vision.window_size), int(vision.patch_size))
        return np.repeat(window_index.numpy(), merge**2)


@register_adapter
class Qwen2VLAdapter(_QwenVLAdapter):
    family = "qwen2_vl"
    display_name = "Qwen2-VL"
    image_layout = "merged h/2 x w/2 grid, M-RoPE"
    model_types = ("qwen2_vl",)
    model_class_name = "Qwen2VLForConditionalGeneration"
