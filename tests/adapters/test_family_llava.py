"""LLaVA-1.5 and LLaVA-OneVision: image-token grids and boxes against hand-computed values, roles, and the quirks.

Hand computations (tiny configs, see ``vlmbind/tiny/llava.py``):

* LLaVA-1.5: shortest edge resized to 224, center crop 224x224, 14 px CLIP patches -> a 16x16 grid. A 448x300 image
  becomes 334x224 (``int(224 * 448 / 300) = 334``), the crop starts at ``int((334 - 224) / 2) = 55``, so column ``c``
  covers ``(55 + 14c) * 448 / 334`` .. ``(69 + 14c) * 448 / 334`` and row ``r`` covers ``14r * 300 / 224`` ..
  ``(14r + 14) * 300 / 224``; the 73.8 px on either side are cropped away.
* LLaVA-OneVision: 112 px tiles, 8x8 features a tile. Base grid: the image stretched to 112x112. A 224x224 image picks
  the 224x224 pinpoint: 2x2 tiles, a 16x16 hi-res grid of 14 px cells. A 320x224 (W x H) image picks (224, 336)
  (full effective resolution, least waste): kept at 320x224, pasted at x = (336 - 320) // 2 = 8, 16x24 features;
  unpadding keeps ``int(round(320 * 16 / 224, 7)) = 22`` columns from column ``(24 - 22) // 2 = 1``, so hi-res
  column ``c`` covers ``14 (c + 1) - 8`` .. ``+ 14``. The 224x320 portrait is the transpose.
  A 448x448 image picks 4x4 tiles (32x32 features), more than ``anyres_max_9`` allows (ratio 4/3 > 1.1), so the model
  bilinearly down-samples to ``int(32 // (4/3)) = 24`` per side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import assert_painting_is_local, check_prepare_refused
from helpers import PROMPT, draw_scene, expected_boxes, get_tiny
from PIL import Image, ImageDraw

import vlmbind as vb


@pytest.fixture(scope="module")
def llava() -> vb.VLM:
    return get_tiny("tiny-llava")


@pytest.fixture(scope="module")
def onevision() -> vb.VLM:
    return get_tiny("tiny-llava_onevision")


def _image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    return draw_scene(seed, size)


# ---- LLaVA-1.5 ----------------------------------------------------------------------------------------------------
def test_llava_square_grid_and_boxes(llava):
    batch = llava.prepare(_image((224, 224)), PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [("image", (16, 16))]
    grid = ti.grid("image")
    # <s> first, then the 256 image tokens in raster order, then the prompt
    assert ti.roles[0] == "special"
    np.testing.assert_array_equal(grid.positions, np.arange(1, 257).reshape(16, 16))
    edges = np.arange(17) * 14.0
    np.testing.assert_allclose(grid.boxes, expected_boxes(edges, edges))


def test_llava_non_square_boxes_follow_resize_and_center_crop(llava):
    batch = llava.prepare(_image((448, 300)), PROMPT)
    grid = batch.index[0].grid("image")
    assert grid.shape == (16, 16)
    xs = (55 + 14 * np.arange(17)) * 448 / 334
    ys = 14 * np.arange(17) * 300 / 224
    np.testing.assert_allclose(grid.boxes, expected_boxes(xs, ys))
    assert grid.boxes[0, 0, 0] == pytest.approx(73.77, abs=0.01)
    # the cropped-away margins are covered by no token
    assert len(batch.index[0].positions_covering((0, 0, 73, 300))) == 0
    assert len(batch.index[0].positions_covering((375, 0, 448, 300))) == 0


def test_llava_cropped_away_pixels_change_nothing(llava):
    """Pixels the center crop removes never reach the model (even with the tower's attention on)."""
    image = _image((448, 300))
    painted = image.copy()
    ImageDraw.Draw(painted).rectangle([0, 0, 70, 299], fill=(255, 0, 255))
    a, b = llava.prepare(image, PROMPT), llava.prepare(painted, PROMPT)
    torch.testing.assert_close(llava.logits(a), llava.logits(b), atol=0, rtol=0)


def test_llava_image_tokens_are_the_projector_features_in_raster_order(llava):
    batch = llava.prepare([_image((224, 224)), _image((300, 200), 1)], [PROMPT, "what colour is it ?"])
    out = llava.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    features = out["projector.hook_out"]  # images, 256, d_model (CLS already dropped)
    assert features.shape == (2, 256, llava.adapter.d_model)
    for row, ti in enumerate(batch.index):
        n_tokens = int((batch.inputs["input_ids"][row] == llava.adapter.image_token_id).sum())
        assert n_tokens == len(ti.image_positions) == 256
        grid = ti.grid("image")
        torch.testing.assert_close(out["blocks.0.hook_resid_pre"][row, grid.positions.reshape(-1)], features[row],
                                   atol=0, rtol=0)


def test_llava_last_vision_block_does_not_reach_the_language_model(llava):
    """vision_feature_layer=-2 (as in llava-1.5): the features are the penultimate CLIP block's output."""
    assert llava.model.config.vision_feature_layer == -2
    batch = llava.prepare(_image((224, 224)), PROMPT)
    clean = llava.logits(batch)

    def zero_output(module, args, output):
        return (torch.zeros_like(output[0]), *output[1:]) if isinstance(output, tuple) else torch.zeros_like(output)

    last = llava.adapter.n_vision_layers - 1
    for layer, should_change in ((last, False), (last - 1, True)):
        # prepend: HF records hidden_states with its own forward hook, installed at the first forward; an edit
        # registered after it would reach the next block but not the recorded features the projector reads
        handle = llava.adapter.vision_block(layer).register_forward_hook(zero_output, prepend=True)
        try:
            edited = llava.logits(batch)
        finally:
            handle.remove()
        changed = (edited - clean).abs().max().item()
        assert (changed > 1e-3) if should_change else changed == 0.0, (layer, changed)


# ---- LLaVA-OneVision ----------------------------------------------------------------------------------------------
def test_onevision_square_layout(onevision):
    batch = onevision.prepare(_image((224, 224)), PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [("base", (8, 8)), ("tiles", (16, 16))]
    start = int(np.flatnonzero(batch.inputs["input_ids"][0] == onevision.adapter.image_token_id)[0])
    n_features = 64 + 16 * 17
    assert int((batch.inputs["input_ids"][0] == onevision.adapter.image_token_id).sum()) == n_features == 336
    base, tiles = ti.grid("base"), ti.grid("tiles")
    np.testing.assert_array_equal(base.positions, start + np.arange(64).reshape(8, 8))
    hires = start + 64 + np.arange(16 * 17).reshape(16, 17)
    np.testing.assert_array_equal(tiles.positions, hires[:, :16])
    # every hi-res row ends with a newline feature: role special, in no grid
    assert (ti.roles[hires[:, 16]] == "special").all()
    assert all(ti.cell(int(p)) is None for p in hires[:, 16])
    assert len(ti.image_positions) == 64 + 256
    np.testing.assert_allclose(base.boxes, expected_boxes(np.arange(9) * 28.0, np.arange(9) * 28.0))
    np.testing.assert_allclose(tiles.boxes, expected_boxes(np.arange(17) * 14.0, np.arange(17) * 14.0))


@pytest.mark.parametrize(
    ("size", "shape", "x_edges", "y_edges"),
    [
        ((320, 224), (16, 22), 14.0 * (np.arange(23) + 1) - 8, 14.0 * np.arange(17)),
        ((224, 320), (22, 16), 14.0 * np.arange(17), 14.0 * (np.arange(23) + 1) - 8),
    ],
)
def test_onevision_non_square_tiles_are_unpadded_in_original_coordinates(onevision, size, shape, x_edges, y_edges):
    batch = onevision.prepare(_image(size), PROMPT)
    ti = batch.index[0]
    base, tiles = ti.grid("base"), ti.grid("tiles")
    assert tiles.shape == shape
    np.testing.assert_allclose(tiles.boxes, expected_boxes(x_edges, y_edges))
    width, height = size  # the base grid is the whole image stretched to 112x112
    np.testing.assert_allclose(base.boxes, expected_boxes(np.arange(9) * width / 8, np.arange(9) * height / 8))
    newlines = np.flatnonzero(ti.roles == "special")
    assert len(newlines) == shape[0]
    assert int((batch.inputs["input_ids"][0] == onevision.adapter.image_token_id).sum()) == 64 + shape[0] * (
        shape[1] + 1)


def test_onevision_features_land_where_the_index_says(onevision):
    """Base features, stitched and unpadded tile features and the newline vector, exactly where the index says."""
    batch = onevision.prepare(_image((320, 224)), PROMPT)
    out = onevision.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    resid, features = out["blocks.0.hook_resid_pre"][0], out["projector.hook_out"]
    ti = batch.index[0]
    d = features.shape[-1]
    assert features.shape == (1 + 2 * 3, 64, d)  # base + 2x3 tiles of 8x8 features
    torch.testing.assert_close(resid[ti.grid("base").positions.reshape(-1)], features[0], atol=0, rtol=0)
    # tile (i, j) holds hi-res rows 8i..8i+7 and columns 8j..8j+7; unpadding keeps columns 1..22
    hires = features[1:].reshape(2, 3, 8, 8, d).permute(0, 2, 1, 3, 4).reshape(16, 24, d)
    torch.testing.assert_close(resid[ti.grid("tiles").positions.reshape(-1)], hires[:, 1:23].reshape(-1, d),
                               atol=0, rtol=0)
    newline = onevision.model.model.image_newline.detach()
    newline_positions = np.flatnonzero(ti.roles == "special")
    assert len(newline_positions) == 16
    torch.testing.assert_close(resid[newline_positions], newline.expand(16, -1), atol=0, rtol=0)
    # the model's own feature count equals the <image> tokens, which the index splits into cells and newlines
    with torch.no_grad():
        packed = onevision.model.model.get_image_features(
            pixel_values=batch.inputs["pixel_values"], image_sizes=batch.inputs["image_sizes"],
            batch_num_images=batch.inputs["batch_num_images"],
        ).pooler_output
    n_tokens = int((batch.inputs["input_ids"][0] == onevision.adapter.image_token_id).sum())
    assert packed[0].shape[0] == n_tokens == len(ti.image_positions) + len(newline_positions)


def test_onevision_large_image_takes_the_downsampling_branch(onevision):
    """4x4 tiles give 32x32 features, over anyres_max_9: the model resizes them to 24x24 bilinearly; a cell's box is
    the union of the 14 px feature cells its kernel reads (cell 3k reads 4k..4k+1, 3k+1 reads 4k+1..4k+2, ...)."""
    batch = onevision.prepare(_image((448, 448)), PROMPT)
    ti = batch.index[0]
    tiles = ti.grid("tiles")
    assert tiles.shape == (24, 24)
    i = np.arange(24)
    lo = 56.0 * (i // 3) + 14.0 * (i % 3)
    expected = np.zeros((24, 24, 4))
    expected[..., 0], expected[..., 2] = lo[None, :], lo[None, :] + 28
    expected[..., 1], expected[..., 3] = lo[:, None], lo[:, None] + 28
    np.testing.assert_allclose(tiles.boxes, expected)
    assert len(np.flatnonzero(ti.roles == "special")) == 24
    assert int((batch.inputs["input_ids"][0] == onevision.adapter.image_token_id).sum()) == 64 + 24 * 25


def test_onevision_multi_image_mode_pads_to_square_and_skips_tiles(onevision):
    """Nested per-prompt image lists with two images: each image is padded to a square and resized, no tiles, one
    trailing newline feature each (what the processor and model do for multi-image prompts)."""
    a = onevision.adapter
    images = [_image((224, 224)), _image((224, 112), 1)]
    inputs = dict(onevision.processor(images=[images], text=["<image><image>" + PROMPT], return_tensors="pt"))
    assert inputs["batch_num_images"].tolist() == [2]
    ids, mask = inputs["input_ids"][0].numpy(), inputs["attention_mask"][0].numpy()
    roles = a.roles(ids, mask)
    grids = a.image_grids(inputs, 0, roles, [0, 1], [im.size for im in images])
    assert [(g.name, g.image, g.shape) for g in grids] == [("base", 0, (8, 8)), ("base", 1, (8, 8))]
    start = int(np.flatnonzero(ids == a.image_token_id)[0])
    np.testing.assert_array_equal(grids[0].positions, start + np.arange(64).reshape(8, 8))
    np.testing.assert_array_equal(grids[1].positions, start + 65 + np.arange(64).reshape(8, 8))
    newlines = [start + 64, start + 129]
    assert (roles[newlines] == "special").all() and (roles == "special").sum() == 2
    # the 224x112 image sits 56 px down a 224 px square: rows 0-1 and 6-7 cover only padding (empty boxes)
    ys = np.clip(28.0 * np.arange(9) - 56, 0, 112)
    np.testing.assert_allclose(grids[1].boxes, expected_boxes(28.0 * np.arange(9), ys))
    with torch.no_grad():
        out = a.model(**inputs, output_hidden_states=True, use_cache=False)
    newline = a.model.model.image_newline
    torch.testing.assert_close(out.hidden_states[0][0, newlines], newline.expand(2, -1), atol=0, rtol=0)


def test_onevision_processor_and_config_pinpoints_must_agree(onevision):
    check_prepare_refused(onevision, onevision.processor.image_processor, "image_grid_pinpoints",
                          [[112, 112], [224, 224]], "image_grid_pinpoints", image=_image((224, 224)))


# ---- both: a painted cell changes exactly the tokens whose boxes cover it -----------------------------------------
@pytest.mark.parametrize(
    ("name", "size", "grid", "cell"),
    [
        ("tiny-llava", (224, 224), "image", (2, 3)),
        ("tiny-llava", (448, 300), "image", (5, 9)),
        ("tiny-llava_onevision", (224, 224), "base", (3, 4)),
        ("tiny-llava_onevision", (224, 224), "tiles", (5, 6)),
        ("tiny-llava_onevision", (320, 224), "tiles", (2, 3)),
        ("tiny-llava_onevision", (448, 448), "tiles", (7, 10)),
    ],
)
def test_painting_a_cell_changes_only_the_tokens_covering_it(name, size, grid, cell):
    """With the tower's attention silenced each feature sees only its own patch, so painting the middle of a cell's
    box (30% margins: resampling kernels reach a few pixels past a box edge) must change exactly the positions
    ``positions_covering`` returns, in every grid of the image."""
    assert_painting_is_local(get_tiny(name), _image(size, 3), grid, cell)


def test_llava_pad_to_square_boxes(llava):
    """LlavaImageProcessor(do_pad=True): a 448x300 image is centred on a 448 square (74 px above), halved to 224;
    rows then cover ``28 r - 74`` .. ``28 r - 46``, clipped to the image."""
    ip = llava.processor.image_processor
    ip.do_pad = True
    try:
        grid = llava.prepare(_image((448, 300)), PROMPT).index[0].grid("image")
        xs, ys = 28.0 * np.arange(17), np.clip(28.0 * np.arange(17) - 74, 0, 300)
        np.testing.assert_allclose(grid.boxes, expected_boxes(xs, ys))
        assert_painting_is_local(llava, _image((448, 300), 3), "image", (6, 7))
    finally:
        ip.do_pad = False
