"""InternVL 3 / 3.5 as transformers ships it natively (``InternVLForConditionalGeneration``, the ``-hf`` checkpoints
such as ``OpenGVLab/InternVL3-1B-hf``).

Design: the image processor (``GotOcr2ImageProcessor`` with ``crop_to_patches``, which ``InternVLProcessor`` turns on
by default) picks the ``cols x rows`` canvas of ``min_patches .. max_patches`` tiles whose aspect ratio is closest to
the image's (``get_optimal_tiled_canvas``, ties going to more tiles while they cover less than twice the image),
stretches the whole image to ``cols * tile x rows * tile`` pixels, cuts it into tiles in raster order and, when it
made more than one tile, appends the whole image stretched to one tile (the thumbnail); an image whose canvas is one
tile (or any image with ``crop_to_patches=False``) is that one frame alone. Every step stretches the whole image
(nothing is cropped or padded), so tile ``(i, j)`` covers exactly the ``(i, j)``-th of ``rows x cols`` equal parts of
the original image and the thumbnail covers all of it. The vision tower (InternViT: a CLS row, then the tile's
``n s x n s`` patches in raster order) runs on every frame; the model drops the CLS row
(``vision_feature_select_strategy="default"``) and pixel-shuffles the patch grid by ``downsample_ratio`` (0.5, so
``s = 2``): token ``(r, c)`` of a frame's ``n x n`` grid concatenates patches ``s r .. s r + s - 1`` x
``s c .. s c + s - 1``. The processor replaces each ``<IMG_CONTEXT>`` placeholder with ``<img>``, then
``image_seq_length`` ``<IMG_CONTEXT>`` tokens per frame (tiles in raster order, then the thumbnail) with nothing
between frames, then ``</img>``; the model scatters the frames' tokens over the ``<IMG_CONTEXT>`` positions in order.

:meth:`InternVLAdapter.image_grids` reads how many frames each image has from its ``<img> ... </img>`` block and
recomputes the canvas with the image processor's own ``get_optimal_tiled_canvas`` and its ``min_patches`` /
``max_patches``; a block whose frame count disagrees is refused by name rather than guessed. One grid per tile, named
``row_{i}_col_{j}`` (1-based, raster order), then ``thumbnail``; an image of one frame is the ``thumbnail`` grid alone
(the whole image at the tower's size). ``<img>`` and ``</img>`` are role ``special``. A box is the token's geometric
footprint; the processor's bicubic resizes read a few original pixels across it. Every frame's vision-block rows
start with its CLS row, which reaches no image token, so no map from vision rows to image tokens is declared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

from ..core.errors import UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter
from .frames import SquareFrames, structure_token_id

START_IMAGE = "<img>"
END_IMAGE = "</img>"


@dataclass(frozen=True)
class ImageBlock:
    """The ``<img> ... </img>`` block of one image in a prompt.

    Attributes:
        start: position of ``<img>``.
        end: position of ``</img>``.
        frames: one ``n*n`` array of ``<IMG_CONTEXT>`` positions per frame, in sequence order.
    """

    start: int
    end: int
    frames: list[np.ndarray]


@register_adapter
class InternVLAdapter(SquareFrames, ModelAdapter):
    """InternVL 3 / 3.5 (``OpenGVLab/InternVL3-*-hf``): InternViT on dynamic tiles plus a thumbnail, pixel shuffle."""

    family = "internvl"
    display_name = "InternVL"
    image_layout = ("cols x rows tiles + thumbnail, s x s patches a token (pixel shuffle), frames back to back in "
                    "`<img>` ... `</img>`")
    # one tile of InternVL 3 / 3.5 (the InternViT tower's vision_config.image_size, the processor's crop size)
    typical_image_size = 448
    model_types = ("internvl",)
    model_class_name = "InternVLForConditionalGeneration"
    text_layers = "model.language_model.layers"
    vision_blocks = "model.vision_tower.encoder.layer"
    vision_attention = "attention"
    # LayerNorm + MLP on the pixel-shuffled features: ``frames n*n d_model``, the frames' tokens in sequence order
    projector = "model.multi_modal_projector"
    image_placeholder = "<IMG_CONTEXT>"
    image_token_attr = "image_token_id"
    capability_notes = {
        "vision-token sites": "no: every frame's vision-block rows start with a CLS row that reaches no image token",
    }

    # ---- geometry -------------------------------------------------------------------------------------------
    @property
    def shuffle(self) -> int:
        """Patches per token side: ``1 / downsample_ratio``."""
        ratio = float(self.config.downsample_ratio)
        s = round(1 / ratio)
        if abs(s * ratio - 1) > 1e-9 or self.patches_per_side % s:
            raise UnsupportedModelError(
                f"{self.display_name}: downsample_ratio {ratio} does not divide the {self.patches_per_side}-patch "
                f"side of a frame into whole tokens; vlmbind grids only 1 / downsample_ratio dividing it")
        return s

    @property
    def tokens_per_side(self) -> int:
        """Side of one frame's token grid after the pixel shuffle."""
        return self.patches_per_side // self.shuffle

    # ---- structure tokens ------------------------------------------------------------------------------------
    def structure_ids(self) -> tuple[int, int]:
        """Ids of ``<img>`` and ``</img>``."""
        return (structure_token_id(self, "start_image_token", START_IMAGE),
                structure_token_id(self, "end_image_token", END_IMAGE))

    def roles(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Role of every position: ``<IMG_CONTEXT>`` is ``image``; ``<img>`` and ``</img>`` are ``special`` even
        where a tokenizer does not flag them."""
        roles = super().roles(input_ids, attention_mask)
        roles[np.isin(input_ids, self.structure_ids()) & (roles == "text")] = "special"
        return roles

    def image_blocks(self, input_ids: np.ndarray, row: int) -> list[ImageBlock]:
        """The images of one row: each ``<img> ... </img>`` block, cut into frames of ``n*n`` tokens.

        Raises:
            UnsupportedModelError: unpaired ``<img>`` / ``</img>``, a block holding other tokens than
                ``<IMG_CONTEXT>``, or one whose length is not whole frames of the model's tokens a frame.
        """
        start_id, end_id = self.structure_ids()
        starts, ends = np.flatnonzero(input_ids == start_id), np.flatnonzero(input_ids == end_id)
        if len(starts) != len(ends) or np.any(starts >= ends) or np.any(starts[1:] <= ends[:-1]):
            raise UnsupportedModelError(f"row {row}: {START_IMAGE} at {starts.tolist()} and {END_IMAGE} at "
                                        f"{ends.tolist()} do not pair up; this prompt layout is not supported")
        per_frame = self.tokens_per_side**2
        blocks = []
        for start, end in zip(starts, ends):
            inside = np.arange(start + 1, end)
            if np.any(input_ids[inside] != self.image_token_id):
                raise UnsupportedModelError(f"row {row}: the {START_IMAGE} block at {int(start)} holds tokens other "
                                            f"than {self.image_placeholder}; this prompt layout is not supported")
            if len(inside) == 0 or len(inside) % per_frame:
                raise UnsupportedModelError(
                    f"row {row}: {len(inside)} image tokens in the {START_IMAGE} block at {int(start)}, not whole "
                    f"frames of {per_frame} ((image_size / patch_size * downsample_ratio)^2); the processor's "
                    f"image_seq_length ({getattr(self.processor, 'image_seq_length', '?')}) must match the model "
                    f"config")
            blocks.append(ImageBlock(int(start), int(end), np.split(inside, len(inside) // per_frame)))
        return blocks

    def canvas(self, width: int, height: int) -> tuple[int, int]:
        """``(cols, rows)`` of tiles the image processor cuts a ``width x height`` image into when it crops to
        patches (its own ``get_optimal_tiled_canvas``, with its ``min_patches`` / ``max_patches``)."""
        ip = self.processor.image_processor
        tile = self.tile_size
        cols, rows = get_optimal_tiled_canvas((int(height), int(width)), (tile, tile), int(ip.min_patches),
                                              int(ip.max_patches))
        return int(cols), int(rows)

    def _check_frames(self, inputs: dict[str, torch.Tensor]) -> None:
        """Frames must reach the tower at its own size and keep only patch features: the model reshapes each
        frame's features into a square patch grid before the pixel shuffle."""
        tile = self.tile_size
        frame = tuple(int(v) for v in inputs["pixel_values"].shape[-2:])
        if frame != (tile, tile):
            raise UnsupportedModelError(
                f"{self.display_name}: the image processor makes {frame[0]}x{frame[1]} frames for a {tile} px tower; "
                f"vlmbind grids only frames of the tower's size (the image processor's size == vision image_size)")
        strategy = self.config.vision_feature_select_strategy
        if strategy != "default":
            raise UnsupportedModelError(
                f"{self.display_name} with vision_feature_select_strategy={strategy!r} keeps each frame's CLS feature "
                f"beside its patch square; the model cannot pixel-shuffle such frames. Use 'default'.")

    # ---- grids ----------------------------------------------------------------------------------------------
    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """Per image, one ``n x n`` grid per tile (``row_{i}_col_{j}``, raster order) then ``thumbnail``, or the
        ``thumbnail`` alone for an image of one frame.

        Raises:
            UnsupportedModelError: the row's image blocks do not match its images, the model's frame size, or the
                tiles the image processor's ``min_patches`` / ``max_patches`` give the image.
        """
        self._check_frames(inputs)
        ids = inputs["input_ids"][row].cpu().numpy()
        blocks = self.image_blocks(ids, row)
        if len(blocks) != len(image_ids):
            raise UnsupportedModelError(f"row {row}: {len(image_ids)} images but the prompt lays out {len(blocks)}")
        n, tile = self.tokens_per_side, self.tile_size
        cell = tile / n  # a token's side in processed pixels: `shuffle` patches
        grids = []
        for k, (block, (width, height)) in enumerate(zip(blocks, image_sizes)):
            thumbnail = grid_boxes(n, n, cell, cell, scale_x=tile / width, scale_y=tile / height,
                                   image_size=(width, height))
            if len(block.frames) == 1:
                grids.append(ImageGrid("thumbnail", k, block.frames[0].reshape(n, n), thumbnail))
                continue
            cols, rows = self.canvas(width, height)
            if cols * rows + 1 != len(block.frames):
                ip = self.processor.image_processor
                raise UnsupportedModelError(
                    f"row {row}, image {k}: {len(block.frames)} frames, but the image processor (min_patches="
                    f"{ip.min_patches}, max_patches={ip.max_patches}) tiles a {width}x{height} image into {cols}x"
                    f"{rows} tiles and a thumbnail; set min_patches / max_patches on the image processor, not per "
                    f"call")
            for t, frame in enumerate(block.frames[:-1]):
                i, j = divmod(t, cols)
                boxes = grid_boxes(n, n, cell, cell, x_off=j * tile, y_off=i * tile, scale_x=cols * tile / width,
                                   scale_y=rows * tile / height, image_size=(width, height))
                grids.append(ImageGrid(f"row_{i + 1}_col_{j + 1}", k, frame.reshape(n, n), boxes))
            grids.append(ImageGrid("thumbnail", k, block.frames[-1].reshape(n, n), thumbnail))
        return grids
