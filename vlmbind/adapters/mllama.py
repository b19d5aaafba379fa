"""Llama-3.2-Vision (``mllama``): the image reaches the language model through cross-attention layers only.

The prompt holds one ``<|image|>`` token per image, and nothing of the image sits at any sequence position: the
vision tower's output (per tile, a CLS row then a raster of patches; the last layer concatenated with intermediate
ones) goes through the projector (``model.multi_modal_projector``, ``projector.hook_out``: ``B images tiles
(1 + patches) d_model``) and becomes the keys and values of the cross-attention layers
(``text_config.cross_attention_layers``). Those layers are :class:`MllamaCrossAttentionDecoderLayer`: a
cross-attention (``cross_attn``, text queries, image keys) and an MLP, each added to the residual stream through a
tanh gate (``cross_attn_attn_gate``, ``cross_attn_mlp_gate``); the MLP's output is also zeroed on text rows that see
no image (``full_text_row_masked_out_mask``).

So at a cross-attention layer ``l``:

* the heads are ``blocks.{l}.cross_attn.hook_z`` (the input of ``cross_attn.o_proj``, head-major) and
  ``blocks.{l}.cross_attn.hook_pattern`` (``B H P K``, ``K`` = images x tiles x (1 + patches) keys of the padded
  batch); ``attn.*`` does not exist there. Head ``(l, h)`` of every head-level tool (patching, zero / mean ablation,
  position-ID edits, locate) is cross-attention head h;
* ``hook_attn_out`` / ``hook_mlp_out`` are the gated outputs, what the layer adds (:meth:`output_gate`);
* the vision blocks are the tower's local layers, then its gated global ones (``vision.blocks.{l}``); each sees
  every tile of an image;
* the cross-attention keys are laid on the image by :meth:`key_grids` (``TokenIndex.key_grids``): one grid per
  image over the tiles of the canvas the processor picked, each cell a patch key, with its pixel box in the original
  image (the processor resizes the image into the canvas keeping its aspect ratio and pads right and bottom; cells
  in the padding have empty boxes). CLS keys are in no cell.

What does not apply: no position of the sequence is an image token (``<|image|>`` is a placeholder, role
``special``), so the ``image_attention`` ablation and per-object pooling of language-model sites are refused by name;
every key of a cross-attention head is an image key, so its zero ablation removes its image attention. Tracking lays
the cross-attention layers' maps on the key grid (the self-attention layers' maps are empty). An HF detail users meet: text rows before the first image token have an all-zero cross-attention mask,
which HF turns into uniform attention over the image keys (not none), and only the MLP's output is masked on those
rows, so their ``cross_attn.hook_z`` is not zero and patching it changes the output.

Which VSM conditions apply: all of them. ID retrieval, ID selection and feature retrieval patch head outputs at text
positions (a described object's words, the last token), which this family has; the candidate heads are the
self-attention heads and the cross-attention ones, the image's only way into the language model. Position-ID edits
add to heads' z at the last token, on either kind.

The key/value cache of a cross-attention layer holds the image's keys, not sequence positions, so the exact locate
method reuses no prefix cache here (:meth:`~vlmbind.adapters.base.ModelAdapter.reuses_prefix_cache`): every head
reruns the prompt from its layer, which gives the naive numbers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers.models.mllama.image_processing_mllama import (
    get_all_supported_aspect_ratios,
    get_image_size_fit_to_canvas,
    get_optimal_tiled_canvas,
)

from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, get_module, register_adapter

CROSS = "cross_attention"


@register_adapter
class MllamaAdapter(ModelAdapter):
    family = "mllama"
    display_name = "Llama-3.2-Vision"
    image_layout = ("no image tokens in the sequence: cross-attention layers attend to tiles of patch keys "
                    "(+ a CLS key a tile)")
    # one tile of Llama-3.2-Vision (MllamaImageProcessor's 560 x 560 in the checkpoints, up to 4 tiles an image)
    typical_image_size = 560
    capability_notes = {
        "capture": "yes (cross-attention layers: blocks.{l}.cross_attn.hook_z / hook_pattern over the image keys in "
                   "place of attn.*; hook_attn_out / hook_mlp_out gated as the layer adds them)",
        "head patching": "yes (self- and cross-attention heads)",
        "ablation": "yes (zero and mean of self- and cross-attention heads; image_attention n/a because no sequence "
                    "position holds image features, and every key of a cross-attention head is an image key, so "
                    "its zero ablation removes its image attention)",
        "exact locate": "yes (no prefix-cache reuse: cross-attention layers cache the image's keys; every head "
                        "reruns the prompt from its layer)",
        "circuits": "yes (cross-attention receivers read through q only: their keys and values are the image's)",
        "vision-token sites": "no: the family declares no map from vision-block rows to patch keys",
        "points": "yes (formats that carry their frame; track lays the cross-attention layers' maps on the key grid, "
                  "the self-attention layers' maps are empty)",
    }
    model_types = ("mllama",)
    model_class_name = "MllamaForConditionalGeneration"
    vision_blocks = "model.vision_model.transformer.layers"
    projector = "model.multi_modal_projector"
    projector_in_sequence_order = False
    image_placeholder = "<|image|>"
    image_token_attr = "image_token_index"
    image_tokens_in_sequence = False
    token_inputs = ("cross_attention_mask",)
    # HF's generation repeats the last row of the cross-attention mask for each new token
    appended_token_values = {"cross_attention_mask": "last"}
    cross_attention: ClassVar[str] = "cross_attn"
    # the tower's gated global layers, after the local ones: vision.blocks.{n_local + i} is global layer i
    vision_global_blocks: ClassVar[str] = "model.vision_model.global_transformer.layers"

    @property
    def n_vision_layers(self) -> int:
        return len(get_module(self.model, self.vision_blocks)) + len(get_module(self.model, self.vision_global_blocks))

    def vision_block(self, layer: int) -> nn.Module:
        local = get_module(self.model, self.vision_blocks)
        if layer < len(local):
            return local[layer]
        return get_module(self.model, self.vision_global_blocks)[layer - len(local)]

    # ---- layers ---------------------------------------------------------------------------------------------
    def cross_attention_layers(self) -> list[int]:
        return sorted(int(l) for l in self.text_config.cross_attention_layers)

    def is_cross(self, layer: int) -> bool:
        return layer in self.cross_attention_layers()

    def layer_kind(self, layer: int) -> str:
        return CROSS if self.is_cross(layer) else "full_attention"

    def attention_module(self, layer: int) -> nn.Module:
        return get_module(self.layer(layer), self.cross_attention if self.is_cross(layer) else self.attention)

    def o_proj_path(self, layer: int) -> str:
        if self.is_cross(layer):
            return f"{self.text_layers}.{layer}.{self.cross_attention}.{self.o_proj}"
        return super().o_proj_path(layer)

    def output_gate(self, layer: int, kind: str, layer_kwargs: dict[str, Any]) -> torch.Tensor | None:
        """``tanh(cross_attn_attn_gate)`` for a cross-attention layer's attention, and
        ``full_text_row_masked_out_mask * tanh(cross_attn_mlp_gate)`` (``B P 1``) for its MLP; None elsewhere."""
        if not self.is_cross(layer):
            return None
        block = self.layer(layer)
        if kind == "attn":
            return block.cross_attn_attn_gate.tanh()
        gate = block.cross_attn_mlp_gate.tanh()
        rows = layer_kwargs.get("full_text_row_masked_out_mask")
        return gate if rows is None else rows[:, 0] * gate

    def declared_paths(self) -> dict[str, nn.Module]:
        paths = super().declared_paths()
        cross = self.cross_attention_layers()
        if cross:
            paths["cross_attention"] = self.attention_module(cross[0])
            paths["cross_o_proj"] = self.o_proj_module(cross[0])
        return paths

    # ---- tokens ---------------------------------------------------------------------------------------------
    def roles(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """As the base class, but ``<|image|>`` is a placeholder (``special``): no image feature sits there."""
        roles = super().roles(input_ids, attention_mask)
        roles[roles == "image"] = "special"
        return roles

    def processor_kwargs(self, chat: bool) -> dict[str, Any]:
        """No tokenizer BOS for chat texts: the chat template writes ``<|begin_of_text|>`` itself."""
        return {"add_special_tokens": False} if chat else {}

    def processor_images(self, rows: list[list[Any]]) -> list[Any]:
        """One list of images per prompt: the processor reads a flat list as the images of one prompt."""
        return [list(row) for row in rows]

    def image_grids(self, inputs: dict[str, torch.Tensor], row: int, roles: np.ndarray, image_ids: list[int],
                    image_sizes: list[tuple[int, int]]) -> list[ImageGrid]:
        """None: the sequence holds no image tokens (the keys are in :meth:`key_grids`)."""
        return []

    def key_grids(self, inputs: dict[str, torch.Tensor], row: int, image_ids: list[int],
                  image_sizes: list[tuple[int, int]]) -> list[ImageGrid]:
        """One grid per image of row ``row`` over the cross-attention keys: the canvas' tiles side by side, each a
        ``patches x patches`` raster of keys (a tile's keys are its CLS, then its patches in raster order; images
        follow each other, ``max_num_tiles`` tiles each, as in the padded batch)."""
        vision = self.config.vision_config
        tile, patch = int(vision.image_size), int(vision.patch_size)
        per_side = tile // patch
        per_tile = per_side * per_side + 1
        max_tiles = int(vision.max_num_tiles)
        layouts = get_all_supported_aspect_ratios(max_tiles)
        ratio_ids = inputs["aspect_ratio_ids"][row].tolist()
        grids = []
        for j, (width, height) in enumerate(image_sizes):
            tiles_h, tiles_w = layouts[int(ratio_ids[j]) - 1]
            canvas_h, canvas_w = get_optimal_tiled_canvas(height, width, max_tiles, tile)
            if (canvas_h, canvas_w) != (tiles_h * tile, tiles_w * tile):
                raise ValueError(f"image {j} of row {row}: the processor's tile layout {tiles_h}x{tiles_w} is not the "
                                 f"canvas {canvas_h}x{canvas_w} px its size {width}x{height} gives")
            new_h, new_w = get_image_size_fit_to_canvas(height, width, canvas_h, canvas_w, tile)
            rows, cols = tiles_h * per_side, tiles_w * per_side
            r, c = np.divmod(np.arange(rows * cols), cols)
            tile_index = (r // per_side) * tiles_w + c // per_side
            keys = j * max_tiles * per_tile + tile_index * per_tile + 1 + (r % per_side) * per_side + c % per_side
            boxes = grid_boxes(rows, cols, patch, patch, scale_x=new_w / width, scale_y=new_h / height,
                               image_size=(width, height))
            grids.append(ImageGrid("keys", j, keys.reshape(rows, cols), boxes))
        return grids
