"""What the tiled families (InternVL, Aya Vision, Ovis2) share: each image is a block of frames (tiles and a
thumbnail or global view), each frame an ``n x n`` token grid that ``s x s`` vision patches are merged into.

An adapter using these has ``image_blocks(input_ids, row)`` (the image blocks of a row, each with ``frames``: one
array of token positions per frame, in sequence order), ``patches_per_side`` (:class:`SquareFrames` gives it) and
``tokens_per_side``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.errors import UnsupportedModelError


def config_side(value: int | list[int] | tuple[int, ...]) -> tuple[int, int]:
    """``(height, width)`` of a config size given as one int or a pair."""
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


class SquareFrames:
    """A frame's geometry from the vision tower's config, for an adapter whose frames are square tiles."""

    @property
    def tile_size(self) -> int:
        """Side in pixels of one frame (the tower's ``image_size``)."""
        height, width = config_side(self.config.vision_config.image_size)
        if height != width:
            raise UnsupportedModelError(f"{self.display_name}: a {height}x{width} vision tower; vlmbind grids only "
                                        f"square tiles (every {self.display_name} checkpoint's)")
        return height

    @property
    def patches_per_side(self) -> int:
        """Side of one frame's patch grid (``image_size / patch_size``)."""
        return self.tile_size // config_side(self.config.vision_config.patch_size)[0]


def structure_token_id(adapter: Any, attr: str, default: str) -> int:
    """The id of the processor's structure token ``attr`` (``default`` where the processor names none).

    Raises:
        UnsupportedModelError: the tokenizer does not have that token.
    """
    token = getattr(adapter.processor, attr, None) or default
    token_id = adapter.tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == adapter.tokenizer.unk_token_id:
        raise UnsupportedModelError(f"{adapter.display_name}: the tokenizer has no {token} token, which the "
                                    f"processor writes around every image; vlmbind cannot lay out its images")
    return int(token_id)


def frame_row_tokens(adapter: Any, inputs: dict[str, torch.Tensor], image_id: int, stride: int) -> np.ndarray:
    """Each vision row of image ``image_id`` (its frames in sequence order, each frame's patches in raster order) ->
    the image token its ``stride x stride`` patch group is merged into, counting the image's tokens in sequence
    order (frame by frame).

    Raises:
        UnsupportedModelError: the batch has no image ``image_id``.
    """
    ids = inputs["input_ids"].cpu().numpy()
    seen = 0
    for row in range(ids.shape[0]):
        blocks = adapter.image_blocks(ids[row], row)
        if image_id < seen + len(blocks):
            n_frames = len(blocks[image_id - seen].frames)
            break
        seen += len(blocks)
    else:
        raise UnsupportedModelError(f"image {image_id} is not in this batch ({seen} images)")
    side, n = adapter.patches_per_side, adapter.tokens_per_side
    patch_r, patch_c = np.divmod(np.arange(side * side), side)
    in_frame = (patch_r // stride) * n + patch_c // stride
    return (np.arange(n_frames)[:, None] * n * n + in_frame[None, :]).reshape(-1)
