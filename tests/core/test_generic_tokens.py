"""TokenIndex against the model's own computation, for every family.

With the vision tower's attention silenced, every vision block works patch by patch, and the projector only mixes
the patches it pools, so painting pixels inside one cell's box changes the language model's input features exactly
at the image tokens whose boxes overlap the painted pixels. That checks the family's grid layout and pixel boxes
against what the model computes, not against our own formula.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PROMPT, silenced_vision_attention
from PIL import Image, ImageDraw

from vlmbind.core.errors import SpanNotFoundError


def _features(vlm, image):
    """The language model's input at every position; where the image enters through cross-attention only
    (Llama-3.2-Vision), the projector's rows, one per image key."""
    batch = vlm.prepare(image, PROMPT)
    if not vlm.adapter.image_tokens_in_sequence:
        rows = vlm.capture(batch, "projector.hook_out")["projector.hook_out"]
        return batch, rows[0].reshape(-1, vlm.adapter.d_model)
    return batch, vlm.capture(batch, "blocks.0.hook_resid_pre")["blocks.0.hook_resid_pre"][0]


def _grids(vlm, index):
    """The grids a painted cell is found in, and the function listing the positions (or keys) covering a box."""
    if vlm.adapter.image_tokens_in_sequence:
        return index.grids, index.positions_covering
    return index.key_grids, index.keys_covering


@pytest.mark.parametrize("size", [(224, 224), (256, 192)])
def test_painted_region_changes_only_mapped_tokens(tiny, size):
    base = Image.new("RGB", size, (255, 255, 255))
    with silenced_vision_attention(tiny):
        batch, ref = _features(tiny, base)
        ti = batch.index[0]
        grids, covering = _grids(tiny, ti)
        checked = 0
        for grid in grids:
            rows, cols = grid.shape
            for r, c in {(rows // 2, cols // 3), (1, cols - 2), (rows - 1, 0)}:
                x0, y0, x1, y1 = grid.boxes[r, c]
                w, h = x1 - x0, y1 - y0
                if w <= 0 or h <= 0:
                    continue  # a key of the canvas' padding (Llama-3.2-Vision): no pixel of the image
                # whole pixels [px0, px1) x [py0, py1) in the middle of the cell, so the expected set is exact
                px0, py0 = round(x0 + 0.35 * w), round(y0 + 0.35 * h)
                px1, py1 = max(round(x1 - 0.35 * w), px0 + 1), max(round(y1 - 0.35 * h), py0 + 1)
                box = (px0, py0, px1, py1)
                painted = base.copy()
                ImageDraw.Draw(painted).rectangle([px0, py0, px1 - 1, py1 - 1], fill=(200, 30, 40))
                _, feats = _features(tiny, painted)
                changed = np.flatnonzero((feats - ref).abs().amax(-1).numpy() > 1e-5)
                expected = covering(box)
                assert grid.positions[r, c] in expected
                assert set(changed.tolist()) == set(expected.tolist()), (grid.name, r, c, box)
                checked += 1
        assert checked >= 2


def test_boxes_lie_inside_the_image(tiny):
    batch = tiny.prepare(Image.new("RGB", (256, 192), "white"), PROMPT)
    index = batch.index[0]
    for grid in index.grids + index.key_grids:
        b = grid.boxes
        if grid in index.key_grids:
            # Llama-3.2-Vision pads the resized image right and bottom to whole tiles: those keys cover no pixel of
            # the image (empty boxes on its edge); the cells that do form the grid's top-left block
            inside = (b[..., 2] > b[..., 0]) & (b[..., 3] > b[..., 1])
            rows, cols = int(inside[:, 0].sum()), int(inside[0].sum())
            assert inside[:rows, :cols].all() and inside.sum() == rows * cols
            assert np.allclose(b[rows:, :, 1], 192) and np.allclose(b[:, cols:, 0], 256)
            b = b[:rows, :cols]
        assert (b[..., 0] >= 0).all() and (b[..., 2] <= 256 + 1e-6).all()
        assert (b[..., 1] >= 0).all() and (b[..., 3] <= 192 + 1e-6).all()
        assert (b[..., 2] > b[..., 0]).all() and (b[..., 3] > b[..., 1]).all()
        # raster order: x grows along a row, y down a column
        assert (np.diff(b[..., 0], axis=1) > 0).all() and (np.diff(b[..., 1], axis=0) > 0).all()


def test_span_positions(tiny, scene):
    batch = tiny.prepare(scene, "there is a red square, a blue circle and a blue star")
    ti = batch.index[0]
    tok = tiny.adapter.tokenizer
    first = ti.span("blue", occurrence=0)
    last = ti.span("blue")
    assert first[0] < last[0]
    assert "blue circle" in tok.decode(ti.input_ids[ti.span("blue circle")])
    assert (ti.roles[ti.span("red square")] == "text").all()
    with pytest.raises(SpanNotFoundError):
        ti.span("green triangle")
    with pytest.raises(SpanNotFoundError, match="occurs 2 times"):
        ti.span("blue", occurrence=5)
