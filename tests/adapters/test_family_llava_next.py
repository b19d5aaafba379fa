"""LLaVA-NeXT: image-token grids and boxes against hand-computed values, against the model's own computation, and
the engine (identity interventions, exact == naive patching, nnsight) on the tiled layout. TransformerLens's bridge
of ``LlavaNextForConditionalGeneration`` is checked with the other bridged families in test_transformer_lens.py.

Hand computations (tiny config, see ``vlmbind/tiny/llava_next.py``): 112 px tiles, 8x8 features a tile, pinpoints
``(112 i, 112 j)`` for ``i, j`` in 1..3. Base grid: the image stretched to 112x112. A 224x224 image picks 2x2 tiles,
a 16x16 hi-res grid of 14 px cells. A 320x224 (W x H) image picks (224, 336): kept at 320x224, pasted at
x = (336 - 320) // 2 = 8, 16x24 features; unpadding keeps ``int(round(320 * 16 / 224, 7)) = 22`` columns from column
``(24 - 22) // 2 = 1``, so hi-res column ``c`` covers ``14 (c + 1) - 8`` .. ``+ 14``; the portrait is the transpose.
A 448x300 image picks (336, 336) (the largest effective resolution): shrunk by 0.75 to 336x225 (``ceil``), pasted
at y = (336 - 225) // 2 = 55, 24x24 features; unpadding keeps ``int(round(300 * 24 / 448, 7)) = 16`` rows from row
``(24 - 16) // 2 = 4``, so row ``r`` covers ``(14 (r + 4) - 55) / 0.75`` .. ``+ 14 / 0.75`` and column ``c`` covers
``14 c / 0.75`` .. ``+ 14 / 0.75``. Unlike LLaVA-OneVision no grid is ever down-sampled and every image is tiled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import assert_exact_equals_naive, assert_painting_is_local, check_prepare_refused, pushed
from helpers import PROMPT, draw_scene, expected_boxes, get_tiny

import vlmbind as vb
from vlmbind.adapters.llava_next import LlavaNextAdapter
from vlmbind.engine.interventions import PatchHeadEntries
from vlmbind.engine.patching import PatchTask

NAME = "tiny-llava_next"


@pytest.fixture(scope="module")
def nxt() -> vb.VLM:
    return get_tiny(NAME)


@pytest.fixture(scope="module")
def pair(nxt) -> vb.Batch:
    """A left-padded batch of two differently tiled images (2x2 and 2x3 tiles)."""
    return nxt.prepare([draw_scene(0), draw_scene(1, (320, 224))], [PROMPT, "the red object is a"])


def _image_tokens(vlm: vb.VLM, batch: vb.Batch, row: int = 0) -> np.ndarray:
    return np.flatnonzero(batch.inputs["input_ids"][row].numpy() == vlm.adapter.image_token_id)


def _newlines(vlm: vb.VLM, batch: vb.Batch, row: int = 0) -> np.ndarray:
    """Image-token positions the index marks ``special``: the ``image_newline`` features."""
    positions = _image_tokens(vlm, batch, row)
    return positions[batch.index[row].roles[positions] == "special"]


# ---- declarations and shapes --------------------------------------------------------------------------------------
def test_declared_paths_resolve_and_shapes(nxt, pair):
    a = nxt.adapter
    assert isinstance(a, LlavaNextAdapter) and a.family == "llava_next" and a.transformer_lens_bridge
    assert type(a.layer(0)).__name__ == "MistralDecoderLayer"
    assert type(a.vision_block(0)).__name__ == "CLIPEncoderLayer"
    assert not hasattr(nxt.model.config, "vision_aspect_ratio")  # no anyres_max down-sampling in this family
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model, a.n_vision_layers) == (4, 4, 2, 32, 128, 2)
    b, p = pair.inputs["input_ids"].shape
    out = nxt.run(pair, sites=["blocks.1.attn.hook_z", "blocks.2.hook_resid_post", "blocks.0.attn.hook_pattern",
                               "projector.hook_out"])
    assert out.logits.shape == (b, p, nxt.model.config.text_config.vocab_size)
    assert out["blocks.1.attn.hook_z"].shape == (b, p, 4, 32)
    assert out["blocks.2.hook_resid_post"].shape == (b, p, 128)
    assert out["blocks.0.attn.hook_pattern"].shape == (b, 4, p, p)
    assert out["projector.hook_out"].shape == (1 + 4 + 1 + 6, 64, 128)  # base + tiles of both images, CLS dropped


# ---- layout and boxes ---------------------------------------------------------------------------------------------
def test_square_layout(nxt):
    batch = nxt.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [("base", (8, 8)), ("tiles", (16, 16))]
    image = _image_tokens(nxt, batch)
    assert len(image) == 64 + 16 * 17 == 336
    start = int(image[0])
    assert ti.roles[0] == "special" and start == 1  # <s>, then the image
    np.testing.assert_array_equal(ti.grid("base").positions, start + np.arange(64).reshape(8, 8))
    hires = start + 64 + np.arange(16 * 17).reshape(16, 17)
    np.testing.assert_array_equal(ti.grid("tiles").positions, hires[:, :16])
    np.testing.assert_array_equal(_newlines(nxt, batch), hires[:, 16])
    assert all(ti.cell(int(p)) is None for p in hires[:, 16])
    np.testing.assert_allclose(ti.grid("base").boxes, expected_boxes(np.arange(9) * 28.0, np.arange(9) * 28.0))
    np.testing.assert_allclose(ti.grid("tiles").boxes, expected_boxes(np.arange(17) * 14.0, np.arange(17) * 14.0))


@pytest.mark.parametrize(
    ("size", "shape", "x_edges", "y_edges"),
    [
        ((320, 224), (16, 22), 14.0 * (np.arange(23) + 1) - 8, 14.0 * np.arange(17)),
        ((224, 320), (22, 16), 14.0 * np.arange(17), 14.0 * (np.arange(23) + 1) - 8),
        ((448, 300), (16, 24), 14.0 * np.arange(25) / 0.75, (14.0 * (np.arange(17) + 4) - 55) / 0.75),
    ],
)
def test_non_square_tiles_are_unpadded_in_original_coordinates(nxt, size, shape, x_edges, y_edges):
    batch = nxt.prepare(draw_scene(0, size), PROMPT)
    ti = batch.index[0]
    assert ti.grid("tiles").shape == shape
    np.testing.assert_allclose(ti.grid("tiles").boxes, expected_boxes(x_edges, y_edges))
    width, height = size
    np.testing.assert_allclose(ti.grid("base").boxes, expected_boxes(np.arange(9) * width / 8,
                                                                     np.arange(9) * height / 8))
    assert len(_newlines(nxt, batch)) == shape[0]
    assert len(_image_tokens(nxt, batch)) == 64 + shape[0] * (shape[1] + 1)


def test_features_land_where_the_index_says(nxt):
    """Base features, stitched and unpadded tile features and the newline vector, exactly where the index says."""
    batch = nxt.prepare(draw_scene(0, (320, 224)), PROMPT)
    out = nxt.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    resid, features = out["blocks.0.hook_resid_pre"][0], out["projector.hook_out"]
    ti = batch.index[0]
    d = features.shape[-1]
    assert features.shape == (1 + 2 * 3, 64, d)  # base + 2x3 tiles of 8x8 features
    torch.testing.assert_close(resid[ti.grid("base").positions.reshape(-1)], features[0], atol=0, rtol=0)
    # tile (i, j) holds hi-res rows 8i..8i+7 and columns 8j..8j+7; unpadding keeps columns 1..22
    hires = features[1:].reshape(2, 3, 8, 8, d).permute(0, 2, 1, 3, 4).reshape(16, 24, d)
    torch.testing.assert_close(resid[ti.grid("tiles").positions.reshape(-1)], hires[:, 1:23].reshape(-1, d),
                               atol=0, rtol=0)
    newlines = _newlines(nxt, batch)
    newline = nxt.model.model.image_newline.detach()
    torch.testing.assert_close(resid[newlines], newline.expand(len(newlines), -1), atol=0, rtol=0)
    # the model's own feature count equals the <image> tokens, which the index splits into cells and newlines
    with torch.no_grad():
        packed = nxt.model.model.get_image_features(
            pixel_values=batch.inputs["pixel_values"], image_sizes=batch.inputs["image_sizes"]
        ).pooler_output
    assert packed[0].shape[0] == len(_image_tokens(nxt, batch)) == len(ti.image_positions) + len(newlines)


def test_several_images_in_one_prompt_are_each_tiled(nxt):
    """No multi-image mode (OneVision's pad-to-square, no tiles): each image gets its base grid and its tiles."""
    images = [draw_scene(0, (112, 112)), draw_scene(1, (224, 112))]  # 1x1 and 1x2 tiles
    batch = nxt.prepare([images], [PROMPT])
    ti = batch.index[0]
    assert [(g.name, g.image, g.shape) for g in ti.grids] == [
        ("base", 0, (8, 8)), ("tiles", 0, (8, 8)), ("base", 1, (8, 8)), ("tiles", 1, (8, 16))]
    start = int(_image_tokens(nxt, batch)[0])
    second = start + 64 + 8 * 9
    np.testing.assert_array_equal(ti.grid("base", 1).positions, second + np.arange(64).reshape(8, 8))
    np.testing.assert_array_equal(
        ti.grid("tiles", 1).positions, (second + 64 + np.arange(8 * 17).reshape(8, 17))[:, :16])
    resid = nxt.capture(batch, "blocks.0.hook_resid_pre")["blocks.0.hook_resid_pre"][0]
    newlines = _newlines(nxt, batch)
    assert len(newlines) == 8 + 8
    torch.testing.assert_close(resid[newlines], nxt.model.model.image_newline.detach().expand(16, -1), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("size", "grid", "cell"),
    [((320, 224), "tiles", (2, 3)), ((448, 300), "tiles", (7, 10)), ((448, 300), "base", (5, 2))],
)
def test_painting_a_cell_changes_only_the_tokens_covering_it(nxt, size, grid, cell):
    """With the tower's attention silenced, painting the middle of a cell changes exactly the positions whose boxes
    cover the paint, in both grids: unpadded tiles, and tiles that are a shrunk copy of the image (448x300); the
    square layout is painted by ``tests/core/test_generic_tokens.py``."""
    assert_painting_is_local(nxt, draw_scene(3, size), grid, cell)


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_a_strategy_that_keeps_a_cls_feature_is_refused(nxt):
    assert nxt.model.config.vision_feature_select_strategy == "default"
    check_prepare_refused(nxt, nxt.model.config, "vision_feature_select_strategy", "full",
                          "vision_feature_select_strategy='full'")


def test_tiles_resized_after_cutting_are_refused(nxt):
    # every tile zoomed 2x and center-cropped back to 112: the model still runs
    check_prepare_refused(nxt, nxt.processor.image_processor, "size", {"shortest_edge": 224}, "reach the tower as cut")


def test_processor_and_config_pinpoints_must_agree(nxt):
    check_prepare_refused(nxt, nxt.processor.image_processor, "image_grid_pinpoints", [[112, 112], [224, 224]],
                          "image_grid_pinpoints")


# ---- the engine on the tiled layout -------------------------------------------------------------------------------
def test_identity_interventions_are_exact(nxt, pair):
    clean = nxt.logits(pair)
    layer, heads = 2, list(range(nxt.n_heads))
    z = nxt.capture(pair, f"blocks.{layer}.attn.hook_z")[f"blocks.{layer}.attn.hook_z"]
    self_patch = vb.PatchHeads(layer=layer, heads=heads, positions=list(range(pair.seq_len)), values=z)
    torch.testing.assert_close(nxt.logits(pair, [self_patch]), clean, atol=0, rtol=0)
    nothing = vb.AddToHeads(layer=layer, heads=heads, positions=[-1], vector=torch.ones(nxt.adapter.d_head), alpha=0.0)
    torch.testing.assert_close(nxt.logits(pair, [nothing]), clean, atol=0, rtol=0)


@pytest.fixture(scope="module")
def patch_task(nxt) -> PatchTask:
    """The clean scene patched with another scene's head outputs, pushed far from the clean ones so that effects
    are large enough for a tight comparison (positions chosen per test)."""
    clean, corrupt = (nxt.prepare(draw_scene(s, (112, 112)), "the red object is a") for s in (0, 4))  # 1 tile
    tok = nxt.adapter.tokenizer
    red, blue = (tok.convert_tokens_to_ids(tok.tokenize(w))[0] for w in (" red", " blue"))
    layers = range(nxt.n_layers)
    z = nxt.capture(corrupt, [f"blocks.{l}.attn.hook_z" for l in layers])
    values = {l: z[f"blocks.{l}.attn.hook_z"][0] for l in layers}
    return pushed(PatchTask(clean, np.array([0]), values, clean.index[0].last_position, red, blue))


@pytest.mark.parametrize("where", ["last_token", "mid_prompt"])
def test_exact_equals_naive(nxt, patch_task, where):
    last = patch_task.score_position
    positions = np.array([last]) if where == "last_token" else np.array([last - 2, last - 1])
    task = PatchTask(patch_task.batch, positions, {l: v[positions] for l, v in patch_task.values.items()},
                     last, patch_task.a, patch_task.a_star)
    heads = [(l, h) for l in range(nxt.n_layers) for h in range(nxt.n_heads)]
    assert_exact_equals_naive(nxt, task, heads, layouts=({},))


def test_nnsight_patch_at_the_newline_tokens_equals_vlmbind(nxt, pair):
    """An nnsight edit of one head's z at the newline positions (image tokens in no grid) gives vlmbind's logits."""
    layer, head, d = 1, 3, nxt.adapter.d_head
    newlines = _newlines(nxt, pair, row=0)
    n = len(newlines)
    values = torch.randn(n, d, generator=torch.Generator().manual_seed(1))
    ours = nxt.logits(pair, [PatchHeadEntries(layer=layer, heads=[head] * n, rows=[0] * n,
                                                 positions=newlines.tolist(), values=values)])
    nn_model = nxt.nnsight()
    with torch.no_grad(), nn_model.trace(**pair.inputs, use_cache=False):
        x = nxt.nnsight_module(nn_model, nxt.adapter.o_proj_path(layer)).input
        x[0, torch.as_tensor(newlines), head * d : (head + 1) * d] = values
        theirs = nn_model.output.logits.save()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert (ours - nxt.logits(pair)).abs().max() > 1e-4

