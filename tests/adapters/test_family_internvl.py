"""InternVL: dynamic tiles plus a thumbnail, the pixel shuffle, the ``<img> ... </img>`` block; boxes against
hand-computed values and against the patch embeddings, where the projector's rows land, exact == naive and nnsight.
TransformerLens has no bridge for ``InternVLForConditionalGeneration`` (tests/engine/test_transformer_lens.py checks the
refusal for every unbridged family).

Hand computations (tiny processor, see ``vlmbind/tiny/internvl.py``: 64 px tiles, 1 to 6 tiles, each frame a 4x4
token grid, so a token is 16 px of its tile and 16 px of the 64 px thumbnail). The canvas is the ``cols x rows`` of at
most 6 tiles whose ``cols / rows`` is closest to the image's ``W / H``, ties going to more tiles while the image's area
exceeds half the canvas's:

* 224 x 224: 1x1 and 2x2 tie (ratio 1); 224^2 > 0.5 * 4 * 64^2, so 2x2, stretched to 128 x 128: a tile token covers
  ``16 * 224 / 128 = 28`` original px, tile ``(i, j)`` starting at ``(112 j, 112 i)``; a thumbnail token
  ``16 * 224 / 64 = 56`` px.
* 448 x 224 (W x H): 2 columns x 1 row (ratio 2 exactly; 4x2 is over 6 tiles), 128 x 64: tile tokens
  ``16 * 448 / 128 = 56`` px across and ``16 * 224 / 64 = 56`` down, tile ``(0, j)`` from x = 224 j; thumbnail tokens
  112 x 56 px.
* 320 x 224 (ratio 1.43): 3 columns x 2 rows (ratio 1.5 is the closest), 192 x 128: tile tokens
  ``16 * 320 / 192 = 26.67`` across and ``16 * 224 / 128 = 28`` down, tile ``(i, j)`` from ``(106.67 j, 112 i)``;
  thumbnail tokens 80 x 56.
* 64 x 64: 1x1 and 2x2 tie, but 64^2 < 0.5 * 4 * 64^2, so one tile: no thumbnail is added, the one frame is the whole
  image (the ``thumbnail`` grid), tokens 16 px.

The prompt of a 224 x 224 image: ``<img>``, 4 tiles of 16 ``<IMG_CONTEXT>`` then the thumbnail's 16, ``</img>``, then
the prompt's text (no BOS): ``<img>`` at 0, frame ``f`` at ``1 + 16 f``, ``</img>`` at 81, the text from 82.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import (
    check_chat_grids,
    check_exact_equals_naive,
    check_prepare_refused,
    check_tokens_per_frame_must_agree,
    painted_cell_changes,
)
from helpers import PROMPT, draw_scene, expected_boxes, get_tiny

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.adapters.base import ModelAdapter
from vlmbind.adapters.internvl import InternVLAdapter
from vlmbind.core.errors import UnsupportedModelError

NAME = "tiny-internvl"
# (W, H) -> (cols, rows) of tiles
CANVAS = {(224, 224): (2, 2), (448, 224): (2, 1), (320, 224): (3, 2)}


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    return get_tiny(NAME)


def _grid_names(cols: int, rows: int) -> list[str]:
    return [f"row_{i}_col_{j}" for i in range(1, rows + 1) for j in range(1, cols + 1)] + ["thumbnail"]


# ---- declarations and shapes --------------------------------------------------------------------------------------
def test_declared_paths_resolve_and_shapes(vlm):
    a = vlm.adapter
    assert type(a) is InternVLAdapter and adapter_class_for_config(vlm.model.config) is InternVLAdapter
    assert vlm.model.config.architectures == [a.model_class_name]
    paths = a.declared_paths()
    assert paths["projector"] is vlm.model.model.multi_modal_projector
    assert paths["vision_blocks"] is vlm.model.model.vision_tower.encoder.layer
    assert paths["text_layers"] is vlm.model.model.language_model.layers
    assert type(a.vision_block(0).attention).__name__ == "InternVLVisionAttention"
    assert type(a.layer(0)).__name__ == "Qwen2DecoderLayer"
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model, a.n_vision_layers) == (4, 4, 2, 32, 128, 2)
    assert (a.tile_size, a.patches_per_side, a.shuffle, a.tokens_per_side) == (64, 8, 2, 4)
    assert vlm.processor.image_seq_length == 16 and a.image_placeholder == vlm.processor.image_token
    assert not a.transformer_lens_bridge
    assert type(a).vision_row_tokens is ModelAdapter.vision_row_tokens  # CLS rows: no map declared

    batch = vlm.prepare([draw_scene(0), draw_scene(1, (448, 224))], [PROMPT, "the red object is a"])
    b, p = batch.inputs["input_ids"].shape
    out = vlm.run(batch, sites=["blocks.1.attn.hook_z", "blocks.2.hook_resid_post", "blocks.0.attn.hook_pattern",
                                "projector.hook_out", "vision.blocks.1.hook_resid_post"])
    assert out.logits.shape == (b, p, vlm.model.config.text_config.vocab_size)
    assert out["blocks.1.attn.hook_z"].shape == (b, p, 4, 32)
    assert out["blocks.2.hook_resid_post"].shape == (b, p, 128)
    assert out["blocks.0.attn.hook_pattern"].shape == (b, 4, p, p)
    assert out["projector.hook_out"].shape == (5 + 3, 16, 128)  # the frames of both images
    assert out["vision.blocks.1.hook_resid_post"].shape == (5 + 3, 1 + 64, 64)  # a CLS row, then 8x8 patches


# ---- layout: tiles, thumbnail, <img> ... </img> --------------------------------------------------------------------
def test_square_image_layout_tokens_and_boxes(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    tok = vlm.adapter.tokenizer
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(2, 2)]
    for frame, name in enumerate(_grid_names(2, 2)):
        np.testing.assert_array_equal(ti.grid(name).positions, 1 + 16 * frame + np.arange(16).reshape(4, 4))
    np.testing.assert_array_equal(ti.positions("special"), [0, 81])
    assert tok.convert_ids_to_tokens([int(i) for i in ti.input_ids[[0, 1, 80, 81]]]) == [
        "<img>", "<IMG_CONTEXT>", "<IMG_CONTEXT>", "</img>"]
    assert ti.positions("text")[0] == 82 and ti.text == PROMPT
    assert len(ti.image_positions) == 80 and batch.inputs["pixel_values"].shape == (5, 3, 64, 64)
    edges = 28.0 * np.arange(5)
    for i in range(2):
        for j in range(2):
            np.testing.assert_allclose(ti.grid(f"row_{i + 1}_col_{j + 1}").boxes,
                                       expected_boxes(112 * j + edges, 112 * i + edges))
    np.testing.assert_allclose(ti.grid("thumbnail").boxes, expected_boxes(56.0 * np.arange(5), 56.0 * np.arange(5)))
    assert ti.cell(int(ti.grid("row_2_col_1").positions[1, 3])) == ("row_2_col_1", 0, 1, 3)
    # a point lies in one tile token and one thumbnail token
    hit = ti.positions_covering((120, 10, 121, 11))
    assert hit.tolist() == [int(ti.grid("row_1_col_2").positions[0, 0]), int(ti.grid("thumbnail").positions[0, 2])]


@pytest.mark.parametrize(("size", "cell_w", "cell_h", "thumb_w", "thumb_h"), [
    ((448, 224), 56.0, 56.0, 112.0, 56.0),
    ((320, 224), 16 * 320 / 192, 28.0, 80.0, 56.0),
])
def test_non_square_tiles_and_thumbnail_boxes(vlm, size, cell_w, cell_h, thumb_w, thumb_h):
    cols, rows = CANVAS[size]
    assert vlm.adapter.canvas(*size) == (cols, rows)
    batch = vlm.prepare(draw_scene(1, size), PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(cols, rows)]
    assert batch.inputs["pixel_values"].shape[0] == cols * rows + 1  # the frames: tiles, then the thumbnail
    np.testing.assert_array_equal(ti.image_positions, 1 + np.arange(16 * (cols * rows + 1)))
    width, height = size
    for i in range(rows):
        for j in range(cols):
            xs, ys = width / cols * j + cell_w * np.arange(5), height / rows * i + cell_h * np.arange(5)
            np.testing.assert_allclose(ti.grid(f"row_{i + 1}_col_{j + 1}").boxes, expected_boxes(xs, ys))
    np.testing.assert_allclose(ti.grid("thumbnail").boxes,
                               expected_boxes(thumb_w * np.arange(5), thumb_h * np.arange(5)))
    # the tiles cover the image exactly once, and so does the thumbnail
    tiles = np.concatenate([g.boxes.reshape(-1, 4) for g in ti.grids[:-1]])
    for boxes in (tiles, ti.grid("thumbnail").boxes.reshape(-1, 4)):
        assert ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).sum() == pytest.approx(width * height)
    np.testing.assert_array_equal(ti.positions("special"), [0, 16 * (cols * rows + 1) + 1])


def test_an_image_of_one_tile_is_only_the_thumbnail(vlm):
    """A 64 x 64 image's canvas is one tile: the processor adds no thumbnail, the one frame is the whole image."""
    batch = vlm.prepare(draw_scene(2, (64, 64)), "the red object is a")
    ti = batch.index[0]
    assert vlm.adapter.canvas(64, 64) == (1, 1)
    assert [(g.name, g.shape) for g in ti.grids] == [("thumbnail", (4, 4))]
    np.testing.assert_array_equal(ti.grid("thumbnail").positions, 1 + np.arange(16).reshape(4, 4))
    np.testing.assert_array_equal(ti.positions("special"), [0, 17])
    np.testing.assert_allclose(ti.grid("thumbnail").boxes, expected_boxes(16.0 * np.arange(5), 16.0 * np.arange(5)))
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    assert out["projector.hook_out"].shape == (1, 16, 128)
    torch.testing.assert_close(out["blocks.0.hook_resid_pre"][0, 1:17], out["projector.hook_out"][0], atol=0, rtol=0)


def test_chat_prompt_has_the_same_grids(vlm):
    check_chat_grids(vlm, "thumbnail", "<|im_start|>user\n<img><IMG_CONTEXT>", "<|im_start|>assistant\n")


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_processor_and_model_must_agree_on_tokens_per_frame(vlm):
    check_tokens_per_frame_must_agree(vlm, "image_seq_length")


def test_tiles_the_image_processor_would_not_cut_are_refused(vlm):
    """A processor call with other tile bounds than the image processor's (here max_patches=4: 320 x 224 becomes 2x2
    tiles, not 3x2) lays out frames the adapter cannot place: refused by name, not guessed."""
    image = draw_scene(1, (320, 224))
    inputs = vlm.processor(images=[image], text=[vlm.adapter.build_prompt(PROMPT, 1)], return_tensors="pt",
                           max_patches=4)
    assert inputs["pixel_values"].shape[0] == 5
    with pytest.raises(UnsupportedModelError, match="max_patches=6"):
        vlm.token_index(dict(inputs), [[image]])


def test_a_strategy_that_keeps_the_cls_feature_is_refused(vlm):
    assert vlm.model.config.vision_feature_select_strategy == "default"
    check_prepare_refused(vlm, vlm.model.config, "vision_feature_select_strategy", "full",
                          "vision_feature_select_strategy='full'")


# ---- what the language model receives -----------------------------------------------------------------------------
def test_projector_rows_land_where_the_index_says(vlm):
    """A left-padded batch: row 0 with two images (224 x 224, then 448 x 224), row 1 with a 320 x 224 one. Frame f's
    16 projector rows are the layer-0 input at the f-th grid's positions (frames in batch order: row 0's tiles and
    thumbnails, then row 1's), exactly."""
    batch = vlm.prepare([[draw_scene(0), draw_scene(1, (448, 224))], draw_scene(2, (320, 224))],
                        ["which image has the red square ?", PROMPT])
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    frames = out["projector.hook_out"]
    assert frames.shape == (5 + 3 + 7, 16, 128)
    grids = [(row, g) for row, ti in enumerate(batch.index) for g in ti.grids]
    assert [(g.name, g.image) for row, g in grids[:8]] == [
        *[(n, 0) for n in _grid_names(2, 2)], *[(n, 1) for n in _grid_names(2, 1)]]
    for frame, (row, g) in zip(frames, grids):
        torch.testing.assert_close(out["blocks.0.hook_resid_pre"][row, g.positions.reshape(-1)], frame, atol=0, rtol=0)
    ti = batch.index[0]
    assert ti.grid("thumbnail", 0).positions.max() + 1 < ti.grid("row_1_col_1", 1).positions.min()  # </img><img>
    assert batch.inputs["attention_mask"][1].min() == 0  # row 1 is the shorter, left-padded one


def test_pixel_shuffle_gives_each_token_its_2x2_patches(vlm):
    """The model's own pixel shuffle of a frame's patch features (CLS dropped): token ``(r, c)`` holds exactly the
    features of patches ``2r .. 2r + 1`` x ``2c .. 2c + 1`` (in some channel order), the footprint the boxes assume."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    model = vlm.model.model
    with torch.no_grad():
        patches = model.vision_tower(pixel_values=batch.inputs["pixel_values"]).last_hidden_state[:, 1:]
        grid = patches.reshape(5, 8, 8, -1)
        shuffled = model.pixel_shuffle(grid, scale_factor=vlm.model.config.downsample_ratio)
    assert shuffled.shape == (5, 4, 4, 4 * grid.shape[-1])
    for r in range(4):
        for c in range(4):
            own = grid[:, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].reshape(5, -1)
            torch.testing.assert_close(shuffled[:, r, c].sort(-1).values, own.sort(-1).values, atol=0, rtol=0)


# ---- painting one cell is local -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "grid", "cell"), [
    ((224, 224), "row_1_col_2", (1, 2)),
    ((320, 224), "row_2_col_3", (2, 1)),
    ((448, 224), "thumbnail", (1, 2)),
])
def test_painting_a_cell_changes_only_the_tokens_covering_it(vlm, size, grid, cell):
    """With the tower's attention silenced each token's features see only its own 2x2 patches, so painting the middle
    of a cell's box (30% margins: the bicubic resizes reach a few pixels past a box edge) changes exactly the
    positions ``positions_covering`` returns: the tile tokens under the paint and the thumbnail token above them."""
    p = painted_cell_changes(vlm, draw_scene(3, size), grid, cell)
    ti, expected = p.index, p.expected
    assert {ti.cell(int(q))[0] == "thumbnail" for q in expected} == {True, False}  # tile and thumbnail tokens alike
    assert int(ti.grid(grid).positions[cell]) in expected
    np.testing.assert_array_equal(p.changed, expected)


# ---- interventions ------------------------------------------------------------------------------------------------
def test_identity_interventions_at_image_and_block_tokens_are_exact(vlm):
    batch = vlm.prepare(draw_scene(0, (448, 224)), PROMPT)
    ti, layer = batch.index[0], 1
    positions = np.concatenate([ti.grid("row_1_col_2").positions.reshape(-1), ti.positions("special")])
    z = vlm.capture(batch, f"blocks.{layer}.attn.hook_z")[f"blocks.{layer}.attn.hook_z"]
    clean = vlm.logits(batch)
    heads = list(range(vlm.n_heads))
    patch = vb.PatchHeads(layer=layer, heads=heads, positions=positions.tolist(), values=z[:, positions])
    zero_alpha = vb.AddToHeads(layer=layer, heads=heads, positions=positions.tolist(),
                               vector=torch.ones(vlm.adapter.d_head), alpha=0.0)
    torch.testing.assert_close(vlm.logits(batch, [patch, zero_alpha]), clean, atol=0, rtol=0)


@pytest.mark.parametrize("condition", [
    "id_selection",  # the last token
    "id_retrieval",  # a mid-prompt span: an earlier object's name
])
def test_exact_equals_naive_on_the_tiled_layout(vlm, condition):
    task = check_exact_equals_naive(vlm, condition)
    if condition == "id_selection":
        assert task.positions.tolist() == [task.score_position]
    else:
        assert task.positions.max() < task.score_position - 1
    ti = task.batch.index[0]
    assert len(ti.grids) > 2 and task.positions.min() > ti.image_positions.max()  # tiles and a thumbnail before


# ---- nnsight ------------------------------------------------------------------------------------------------------
def test_nnsight_sees_the_projector_rows_and_the_residual_stream(vlm):
    """nnsight's view of the projector's output and of layer 1's input, on the same forward, equals vlmbind's
    ``projector.hook_out`` and ``blocks.1.hook_resid_pre``; the projector's rows are layer 0's input at the image
    tokens."""
    a = vlm.adapter
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (448, 224))], [PROMPT, "the red object is a"])
    nn_model = vlm.nnsight()
    with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
        # in execution order, as nnsight requires: the projector runs before the text layers
        frames = vlm.nnsight_module(nn_model, a.projector).output.save()
        embedded = vlm.nnsight_module(nn_model, f"{a.text_layers}.0").input.save()
        pre = vlm.nnsight_module(nn_model, f"{a.text_layers}.1").input.save()
    out = vlm.run(batch, sites=["projector.hook_out", "blocks.1.hook_resid_pre"])
    torch.testing.assert_close(out["projector.hook_out"], frames, atol=0, rtol=0)
    torch.testing.assert_close(out["blocks.1.hook_resid_pre"], pre, atol=0, rtol=0)
    image = batch.inputs["input_ids"] == a.image_token_id
    torch.testing.assert_close(embedded[image], frames.reshape(-1, a.d_model), atol=0, rtol=0)
