"""Aya Vision (``AyaVisionForConditionalGeneration``: SigLIP tower on tiles plus a global image, pixel-shuffle SwiGLU
projector, Cohere decoder with parallel attention and MLP).

Design: the image processor (``GotOcr2ImageProcessor`` with ``crop_to_patches``, which ``AyaVisionProcessor`` turns on
by default) picks the ``cols x rows`` canvas of ``min_patches .. max_patches`` tiles whose aspect ratio is closest to
the image's (``get_optimal_tiled_canvas``), stretches the whole image to ``cols * tile x rows * tile`` pixels, cuts it
into tiles in raster order and, when it made more than one tile, appends the whole image stretched to one tile (the
global image); an image whose canvas is one tile is that one frame alone. Nothing is cropped or padded, so tile
``(i, j)`` covers exactly the ``(i, j)``-th of ``rows x cols`` equal parts of the original image. SigLIP has no CLS
row, so every patch feature is kept (``vision_feature_select_strategy="full"``), and the projector pixel-shuffles a
frame's ``n s x n s`` patch grid by ``downsample_factor`` (``s = 2``): token ``(r, c)`` of the frame's ``n x n`` grid
concatenates patches ``s r .. s r + s - 1`` x ``s c .. s c + s - 1``, then LayerNorm and a SwiGLU MLP. The processor
replaces each ``<image>`` with ``<|START_OF_IMG|>``, then ``TILE_{k}`` and ``(img_size / (patch_size s))^2``
``<|IMG_PATCH|>`` tokens per tile, ``TILE_GLOBAL`` and the global image's tokens, then ``<|END_OF_IMG|>``; the model
scatters the frames' tokens over the ``<|IMG_PATCH|>`` positions in order. The tile tags are written as text
(``TILE_1`` tokenizes into several tokens, which a tokenizer need not flag as special), so every token of an image
block that is not ``<|IMG_PATCH|>`` is role ``special``; the tags carry no row and column, so the canvas is
recomputed with the image processor's own ``get_optimal_tiled_canvas`` and a block whose frame count disagrees is
refused by name. One grid per tile, named ``row_{i}_col_{j}`` (1-based, raster order), then ``global``; an image of
one frame is the ``global`` grid alone.

The language model is Cohere2 (Command R7B, aya-vision-8b) or Cohere (Aya Expanse, aya-vision-32b). Their decoder
layer is parallel: one ``input_layernorm`` feeds both the attention and the MLP, and the layer returns
``x + attn(ln x) + mlp(ln x)``, so ``hook_attn_out`` and ``hook_mlp_out`` (the attention and MLP modules' outputs) are
exactly what the layer adds and ``resid_post = resid_pre + attn_out + mlp_out`` still holds; there is no residual
stream between them, and the MLP never reads an attention head's output of its own layer (path patching's hold on
the sender layer's MLP is then a no-op). Cohere2 layers follow ``text_config.layer_types`` (3 sliding-window layers,
then a full one): sliding layers rotate queries and keys (RoPE, interleaved pairs), full layers use no positional
encoding at all; Cohere's layers are all full, with RoPE. Attention is causal throughout (no bidirectional image
block) and the masks are the model's own. ``Cohere2ForCausalLM`` / ``CohereForCausalLM`` multiply their logits by
``text_config.logit_scale``, but ``AyaVisionForConditionalGeneration`` does not, so neither does the logit lens (no
final scale or softcap is declared). The vision tower's rows map cleanly to image tokens (each token concatenates
its ``s x s`` patches), so :meth:`AyaVisionAdapter.vision_row_tokens` is declared. A box is the token's geometric
footprint; the processor's bicubic resizes read a few original pixels across it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

from ..core.errors import UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, get_module, register_adapter
from .frames import SquareFrames, frame_row_tokens, structure_token_id

START_IMAGE = "<|START_OF_IMG|>"
END_IMAGE = "<|END_OF_IMG|>"
IMAGE_PATCH = "<|IMG_PATCH|>"


@dataclass(frozen=True)
class ImageBlock:
    """The ``<|START_OF_IMG|> ... <|END_OF_IMG|>`` block of one image in a prompt.

    Attributes:
        start: position of ``<|START_OF_IMG|>``.
        end: position of ``<|END_OF_IMG|>``.
        frames: one ``n*n`` array of ``<|IMG_PATCH|>`` positions per frame (tiles in raster order, then the global
            image), in sequence order.
    """

    start: int
    end: int
    frames: list[np.ndarray]


@register_adapter
class AyaVisionAdapter(SquareFrames, ModelAdapter):
    """Aya Vision (``CohereLabs/aya-vision-8b`` / ``-32b``): SigLIP on tiles plus a global image, Cohere2 decoder."""

    family = "aya_vision"
    display_name = "Aya Vision"
    image_layout = "cols x rows tiles + global image, s x s patches a token (pixel shuffle), `TILE_k` tags"
    # one tile of aya-vision-8b / -32b (the SigLIP2 tower's image_size, the image processor's size)
    typical_image_size = 364
    model_types = ("aya_vision",)
    model_class_name = "AyaVisionForConditionalGeneration"
    text_layers = "model.language_model.layers"
    vision_blocks = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    # pixel shuffle + LayerNorm + SwiGLU MLP: ``frames n n d_model``, each frame's token grid in raster order
    projector = "model.multi_modal_projector"
    image_placeholder = "<image>"
    image_token_attr = "image_token_id"
    # TransformerLens bridges Cohere2ForCausalLM (the text model alone), not this class: the default "no" cell

    # ---- geometry -------------------------------------------------------------------------------------------
    @property
    def shuffle(self) -> int:
        """Patches per token side: the projector's ``downsample_factor``."""
        s = int(self.config.downsample_factor)
        if self.patches_per_side % s:
            raise UnsupportedModelError(
                f"{self.display_name}: downsample_factor {s} does not divide the {self.patches_per_side}-patch side "
                f"of a frame; the model's pixel shuffle needs it to")
        return s

    @property
    def tokens_per_side(self) -> int:
        """Side of one frame's token grid after the pixel shuffle."""
        return self.patches_per_side // self.shuffle

    # ---- structure tokens ------------------------------------------------------------------------------------
    def structure_ids(self) -> tuple[int, int]:
        """Ids of ``<|START_OF_IMG|>`` and ``<|END_OF_IMG|>``."""
        return (structure_token_id(self, "start_of_img_token", START_IMAGE),
                structure_token_id(self, "end_of_img_token", END_IMAGE))

    def roles(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Role of every position: ``<|IMG_PATCH|>`` is ``image``; every other token of an image block (its
        delimiters and the ``TILE_k`` / ``TILE_GLOBAL`` tags, which a tokenizer may split into ordinary tokens) is
        ``special``."""
        roles = super().roles(input_ids, attention_mask)
        start_id, end_id = self.structure_ids()
        inside = np.cumsum(input_ids == start_id) - np.cumsum(input_ids == end_id)
        block = (inside > 0) | (input_ids == end_id)
        roles[block & (roles == "text")] = "special"
        return roles

    def image_blocks(self, input_ids: np.ndarray, row: int) -> list[ImageBlock]:
        """The images of one row: each ``<|START_OF_IMG|> ... <|END_OF_IMG|>`` block's runs of ``<|IMG_PATCH|>``
        tokens, one run a frame.

        Raises:
            UnsupportedModelError: unpaired delimiters, an image token outside a block, or a run whose length is not
                the model's tokens a frame.
        """
        start_id, end_id = self.structure_ids()
        starts, ends = np.flatnonzero(input_ids == start_id), np.flatnonzero(input_ids == end_id)
        if len(starts) != len(ends) or np.any(starts >= ends) or np.any(starts[1:] <= ends[:-1]):
            raise UnsupportedModelError(f"row {row}: {START_IMAGE} at {starts.tolist()} and {END_IMAGE} at "
                                        f"{ends.tolist()} do not pair up; this prompt layout is not supported")
        image = input_ids == self.image_token_id
        in_blocks = sum(int(image[first:last].sum()) for first, last in zip(starts, ends))
        if in_blocks != int(image.sum()):
            raise UnsupportedModelError(f"row {row}: {int(image.sum()) - in_blocks} {IMAGE_PATCH} token(s) outside "
                                        f"any {START_IMAGE} block; this prompt layout is not supported")
        per_frame = self.tokens_per_side**2
        blocks = []
        for start, end in zip(starts, ends):
            positions = start + 1 + np.flatnonzero(image[start + 1 : end])
            runs = np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1) if len(positions) else []
            for run in runs:
                if len(run) != per_frame:
                    raise UnsupportedModelError(
                        f"row {row}: a run of {len(run)} image tokens at position {int(run[0])}, but the model makes "
                        f"{per_frame} a frame ((image_size / patch_size / downsample_factor)^2); the processor's "
                        f"(img_size / patch_size)^2 must match it (img_size {getattr(self.processor, 'img_size', '?')}"
                        f", patch_size {getattr(self.processor, 'patch_size', '?')}: the pixels of one token, the "
                        f"tower's patch_size times downsample_factor)")
            if not runs:
                raise UnsupportedModelError(f"row {row}: the {START_IMAGE} block at {int(start)} holds no image "
                                            f"tokens; this prompt layout is not supported")
            blocks.append(ImageBlock(int(start), int(end), runs))
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
        """Frames must reach the tower at its own size and keep exactly their patch features: the projector reshapes
        each frame's features into a square patch grid before the pixel shuffle."""
        tile = self.tile_size
        frame = tuple(int(v) for v in inputs["pixel_values"].shape[-2:])
        if frame != (tile, tile):
            raise UnsupportedModelError(
                f"{self.display_name}: the image processor makes {frame[0]}x{frame[1]} frames for a {tile} px tower; "
                f"vlmbind grids only frames of the tower's size (the image processor's size == vision image_size)")
        has_cls = hasattr(get_module(self.model, "model.vision_tower.embeddings"), "class_embedding")
        strategy = self.config.vision_feature_select_strategy
        if has_cls or strategy != "full":
            raise UnsupportedModelError(
                f"{self.display_name} with vision_feature_select_strategy={strategy!r} on a tower "
                f"{'with' if has_cls else 'without'} a CLS feature: the projector's pixel shuffle needs exactly a "
                f"frame's patch square; vlmbind supports the released layout (SigLIP, 'full')")

    def processor_kwargs(self, chat: bool) -> dict[str, Any]:
        """No tokenizer BOS for chat texts: the chat template starts with ``<BOS_TOKEN>`` itself (as HF's
        ``apply_chat_template`` tokenizes it)."""
        return {"add_special_tokens": False} if chat else {}

    # ---- grids ----------------------------------------------------------------------------------------------
    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """Per image, one ``n x n`` grid per tile (``row_{i}_col_{j}``, raster order) then ``global``, or the
        ``global`` grid alone for an image of one frame.

        Raises:
            UnsupportedModelError: the row's image blocks do not match its images, the model's frame size, or the
                tiles the image processor's ``min_patches`` / ``max_patches`` give the image.
        """
        self._check_frames(inputs)
        blocks = self.image_blocks(inputs["input_ids"][row].cpu().numpy(), row)
        if len(blocks) != len(image_ids):
            raise UnsupportedModelError(f"row {row}: {len(image_ids)} images but the prompt lays out {len(blocks)}")
        n, tile = self.tokens_per_side, self.tile_size
        cell = tile / n  # a token's side in processed pixels: `shuffle` patches
        grids = []
        for k, (block, (width, height)) in enumerate(zip(blocks, image_sizes)):
            whole = grid_boxes(n, n, cell, cell, scale_x=tile / width, scale_y=tile / height,
                               image_size=(width, height))
            if len(block.frames) > 1:
                cols, rows = self.canvas(width, height)
                if cols * rows + 1 != len(block.frames):
                    ip = self.processor.image_processor
                    raise UnsupportedModelError(
                        f"row {row}, image {k}: {len(block.frames)} frames, but the image processor (min_patches="
                        f"{ip.min_patches}, max_patches={ip.max_patches}) tiles a {width}x{height} image into {cols}x"
                        f"{rows} tiles and a global image; set min_patches / max_patches on the image processor, "
                        f"not per call")
                for t, frame in enumerate(block.frames[:-1]):
                    i, j = divmod(t, cols)
                    boxes = grid_boxes(n, n, cell, cell, x_off=j * tile, y_off=i * tile,
                                       scale_x=cols * tile / width, scale_y=rows * tile / height,
                                       image_size=(width, height))
                    grids.append(ImageGrid(f"row_{i + 1}_col_{j + 1}", k, frame.reshape(n, n), boxes))
            grids.append(ImageGrid("global", k, block.frames[-1].reshape(n, n), whole))
        return grids

    def vision_row_tokens(self, inputs: dict[str, torch.Tensor], image_id: int) -> np.ndarray:
        """Each vision row of image ``image_id`` (its frames in order, each frame's patches in raster order) -> the
        image token it is shuffled into, counting the image's tokens in sequence order (frame by frame).

        Raises:
            UnsupportedModelError: the batch has no image ``image_id``.
        """
        return frame_row_tokens(self, inputs, image_id, self.shuffle)
