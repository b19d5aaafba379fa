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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..core.errors import TrainingError
from ..tiny.qwen import build_qwen_vl

__all__ = ["CELL_PX", "OrganismSize", "build_organism", "evaluating", "grid_side", "shared_image_features"]

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
        rope_theta: the text decoder's RoPE base. M-RoPE gives an image token's column the lowest frequencies of
            the head: with ``d_head`` 32 and the usual 10,000 they turn by under 0.004 rad a cell, so attention
            cannot tell columns apart; 10 turns them by 0.1-0.2 rad.
    """

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int | None = None
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 4
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is None and name == "intermediate":
                continue
            if name == "rope_theta":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
                    raise TrainingError(f"model size rope_theta must be a number > 1, got {value!r}")
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
        d = asdict(self)
        if d["rope_theta"] == OrganismSize.rope_theta:  # configs at the usual base keep the keys they always had
            del d["rope_theta"]
        return d


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
    rope_theta: float = 10000.0,
) -> tuple[torch.nn.Module, Any]:
    """A freshly initialised organism and its processor.

    Args:
        seed: seeds the weight init; the same seed and size give the same weights.
        image_size: the fixed square image size in pixels, a multiple of 28 (``image_size / 28`` tokens a side).
        layers, hidden, heads, kv_heads, intermediate, vision_depth, vision_hidden, vision_heads, rope_theta: see
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
                        vision_depth=vision_depth, vision_hidden=vision_hidden, vision_heads=vision_heads,
                        rope_theta=rope_theta)
    return build_qwen_vl(
        "qwen2_5_vl", seed, image_size,
        layers=size.layers, hidden=size.hidden, intermediate=size.intermediate, heads=size.heads,
        kv_heads=size.kv_heads, vision_depth=size.vision_depth, vision_hidden=size.vision_hidden,
        vision_heads=size.vision_heads, text_init_std=None, attn_implementation=attn_implementation,
        rope_theta=size.rope_theta,
    )


class _ImageFeatureCache:
    """Each distinct image's merged vision features, valid while the vision tower's parameters are unchanged.

    An entry is found by a fingerprint of the image's pixels and confirmed with ``torch.equal``, so a hit is always
    the same image. Entries computed with gradients serve every later call; one computed without gradients serves
    only calls without them (a forward that needs the graph recomputes it).
    """

    def __init__(self, model: Any):
        self.inner = model.model
        self.original = type(self.inner).get_image_features.__get__(self.inner)
        self.parameters = list(self.inner.visual.parameters())
        self.entries: dict[tuple, list[list[Any]]] = {}
        self.state: tuple | None = None
        self.images_in = 0  # images asked for
        self.images_encoded = 0  # images that went through the vision tower

    def _state(self) -> tuple:
        # an optimiser step (in place) bumps every parameter's version: the features are stale then
        return (self.inner.training, tuple(p._version for p in self.parameters))

    @staticmethod
    def _fingerprint(block: torch.Tensor, thw: tuple[int, ...]) -> tuple:
        flat = block.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].to("cpu", torch.float32)  # numpy has no bfloat16
        return (thw, flat.numel(), str(block.dtype), hash(sample.numpy().tobytes()))

    def _find(self, key: tuple, block: torch.Tensor, grad: bool) -> list[Any] | None:
        for entry in self.entries.get(key, []):
            if torch.equal(entry[0], block) and (entry[2] or not grad):
                return entry
        return None

    def __call__(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        if image_grid_thw is None or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            return self.original(pixel_values, image_grid_thw, **kwargs)
        state = self._state()
        if state != self.state:
            self.entries.clear()
            self.state = state
        grad = torch.is_grad_enabled()
        grids = [tuple(int(v) for v in row) for row in image_grid_thw.tolist()]
        blocks = torch.split(pixel_values, [t * h * w for t, h, w in grids])
        keys = [self._fingerprint(b, g) for b, g in zip(blocks, grids)]
        found = [self._find(k, b, grad) for k, b in zip(keys, blocks)]
        missing: list[int] = []
        for i, entry in enumerate(found):  # an image twice in one batch is encoded once
            if entry is None and not any(keys[j] == keys[i] and torch.equal(blocks[j], blocks[i]) for j in missing):
                missing.append(i)
        self.images_in += len(blocks)
        if missing:
            out = self.original(torch.cat([blocks[i] for i in missing]), image_grid_thw[missing],
                                return_dict=True, **{k: v for k, v in kwargs.items() if k != "return_dict"})
            for i, features in zip(missing, out.pooler_output):
                entry = [blocks[i].detach().clone(), features, grad]
                self.entries.setdefault(keys[i], []).insert(0, entry)
            self.images_encoded += len(missing)
            found = [self._find(k, b, grad) for k, b in zip(keys, blocks)]
        features = tuple(entry[1] if grad else entry[1].detach() for entry in found)
        return BaseModelOutputWithPooling(pooler_output=features)


@contextmanager
def evaluating(model: Any) -> Iterator[None]:
    """Eval mode and no gradients for the block; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


@contextmanager
def shared_image_features(model: Any) -> Iterator[_ImageFeatureCache]:
    """Within the block, each distinct image goes through ``model``'s vision tower once.

    Organism training runs the same images through the model many times a step (the base run, the source run, the
    patched and the ablated runs): the vision tower's output does not change between them, so it is computed once
    per image and shared (the graph too: a loss over several forwards sends each image's gradient back through one
    vision forward, the sum of what separate forwards would send). An optimiser step inside the block empties the
    cache (it watches the parameters' versions); a forward asking for the vision tower's hidden states or attentions
    bypasses it. Yields the cache (``images_in``, ``images_encoded`` count the saving). The model's own
    ``get_image_features`` is restored on exit, also after an error.
    """
    inner = model.model
    if "get_image_features" in vars(inner):
        raise TrainingError("shared_image_features is already active on this model; nest the work in one block")
    cache = _ImageFeatureCache(model)
    inner.get_image_features = cache
    try:
        yield cache
    finally:
        del inner.get_image_features
        cache.entries.clear()
