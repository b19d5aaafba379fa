"""LLaVA-NeXT / LLaVA-1.6 (``LlavaNextForConditionalGeneration``, e.g. ``llava-hf/llava-v1.6-mistral-7b-hf``).

Design: LLaVA-NeXT is the layout LLaVA-OneVision inherited, so the adapter is the OneVision adapter with two
differences, and every piece of arithmetic (best pinpoint, resize and centred paste, unpadding in feature units,
boxes in original-image pixels) is OneVision's, shared by subclassing. The processor expands one ``<image>`` into
the ``base`` grid (the whole image stretched to one tile) followed by the any-res ``tiles`` grid (the image resized
into the best ``image_grid_pinpoints`` resolution, centred, padded, cut into tiles, the tiles' features stitched and
the padding rows or columns removed), each hi-res row followed by the learned ``image_newline`` feature, which sits
on an ``<image>`` token id, is set to role ``special`` and belongs to no grid. The differences from OneVision:

* no ``anyres_max_N`` down-sampling: ``pack_image_features`` keeps every unpadded hi-res feature;
* no multi-image mode: the processor outputs no ``batch_num_images`` and the model tiles every image, also when a
  prompt has several.

Real checkpoints use a CLIP tower with ``vision_feature_select_strategy="default"``: each tile's CLS feature is
dropped, so a tile gives ``(image_size / patch_size)^2`` features. The model reshapes every tile's features into that
square, so a strategy that keeps a CLS feature (or drops a patch of a tower without one) cannot be laid out and is
refused by name.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.errors import UnsupportedModelError
from ..core.tokens import ImageGrid
from .base import register_adapter
from .llava import LlavaOnevisionAdapter, _resized_size, _size


@register_adapter
class LlavaNextAdapter(LlavaOnevisionAdapter):
    """LLaVA-NeXT (``llava-hf/llava-v1.6-*-hf``): CLIP tower, base grid plus unpadded any-res tiles, newline rows."""

    family = "llava_next"
    display_name = "LLaVA-NeXT"
    image_layout = "base grid + unpadded any-res tiles with newline tokens"
    # the CLIP ViT-L/14-336 tile (the base view and the side of LlavaNextImageProcessor's image_grid_pinpoints)
    typical_image_size = 336
    model_types = ("llava_next",)
    model_class_name = "LlavaNextForConditionalGeneration"

    def _max_tiles(self) -> int | None:
        return None  # LLaVA-NeXT keeps the whole unpadded hi-res grid

    def _check_features_per_tile(self) -> None:
        """The model reshapes each tile's features into a ``side x side`` square: the features the strategy keeps
        must be exactly the patches (the processor's ``num_additional_image_tokens`` says whether there is a CLS)."""
        extra = int(getattr(self.processor, "num_additional_image_tokens", 0) or 0)
        dropped = 1 if self.config.vision_feature_select_strategy == "default" else 0
        if extra != dropped:
            raise UnsupportedModelError(
                f"{self.display_name} with vision_feature_select_strategy="
                f"{self.config.vision_feature_select_strategy!r} and {extra} non-patch feature(s) per tile "
                f"(num_additional_image_tokens) keeps {extra - dropped:+d} feature(s) beyond the patch square; the "
                f"model cannot reshape such tiles into a grid. Use 'default' with a CLS tower (and a processor with "
                f"num_additional_image_tokens=1), 'full' without one."
            )

    def _check_tiles(self, inputs: dict[str, torch.Tensor]) -> None:
        """Tiles must reach the tower as cut: of the tower's input size, not resized or cropped afterwards
        (the image processor resizes and crops every tile after cutting, a no-op only in this case)."""
        ip = self.image_processor
        tower = int(self.config.vision_config.image_size)
        pixel_hw = tuple(int(v) for v in inputs["pixel_values"].shape[-2:])
        resized = _resized_size(ip.size, tower, tower) if getattr(ip, "do_resize", True) else (tower, tower)
        cropped = (tower, tower)
        if getattr(ip, "do_center_crop", False):
            cropped = (_size(ip.crop_size, "height"), _size(ip.crop_size, "width"))
        sizes = (pixel_hw, resized, cropped, (self._tile_size(),) * 2, self._base_size())
        if any(hw != (tower, tower) for hw in sizes):
            raise UnsupportedModelError(
                f"{self.display_name}: the image processor makes {pixel_hw[0]}x{pixel_hw[1]} tiles of "
                f"{self._tile_size()} px (resized to {resized}, cropped to {cropped}, base image {self._base_size()}) "
                f"for a {tower} px vision tower; vlmbind grids only tiles that reach the tower as cut"
            )

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """``base`` then ``tiles`` grids per image (every image tiled); the newline features after each hi-res row
        are set to role ``special`` in ``roles``, in place."""
        self._check_features_per_tile()
        self._check_tiles(inputs)
        return super().image_grids(inputs, row, roles, image_ids, image_sizes)
