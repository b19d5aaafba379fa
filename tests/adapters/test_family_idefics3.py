"""Idefics3 and SmolVLM: tiles plus a global image, the pixel shuffle, the tile tags; boxes against hand-computed values
and against the patch embeddings, where the connector's rows land, exact == naive, nnsight and TransformerLens.

Hand computations (tiny processors, see ``vlmbind/tiny/idefics3.py``: longest edge resized to 128 px, 64 px tiles,
each frame a 4x4 token grid, so a token is 16 px of its tile and 16 px of the 64 px global image):

* 224 x 224: 128 x 128, 2 x 2 tiles; a tile token covers ``16 * 224 / 128 = 28`` original px, tile ``(i, j)``
  starting at ``(112 j, 112 i)``; a global token covers ``16 * 224 / 64 = 56`` px.
* 448 x 224 (W x H): 128 x 64, one row of 2 tiles; tile tokens ``16 * 448 / 128 = 56`` px across and
  ``16 * 224 / 64 = 56`` down, tile ``(0, j)`` from x = 224 j; global tokens 112 x 56 px. 224 x 448 is the transpose.
* 320 x 224: 128 x 90 (``int(128 * 224 / 320) = 89``, made even), stretched to 128 x 128: 2 x 2 tiles, tile tokens
  ``16 * 320 / 128 = 40`` across and ``16 * 224 / 128 = 28`` down; global tokens 80 x 56.

The prompt of a 224 x 224 image: ``<fake><row_1_col_1>`` + 16 ``<image>``, ``<fake><row_1_col_2>`` + 16, ``\\n``,
the same for row 2, ``\\n\\n<fake><global-img>`` + 16, ``<fake>``, then the prompt's text (no BOS): 94 positions
before the text.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import (
    check_chat_grids,
    check_exact_equals_naive,
    check_tokens_per_frame_must_agree,
    painted_cell_changes,
)
from helpers import PROMPT, draw_scene, expected_boxes, get_tiny

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.adapters.idefics3 import Idefics3Adapter, SmolVLMAdapter
from vlmbind.core.errors import UnsupportedModelError

NAMES = ("tiny-idefics3", "tiny-smolvlm")
TILES = {(224, 224): (2, 2), (448, 224): (1, 2), (224, 448): (2, 1), (320, 224): (2, 2)}


@pytest.fixture(scope="module", params=NAMES)
def vlm(request) -> vb.VLM:
    return get_tiny(request.param)


@pytest.fixture(scope="module")
def idefics3() -> vb.VLM:
    return get_tiny("tiny-idefics3")


@pytest.fixture(scope="module")
def smolvlm() -> vb.VLM:
    return get_tiny("tiny-smolvlm")


def _grid_names(rows: int, cols: int) -> list[str]:
    return [f"row_{i}_col_{j}" for i in range(1, rows + 1) for j in range(1, cols + 1)] + ["global"]


# ---- declarations -------------------------------------------------------------------------------------------------
def test_declared_paths_and_sizes(idefics3, smolvlm):
    for vlm, cls, scale in ((idefics3, Idefics3Adapter, 2), (smolvlm, SmolVLMAdapter, 4)):
        a = vlm.adapter
        assert type(a) is cls and adapter_class_for_config(vlm.model.config) is cls
        assert vlm.model.config.architectures == [cls.model_class_name]
        paths = a.declared_paths()
        assert paths["projector"] is vlm.model.model.connector
        assert paths["vision_blocks"] is vlm.model.model.vision_model.encoder.layers
        assert paths["text_layers"] is vlm.model.model.text_model.layers
        assert type(a.vision_block(0).self_attn).__name__.endswith("VisionAttention")
        assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model, a.n_vision_layers) == (4, 4, 2, 32, 128, 2)
        assert a.scale_factor == scale and a.tokens_per_side == 4
        assert vlm.processor.image_seq_len == 16 and a.image_placeholder == vlm.processor.image_token
    assert idefics3.adapter.transformer_lens_bridge and not smolvlm.adapter.transformer_lens_bridge


# ---- layout: tiles, global image, separators ----------------------------------------------------------------------
def test_square_image_layout_tokens_and_boxes(vlm):
    ti = vlm.prepare(draw_scene(0), PROMPT).index[0]
    tok = vlm.adapter.tokenizer
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(2, 2)]
    starts = {"row_1_col_1": 0, "row_1_col_2": 18, "row_2_col_1": 37, "row_2_col_2": 55, "global": 75}
    for name, start in starts.items():
        g = ti.grid(name)
        np.testing.assert_array_equal(g.positions, start + 2 + np.arange(16).reshape(4, 4))
        tag = "<global-img>" if name == "global" else f"<{name}>"
        assert tok.convert_ids_to_tokens([int(i) for i in ti.input_ids[start : start + 2]]) == [
            "<fake_token_around_image>", tag]
    # the newlines after each row of tiles, the tags and every <fake_token_around_image> are special
    special = [0, 1, 18, 19, 36, 37, 38, 55, 56, 73, 74, 75, 76, 93]
    np.testing.assert_array_equal(ti.positions("special"), special)
    assert tok.decode([int(i) for i in ti.input_ids[[36, 73, 74]]]) == "\n\n\n"
    assert ti.positions("text")[0] == 94 and ti.text == PROMPT
    assert len(ti.image_positions) == 80
    edges = 28.0 * np.arange(5)
    for i in range(2):
        for j in range(2):
            np.testing.assert_allclose(ti.grid(f"row_{i + 1}_col_{j + 1}").boxes,
                                       expected_boxes(112 * j + edges, 112 * i + edges))
    np.testing.assert_allclose(ti.grid("global").boxes, expected_boxes(56.0 * np.arange(5), 56.0 * np.arange(5)))
    assert ti.cell(int(ti.grid("row_2_col_1").positions[1, 3])) == ("row_2_col_1", 0, 1, 3)
    # a point lies in one tile token and one global token
    hit = ti.positions_covering((120, 10, 121, 11))
    assert hit.tolist() == [int(ti.grid("row_1_col_2").positions[0, 0]), int(ti.grid("global").positions[0, 2])]


@pytest.mark.parametrize(("size", "cell_w", "cell_h", "global_w", "global_h"), [
    ((448, 224), 56.0, 56.0, 112.0, 56.0),
    ((224, 448), 56.0, 56.0, 56.0, 112.0),
    ((320, 224), 40.0, 28.0, 80.0, 56.0),
])
def test_non_square_tiles_and_global_boxes(vlm, size, cell_w, cell_h, global_w, global_h):
    rows, cols = TILES[size]
    batch = vlm.prepare(draw_scene(1, size), PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(rows, cols)]
    assert batch.inputs["pixel_values"].shape[1] == rows * cols + 1  # the frames: tiles, then the global image
    width, height = size
    for i in range(rows):
        for j in range(cols):
            xs, ys = width / cols * j + cell_w * np.arange(5), height / rows * i + cell_h * np.arange(5)
            np.testing.assert_allclose(ti.grid(f"row_{i + 1}_col_{j + 1}").boxes, expected_boxes(xs, ys))
    np.testing.assert_allclose(ti.grid("global").boxes,
                               expected_boxes(global_w * np.arange(5), global_h * np.arange(5)))
    # the tiles cover the image exactly once, and so does the global image
    tiles = np.concatenate([g.boxes.reshape(-1, 4) for g in ti.grids[:-1]])
    for boxes in (tiles, ti.grid("global").boxes.reshape(-1, 4)):
        assert ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).sum() == pytest.approx(width * height)
    # a <fake_token_around_image> and a tag per tile and for the global image, the closing <fake...>, a newline
    # after each row of tiles and one more before the global image
    assert len(ti.positions("special")) == 2 * rows * cols + 2 + 1 + rows + 1


def test_an_unsplit_image_is_only_the_global_image(idefics3):
    """Without image splitting the processor squashes the image to one tile: ``<fake><global-img>`` and 16 tokens,
    what the model receives there, and nothing else."""
    ip = idefics3.processor.image_processor
    ip.do_image_splitting = False
    try:
        batch = idefics3.prepare(draw_scene(2, (320, 224)), PROMPT)
    finally:
        ip.do_image_splitting = True
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [("global", (4, 4))]
    np.testing.assert_array_equal(ti.grid("global").positions, 2 + np.arange(16).reshape(4, 4))
    np.testing.assert_array_equal(ti.positions("special"), [0, 1, 18])
    np.testing.assert_allclose(ti.grid("global").boxes, expected_boxes(80.0 * np.arange(5), 56.0 * np.arange(5)))
    out = idefics3.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    assert out["projector.hook_out"].shape == (1, 16, 128)
    torch.testing.assert_close(out["blocks.0.hook_resid_pre"][0, 2:18], out["projector.hook_out"][0], atol=0, rtol=0)


def test_chat_prompt_has_the_same_grids(vlm):
    check_chat_grids(vlm, "global", "<|im_start|>User:<fake_token_around_image>", "Assistant:")


def test_processor_and_model_must_agree_on_tokens_per_frame(idefics3):
    check_tokens_per_frame_must_agree(idefics3, "image_seq_len")


# ---- what the language model receives -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rows(vlm) -> dict:
    """A left-padded batch: row 0 with two images (224 x 224, then 448 x 224), row 1 with a 320 x 224 one, run once
    with the layer-0 input, the connector's rows and the last vision block."""
    batch = vlm.prepare([[draw_scene(0), draw_scene(1, (448, 224))], draw_scene(2, (320, 224))],
                        ["which image has the red square ?", PROMPT])
    last = f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post"
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out", last])
    return dict(batch=batch, out=out, last=last)


def test_connector_rows_land_where_the_index_says(vlm, two_rows):
    """Frame f's 16 connector rows are the layer-0 input at the f-th grid's positions (frames in batch order: row 0's
    tiles and global images, then row 1's), exactly."""
    batch, out = two_rows["batch"], two_rows["out"]
    frames = out["projector.hook_out"]
    assert frames.shape == (5 + 3 + 5, 16, 128)
    grids = [(row, g) for row, ti in enumerate(batch.index) for g in ti.grids]
    assert [(g.name, g.image) for row, g in grids[:8]] == [
        *[(n, 0) for n in _grid_names(2, 2)], *[(n, 1) for n in _grid_names(1, 2)]]
    for frame, (row, g) in zip(frames, grids):
        torch.testing.assert_close(out["blocks.0.hook_resid_pre"][row, g.positions.reshape(-1)], frame, atol=0, rtol=0)
    ti = batch.index[0]
    assert ti.grid("global", 0).positions.max() < ti.grid("row_1_col_1", 1).positions.min()
    assert batch.inputs["attention_mask"][1].min() == 0  # row 1 is the shorter, left-padded one


def test_vision_rows_shuffle_into_the_connector_rows(vlm, two_rows):
    """``vision_row_tokens``: regrouping an image's last-block rows by the map (``s x s`` patches a token, in raster
    order) and projecting them gives the connector's rows for that image's tokens."""
    a, batch, out = vlm.adapter, two_rows["batch"], two_rows["out"]
    rows = out[two_rows["last"]]  # frames, patches, d_vision
    assert rows.shape[:2] == (13, a.patches_per_side**2)
    connector = vlm.model.model.connector
    first_frame = {0: 0, 1: 5, 2: 8}  # image -> its first frame
    for image_id, n_frames in ((0, 5), (1, 3), (2, 5)):
        owner = a.vision_row_tokens(batch.inputs, image_id)
        assert len(owner) == n_frames * a.patches_per_side**2
        np.testing.assert_array_equal(np.bincount(owner), np.full(16 * n_frames, a.scale_factor**2))
        image_rows = rows[first_frame[image_id] : first_frame[image_id] + n_frames].reshape(-1, rows.shape[-1])
        regrouped = image_rows[torch.as_tensor(np.argsort(owner, kind="stable"))]
        with torch.no_grad():
            normed = vlm.model.model.vision_model.post_layernorm(regrouped)
            merged = connector.modality_projection(normed.reshape(16 * n_frames, -1))
        expected = out["projector.hook_out"][first_frame[image_id] : first_frame[image_id] + n_frames]
        torch.testing.assert_close(merged, expected.reshape(-1, 128), atol=1e-5, rtol=1e-5)


# ---- painting one cell is local -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "size", "grid", "cell"), [
    ("tiny-idefics3", (224, 224), "row_1_col_2", (1, 2)),
    ("tiny-idefics3", (320, 224), "global", (2, 1)),
    ("tiny-smolvlm", (448, 224), "row_1_col_2", (2, 1)),
])
def test_painting_a_cell_changes_only_the_tokens_covering_it(name, size, grid, cell):
    """With the tower's attention silenced each token's features see only its own ``s x s`` patches, so painting the
    middle of a cell's box (30% margins: the Lanczos resizes reach a few pixels past a box edge) changes exactly the
    positions ``positions_covering`` returns: the tile tokens under the paint and the global token above them."""
    p = painted_cell_changes(get_tiny(name), draw_scene(3, size), grid, cell)
    ti, expected = p.index, p.expected
    assert {ti.cell(int(q))[0] == "global" for q in expected} == {True, False}  # tile and global tokens alike
    assert int(ti.grid(grid).positions[cell]) in expected
    np.testing.assert_array_equal(p.changed, expected)


# ---- interventions ------------------------------------------------------------------------------------------------
def test_identity_interventions_at_image_and_separator_tokens_are_exact(idefics3):
    batch = idefics3.prepare(draw_scene(0), PROMPT)
    ti, layer = batch.index[0], 1
    positions = np.concatenate([ti.grid("row_2_col_1").positions.reshape(-1), ti.positions("special")])
    z = idefics3.capture(batch, f"blocks.{layer}.attn.hook_z")[f"blocks.{layer}.attn.hook_z"]
    clean = idefics3.logits(batch)
    heads = list(range(idefics3.n_heads))
    patch = vb.PatchHeads(layer=layer, heads=heads, positions=positions.tolist(), values=z[:, positions])
    zero_alpha = vb.AddToHeads(layer=layer, heads=heads, positions=positions.tolist(),
                               vector=torch.ones(idefics3.adapter.d_head), alpha=0.0)
    torch.testing.assert_close(idefics3.logits(batch, [patch, zero_alpha]), clean, atol=0, rtol=0)


@pytest.mark.parametrize(("name", "condition"), [
    ("tiny-idefics3", "id_selection"),  # the last token
    ("tiny-smolvlm", "id_retrieval"),  # a mid-prompt span: an earlier object's name
])
def test_exact_equals_naive_across_layouts(name, condition):
    task = check_exact_equals_naive(get_tiny(name), condition)
    if condition == "id_selection":
        assert task.positions.tolist() == [task.score_position]
    else:
        assert task.positions.max() < task.score_position - 1
    assert task.positions.min() > task.batch.index[0].image_positions.max()


# ---- nnsight and TransformerLens ----------------------------------------------------------------------------------
def test_nnsight_sees_the_connector_rows_and_the_residual_stream(smolvlm):
    """nnsight's view of the connector's output and of layer 1's input, on the same forward, equals vlmbind's
    ``projector.hook_out`` and ``blocks.1.hook_resid_pre``; the connector's rows are layer 0's input at the image
    tokens."""
    a = smolvlm.adapter
    batch = smolvlm.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "the red object is a"])
    nn_model = smolvlm.nnsight()
    with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
        # in execution order, as nnsight requires: the connector runs before the text layers
        frames = smolvlm.nnsight_module(nn_model, a.projector).output.save()
        embedded = smolvlm.nnsight_module(nn_model, f"{a.text_layers}.0").input.save()
        pre = smolvlm.nnsight_module(nn_model, f"{a.text_layers}.1").input.save()
    out = smolvlm.run(batch, sites=["projector.hook_out", "blocks.1.hook_resid_pre"])
    torch.testing.assert_close(out["projector.hook_out"], frames, atol=0, rtol=0)
    torch.testing.assert_close(out["blocks.1.hook_resid_pre"], pre, atol=0, rtol=0)
    image = batch.inputs["input_ids"] == a.image_token_id
    torch.testing.assert_close(embedded[image], frames.reshape(-1, a.d_model), atol=0, rtol=0)


def test_transformer_lens_bridge_sees_the_connector(idefics3):
    """The bridge (TL's Idefics3 adapter) gives HF's logits, and its ``vision_projector.hook_out`` is vlmbind's
    ``projector.hook_out`` (the hooks of the text blocks: tests/engine/test_transformer_lens.py); SmolVLM has no
    bridge."""
    from vlmbind.engine.interop import bridge_inputs, transformer_lens_bridge

    batch = idefics3.prepare([draw_scene(0), draw_scene(1, (448, 224))], [PROMPT, "the red object is a"])
    bridge = transformer_lens_bridge(idefics3)
    ids, kwargs = bridge_inputs(idefics3, batch)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=["vision_projector.hook_out"], **kwargs)
    ours = idefics3.run(batch, sites=["projector.hook_out"])
    torch.testing.assert_close(logits, ours.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["vision_projector.hook_out"], ours["projector.hook_out"], atol=1e-5, rtol=0)
    with pytest.raises(UnsupportedModelError, match="no bridge"):
        transformer_lens_bridge(get_tiny("tiny-smolvlm"))
