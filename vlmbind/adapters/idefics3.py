"""Idefics3 (``Idefics3ForConditionalGeneration``) and SmolVLM (``SmolVLMForConditionalGeneration``).

Design: the two families share one image pipeline, so SmolVLM's adapter is Idefics3's with other names. The image
processor resizes an image (longest edge to ``size["longest_edge"]``), stretches it to whole tiles of
``max_image_size["longest_edge"]`` pixels (the vision tower's ``image_size``), cuts it into ``rows x cols`` tiles in
raster order and, when it made more than one tile, appends the whole image squashed to one tile (the global image);
an image that fits one tile is only the global image. Every step stretches the whole image (nothing is cropped or
padded), so tile ``(i, j)`` covers exactly the ``(i, j)``-th of ``rows x cols`` equal parts of the original image and
the global image covers all of it. The processor replaces each ``<image>`` with, per tile,
``<fake_token_around_image><row_i_col_j>`` and ``image_seq_len`` ``<image>`` tokens, a newline after each row of
tiles, then ``\\n<fake_token_around_image><global-img>``, the global image's ``<image>`` tokens and a closing
``<fake_token_around_image>``. The connector pixel-shuffles each frame's ``(n s) x (n s)`` patch grid into an
``n x n`` grid (``s = config.scale_factor``): token ``(r, c)`` concatenates patches ``r s .. r s + s - 1`` x
``c s .. c s + s - 1``, so it covers ``s x s`` patches; the model scatters the frames' tokens over the ``<image>``
positions in order (tiles in raster order, then the global image).

:meth:`Idefics3Adapter.image_grids` reads the layout from the prompt itself: each run of ``<image>`` tokens is named
by the tag before it (``<row_i_col_j>`` or ``<global-img>``), which gives the tile counts without redoing the
processor's resize arithmetic, and it checks the runs against the model's ``n x n`` grid. One grid per tile, named
like its tag (``row_1_col_2``), then ``global``. The structure tokens (``<fake_token_around_image>``, the tags,
``<global-img>``) and the newlines the processor writes between them are role ``special``: they carry no image
feature and are no part of the prompt's text. The vision tower's rows map to image tokens cleanly (each token
concatenates its ``s x s`` patches, no pooling), so :meth:`Idefics3Adapter.vision_row_tokens` is declared. A box is
the token's geometric footprint; the processor's resizes (Lanczos by default) read a few original pixels across it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.errors import UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"
TILE_TAG = re.compile(r"<row_(\d+)_col_(\d+)>")


@dataclass(frozen=True)
class ImageFrames:
    """The token runs of one image in a prompt.

    Attributes:
        rows: tile rows (0 when the image is only the global image).
        cols: tile columns.
        runs: one array of ``<image>`` positions per frame, tiles in raster order then the global image.
        start: position of the image's first structure token.
        end: position of its closing ``<fake_token_around_image>``.
    """

    rows: int
    cols: int
    runs: list[np.ndarray]
    start: int
    end: int


@register_adapter
class Idefics3Adapter(ModelAdapter):
    """Idefics3 (``HuggingFaceM4/Idefics3-8B-Llama3``): SigLIP tower on tiles plus a global image, pixel shuffle."""

    family = "idefics3"
    display_name = "Idefics3"
    image_layout = "rows x cols tiles + global image, s x s patches a token (pixel shuffle), tile-tag separators"
    # one tile of the processor (Idefics3ImageProcessor's max_image_size, the SigLIP tower's 364 px)
    typical_image_size = 364
    model_types = ("idefics3",)
    model_class_name = "Idefics3ForConditionalGeneration"
    text_layers = "model.text_model.layers"
    vision_blocks = "model.vision_model.encoder.layers"
    vision_attention = "self_attn"
    # the pixel shuffle + projection: ``frames n*n d_model``, the frames' tokens in sequence order
    projector = "model.connector"
    image_placeholder = "<image>"
    image_token_attr = "image_token_id"
    transformer_lens_bridge = True

    # ---- geometry -------------------------------------------------------------------------------------------
    @property
    def scale_factor(self) -> int:
        return int(self.config.scale_factor)

    @property
    def patches_per_side(self) -> int:
        """Side of one frame's patch grid (the tower's ``image_size / patch_size``)."""
        vision = self.config.vision_config
        return int(vision.image_size) // int(vision.patch_size)

    @property
    def tokens_per_side(self) -> int:
        """Side of one frame's token grid after the pixel shuffle."""
        return self.patches_per_side // self.scale_factor

    # ---- structure tokens ------------------------------------------------------------------------------------
    def _tag_ids(self) -> dict[int, tuple[int, int]]:
        """Token id -> ``(row, col)`` (1-based) of every ``<row_i_col_j>`` tag in the vocabulary (cached)."""
        cached = getattr(self, "_tile_tags", None)
        if cached is None:
            cached = {}
            for token, token_id in self.tokenizer.get_vocab().items():
                match = TILE_TAG.fullmatch(token)
                if match:
                    cached[int(token_id)] = (int(match[1]), int(match[2]))
            self._tile_tags = cached
        return cached

    def _single_token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise UnsupportedModelError(f"{self.display_name}: the tokenizer has no {token} token, which the "
                                        f"processor writes around every image; vlmbind cannot lay out its images")
        return int(token_id)

    def _fake_id(self) -> int:
        return self._single_token_id(getattr(self.processor, "fake_image_token", None) or FAKE_TOKEN)

    def _global_id(self) -> int:
        # Idefics3's processor calls it global_image_tag, SmolVLM's global_image_token
        token = getattr(self.processor, "global_image_token", None) or getattr(self.processor, "global_image_tag", None)
        return self._single_token_id(token or GLOBAL_TAG)

    def structure_ids(self) -> list[int]:
        """Ids of ``<fake_token_around_image>``, ``<global-img>`` and the ``<row_i_col_j>`` tags."""
        return [self._fake_id(), self._global_id(), *self._tag_ids()]

    def roles(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Role of every position: ``<image>`` is ``image``; the structure tokens are ``special`` even where a
        tokenizer does not flag them (the newlines between them become ``special`` in :meth:`image_grids`)."""
        roles = super().roles(input_ids, attention_mask)
        roles[np.isin(input_ids, self.structure_ids()) & (roles == "text")] = "special"
        return roles

    def image_frames(self, input_ids: np.ndarray, image_positions: np.ndarray, row: int) -> list[ImageFrames]:
        """The images of one row, read from the tags before each run of ``<image>`` tokens.

        Raises:
            UnsupportedModelError: a run not preceded by a tile tag or ``<global-img>``, tiles out of raster order,
                an image without its global run, or a run whose length is not the model's tokens per frame.
        """
        per_frame = self.tokens_per_side**2
        fake, global_id, tags = self._fake_id(), self._global_id(), self._tag_ids()
        breaks = np.flatnonzero(np.diff(image_positions) != 1) + 1
        runs = np.split(image_positions, breaks) if len(image_positions) else []
        images, tiles = [], []
        for run in runs:
            if len(run) != per_frame:
                raise UnsupportedModelError(
                    f"row {row}: a run of {len(run)} image tokens at position {int(run[0])}, but the model makes "
                    f"{per_frame} a frame ((image_size / patch_size / scale_factor)^2); the processor's image_seq_len "
                    f"({getattr(self.processor, 'image_seq_len', '?')}) must match the model config")
            tag = int(input_ids[run[0] - 1]) if run[0] > 0 else -1
            if tag in tags:
                tiles.append((tags[tag], run))
                continue
            if tag != global_id:
                raise UnsupportedModelError(f"row {row}: the image tokens at {int(run[0])} follow neither a "
                                            f"<row_i_col_j> tag nor {GLOBAL_TAG}; this prompt layout is not supported")
            rows = max((rc[0] for rc, _ in tiles), default=0)
            cols = max((rc[1] for rc, _ in tiles), default=0)
            expected = [(i, j) for i in range(1, rows + 1) for j in range(1, cols + 1)]
            if [rc for rc, _ in tiles] != expected:
                raise UnsupportedModelError(f"row {row}: tile tags {[rc for rc, _ in tiles]} are not the "
                                            f"{rows}x{cols} tiles in raster order")
            first = (tiles[0][1] if tiles else run)[0] - 2  # the <fake_token_around_image> before the first tag
            end = int(run[-1]) + 1
            if first < 0 or input_ids[first] != fake or end >= len(input_ids) or input_ids[end] != fake:
                raise UnsupportedModelError(f"row {row}: image {len(images)} is not enclosed in {FAKE_TOKEN}")
            images.append(ImageFrames(rows, cols, [r for _, r in tiles] + [run], int(first), end))
            tiles = []
        if tiles:
            raise UnsupportedModelError(f"row {row}: tiles without their {GLOBAL_TAG} run")
        return images

    def _check_frames(self, inputs: dict[str, torch.Tensor]) -> None:
        """Frames must reach the tower at its own size: the pixel shuffle reads a square grid of its patches."""
        side = int(self.config.vision_config.image_size)
        frame = tuple(int(v) for v in inputs["pixel_values"].shape[-2:])
        if frame != (side, side):
            raise UnsupportedModelError(
                f"{self.display_name}: the image processor makes {frame[0]}x{frame[1]} frames for a {side} px tower; "
                f"vlmbind grids only frames of the tower's size (max_image_size['longest_edge'] == image_size)")

    def processor_images(self, rows: list[list[Any]]) -> list[Any]:
        """One list of images per prompt: SmolVLM's processor reads a flat list as the images of a single prompt
        (Idefics3's splits it by the prompts' ``<image>`` counts, and takes nested lists alike)."""
        return [list(row) for row in rows]

    # ---- grids ----------------------------------------------------------------------------------------------
    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """Per image, one ``n x n`` grid per tile (``row_{i}_col_{j}``, raster order) then ``global``; the
        newlines the processor writes between the structure tokens are set to role ``special`` in ``roles``, in
        place.

        Raises:
            UnsupportedModelError: the row's image runs do not match its images or the model's frame size.
        """
        self._check_frames(inputs)
        ids = inputs["input_ids"][row].cpu().numpy()
        images = self.image_frames(ids, np.flatnonzero(roles == "image"), row)
        if len(images) != len(image_ids):
            raise UnsupportedModelError(f"row {row}: {len(image_ids)} images but the prompt lays out {len(images)}")
        n = self.tokens_per_side
        tile = int(self.config.vision_config.image_size)
        cell = tile / n  # a token's side in processed pixels: scale_factor patches
        grids = []
        for k, (frames, (width, height)) in enumerate(zip(images, image_sizes)):
            block = np.arange(frames.start, frames.end + 1)
            roles[block[roles[block] == "text"]] = "special"  # the newlines between tile rows
            canvas_w, canvas_h = frames.cols * tile, frames.rows * tile
            tiles = [(i, j) for i in range(frames.rows) for j in range(frames.cols)]
            for (i, j), run in zip(tiles, frames.runs):
                boxes = grid_boxes(n, n, cell, cell, x_off=j * tile, y_off=i * tile, scale_x=canvas_w / width,
                                   scale_y=canvas_h / height, image_size=(width, height))
                grids.append(ImageGrid(f"row_{i + 1}_col_{j + 1}", k, run.reshape(n, n), boxes))
            boxes = grid_boxes(n, n, cell, cell, scale_x=tile / width, scale_y=tile / height,
                               image_size=(width, height))
            grids.append(ImageGrid("global", k, frames.runs[-1].reshape(n, n), boxes))
        return grids

    def vision_row_tokens(self, inputs: dict[str, torch.Tensor], image_id: int) -> np.ndarray:
        """Each vision row of image ``image_id`` (its frames in order, each frame's patches in raster order) -> the
        image token it is shuffled into, counting the image's tokens in sequence order (frame by frame)."""
        ids = inputs["input_ids"].cpu().numpy()
        image_token = self.image_token_id
        seen = 0
        for row in range(ids.shape[0]):
            images = self.image_frames(ids[row], np.flatnonzero(ids[row] == image_token), row)
            if image_id < seen + len(images):
                n_frames = len(images[image_id - seen].runs)
                break
            seen += len(images)
        else:
            raise UnsupportedModelError(f"image {image_id} is not in this batch ({seen} images)")
        side, s, n = self.patches_per_side, self.scale_factor, self.tokens_per_side
        patch_r, patch_c = np.divmod(np.arange(side * side), side)
        in_frame = (patch_r // s) * n + patch_c // s
        return (np.arange(n_frames)[:, None] * n * n + in_frame[None, :]).reshape(-1)


@register_adapter
class SmolVLMAdapter(Idefics3Adapter):
    """SmolVLM / SmolVLM2 (``HuggingFaceTB/SmolVLM-256M-Instruct`` ...): Idefics3's layout, usually 4x4 shuffles."""

    family = "smolvlm"
    display_name = "SmolVLM"
    model_types = ("smolvlm",)
    model_class_name = "SmolVLMForConditionalGeneration"
    # one tile of the 256M / 500M checkpoints (their processor's max_image_size; the 2B ones tile at 384)
    typical_image_size = 512
    # TransformerLens 4.3 bridges Idefics3ForConditionalGeneration only
    transformer_lens_bridge = False
