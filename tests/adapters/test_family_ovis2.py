"""Ovis2: the covering-area tiles plus a thumbnail, the indicator tokens between frames, the visual tokenizer's
distributions times the visual embedding table; boxes against hand-computed values, where the projector's rows and
the indicators' rows land, exact == naive and nnsight. TransformerLens has no bridge for
``Ovis2ForConditionalGeneration`` (tests/engine/test_transformer_lens.py checks the refusal for every unbridged family).

Hand computations (tiny processor, see ``vlmbind/tiny/ovis2.py``: 112 px tiles of 8x8 patches of 14 px, 2x2 patches a
token, so each frame is a 4x4 token grid and a token is 28 px of its frame; at most 6 tiles). The covering search
scores a split of the ``W x H`` image into ``a`` rows and ``b`` columns of regions by the area each region keeps
when shrunk to fit one tile (``w h`` if both sides are at most 112, else ``112 * 112 min / max``), over the image's
area, and takes the fewest tiles scoring over 0.9 (none: the best score). transformers then reads ``(a, b)`` as
``(cols, rows)``:

* 224 x 224: 2x2 regions of 112 x 112 keep everything (1.0); every split of fewer tiles keeps 0.25. So 2 columns x 2
  rows, a 224 x 224 canvas: a tile token covers 28 original px, tile ``(i, j)`` starts at ``(112 j, 112 i)``; a
  thumbnail token ``28 * 224 / 112 = 56`` px.
* 448 x 224: no split of at most 6 tiles reaches 0.9; the best is 2 rows x 3 columns of 112 x 149 regions
  (``2 * (2 * 112^3 / 149 + 112^3 / 150) / (448 * 224) = 0.5625``), read as 2 columns x 3 rows: a 224 x 336 canvas.
  Tile tokens are ``28 * 448 / 224 = 56`` px across and ``28 * 224 / 336 = 18.67`` down, tile ``(i, j)`` from
  ``(224 j, 74.67 i)``; thumbnail tokens 112 x 56.
* 320 x 224: 2 rows x 3 columns of 112 x 106 regions keep everything (fewer tiles keep at most 0.49): read as 2
  columns x 3 rows, 224 x 336: tile tokens ``28 * 320 / 224 = 40`` across and 18.67 down, tile ``(i, j)`` from
  ``(160 j, 74.67 i)``; thumbnail tokens 80 x 56.
* 224 x 448 (tall): the mirror of 448 x 224, 3 rows x 2 columns read as 3 columns x 2 rows, a 336 x 224 canvas: tile
  tokens ``28 * 224 / 336 = 18.67`` across and ``28 * 448 / 224 = 56`` down; thumbnail tokens 56 x 112.
* 112 x 112: one tile keeps everything: the one frame is the whole image (the ``thumbnail`` grid), tokens 28 px.

The prompt of a 224 x 224 image (no BOS): ``<IMG_START>`` at 0, the thumbnail at 1..16, ``<IMG_GRID>`` at 17, then the
tiles, each 16 ``<IMG_ATOM>`` after a separator (tile ``(1, 1)`` after ``<IMG_GRID>``, ``(1, 2)`` after ``<IMG_COL>``
at 34, ``(2, 1)`` after ``<IMG_ROW>`` at 51, ``(2, 2)`` after ``<IMG_COL>`` at 68), ``<IMG_END>`` at 85, the text from
86: frame ``f`` (0: the thumbnail) starts at ``1 + 17 f``, 80 image tokens, the projector's 5 x 16 rows.
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
from transformers.models.ovis2.image_processing_ovis2 import get_min_tile_covering_grid

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.adapters.ovis2 import INDICATORS, Ovis2Adapter

NAME = "tiny-ovis2"
THIRD = 224 / 3  # a tile row of the 336 px tall canvases, in original pixels of a 224 px high image


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    return get_tiny(NAME)


def _grid_names(rows: int, cols: int) -> list[str]:
    return ["thumbnail"] + [f"row_{i}_col_{j}" for i in range(1, rows + 1) for j in range(1, cols + 1)]


# ---- declarations and shapes --------------------------------------------------------------------------------------
def test_declared_paths_resolve_and_shapes(vlm):
    a = vlm.adapter
    assert type(a) is Ovis2Adapter and adapter_class_for_config(vlm.model.config) is Ovis2Adapter
    assert vlm.model.config.architectures == [a.model_class_name]
    paths = a.declared_paths()
    assert paths["projector"] is vlm.model.model.visual_embeddings_table
    assert paths["vision_blocks"] is vlm.model.model.vision_tower.transformer.encoder.layers
    assert paths["text_layers"] is vlm.model.model.language_model.layers
    assert type(a.vision_block(0).attention).__name__ == "Ovis2VisionAttention"
    assert type(a.layer(0)).__name__ == "Qwen2DecoderLayer"
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model, a.n_vision_layers) == (4, 4, 2, 32, 128, 2)
    assert (a.tile_size, a.patches_per_side, a.stride, a.tokens_per_side) == (112, 8, 2, 4)
    assert vlm.processor.image_seq_length == 16 and not a.transformer_lens_bridge
    # 1-D positions, causal everywhere: nothing for the exact method to treat specially
    assert a.position_ids(vlm.prepare(draw_scene(0), PROMPT).inputs) is None and not a.bidirectional_image

    batch = vlm.prepare([draw_scene(0), draw_scene(1, (448, 224))], [PROMPT, "the red object is a"])
    b, p = batch.inputs["input_ids"].shape
    out = vlm.run(batch, sites=["blocks.1.attn.hook_z", "blocks.0.attn.hook_pattern", "projector.hook_out",
                                "vision.blocks.1.hook_resid_post"])
    assert out.logits.shape == (b, p, vlm.model.config.text_config.vocab_size)
    assert out["blocks.1.attn.hook_z"].shape == (b, p, 4, 32)
    assert out["blocks.0.attn.hook_pattern"].shape == (b, 4, p, p)
    # the frames of both images (5 + 7), once: the table's second call, on the indicator ids, is not kept
    assert out["projector.hook_out"].shape == (5 + 7, 16, 128)
    assert out["vision.blocks.1.hook_resid_post"].shape == (5 + 7, 64, 64)  # 8x8 patches, no CLS row
    assert sum(len(ti.image_positions) for ti in batch.index) == (5 + 7) * 16


# ---- layout: thumbnail, tiles, indicator tokens --------------------------------------------------------------------
def test_square_image_layout_tokens_and_boxes(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    tok = vlm.adapter.tokenizer
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(2, 2)]
    for frame, name in enumerate(_grid_names(2, 2)):
        np.testing.assert_array_equal(ti.grid(name).positions, 1 + 17 * frame + np.arange(16).reshape(4, 4))
    np.testing.assert_array_equal(ti.positions("special"), [0, 17, 34, 51, 68, 85])
    assert tok.convert_ids_to_tokens([int(i) for i in ti.input_ids[[0, 1, 17, 34, 51, 68, 85]]]) == [
        "<IMG_START>", "<IMG_ATOM>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_COL>", "<IMG_END>"]
    assert ti.positions("text")[0] == 86 and ti.text == PROMPT
    assert len(ti.image_positions) == 80 and batch.inputs["pixel_values"].shape == (5, 3, 112, 112)
    edges = 28.0 * np.arange(5)
    for i in range(2):
        for j in range(2):
            np.testing.assert_allclose(ti.grid(f"row_{i + 1}_col_{j + 1}").boxes,
                                       expected_boxes(112 * j + edges, 112 * i + edges))
    np.testing.assert_allclose(ti.grid("thumbnail").boxes, expected_boxes(56.0 * np.arange(5), 56.0 * np.arange(5)))
    assert ti.cell(int(ti.grid("row_2_col_1").positions[1, 3])) == ("row_2_col_1", 0, 1, 3)
    # a point lies in one thumbnail token and one tile token
    hit = ti.positions_covering((120, 10, 121, 11))
    assert hit.tolist() == [int(ti.grid("thumbnail").positions[0, 2]), int(ti.grid("row_1_col_2").positions[0, 0])]


@pytest.mark.parametrize(("size", "rows", "cols", "cell_w", "cell_h", "thumb_w", "thumb_h"), [
    ((448, 224), 3, 2, 56.0, THIRD / 4, 112.0, 56.0),
    ((320, 224), 3, 2, 40.0, THIRD / 4, 80.0, 56.0),
    ((224, 448), 2, 3, THIRD / 4, 56.0, 56.0, 112.0),
])
def test_non_square_tiles_and_thumbnail_boxes(vlm, size, rows, cols, cell_w, cell_h, thumb_w, thumb_h):
    width, height = size
    image = draw_scene(1, size)
    # the image processor's own canvas: the covering search's (rows, cols) read as (cols, rows)
    covering = get_min_tile_covering_grid((height, width), 112, 6)
    assert covering == (cols, rows)
    assert vlm.processor.image_processor(image, return_tensors="pt")["grids"].tolist() == [[rows, cols]]
    batch = vlm.prepare(image, PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(rows, cols)]
    assert batch.inputs["pixel_values"].shape[0] == rows * cols + 1  # the thumbnail, then the tiles
    n_frames = rows * cols + 1
    np.testing.assert_array_equal(ti.image_positions, (1 + 17 * np.arange(n_frames)[:, None] + np.arange(16)).ravel())
    separators = [ti.input_ids[1 + 17 * f - 1] for f in range(2, n_frames)]
    expected = ((["<IMG_COL>"] * (cols - 1) + ["<IMG_ROW>"]) * rows)[:-1]
    assert vlm.adapter.tokenizer.convert_ids_to_tokens([int(s) for s in separators]) == expected
    for i in range(rows):
        for j in range(cols):
            xs, ys = width / cols * j + cell_w * np.arange(5), height / rows * i + cell_h * np.arange(5)
            np.testing.assert_allclose(ti.grid(f"row_{i + 1}_col_{j + 1}").boxes, expected_boxes(xs, ys))
    np.testing.assert_allclose(ti.grid("thumbnail").boxes,
                               expected_boxes(thumb_w * np.arange(5), thumb_h * np.arange(5)))
    # the tiles cover the image exactly once, and so does the thumbnail
    tiles = np.concatenate([g.boxes.reshape(-1, 4) for g in ti.grids[1:]])
    for boxes in (tiles, ti.grid("thumbnail").boxes.reshape(-1, 4)):
        assert ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).sum() == pytest.approx(width * height)


def test_an_image_of_one_tile_is_only_the_thumbnail(vlm):
    """A 112 x 112 image is one tile: no thumbnail is added, the one frame is the whole image; the block is
    ``<IMG_START>``, 16 ``<IMG_ATOM>``, ``<IMG_GRID>``, ``<IMG_END>``."""
    batch = vlm.prepare(draw_scene(2, (112, 112)), "the red object is a")
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [("thumbnail", (4, 4))]
    np.testing.assert_array_equal(ti.grid("thumbnail").positions, 1 + np.arange(16).reshape(4, 4))
    np.testing.assert_array_equal(ti.positions("special"), [0, 17, 18])
    np.testing.assert_allclose(ti.grid("thumbnail").boxes, expected_boxes(28.0 * np.arange(5), 28.0 * np.arange(5)))
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    assert out["projector.hook_out"].shape == (1, 16, 128)
    torch.testing.assert_close(out["blocks.0.hook_resid_pre"][0, 1:17], out["projector.hook_out"][0], atol=0, rtol=0)


def test_chat_prompt_has_the_same_grids(vlm):
    check_chat_grids(vlm, "thumbnail", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                     "<IMG_START><IMG_ATOM>", "<|im_start|>assistant\n")


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_processor_and_model_must_agree_on_tokens_per_frame(vlm):
    check_tokens_per_frame_must_agree(vlm, "image_seq_length")


def test_a_random_visual_tokenizer_is_refused(vlm):
    """``gumbel_argmax`` draws noise in every forward (two runs of one batch would differ): refused by name."""
    assert vlm.model.config.vision_config.tokenize_function == "softmax"
    check_prepare_refused(vlm, vlm.model.config.vision_config, "tokenize_function", "gumbel_argmax", "Gumbel noise")


def test_indicator_ids_must_be_the_configs(vlm):
    """The model embeds ``visual_indicator_token_ids[k]`` with the table's row ``k`` of the indicators; a config
    listing them in another order than the processor writes them is refused."""
    ids = list(vlm.model.config.visual_indicator_token_ids)
    check_prepare_refused(vlm, vlm.model.config, "visual_indicator_token_ids", ids[::-1], "visual_indicator_token_ids")


# ---- what the language model receives -----------------------------------------------------------------------------
def test_image_rows_are_visual_word_probabilities_times_the_table(vlm):
    """The projector's rows are the visual tokenizer's distributions (over the 59 visual words, the 5 indicator rows
    weighted 0) times the table; they are the layer-0 input at the ``<IMG_ATOM>`` positions, frame by frame, and the
    indicator tokens' layer-0 input is the table's last 5 rows, not their text embeddings."""
    model = vlm.model.model
    batch = vlm.prepare([[draw_scene(0), draw_scene(1, (448, 224))], draw_scene(2, (320, 224))],
                        ["which image has the red square ?", PROMPT])
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    frames = out["projector.hook_out"]
    assert frames.shape == (5 + 7 + 7, 16, 128)
    table = model.visual_embeddings_table.weight
    with torch.no_grad():
        probs = model.vision_tower(batch.inputs["pixel_values"]).pooler_output
    assert probs.shape == (19, 16, 59)
    torch.testing.assert_close(probs.sum(-1), torch.ones(19, 16))
    torch.testing.assert_close(frames, probs @ table[:59], atol=1e-6, rtol=1e-5)
    grids = [(row, g) for row, ti in enumerate(batch.index) for g in ti.grids]
    assert [(g.name, g.image) for _, g in grids[:12]] == [*[(n, 0) for n in _grid_names(2, 2)],
                                                          *[(n, 1) for n in _grid_names(3, 2)]]
    for frame, (row, g) in zip(frames, grids):
        torch.testing.assert_close(out["blocks.0.hook_resid_pre"][row, g.positions.reshape(-1)], frame, atol=0, rtol=0)
    ids = batch.inputs["input_ids"]
    indicator_ids = list(vlm.model.config.visual_indicator_token_ids)
    assert vlm.adapter.tokenizer.convert_ids_to_tokens(indicator_ids) == list(INDICATORS)
    for k, token_id in enumerate(indicator_ids):
        at = ids == token_id
        assert at.sum() >= 3  # every image has its <IMG_START>, <IMG_GRID>, ... (and tiles their <IMG_COL>)
        received = out["blocks.0.hook_resid_pre"][at]
        torch.testing.assert_close(received, table[59 + k].expand_as(received), atol=0, rtol=0)
        assert not torch.allclose(received[0], model.get_input_embeddings().weight[token_id])
    assert batch.inputs["attention_mask"][1].min() == 0  # row 1 is the shorter, left-padded one


def test_vision_rows_map_to_the_tokens_they_are_concatenated_into(vlm):
    """Regrouping the last block's rows by ``vision_row_tokens`` (after the tower's final norm) and concatenating
    each token's 2x2 patches gives the tower's ``hidden_stride`` output, frame by frame in sequence order."""
    batch = vlm.prepare(draw_scene(1, (448, 224)), PROMPT)
    last = f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post"
    rows = vlm.capture(batch, last)[last].reshape(-1, 64)
    owner = vlm.adapter.vision_row_tokens(batch.inputs, 0)
    assert len(owner) == rows.shape[0] == 7 * 64
    assert np.array_equal(np.bincount(owner), np.full(7 * 16, 4))
    tower = vlm.model.model.vision_tower
    with torch.no_grad():
        merged = tower.transformer.rms_norm(rows)[torch.as_tensor(np.argsort(owner, kind="stable"))]
        expected = tower(batch.inputs["pixel_values"]).last_hidden_state
    torch.testing.assert_close(merged.reshape(7, 16, 4 * 64), expected, atol=1e-6, rtol=1e-5)


def test_image_tokens_attend_causally(vlm):
    """No bidirectional image block: HF's own attention probabilities give every image token nothing of a later
    position, in every layer, and the exact method sees no bidirectional positions."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ref = vlm.model(**batch.inputs, output_attentions=True, use_cache=False)
    block = slice(0, 86)
    for pattern in ref.attentions:
        assert torch.all(torch.triu(pattern[0, :, block, block], diagonal=1) == 0)
        assert torch.all(pattern[0, :, block, block].diagonal(dim1=-2, dim2=-1) > 0)
    assert vlm.adapter.bidirectional_positions(batch.inputs).numel() == 0


# ---- painting one cell is local -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "grid", "cell"), [
    ((224, 224), "row_1_col_2", (1, 2)),
    ((448, 224), "row_3_col_1", (2, 1)),
    ((320, 224), "thumbnail", (1, 2)),
])
def test_painting_a_cell_changes_only_the_tokens_covering_it(vlm, size, grid, cell):
    """With the tower's attention silenced each token's row sees only its own 2x2 patches (the visual tokenizer and
    the table work token by token), so painting the middle of a cell's box (30% margins: the bicubic resizes reach a
    few pixels past a box edge) changes exactly the positions ``positions_covering`` returns: the tile tokens under
    the paint and the thumbnail token above them."""
    p = painted_cell_changes(vlm, draw_scene(3, size), grid, cell)
    ti, expected = p.index, p.expected
    assert {ti.cell(int(q))[0] == "thumbnail" for q in expected} == {True, False}  # tile and thumbnail tokens alike
    assert int(ti.grid(grid).positions[cell]) in expected
    np.testing.assert_array_equal(p.changed, expected)


# ---- interventions ------------------------------------------------------------------------------------------------
def test_identity_interventions_at_image_and_indicator_tokens_are_exact(vlm):
    batch = vlm.prepare(draw_scene(0, (448, 224)), PROMPT)
    ti, layer = batch.index[0], 1
    positions = np.concatenate([ti.grid("row_2_col_2").positions.reshape(-1), ti.positions("special")])
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
    assert len(ti.grids) == 5 and task.positions.min() > ti.image_positions.max()  # thumbnail and 2x2 tiles before


# ---- nnsight ------------------------------------------------------------------------------------------------------
def test_nnsight_sees_the_projector_rows_and_the_residual_stream(vlm):
    """nnsight's view of the table's first call (on the distributions) and of layer 1's input, on the same forward,
    equals vlmbind's ``projector.hook_out`` and ``blocks.1.hook_resid_pre``; those rows are layer 0's input at the
    image tokens."""
    a = vlm.adapter
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (448, 224))], [PROMPT, "the red object is a"])
    nn_model = vlm.nnsight()
    with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
        # in execution order, as nnsight requires: the table runs before the text layers
        frames = vlm.nnsight_module(nn_model, a.projector).output.save()
        embedded = vlm.nnsight_module(nn_model, f"{a.text_layers}.0").input.save()
        pre = vlm.nnsight_module(nn_model, f"{a.text_layers}.1").input.save()
    out = vlm.run(batch, sites=["projector.hook_out", "blocks.1.hook_resid_pre"])
    torch.testing.assert_close(out["projector.hook_out"], frames, atol=0, rtol=0)
    torch.testing.assert_close(out["blocks.1.hook_resid_pre"], pre, atol=0, rtol=0)
    image = batch.inputs["input_ids"] == a.image_token_id
    torch.testing.assert_close(embedded[image], frames.reshape(-1, a.d_model), atol=0, rtol=0)
