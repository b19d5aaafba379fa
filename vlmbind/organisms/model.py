"""The organism architecture: a small Qwen2.5-VL (the real HF class) with a fixed image-token grid.

Design: an organism is built by the same builder as ``tiny-qwen2_5_vl`` (:func:`vlmbind.tiny.qwen.build_qwen_vl`), so
it has the same byte-level BPE tokenizer (every colour, shape, number and ``yes`` / ``no`` / ``none`` answer word
with its leading space is one token), the same processor classes and the same config layout, and it loads through
the ordinary ``from_pretrained`` path once saved. Two things differ from the tiny model: the weights keep Hugging
Face's default init (the tiny model's 0.08 re-scale exists to make random heads visible, which training does not
need), and the size is a parameter. The processor's ``min_pixels = max_pixels = image_size**2`` fixes the image size;
with 14 px patches merged 2x2 each language-model image token covers one 28 px cell, so a stimuli canvas with
``image_size / 28`` cells a side puts every object in exactly one image token (168 px -> 6x6 grid).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import TrainingError
from ..tiny.qwen import build_qwen_vl

__all__ = ["CELL_PX", "OrganismSize", "build_organism", "grid_side"]

# pixels covered by one merged image token: patch 14 x merge 2
CELL_PX = 28


def grid_side(image_size: int) -> int:
    """Image tokens per side for a square ``image_size`` image (168 -> 6).

    Raises:
        TrainingError: ``image_size`` is not a positive multiple of 28 (the grid would not be aligned).
    """
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < CELL_PX \
            or image_size % CELL_PX:
        raise TrainingError(
            f"image_size must be a positive multiple of {CELL_PX} px (one merged image token per {CELL_PX} px cell), "
            f"got {image_size!r}; e.g. 112 (4x4 grid), 168 (6x6) or 224 (8x8)"
        )
    return image_size // CELL_PX


@dataclass(frozen=True, kw_only=True)
class OrganismSize:
    """The architecture's size parameters (text decoder and vision tower).

    Attributes:
        layers: text decoder layers.
        hidden: text hidden size (``d_model``).
        heads: query heads; ``hidden / heads`` is ``d_head`` (even, for M-RoPE).
        kv_heads: key/value heads (grouped-query attention); divides ``heads``.
        intermediate: text MLP size (None: ``2 * hidden``).
        vision_depth: vision blocks (the last attends globally, the others in windows).
        vision_hidden: vision width.
        vision_heads: vision attention heads.
    """

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int | None = None
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 4

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is None and name == "intermediate":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrainingError(f"model size {name} must be a positive int, got {value!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise TrainingError(f"hidden {self.hidden} must split into {self.heads} heads of even size (M-RoPE)")
        if self.heads % self.kv_heads:
            raise TrainingError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.vision_hidden % self.vision_heads or (self.vision_hidden // self.vision_heads) % 2:
            raise TrainingError(
                f"vision_hidden {self.vision_hidden} must split into {self.vision_heads} heads of even size"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_organism(
    *,
    seed: int,
    image_size: int,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    attn_implementation: str = "sdpa",
) -> tuple[torch.nn.Module, Any]:
    """A freshly initialised organism and its processor.

    Args:
        seed: seeds the weight init; the same seed and size give the same weights.
        image_size: the fixed square image size in pixels, a multiple of 28 (``image_size / 28`` tokens a side).
        layers, hidden, heads, kv_heads, intermediate, vision_depth, vision_hidden, vision_heads: see
            :class:`OrganismSize`.
        attn_implementation: ``"sdpa"`` (faster to train) or ``"eager"``; not stored in the saved config, and
            :func:`vlmbind.load` picks its own.

    Returns:
        ``(model, processor)``: a ``Qwen2_5_VLForConditionalGeneration`` in eval mode and its ``Qwen2_5_VLProcessor``.

    Raises:
        TrainingError: an image size that is not a multiple of 28, or inconsistent size parameters.
    """
    grid_side(image_size)
    size = OrganismSize(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                        vision_depth=vision_depth, vision_hidden=vision_hidden, vision_heads=vision_heads)
    return build_qwen_vl(
        "qwen2_5_vl", seed, image_size,
        layers=size.layers, hidden=size.hidden, intermediate=size.intermediate, heads=size.heads,
        kv_heads=size.kv_heads, vision_depth=size.vision_depth, vision_hidden=size.vision_hidden,
        vision_heads=size.vision_heads, text_init_std=None, attn_implementation=attn_implementation,
    )
