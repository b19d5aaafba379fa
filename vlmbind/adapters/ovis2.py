"""Ovis2 as transformers ships it natively (``Ovis2ForConditionalGeneration``, the ``-hf`` checkpoints such as
``thisisiron/Ovis2-2B-hf``): an AIMv2 tower on tiles plus a thumbnail, a visual tokenizer and a visual embedding table
under a Qwen2 language model.

Design: the image processor (``Ovis2ImageProcessor`` with ``crop_to_patches``, on in the real checkpoints) picks the
fewest tiles (at most ``max_patches``) whose regions cover 90% of the image (``use_covering_area_grid``; else the
canvas of the closest aspect ratio), stretches the whole image to ``cols * tile x rows * tile`` pixels, cuts it into
tiles in raster order and, when it made more than one tile, puts the whole image stretched to one tile (the
thumbnail) first; an image of one tile is that one frame alone. transformers reads the covering search's
``(rows, cols)`` answer as ``(cols, rows)``, so a wide image gets a tall canvas (448 x 224 at 112 px tiles and
``max_patches=6``: 3 rows of 2 tiles); vlmbind takes the canvas from the prompt's own separators, never from that
arithmetic. Every step stretches the whole image, so tile ``(i, j)`` covers exactly the ``(i, j)``-th of
``rows x cols`` equal parts of the original image and the thumbnail covers all of it. The tower (patches in raster
order, no CLS row) runs on every frame; ``hidden_stride`` ``s`` then concatenates ``s x s`` patches into one token,
a linear head and a LayerNorm give each token logits over a visual vocabulary, ``tokenize_function`` (softmax in the
real checkpoints) turns them into a distribution, and the language model receives that distribution times the
visual embedding table (``model.visual_embeddings_table``, the projector site: its output rows are exactly the
image tokens' inputs, frames in sequence order). The table is called a second time on the five visual indicator
ids, whose rows replace the text embeddings of ``<IMG_START>``, ``<IMG_GRID>``, ``<IMG_COL>``, ``<IMG_ROW>`` and
``<IMG_END>`` (``config.visual_indicator_token_ids``); ``projector.hook_out`` skips that call. The processor replaces
each ``<image>`` with ``<IMG_START>``, the first frame's ``image_seq_length`` ``<IMG_ATOM>`` tokens, ``<IMG_GRID>``,
then (more than one tile) the tiles' tokens in raster order with ``<IMG_COL>`` between the tiles of a row and
``<IMG_ROW>`` between rows, then ``<IMG_END>``. The language model is Qwen2: 1-D positions ``0..P-1``, causal
full attention in every layer, no bidirectional image block.

:meth:`Ovis2Adapter.image_grids` reads each image's block from the prompt: its rows and columns of tiles from the
separators, each run of ``<IMG_ATOM>`` checked against the model's ``n x n`` tokens a frame. One grid per frame, in
sequence order: ``thumbnail`` (the whole image; an image of one frame is this grid alone), then one grid per tile
named ``row_{i}_col_{j}`` (1-based). The indicator tokens are role ``special``. A box is the token's geometric
footprint; the processor's bicubic resizes read a few original pixels across it. The tower's rows map to image
tokens cleanly (each token concatenates its ``s x s`` patches), so :meth:`Ovis2Adapter.vision_row_tokens` is declared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.errors import UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter
from .frames import SquareFrames, frame_row_tokens

# the processor's separators, in the order of config.visual_indicator_token_ids (and of the table's last rows)
INDICATORS = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")


@dataclass(frozen=True)
class ImageBlock:
    """The ``<IMG_START> ... <IMG_END>`` block of one image in a prompt.

    Attributes:
        start: position of ``<IMG_START>``.
        end: position of ``<IMG_END>``.
        rows: tile rows (0 when the image is one frame).
        cols: tile columns (0 when the image is one frame).
        frames: one ``n*n`` array of ``<IMG_ATOM>`` positions per frame, in sequence order (the thumbnail first).
    """

    start: int
    end: int
    rows: int
    cols: int
    frames: list[np.ndarray]


@register_adapter
class Ovis2Adapter(SquareFrames, ModelAdapter):
    """Ovis2 (``thisisiron/Ovis2-*-hf``): AIMv2 on a thumbnail plus tiles, probabilities over a visual vocabulary
    times a visual embedding table."""

    family = "ovis2"
    display_name = "Ovis2"
    image_layout = ("thumbnail + rows x cols tiles, s x s patches a token, `<IMG_START>` ... `<IMG_END>` with "
                    "`<IMG_GRID>` / `<IMG_COL>` / `<IMG_ROW>` between frames")
    # one tile of the Ovis2 checkpoints (the AIMv2 tower's vision_config.image_size, the processor's size)
    typical_image_size = 448
    model_types = ("ovis2",)
    model_class_name = "Ovis2ForConditionalGeneration"
    text_layers = "model.language_model.layers"
    vision_blocks = "model.vision_tower.transformer.encoder.layers"
    vision_attention = "attention"
    # probabilities over the visual vocabulary times this table: ``frames n*n d_model``, in sequence order
    projector = "model.visual_embeddings_table"
    image_placeholder = "<image>"
    image_token_attr = "image_token_id"

    # ---- geometry -------------------------------------------------------------------------------------------
    @property
    def stride(self) -> int:
        """Patches per token side: ``vision_config.hidden_stride``."""
        return int(self.config.vision_config.hidden_stride)

    @property
    def tokens_per_side(self) -> int:
        """Side of one frame's token grid (the model pads the patch grid to a multiple of the stride)."""
        return -(-self.patches_per_side // self.stride)

    # ---- structure tokens ------------------------------------------------------------------------------------
    def indicator_ids(self) -> dict[str, int]:
        """Token -> id of the five separators the processor writes.

        Raises:
            UnsupportedModelError: the tokenizer lacks one, or its ids are not the config's
                ``visual_indicator_token_ids`` in the processor's order (the model would embed the wrong rows).
        """
        ids = {}
        for token in INDICATORS:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == self.tokenizer.unk_token_id:
                raise UnsupportedModelError(f"{self.display_name}: the tokenizer has no {token} token, which the "
                                            "processor writes around every image; vlmbind cannot lay out its images")
            ids[token] = int(token_id)
        declared = [int(i) for i in self.config.visual_indicator_token_ids]
        if list(ids.values()) != declared:
            raise UnsupportedModelError(
                f"{self.display_name}: the tokenizer's ids of {', '.join(INDICATORS)} are {list(ids.values())}, but "
                f"config.visual_indicator_token_ids is {declared}; the processor and the model must agree")
        return ids

    def roles(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Role of every position: ``<IMG_ATOM>`` is ``image``; the five indicators are ``special`` even where a
        tokenizer does not flag them (their rows come from the visual embedding table, not the text)."""
        roles = super().roles(input_ids, attention_mask)
        roles[np.isin(input_ids, list(self.config.visual_indicator_token_ids)) & (roles == "text")] = "special"
        return roles

    def image_blocks(self, input_ids: np.ndarray, row: int) -> list[ImageBlock]:
        """The images of one row: each ``<IMG_START> ... <IMG_END>`` block, cut into frames.

        Raises:
            UnsupportedModelError: unpaired ``<IMG_START>`` / ``<IMG_END>``, or a block that is not the processor's
                layout (separators out of place, runs of other than ``n*n`` ``<IMG_ATOM>`` tokens, rows of unequal
                length).
        """
        ids = self.indicator_ids()
        start_id, grid_id, col_id, row_id, end_id = (ids[t] for t in INDICATORS)
        starts, ends = np.flatnonzero(input_ids == start_id), np.flatnonzero(input_ids == end_id)
        if len(starts) != len(ends) or np.any(starts >= ends) or np.any(starts[1:] <= ends[:-1]):
            raise UnsupportedModelError(f"row {row}: <IMG_START> at {starts.tolist()} and <IMG_END> at "
                                        f"{ends.tolist()} do not pair up; this prompt layout is not supported")
        per_frame = self.tokens_per_side**2
        blocks = []
        for start, end in zip(starts, ends):
            inside = input_ids[start + 1 : end]
            bad = f"row {row}: the <IMG_START> block at {int(start)} is not the processor's layout"
            separators = np.flatnonzero(inside != self.image_token_id)
            if len(separators) == 0 or inside[separators[0]] != grid_id:
                raise UnsupportedModelError(f"{bad} (no <IMG_GRID> after the first frame)")
            # runs of <IMG_ATOM> between the separators, and the separator after each tile
            bounds = np.concatenate([[-1], separators, [len(inside)]])
            runs = [np.arange(a + 1, b) + start + 1 for a, b in zip(bounds[:-1], bounds[1:])]
            after = [int(inside[s]) for s in separators[1:]]
            tiles = runs[1:] if len(runs) > 2 or len(runs[-1]) else []
            if any(len(r) != per_frame for r in [runs[0], *tiles]) or any(a not in (col_id, row_id) for a in after):
                raise UnsupportedModelError(
                    f"{bad}: frames of {[len(r) for r in runs]} image tokens, not of {per_frame} ((image_size / "
                    f"patch_size / hidden_stride)^2); the processor's image_seq_length "
                    f"({getattr(self.processor, 'image_seq_length', '?')}) must match the model config")
            n_rows = after.count(row_id) + 1 if tiles else 0
            n_cols = len(tiles) // n_rows if tiles else 0
            expected = ([col_id] * (n_cols - 1) + [row_id]) * n_rows
            if tiles and (n_rows * n_cols != len(tiles) or after != expected[:-1]):
                raise UnsupportedModelError(f"{bad}: its tiles are not whole rows separated by <IMG_COL> / <IMG_ROW>")
            blocks.append(ImageBlock(int(start), int(end), n_rows, n_cols, [runs[0], *tiles]))
        return blocks

    def _check_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        """Frames must reach the tower at its own size (its position embeddings are fixed), and the visual
        tokenizer must be deterministic (exact patching compares runs)."""
        tile = self.tile_size
        frame = tuple(int(v) for v in inputs["pixel_values"].shape[-2:])
        if frame != (tile, tile):
            raise UnsupportedModelError(
                f"{self.display_name}: the image processor makes {frame[0]}x{frame[1]} frames for a {tile} px tower; "
                f"vlmbind grids only frames of the tower's size (the image processor's size == vision image_size)")
        function = self.config.vision_config.tokenize_function
        if function == "gumbel_argmax":
            raise UnsupportedModelError(
                f"{self.display_name} with vision_config.tokenize_function={function!r} draws Gumbel noise in every "
                "forward, so no two runs agree; use 'softmax' (the checkpoints') or 'st_argmax'")

    # ---- grids ----------------------------------------------------------------------------------------------
    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """Per image, the ``n x n`` ``thumbnail`` grid, then one per tile (``row_{i}_col_{j}``, raster order).

        Raises:
            UnsupportedModelError: the row's image blocks do not match its images or the model's frames.
        """
        self._check_inputs(inputs)
        blocks = self.image_blocks(inputs["input_ids"][row].cpu().numpy(), row)
        if len(blocks) != len(image_ids):
            raise UnsupportedModelError(f"row {row}: {len(image_ids)} images but the prompt lays out {len(blocks)}")
        n, tile = self.tokens_per_side, self.tile_size
        cell = self.stride * tile / self.patches_per_side  # a token's side in processed pixels
        grids = []
        for k, (block, (width, height)) in enumerate(zip(blocks, image_sizes)):
            thumbnail = grid_boxes(n, n, cell, cell, scale_x=tile / width, scale_y=tile / height,
                                   image_size=(width, height))
            grids.append(ImageGrid("thumbnail", k, block.frames[0].reshape(n, n), thumbnail))
            for t, frame in enumerate(block.frames[1:]):
                i, j = divmod(t, block.cols)
                boxes = grid_boxes(n, n, cell, cell, x_off=j * tile, y_off=i * tile,
                                   scale_x=block.cols * tile / width, scale_y=block.rows * tile / height,
                                   image_size=(width, height))
                grids.append(ImageGrid(f"row_{i + 1}_col_{j + 1}", k, frame.reshape(n, n), boxes))
        return grids

    def projector_call_has_image_rows(self, args: tuple) -> bool:
        """The table's call on the image distributions (float) makes the image rows; its call on the indicator ids
        (integers) does not."""
        return bool(args) and torch.is_floating_point(args[0])

    def vision_row_tokens(self, inputs: dict[str, torch.Tensor], image_id: int) -> np.ndarray:
        """Each vision row of image ``image_id`` (its frames in sequence order, the thumbnail first, each frame's
        patches in raster order) -> the image token it is concatenated into, counting the image's tokens in
        sequence order (frame by frame)."""
        return frame_row_tokens(self, inputs, image_id, self.stride)
