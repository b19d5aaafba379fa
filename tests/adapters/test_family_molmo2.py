"""Molmo2: the two pooled grids per image, their boxes, roles, the bidirectional image block, the image path scale.

Hand-computed geometry of the tiny processor (224 px crops, 14 px patches, 2x2 pooling, overlap margins 4+4 patches,
so the high-res window is 8 patches = 112 px and the canvas is ``tiling * 112 + 112`` px):

* 224x224: low-res 16x16 patches -> 8x8 cells of 28 px; tiling 1x1, canvas 224x224 -> high-res 8x8 cells of 28 px.
* 448x224 (w x h): low-res cells 56 x 28 px (the image is squashed to 224x224); tiling 1x3, canvas 448x224 ->
  high-res 8x16 cells of 28 px.
* 300x200: low-res cells 37.5 x 25 px; tiling 1x2, canvas 336x224 (scale 1.12 both ways) -> high-res 8x12 cells of
  25 px.

The real checkpoints' processor (378 px crops, 27 patches a side) pads the odd patch count: 14x14 cells, the last
row and column pooling one patch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import RESID0, changed_positions, check_chat_grids, paint
from helpers import PROMPT, draw_scene, get_tiny
from PIL import Image
from transformers import Molmo2ImageProcessor, Molmo2Processor, Molmo2VideoProcessor
from transformers.models.molmo2.image_processing_molmo2 import compute_crop_geometry

import vlmbind as vb
from vlmbind.adapters.base import get_module
from vlmbind.adapters.molmo2 import Molmo2Adapter, pooled_cell_boxes
from vlmbind.core.errors import InputError


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    return get_tiny("tiny-molmo2")


def _noise(size: tuple[int, int], seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _regular_boxes(rows: int, cols: int, cell_w: float, cell_h: float) -> np.ndarray:
    """Hand-written boxes of a plain grid: cell (r, c) is [c*w, (c+1)*w) x [r*h, (r+1)*h)."""
    out = np.zeros((rows, cols, 4))
    for r in range(rows):
        for c in range(cols):
            out[r, c] = (c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h)
    return out


def _default_processor_vlm(vlm: vb.VLM) -> vb.VLM:
    """The tiny model with the real checkpoints' image processor (378 px crops); only for TokenIndex checks (the tiny
    ViT has position embeddings for 224 px crops, so this one cannot run a forward)."""
    processor = Molmo2Processor(
        image_processor=Molmo2ImageProcessor(), video_processor=Molmo2VideoProcessor(),
        tokenizer=vlm.processor.tokenizer, chat_template=vlm.processor.chat_template,
    )
    return vb.VLM(vlm.model, processor, name="tiny-molmo2 (378 px processor)", source="test")


# ---- grids and boxes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "low_cell", "high_shape", "high_cell"),
    [((224, 224), (28, 28), (8, 8), (28, 28)),
     ((448, 224), (56, 28), (8, 16), (28, 28)),
     ((300, 200), (37.5, 25), (8, 12), (25, 25))],
)
def test_grid_shapes_and_boxes_by_hand(vlm, size, low_cell, high_cell, high_shape):
    ti = vlm.prepare(Image.new("RGB", size, "white"), PROMPT).index[0]
    assert [(g.name, g.image) for g in ti.grids] == [("low_res", 0), ("high_res", 0)]
    low, high = ti.grid("low_res"), ti.grid("high_res")
    assert low.shape == (8, 8) and high.shape == high_shape
    np.testing.assert_allclose(low.boxes, _regular_boxes(8, 8, *low_cell))
    np.testing.assert_allclose(high.boxes, _regular_boxes(*high_shape, *high_cell))
    # both grids tile the whole image
    for g in (low, high):
        assert g.boxes[..., :2].min() == 0 and tuple(g.boxes[-1, -1, 2:]) == pytest.approx(size)


def test_odd_patch_count_is_padded_like_the_processor(vlm):
    """378 px crops have 27 patches a side: 14 pooled cells, the last one pooling a single patch (pad 0 before, 1
    after). 640x480: tiling 2x2 (window 19 patches = 266 px), canvas 644x644 -> 46 patches -> 23x23 cells."""
    big = _default_processor_vlm(vlm)
    ti = big.prepare(Image.new("RGB", (378, 378)), PROMPT).index[0]
    low, high = ti.grid("low_res"), ti.grid("high_res")
    assert low.shape == high.shape == (14, 14)
    np.testing.assert_allclose(low.boxes[0, 0], (0, 0, 28, 28))
    np.testing.assert_allclose(low.boxes[-1, -1], (364, 364, 378, 378))
    np.testing.assert_allclose(low.boxes[6, 13], (364, 168, 378, 196))
    np.testing.assert_allclose(high.boxes, low.boxes)

    ti = big.prepare(Image.new("RGB", (640, 480)), PROMPT).index[0]
    low, high = ti.grid("low_res"), ti.grid("high_res")
    assert low.shape == (14, 14) and high.shape == (23, 23)
    np.testing.assert_allclose(low.boxes[-1, -1], (26 * 14 * 640 / 378, 26 * 14 * 480 / 378, 640, 480))
    np.testing.assert_allclose(high.boxes[1, 2], (56 * 640 / 644, 28 * 480 / 644, 84 * 640 / 644, 56 * 480 / 644))


def test_pooled_cell_boxes_pads_the_smaller_half_first():
    # 5 patches pooled by 2: pad 1 -> 0 before, 1 after: cells [0,2) [2,4) [4,5); 7 patches pooled by 4: pad 1 -> same
    b = pooled_cell_boxes(5, 7, 2, 4, patch_size=10, scale_x=1.0, scale_y=2.0)
    assert b.shape == (3, 2, 4)
    np.testing.assert_allclose(b[:, 0, 1], [0, 10, 20])
    np.testing.assert_allclose(b[:, 0, 3], [10, 20, 25])
    np.testing.assert_allclose(b[0, :, 0], [0, 40])
    np.testing.assert_allclose(b[0, :, 2], [40, 70])
    # 6 patches pooled by 4: pad 2 -> 1 before, 1 after: cells [0,3) [3,6)
    np.testing.assert_allclose(pooled_cell_boxes(4, 6, 4, 4, 1, 1.0, 1.0)[0, :, [0, 2]].T, [[0, 3], [3, 6]])


def _boxes_from_pooling(inputs, image_id: int, size: tuple[int, int], ip) -> np.ndarray:
    """Each token's box rebuilt from the processor's ``image_token_pooling``: the union of the pooled patches, each
    patch placed by the crop it comes from (crop 0: the squashed image; crop 1+: canvas crops in raster order)."""
    width, height = size
    crop, patch = ip.size["height"], ip.patch_size
    cp = crop // patch
    grids = inputs["image_grids"].numpy()
    crops = inputs["image_num_crops"].numpy()
    first_token = int(sum(g[0] * g[1] + g[2] * g[3] for g in grids[:image_id]))
    n_tokens = int(grids[image_id][0] * grids[image_id][1] + grids[image_id][2] * grids[image_id][3])
    patch_offset = int(crops[:image_id].sum()) * cp * cp
    tiling_h, tiling_w, canvas_h, canvas_w = compute_crop_geometry(height, width, ip.max_crops, ip.overlap_margins,
                                                                   crop, patch)
    window = (cp - sum(ip.overlap_margins)) * patch
    pooling = inputs["image_token_pooling"].numpy()[first_token : first_token + n_tokens]
    out = np.zeros((n_tokens, 4))
    for t, idx in enumerate(pooling):
        boxes = []
        for i in idx[idx >= 0] - patch_offset:
            c, local = divmod(int(i), cp * cp)
            pr, pc = divmod(local, cp)
            if c == 0:
                sx, sy, ox, oy = crop / width, crop / height, 0, 0
            else:
                ti, tj = divmod(c - 1, tiling_w)
                sx, sy, ox, oy = canvas_w / width, canvas_h / height, tj * window, ti * window
            boxes.append(((ox + pc * patch) / sx, (oy + pr * patch) / sy,
                          (ox + (pc + 1) * patch) / sx, (oy + (pr + 1) * patch) / sy))
        b = np.array(boxes)
        out[t] = (b[:, 0].min(), b[:, 1].min(), b[:, 2].max(), b[:, 3].max())
    return out


@pytest.mark.parametrize("default_processor", [False, True])
def test_boxes_match_the_processor_pooling_indices(vlm, default_processor):
    model = _default_processor_vlm(vlm) if default_processor else vlm
    sizes = [(224, 224), (300, 200), (640, 480), (100, 377)]
    batch = model.prepare([[Image.new("RGB", s) for s in sizes[:2]], [Image.new("RGB", s) for s in sizes[2:]]],
                          [PROMPT, "is"])
    ip = model.processor.image_processor
    for image_id, size in enumerate(sizes):
        row, k = divmod(image_id, 2)
        ti = batch.index[row]
        ours = np.concatenate([ti.grid("low_res", k).boxes.reshape(-1, 4), ti.grid("high_res", k).boxes.reshape(-1, 4)])
        np.testing.assert_allclose(ours, _boxes_from_pooling(batch.inputs, image_id, size, ip), atol=1e-9)


def test_grid_positions_rows_and_separators(vlm):
    batch = vlm.prepare(Image.new("RGB", (448, 224)), PROMPT)
    ti, tok = batch.index[0], vlm.adapter.tokenizer
    ids = ti.input_ids
    for grid, start in (("low_res", "<low_res_im_start>"), ("high_res", "<im_start>")):
        g = ti.grid(grid)
        assert ids[g.positions[0, 0] - 1] == tok.convert_tokens_to_ids(start)
        assert np.all(np.diff(g.positions, axis=1) == 1)  # a row is contiguous
        # every row ends with one <im_col>; the last one is followed by <im_end>
        after = ids[g.positions[:, -1] + 1]
        assert np.all(after == tok.convert_tokens_to_ids("<im_col>"))
        assert np.all(g.positions[1:, 0] - g.positions[:-1, -1] == 2)
        assert ids[g.positions[-1, -1] + 2] == tok.convert_tokens_to_ids("<im_end>")
        assert np.all(ti.roles[g.positions[:, -1] + 1] == "special")
    assert ti.grid("low_res").positions.max() < ti.grid("high_res").positions.min()


def test_cell_lookup_and_positions_covering(vlm):
    ti = vlm.prepare(Image.new("RGB", (448, 224)), PROMPT).index[0]
    low, high = ti.grid("low_res"), ti.grid("high_res")
    assert ti.cell(int(high.positions[2, 5])) == ("high_res", 0, 2, 5)
    assert ti.box(int(low.positions[1, 3])) == (168.0, 28.0, 224.0, 56.0)
    # high-res cell (2, 5) = x [140, 168), y [56, 84) lies inside low-res cell (2, 2) = x [112, 168)
    covering = ti.positions_covering((141, 57, 167, 83))
    assert covering.tolist() == sorted([int(low.positions[2, 2]), int(high.positions[2, 5])])


# ---- roles and inserted features ------------------------------------------------------------------------------
def test_image_role_is_exactly_where_features_are_added(vlm):
    """Molmo2 adds one pooled feature to the embedding of each <im_patch>; <im_col> and start/end get none."""
    batch = vlm.prepare([draw_scene(0), draw_scene(1, size=(300, 200))], [PROMPT, "the blue object is a"])
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    features = out["projector.hook_out"]
    n_cells = sum(g.positions.size for ti in batch.index for g in ti.grids)
    assert features.shape == (n_cells, vlm.adapter.d_model)
    assert n_cells == sum(len(ti.image_positions) for ti in batch.index) == 64 + 64 + 64 + 96
    embed = vlm.model.get_input_embeddings()
    with torch.no_grad():
        plain = embed(batch.inputs["input_ids"])
    added = out["blocks.0.hook_resid_pre"] - plain
    row_feats = torch.split(features, [len(ti.image_positions) for ti in batch.index])
    for row, ti in enumerate(batch.index):
        torch.testing.assert_close(added[row, ti.image_positions], row_feats[row], atol=1e-6, rtol=0)
        others = np.setdiff1d(np.arange(len(ti)), ti.image_positions)
        assert added[row, others].abs().max() == 0
        special = ti.positions("special")
        n_rows = sum(g.shape[0] for g in ti.grids)
        col_id = vlm.adapter.tokenizer.convert_tokens_to_ids("<im_col>")
        assert (ti.input_ids[special] == col_id).sum() == n_rows
        assert not set(special.tolist()) & set(ti.image_positions.tolist())


def test_image_features_are_order_one(vlm):
    """The default init hands the language model features of ~1e-6; the tiny builder redraws the adapter."""
    out = vlm.run(vlm.prepare(draw_scene(0), PROMPT), sites=["projector.hook_out"])
    feats = out["projector.hook_out"]
    token_scale = vlm.model.get_input_embeddings().weight.std()
    assert feats.std() > 0.05 and feats.std() > 2 * token_scale


def test_adapter_declarations(vlm):
    a = vlm.adapter
    assert isinstance(a, Molmo2Adapter) and a.bidirectional_image and not a.transformer_lens_bridge
    assert a.image_placeholder == vlm.processor.image_token
    assert a.image_token_id == vlm.adapter.tokenizer.convert_tokens_to_ids("<im_patch>")
    assert vlm.model.config.architectures == ["Molmo2ForConditionalGeneration"]
    assert type(get_module(a.vision_block(0), a.vision_attention)).__name__ == "Molmo2VisionAttention"
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.n_vision_layers) == (4, 4, 2, 32, 2)


def test_mismatched_image_grids_raise(vlm):
    batch = vlm.prepare(Image.new("RGB", (224, 224)), PROMPT)
    inputs = dict(batch.inputs, image_grids=torch.tensor([[8, 8, 8, 16]]))
    roles = batch.index[0].roles
    with pytest.raises(InputError, match=r"image_grids \[8, 8, 8, 16\].*\[8, 8, 8, 8\]"):
        vlm.adapter.image_grids(inputs, 0, roles, [0], [(224, 224)])


def test_chat_prompt_has_the_same_grids(vlm):
    check_chat_grids(vlm, "low_res", "<|endoftext|><|im_start|>user\n<low_res_im_start>", "<|im_start|>assistant\n")


# ---- the bidirectional image block ----------------------------------------------------------------------------
def test_image_block_is_bidirectional_and_text_causal(vlm):
    batch = vlm.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "what is it"])  # row 1 is left-padded
    out = vlm.run(batch, sites=["blocks.0.attn.hook_pattern", "blocks.2.attn.hook_pattern"])
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, output_attentions=True, use_cache=False)
    torch.testing.assert_close(out["blocks.2.attn.hook_pattern"], ref.attentions[2], atol=1e-6, rtol=0)
    pattern = out["blocks.0.attn.hook_pattern"]
    mm = batch.inputs["mm_token_type_ids"]
    for row, ti in enumerate(batch.index):
        block = np.flatnonzero(mm[row].numpy() == 1)
        # the block is the image tokens plus their separators and start/end tokens, contiguous
        assert set(ti.image_positions) < set(block) and np.all(np.diff(block) == 1)
        assert set(ti.roles[block]) == {"image", "special"}
        first, last = int(block[0]), int(block[-1])
        assert (pattern[row, :, first, block[1:]] > 0).all()  # the first image token sees every later one
        text = ti.positions("text")
        future = torch.triu(torch.ones(len(ti), len(ti), dtype=torch.bool), 1)
        assert (pattern[row][:, text] * future[text]).abs().max() == 0  # text stays causal
        assert (pattern[row, :, first:last + 1, last + 1:]).abs().max() == 0  # the block does not see later text


def test_without_mm_token_type_ids_the_prefix_is_causal(vlm):
    """The forward reads the bidirectional block from ``mm_token_type_ids``; dropping them silently makes it causal."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    inputs = {k: v for k, v in batch.inputs.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        causal = vlm.model(**inputs, output_attentions=True, use_cache=False)
        bidir = vlm.model(**batch.inputs, output_attentions=True, use_cache=False)
    future = torch.triu(torch.ones(len(batch.index[0]), len(batch.index[0]), dtype=torch.bool), 1)
    assert causal.attentions[0][0][:, future].abs().max() == 0
    assert bidir.attentions[0][0][:, future].abs().max() > 1e-3
    assert (causal.logits[0, -1] - bidir.logits[0, -1]).abs().max() > 1e-3


def test_two_images_in_one_row(vlm):
    batch = vlm.prepare([[draw_scene(0), draw_scene(1, size=(448, 224))]], ["which image has the red square ?"])
    ti = batch.index[0]
    assert [(g.name, g.image, g.shape) for g in ti.grids] == [
        ("low_res", 0, (8, 8)), ("high_res", 0, (8, 8)), ("low_res", 1, (8, 8)), ("high_res", 1, (8, 16))]
    assert ti.grid("high_res", 0).positions.max() < ti.grid("low_res", 1).positions.min()
    np.testing.assert_allclose(ti.grid("low_res", 1).boxes[0, 1], (56, 0, 112, 28))
    # HF puts every image of a row in one block: image 0 attends to image 1's tokens
    pattern = vlm.run(batch, sites=["blocks.0.attn.hook_pattern"])["blocks.0.attn.hook_pattern"]
    q, k = int(ti.grid("low_res", 0).positions[0, 0]), ti.grid("high_res", 1).positions.reshape(-1)
    assert (pattern[0, :, q, k] > 0).all()


# ---- locality: the boxes are what each token sees --------------------------------------------------------------
@pytest.mark.parametrize(("size", "margin"), [((224, 224), 0), ((448, 224), 0), ((300, 200), 2)])
def test_painting_a_cell_changes_only_the_covering_tokens(vlm, size, margin):
    """With integer resize ratios the boxes are exact. Otherwise the bilinear resize (antialias off) reads up to one
    original pixel across a box edge, so the painted square keeps ``margin`` pixels inside the box."""
    base = _noise(size)
    before = vlm.prepare(base, PROMPT)
    ti = before.index[0]
    for name in ("low_res", "high_res"):
        g = ti.grid(name)
        x0, y0, x1, y1 = g.boxes[g.shape[0] // 2, g.shape[1] // 3]
        box = (int(np.ceil(x0)) + margin, int(np.ceil(y0)) + margin, int(x1) - margin, int(y1) - margin)
        after = vlm.prepare(paint(base, box, fill=(255, 0, 0)), PROMPT)
        changed = changed_positions(vlm, before, after)[0][RESID0]  # with the tower's attention silenced
        expected = ti.positions_covering(box)
        assert len(expected) >= 2  # at least one cell of each grid
        assert changed.tolist() == expected.tolist()
