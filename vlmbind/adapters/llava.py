"""LLaVA-1.5 (``LlavaForConditionalGeneration``) and LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``).

Design: both processors expand one ``<image>`` into as many ``<image>`` tokens as the model inserts image features,
and the model scatters the features over those positions in order; the adapters only reproduce the processors' own
resize / pad / crop / tiling arithmetic (calling HF's helpers where they exist) to say which token covers which
original-image pixels. LLaVA-1.5: optional pad-to-square, shortest-edge resize and center crop, then CLIP's ``(crop /
patch)^2`` grid in raster order (the CLS feature is dropped by ``vision_feature_select_strategy="default"``; a kept CLS
feature would be role ``special``). LLaVA-OneVision (one image per prompt in the processor's view, which is what
:meth:`~vlmbind.engine.vlm.VLM.prepare` produces): first the ``base`` grid of the whole image stretched to one tile,
then the any-res tiles (the image resized into the best ``image_grid_pinpoints`` resolution, centred, padded and cut
into tiles) stitched into one hi-res ``tiles`` grid, with the padding rows or columns removed and, past ``anyres_max_N``
tiles' worth of features, bilinearly down-sampled; every hi-res row is followed by the learned ``image_newline``
feature. Newline features sit on ``<image>`` token ids, so :meth:`LlavaOnevisionAdapter.image_grids` marks them
``special`` in the row's roles (``roles`` alone cannot: it does not see the image sizes). A down-sampled cell's box is
the union of the feature cells the bilinear kernel reads, so boxes of neighbours may overlap. When the processor is
given nested per-prompt image lists with several images (multi-image mode) each image is only padded to a square and
resized: a ``base`` grid and one trailing newline feature.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
from transformers.image_transforms import get_resize_output_image_size, get_size_with_aspect_ratio
from transformers.image_utils import ChannelDimension

from ..core.errors import UnsupportedModelError
from ..core.tokens import ImageGrid, grid_boxes
from .base import ModelAdapter, register_adapter


def _shape_only(height: int, width: int) -> np.ndarray:
    """A zero-cost ``1 H W`` array standing in for an image in HF's size helpers (they read only its shape)."""
    return np.broadcast_to(np.zeros((), dtype=np.uint8), (1, height, width))


def _size(size: Any, key: str) -> int | None:
    """``size[key]`` of an image processor's size (a ``SizeDict`` or a plain dict), or None."""
    if size is None:
        return None
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return None if value is None else int(value)


def _resized_size(size: Any, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` after the image processor's ``resize`` with ``size`` (the torchvision backend's rules)."""
    shortest, longest = _size(size, "shortest_edge"), _size(size, "longest_edge")
    if shortest and longest:
        return tuple(get_size_with_aspect_ratio((height, width), shortest, longest))
    if shortest:
        return tuple(get_resize_output_image_size(
            _shape_only(height, width), size=shortest, default_to_square=False,
            input_data_format=ChannelDimension.FIRST,
        ))
    h, w = _size(size, "height"), _size(size, "width")
    if h and w:
        return h, w
    raise UnsupportedModelError(f"image processor size {size!r} is not supported by vlmbind's LLaVA adapter; "
                                f"expected shortest_edge (and longest_edge) or height and width")


def _crop_offset(resized: int, crop: int) -> int:
    """Where a center crop of ``crop`` pixels starts in a ``resized``-pixel axis (negative: padded first)."""
    if crop > resized:
        return -((crop - resized) // 2)
    return int((resized - crop) / 2.0)


def _axis_edges(lo: np.ndarray, hi: np.ndarray, cell: float, offset: float, scale: float, limit: int) -> tuple:
    """Pixel edges in the original image of cells spanning feature indices ``lo..hi`` (inclusive) on one axis.

    A feature index ``k`` covers processed pixels ``[k*cell, (k+1)*cell)``; ``offset`` is the processed position of
    original pixel 0 and ``scale`` processed pixels per original pixel. Edges are clipped to ``[0, limit]``.
    """
    start = np.clip((lo * cell - offset) / scale, 0, limit)
    end = np.clip(((hi + 1) * cell - offset) / scale, 0, limit)
    return start, end


def _boxes(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray) -> np.ndarray:
    """``rows cols 4`` boxes from per-column x edges and per-row y edges."""
    boxes = np.zeros((len(y0), len(x0), 4))
    boxes[..., 0], boxes[..., 2] = x0[None, :], x1[None, :]
    boxes[..., 1], boxes[..., 3] = y0[:, None], y1[:, None]
    return boxes


def _bilinear_support(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last input index each output index of a bilinear down-sampling (``align_corners=False``) reads.

    Computed with torch's own interpolation of an identity matrix, so it is exactly the kernel the model applies.
    """
    weights = torch.nn.functional.interpolate(
        torch.eye(n_in, dtype=torch.float64)[None], size=n_out, mode="linear", align_corners=False
    )[0]  # n_in n_out: weight of input a in output i
    used = (weights > 0).numpy()
    lo = np.array([np.flatnonzero(used[:, i])[0] for i in range(n_out)])
    hi = np.array([np.flatnonzero(used[:, i])[-1] for i in range(n_out)])
    return lo, hi


def _consume(image_positions: np.ndarray, cursor: int, n: int, row: int, what: str) -> np.ndarray:
    """The next ``n`` image-token positions of the row, or a clear error when the row has fewer."""
    if cursor + n > len(image_positions):
        raise UnsupportedModelError(
            f"row {row}: the {what} needs image tokens {cursor}..{cursor + n - 1} but the row has only "
            f"{len(image_positions)}; the processor and the model config disagree about the image layout"
        )
    return image_positions[cursor : cursor + n]


class _LlavaBase(ModelAdapter):
    """What LLaVA-1.5 and LLaVA-OneVision share: a HF vision tower (CLIP / SigLIP) and a 2-layer MLP projector."""

    vision_blocks = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.multi_modal_projector"
    image_placeholder = "<image>"
    image_token_attr = "image_token_id"
    transformer_lens_bridge = True

    @property
    def image_processor(self) -> Any:
        return self.processor.image_processor

    @property
    def features_per_side(self) -> int:
        """Side of the square patch grid the vision tower makes of one input image (or tile)."""
        vision = self.config.vision_config
        return int(vision.image_size) // int(vision.patch_size)

    def _check_count(self, row: int, used: int, image_positions: np.ndarray) -> None:
        if used != len(image_positions):
            raise UnsupportedModelError(
                f"row {row}: {len(image_positions)} image tokens, but the {self.display_name} layout accounts for "
                f"{used}; the processor and the model config disagree about the image layout"
            )


@register_adapter
class LlavaAdapter(_LlavaBase):
    """LLaVA-1.5 (``llava-hf/llava-1.5-7b-hf`` and the like): CLIP tower, one raster grid per image."""

    family = "llava"
    display_name = "LLaVA-1.5"
    image_layout = "fixed (crop/patch)^2 grid"
    # LLaVA-1.5's CLIP ViT-L/14-336 (the checkpoints' crop_size; every image is resized and cropped to it)
    typical_image_size = 336
    model_types = ("llava",)
    model_class_name = "LlavaForConditionalGeneration"

    def _processed_geometry(self, width: int, height: int) -> tuple[int, int, float, float, float, float]:
        """Size of the processed image and how its pixels map back to the original.

        Returns:
            ``(out_h, out_w, x_off, y_off, scale_x, scale_y)``: processed pixel ``x`` is original pixel
            ``(x + x_off) / scale_x`` (likewise y), the convention of :func:`~vlmbind.core.tokens.grid_boxes`.
        """
        ip = self.image_processor
        canvas_w, canvas_h, pad_x, pad_y = width, height, 0, 0
        if getattr(ip, "do_pad", False):  # pad to a square first (LlavaImageProcessor's do_pad), centred
            side = max(width, height)
            pad_x, pad_y = (side - width) // 2, (side - height) // 2
            canvas_w = canvas_h = side
        out_h, out_w = canvas_h, canvas_w
        if getattr(ip, "do_resize", True):
            out_h, out_w = _resized_size(ip.size, canvas_h, canvas_w)
        scale_x, scale_y = out_w / canvas_w, out_h / canvas_h
        crop_x = crop_y = 0
        if getattr(ip, "do_center_crop", False):
            crop_h, crop_w = _size(ip.crop_size, "height"), _size(ip.crop_size, "width")
            crop_x, crop_y = _crop_offset(out_w, crop_w), _crop_offset(out_h, crop_h)
            out_h, out_w = crop_h, crop_w
        return out_h, out_w, crop_x - pad_x * scale_x, crop_y - pad_y * scale_y, scale_x, scale_y

    def _leading_features(self) -> int:
        """Features before the patch grid in each image's run (a CLS feature kept by the ``full`` strategy)."""
        extra = int(getattr(self.processor, "num_additional_image_tokens", 0) or 0)
        if self.config.vision_feature_select_strategy == "default":
            extra -= 1
        if extra < 0:
            raise UnsupportedModelError(
                "vision_feature_select_strategy='default' drops the first feature, but this tower has no CLS token "
                "(num_additional_image_tokens=0), so a patch would be dropped; vlmbind cannot grid that layout"
            )
        return extra

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """One ``image`` grid per image: ``(H/p) x (W/p)`` cells of the processed ``H x W`` image, raster order.

        Leading non-patch features (a CLS kept by ``vision_feature_select_strategy="full"``) are set to role
        ``special`` in ``roles``, in place.
        """
        image_positions = np.flatnonzero(roles == "image")
        patch = int(self.config.vision_config.patch_size)
        leading = self._leading_features()
        grids, cursor = [], 0
        for k, (image_id, (width, height)) in enumerate(zip(image_ids, image_sizes)):
            out_h, out_w, x_off, y_off, scale_x, scale_y = self._processed_geometry(width, height)
            pixel_hw = tuple(int(v) for v in inputs["pixel_values"][image_id].shape[-2:])
            if pixel_hw != (out_h, out_w):
                raise UnsupportedModelError(
                    f"image {image_id}: vlmbind expected the processor to make a {out_h}x{out_w} image but it made "
                    f"{pixel_hw[0]}x{pixel_hw[1]}; this image processor's settings are not supported"
                )
            rows, cols = out_h // patch, out_w // patch
            run = _consume(image_positions, cursor, leading + rows * cols, row, f"grid of image {k}")
            cursor += len(run)
            roles[run[:leading]] = "special"
            boxes = grid_boxes(rows, cols, patch, patch, x_off=x_off, y_off=y_off, scale_x=scale_x,
                               scale_y=scale_y, image_size=(width, height))
            grids.append(ImageGrid("image", k, run[leading:].reshape(rows, cols), boxes))
        self._check_count(row, cursor, image_positions)
        return grids


@register_adapter
class LlavaOnevisionAdapter(_LlavaBase):
    """LLaVA-OneVision (``llava-hf/llava-onevision-qwen2-*-hf``): SigLIP tower, base grid plus any-res tiles."""

    family = "llava_onevision"
    display_name = "LLaVA-OneVision"
    image_layout = "base grid + any-res tiles with newline tokens"
    # the SigLIP-so400m/384 tile (LlavaOnevisionImageProcessor's size, the base view and the any-res tile side)
    typical_image_size = 384
    model_types = ("llava_onevision",)
    model_class_name = "LlavaOnevisionForConditionalGeneration"
    # the projector's rows are per tile; the model unpads and regroups them (and adds newline rows) afterwards
    projector_in_sequence_order = False

    def _tile_size(self) -> int:
        """Side of one any-res tile in pixels (the image processor's own choice, ``_preprocess``)."""
        ip = self.image_processor
        return (_size(ip.crop_size, "height") or _size(ip.size, "height") or _size(ip.size, "shortest_edge"))

    def _base_size(self) -> tuple[int, int]:
        """``(height, width)`` the whole image is stretched to for the base grid."""
        size = self.image_processor.size
        h, w = _size(size, "height"), _size(size, "width")
        if h and w:
            return h, w
        side = _size(size, "shortest_edge")
        return side, side

    def _check_pinpoints(self) -> list[list[int]]:
        config_points = [list(p) for p in self.config.image_grid_pinpoints]
        processor_points = [list(p) for p in self.image_processor.image_grid_pinpoints]
        if config_points != processor_points:
            raise UnsupportedModelError(
                "the image processor's image_grid_pinpoints differ from the model config's; the processor would "
                "tile images differently from how the model unpacks them. Load both from the same checkpoint."
            )
        return config_points

    def _base_grid(self, k: int, positions: np.ndarray, width: int, height: int, padded: bool) -> ImageGrid:
        """The base grid: the whole image stretched (or, ``padded``, padded to a square first) to one tile."""
        side = self.features_per_side
        base_h, base_w = self._base_size()
        x_off = y_off = 0.0
        canvas_w, canvas_h = width, height
        if padded:
            canvas_w = canvas_h = max(width, height)
        scale_x, scale_y = base_w / canvas_w, base_h / canvas_h
        if padded:
            x_off, y_off = -((canvas_w - width) // 2) * scale_x, -((canvas_h - height) // 2) * scale_y
        boxes = grid_boxes(side, side, base_w / side, base_h / side, x_off=x_off, y_off=y_off,
                           scale_x=scale_x, scale_y=scale_y, image_size=(width, height))
        return ImageGrid("base", k, positions.reshape(side, side), boxes)

    def _max_tiles(self) -> int | None:
        """Tiles' worth of hi-res features past which the model down-samples the grid, or None if it never does
        (LLaVA-NeXT, which shares this layout)."""
        # the model's own parsing of "anyres_max_N" (a character-set strip), kept identical on purpose
        return int(self.config.vision_aspect_ratio.strip("anyres_max_"))  # noqa: B005

    def _tiles_layout(self, width: int, height: int) -> tuple[np.ndarray, int, int]:
        """Boxes of the stitched hi-res grid, as the model lays it out (``pack_image_features``).

        Returns:
            ``(boxes, rows, cols)``: ``rows cols 4`` original-image boxes of the hi-res cells, and the grid's shape
            (each row is followed by one newline feature in the sequence).
        """
        pinpoints = self._check_pinpoints()
        side = self.features_per_side
        tile = self._tile_size()
        best_h, best_w = select_best_resolution((height, width), pinpoints)
        new_h, new_w = get_patch_output_size(_shape_only(height, width), (best_h, best_w), ChannelDimension.FIRST)
        paste_x, paste_y = (best_w - new_w) // 2, (best_h - new_h) // 2
        tile_vision = int(self.config.vision_config.image_size)
        feat_h, feat_w = (best_h // tile_vision) * side, (best_w // tile_vision) * side
        # unpad_image: drop the feature rows (or columns) that fall on the padding, in feature units
        if width / height > feat_w / feat_h:
            kept_h = int(round(height * (feat_w / width), 7))
            pad = (feat_h - kept_h) // 2
            rows_idx, cols_idx = np.arange(pad, feat_h - pad), np.arange(feat_w)
        else:
            kept_w = int(round(width * (feat_h / height), 7))
            pad = (feat_w - kept_w) // 2
            rows_idx, cols_idx = np.arange(feat_h), np.arange(pad, feat_w - pad)
        row_lo = row_hi = rows_idx
        col_lo = col_hi = cols_idx
        cur_h, cur_w = len(rows_idx), len(cols_idx)
        max_patches = self._max_tiles()
        ratio = 0.0 if max_patches is None else math.sqrt(cur_h * cur_w / (max_patches * side**2))
        if ratio > 1.1:  # the model's bilinear down-sampling of an over-large hi-res grid
            out_h, out_w = int(cur_h // ratio), int(cur_w // ratio)
            lo, hi = _bilinear_support(cur_h, out_h)
            row_lo, row_hi = rows_idx[lo], rows_idx[hi]
            lo, hi = _bilinear_support(cur_w, out_w)
            col_lo, col_hi = cols_idx[lo], cols_idx[hi]
        cell = tile / side
        x0, x1 = _axis_edges(col_lo, col_hi, cell, paste_x, new_w / width, width)
        y0, y1 = _axis_edges(row_lo, row_hi, cell, paste_y, new_h / height, height)
        return _boxes(x0, x1, y0, y1), len(row_lo), len(col_lo)

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """``base`` then ``tiles`` grids per image; the newline features are set to role ``special`` in ``roles``,
        in place (they carry the learned ``image_newline`` vector, not image content)."""
        image_positions = np.flatnonzero(roles == "image")
        side = self.features_per_side
        if "batch_num_images" in inputs:
            counts = [int(n) for n in inputs["batch_num_images"]]
            patched = [n == 1 for n in counts for _ in range(n)]
        else:  # the model then tiles every image
            patched = [True] * (max(image_ids) + 1)
        grids, cursor = [], 0
        for k, (image_id, (width, height)) in enumerate(zip(image_ids, image_sizes)):
            base = _consume(image_positions, cursor, side * side, row, f"base grid of image {k}")
            cursor += len(base)
            grids.append(self._base_grid(k, base, width, height, padded=not patched[image_id]))
            if not patched[image_id]:
                newline = _consume(image_positions, cursor, 1, row, f"newline of image {k}")
                cursor += 1
                roles[newline] = "special"
                continue
            boxes, rows, cols = self._tiles_layout(width, height)
            run = _consume(image_positions, cursor, rows * (cols + 1), row, f"tiles grid of image {k}")
            cursor += len(run)
            run = run.reshape(rows, cols + 1)
            roles[run[:, -1]] = "special"
            grids.append(ImageGrid("tiles", k, run[:, :-1].copy(), boxes))
        self._check_count(row, cursor, image_positions)
        return grids
