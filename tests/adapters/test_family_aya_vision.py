"""Aya Vision: tiles plus a global image, the pixel shuffle, the ``<|START_OF_IMG|> ... <|END_OF_IMG|>`` block with its
tile tags; Cohere2's parallel attention + MLP block, sliding-window RoPE layers and a full layer without positional
encoding (against HF's ``output_attentions``), the unscaled logits; exact == naive on the tiled layout.
TransformerLens has no bridge for ``AyaVisionForConditionalGeneration`` (tests/engine/test_transformer_lens.py checks
the refusal for every unbridged family).

Hand computations (tiny processor, see ``vlmbind/tiny/aya_vision.py``: 64 px tiles, 8 px patches, 1 to 6 tiles,
``downsample_factor`` 2, so each frame is a 4x4 token grid and a token is 16 px of its frame). The canvas is the
``cols x rows`` of at most 6 tiles whose ``cols / rows`` is closest to the image's ``W / H``, ties going to more tiles
while the image's area exceeds half the canvas's:

* 224 x 224: 1x1 and 2x2 tie (ratio 1); 224^2 > 0.5 * 4 * 64^2, so 2x2, stretched to 128 x 128: a tile token covers
  ``16 * 224 / 128 = 28`` original px, tile ``(i, j)`` starting at ``(112 j, 112 i)``; a global token
  ``16 * 224 / 64 = 56`` px.
* 448 x 224 (W x H): 2 columns x 1 row (ratio 2 exactly), 128 x 64: tile tokens ``16 * 448 / 128 = 56`` px across and
  ``16 * 224 / 64 = 56`` down, tile ``(0, j)`` from x = 224 j; global tokens 112 x 56 px.
* 320 x 224 (ratio 1.43): 3 columns x 2 rows (ratio 1.5 is the closest), 192 x 128: tile tokens
  ``16 * 320 / 192 = 26.67`` across and ``16 * 224 / 128 = 28`` down, tile ``(i, j)`` from ``(106.67 j, 112 i)``;
  global tokens 80 x 56.
* 64 x 64: 1x1 and 2x2 tie, but 64^2 < 0.5 * 4 * 64^2, so one tile: no global image is added, the one frame is the
  whole image (the ``global`` grid), tokens 16 px.

Token layout (the tokenizer prepends ``<BOS_TOKEN>``; ``TILE_k`` is the three tokens ``TILE``, ``_``, ``k``, and
``TILE_GLOBAL`` one): a 224 x 224 image is ``<BOS_TOKEN>`` at 0, ``<|START_OF_IMG|>`` at 1, then for tile k = 1..4 its
tag at ``2 + 19 (k - 1)`` .. ``4 + 19 (k - 1)`` and its 16 ``<|IMG_PATCH|>`` from ``5 + 19 (k - 1)`` (5, 24, 43, 62),
``TILE_GLOBAL`` at 78, the global image's tokens 79..94, ``<|END_OF_IMG|>`` at 95 and the prompt's text from 96:
5 * 16 = 80 image tokens, the 80 rows the projector makes of 5 frames. A frame of ``c`` tiles and a global image has
``1 + 19 c + 17`` block tokens; the 64 x 64 image's block is 1 (start), 2 (``TILE_GLOBAL``), 3..18, 19 (end).

Cohere2 (layers 0-2 slide with a 16-token window and RoPE, layer 3 is full with no positional encoding): attention
and the MLP both read ``input_layernorm(resid_pre)`` and the layer returns ``resid_pre + attn_out + mlp_out``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import (
    check_chat_grids,
    check_exact_equals_naive,
    check_prepare_refused,
    painted_cell_changes,
)
from helpers import PROMPT, draw_scene, expected_boxes
from transformers.models.cohere2.modeling_cohere2 import apply_rotary_pos_emb

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.adapters.aya_vision import AyaVisionAdapter
from vlmbind.analysis.lens import unembed
from vlmbind.core.errors import UnsupportedModelError
from vlmbind.tiny.aya_vision import LAYER_TYPES, LOGIT_SCALE, SLIDING_WINDOW

NAME = "tiny-aya_vision"
# (W, H) -> (cols, rows) of tiles
CANVAS = {(224, 224): (2, 2), (448, 224): (2, 1), (320, 224): (3, 2)}
SLIDING, FULL = 0, 3


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    # a private instance: HF's output_attentions installs permanent capture hooks, which would leak into the
    # session-wide tiny model that the hook-hygiene tests count hooks on
    return vb.load(NAME)


def _grid_names(cols: int, rows: int) -> list[str]:
    return [f"row_{i}_col_{j}" for i in range(1, rows + 1) for j in range(1, cols + 1)] + ["global"]


def _block_specials(cols: int, rows: int) -> list[int]:
    """Positions of the structure tokens of a one-image prompt (after ``<BOS_TOKEN>``): see the module docstring."""
    tiles = cols * rows if cols * rows > 1 else 0  # one frame: no tile, only TILE_GLOBAL
    tags = [p for k in range(tiles) for p in range(2 + 19 * k, 5 + 19 * k)]
    global_tag = 2 + 19 * tiles
    return [0, 1, *tags, global_tag, global_tag + 17]


# ---- declarations and shapes --------------------------------------------------------------------------------------
def test_declared_paths_resolve_and_shapes(vlm):
    a = vlm.adapter
    assert type(a) is AyaVisionAdapter and adapter_class_for_config(vlm.model.config) is AyaVisionAdapter
    assert vlm.model.config.architectures == [a.model_class_name]
    paths = a.declared_paths()
    assert paths["projector"] is vlm.model.model.multi_modal_projector
    assert paths["vision_blocks"] is vlm.model.model.vision_tower.encoder.layers
    assert paths["text_layers"] is vlm.model.model.language_model.layers
    assert type(a.layer(0)).__name__ == "Cohere2DecoderLayer" and not hasattr(a.layer(0), "post_attention_layernorm")
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model, a.n_vision_layers) == (4, 4, 2, 32, 128, 2)
    assert (a.tile_size, a.patches_per_side, a.shuffle, a.tokens_per_side) == (64, 8, 2, 4)
    assert a.image_placeholder == vlm.processor.image_token and a.image_token_id == vlm.processor.image_token_id
    assert not a.transformer_lens_bridge

    batch = vlm.prepare([draw_scene(0), draw_scene(1, (448, 224))], [PROMPT, "the red object is a"])
    b, p = batch.inputs["input_ids"].shape
    out = vlm.run(batch, sites=["blocks.1.attn.hook_z", "blocks.0.attn.hook_pattern", "projector.hook_out",
                                "vision.blocks.1.hook_resid_post"])
    assert out.logits.shape == (b, p, vlm.model.config.text_config.vocab_size)
    assert out["blocks.1.attn.hook_z"].shape == (b, p, 4, 32)
    assert out["blocks.0.attn.hook_pattern"].shape == (b, 4, p, p)
    assert out["projector.hook_out"].shape == (5 + 3, 4, 4, 128)  # the frames of both images, each a 4x4 grid
    assert out["vision.blocks.1.hook_resid_post"].shape == (5 + 3, 64, 64)  # 8x8 patches, no CLS row


# ---- layout: tiles, global image, <|START_OF_IMG|> ... <|END_OF_IMG|> ----------------------------------------------
def test_square_image_layout_tokens_and_boxes(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    tok = vlm.adapter.tokenizer
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(2, 2)]
    for name, first in zip(_grid_names(2, 2), (5, 24, 43, 62, 79)):
        np.testing.assert_array_equal(ti.grid(name).positions, first + np.arange(16).reshape(4, 4))
    specials = [0, 1, 2, 3, 4, 21, 22, 23, 40, 41, 42, 59, 60, 61, 78, 95]
    assert _block_specials(2, 2) == specials
    np.testing.assert_array_equal(ti.positions("special"), specials)
    assert tok.convert_ids_to_tokens([int(i) for i in ti.input_ids[[0, 1, 2, 3, 4, 5, 78, 79, 95]]]) == [
        "<BOS_TOKEN>", "<|START_OF_IMG|>", "TILE", "_", "1", "<|IMG_PATCH|>", "TILE_GLOBAL", "<|IMG_PATCH|>",
        "<|END_OF_IMG|>"]
    assert ti.positions("text")[0] == 96 and ti.text == PROMPT
    assert len(ti.image_positions) == 80 and batch.inputs["pixel_values"].shape == (5, 3, 64, 64)
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
    ((320, 224), 16 * 320 / 192, 28.0, 80.0, 56.0),
])
def test_non_square_tiles_and_global_boxes(vlm, size, cell_w, cell_h, global_w, global_h):
    cols, rows = CANVAS[size]
    assert vlm.adapter.canvas(*size) == (cols, rows)
    batch = vlm.prepare(draw_scene(1, size), PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [(n, (4, 4)) for n in _grid_names(cols, rows)]
    assert batch.inputs["pixel_values"].shape[0] == cols * rows + 1  # the frames: tiles, then the global image
    frames = [5 + 19 * k + np.arange(16) for k in range(cols * rows)] + [5 + 19 * cols * rows - 2 + np.arange(16)]
    np.testing.assert_array_equal(ti.image_positions, np.concatenate(frames))
    np.testing.assert_array_equal(ti.positions("special"), _block_specials(cols, rows))
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


def test_an_image_of_one_tile_is_only_the_global_grid(vlm):
    """A 64 x 64 image's canvas is one tile: the processor adds no global image and writes no tile tag, the one frame
    (after ``TILE_GLOBAL``) is the whole image."""
    batch = vlm.prepare(draw_scene(2, (64, 64)), "the red object is a")
    ti = batch.index[0]
    assert vlm.adapter.canvas(64, 64) == (1, 1)
    assert [(g.name, g.shape) for g in ti.grids] == [("global", (4, 4))]
    np.testing.assert_array_equal(ti.grid("global").positions, 3 + np.arange(16).reshape(4, 4))
    np.testing.assert_array_equal(ti.positions("special"), [0, 1, 2, 19])
    np.testing.assert_allclose(ti.grid("global").boxes, expected_boxes(16.0 * np.arange(5), 16.0 * np.arange(5)))
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    assert out["projector.hook_out"].shape == (1, 4, 4, 128)
    torch.testing.assert_close(out["blocks.0.hook_resid_pre"][0, 3:19], out["projector.hook_out"].reshape(16, 128),
                               atol=0, rtol=0)


def test_chat_prompt_has_the_same_grids_and_one_bos(vlm):
    check_chat_grids(vlm, "global", "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|><|START_OF_IMG|>TILE_1",
                     "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    ids = vlm.prepare(draw_scene(0), PROMPT, chat=True).index[0].input_ids
    assert (ids == vlm.adapter.tokenizer.bos_token_id).sum() == 1  # the template's, not the tokenizer's as well


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_processor_and_model_must_agree_on_tokens_per_frame(vlm):
    """A processor whose ``patch_size`` (8 instead of 8 * 2) writes (64 / 8)^2 = 64 tokens a frame where the model
    makes 16 is refused by name."""
    check_prepare_refused(vlm, vlm.processor, "patch_size", 8, "a run of 64 image tokens")


def test_tiles_the_image_processor_would_not_cut_are_refused(vlm):
    """A processor call with other tile bounds than the image processor's (here max_patches=4: 320 x 224 becomes 2x2
    tiles, not 3x2) lays out frames the adapter cannot place: refused by name, not guessed."""
    image = draw_scene(1, (320, 224))
    inputs = vlm.processor(images=[image], text=[vlm.adapter.build_prompt(PROMPT, 1)], return_tensors="pt",
                           max_patches=4)
    assert inputs["pixel_values"].shape[0] == 5
    with pytest.raises(UnsupportedModelError, match="max_patches=6"):
        vlm.token_index(dict(inputs), [[image]])


def test_a_strategy_that_drops_a_patch_is_refused(vlm):
    assert vlm.model.config.vision_feature_select_strategy == "full"
    check_prepare_refused(vlm, vlm.model.config, "vision_feature_select_strategy", "default",
                          "vision_feature_select_strategy='default'")


# ---- what the language model receives -----------------------------------------------------------------------------
def test_projector_rows_land_where_the_index_says(vlm):
    """A left-padded batch: row 0 with two images (224 x 224, then 448 x 224), row 1 with a 320 x 224 one. Frame f's
    projector rows are the layer-0 input at the f-th grid's positions (frames in batch order), exactly, and the image
    tokens are as many as the rows the projector inserts."""
    batch = vlm.prepare([[draw_scene(0), draw_scene(1, (448, 224))], draw_scene(2, (320, 224))],
                        ["which image has the red square ?", PROMPT])
    out = vlm.run(batch, sites=["blocks.0.hook_resid_pre", "projector.hook_out"])
    frames = out["projector.hook_out"]
    assert frames.shape == (5 + 3 + 7, 4, 4, 128)
    frames = frames.reshape(15, 16, 128)
    assert int((batch.inputs["input_ids"] == vlm.adapter.image_token_id).sum()) == frames.shape[0] * 16
    grids = [(row, g) for row, ti in enumerate(batch.index) for g in ti.grids]
    assert [(g.name, g.image) for row, g in grids[:8]] == [
        *[(n, 0) for n in _grid_names(2, 2)], *[(n, 1) for n in _grid_names(2, 1)]]
    for frame, (row, g) in zip(frames, grids):
        torch.testing.assert_close(out["blocks.0.hook_resid_pre"][row, g.positions.reshape(-1)], frame, atol=0, rtol=0)
    assert batch.inputs["attention_mask"][1].min() == 0  # row 1 is the shorter, left-padded one


def test_pixel_shuffle_and_vision_rows_give_each_token_its_2x2_patches(vlm):
    """The model's own pixel shuffle of a frame's patch features: token ``(r, c)`` holds exactly the features of
    patches ``2r .. 2r + 1`` x ``2c .. 2c + 1`` (in some channel order), the footprint the boxes assume, and the rows
    ``vision_row_tokens`` assigns to a token are those patches."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    projector = vlm.model.model.multi_modal_projector
    with torch.no_grad():
        patches = vlm.model.model.vision_tower(pixel_values=batch.inputs["pixel_values"]).last_hidden_state
        shuffled = projector.pixel_shuffle(patches)
    assert patches.shape == (5, 64, 64) and shuffled.shape == (5, 4, 4, 4 * 64)
    grid = patches.reshape(5, 8, 8, -1)
    owner = vlm.adapter.vision_row_tokens(batch.inputs, 0)
    assert owner.shape == (5 * 64,) and np.array_equal(np.bincount(owner), np.full(80, 4))
    rows = patches.reshape(5 * 64, -1)
    for r in range(4):
        for c in range(4):
            own = grid[:, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].reshape(5, -1)
            torch.testing.assert_close(shuffled[:, r, c].sort(-1).values, own.sort(-1).values, atol=0, rtol=0)
            for f in range(5):
                mapped = rows[torch.as_tensor(owner == 16 * f + 4 * r + c)].reshape(-1)
                torch.testing.assert_close(mapped.sort().values, own[f].sort().values, atol=0, rtol=0)


@pytest.mark.parametrize(("size", "grid", "cell"), [
    ((224, 224), "row_1_col_2", (1, 2)),
    ((448, 224), "global", (1, 2)),
])
def test_painting_a_cell_changes_only_the_tokens_covering_it(vlm, size, grid, cell):
    """With the tower's attention silenced each token's features see only its own 2x2 patches, so painting the middle
    of a cell's box (30% margins: the bicubic resizes reach a few pixels past a box edge) changes exactly the
    positions ``positions_covering`` returns: the tile tokens under the paint and the global token above them."""
    p = painted_cell_changes(vlm, draw_scene(3, size), grid, cell)
    ti, expected = p.index, p.expected
    assert {ti.cell(int(q))[0] == "global" for q in expected} == {True, False}  # tile and global tokens alike
    assert int(ti.grid(grid).positions[cell]) in expected
    np.testing.assert_array_equal(p.changed, expected)


# ---- Cohere2: parallel block, sliding RoPE layers, a full layer without positions, unscaled logits ----------------
def _module_inputs(vlm, batch, modules):
    """The first positional input of each module in one forward."""
    seen = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, kwargs, k=k: seen.__setitem__(k, (
        args[0] if args else kwargs["hidden_states"]).detach()), with_kwargs=True) for k, m in modules.items()]
    try:
        vlm.logits(batch)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_attention_and_mlp_read_the_same_normed_stream_in_parallel(vlm):
    """Both branches read ``input_layernorm(resid_pre)``, so ablating every head of a layer leaves that layer's
    ``hook_mlp_out`` exactly as it was (in a sequential block the MLP would read the ablated heads' output) while
    its ``resid_post`` and the next layer's MLP output change."""
    a = vlm.adapter
    batch = vlm.prepare(draw_scene(0), PROMPT)
    layer = 1
    seen = _module_inputs(vlm, batch, {"attn": a.attention_module(layer), "mlp": a.mlp_module(layer)})
    resid_pre = vlm.capture(batch, f"blocks.{layer}.hook_resid_pre")[f"blocks.{layer}.hook_resid_pre"]
    with torch.no_grad():
        normed = a.layer(layer).input_layernorm(resid_pre)
    torch.testing.assert_close(seen["attn"], normed, atol=0, rtol=0)
    torch.testing.assert_close(seen["mlp"], normed, atol=0, rtol=0)
    sites = [f"blocks.{layer}.hook_mlp_out", f"blocks.{layer}.hook_resid_post", f"blocks.{layer + 1}.hook_mlp_out"]
    clean = vlm.run(batch, sites=sites)
    ablated = vlm.run(batch, sites=sites, interventions=[vb.AblateHeads(layer=layer, heads=list(range(a.n_heads)))])
    torch.testing.assert_close(ablated[sites[0]], clean[sites[0]], atol=0, rtol=0)
    assert (ablated[sites[1]] - clean[sites[1]]).abs().max() > 1e-2
    assert (ablated[sites[2]] - clean[sites[2]]).abs().max() > 1e-3


def test_sliding_layers_rotate_and_window_the_full_layer_has_no_positions(vlm):
    """Against HF's ``output_attentions``: a sliding layer's text query sees exactly the last 16 keys and its pattern
    is the softmax of RoPE-rotated queries and keys; the full layer sees every earlier key and its pattern is the
    softmax of the raw (unrotated) ones, which does not hold on the sliding layer."""
    a = vlm.adapter
    assert LAYER_TYPES[SLIDING] == "sliding_attention" and LAYER_TYPES[FULL] == "full_attention"
    assert vlm.model.config.text_config.layer_types == LAYER_TYPES
    batch = vlm.prepare(draw_scene(0), PROMPT)
    q = batch.index[0].last_position
    p = batch.seq_len
    assert p > 4 * SLIDING_WINDOW
    sites = [f"blocks.{l}.attn.hook_pattern" for l in (SLIDING, FULL)] + [
        f"blocks.{l}.hook_resid_pre" for l in (SLIDING, FULL)]
    out = vlm.run(batch, sites=sites)
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, use_cache=False, output_attentions=True)
    for layer in (SLIDING, FULL):
        torch.testing.assert_close(out[f"blocks.{layer}.attn.hook_pattern"], ref.attentions[layer], atol=1e-6, rtol=0)
    sliding, full = out[sites[0]][0], out[sites[1]][0]
    np.testing.assert_array_equal(np.flatnonzero((sliding[:, q] > 0).all(0).numpy()),
                                  np.arange(q - SLIDING_WINDOW + 1, q + 1))
    assert (full[:, q, : q + 1] > 0).all()

    def pattern(layer: int, rotate: bool) -> torch.Tensor:
        attn = a.attention_module(layer)
        with torch.no_grad():
            x = a.layer(layer).input_layernorm(out[f"blocks.{layer}.hook_resid_pre"])
            query = attn.q_proj(x).view(1, p, 4, 32).transpose(1, 2)
            key = attn.k_proj(x).view(1, p, 2, 32).transpose(1, 2).repeat_interleave(2, dim=1)
            if rotate:
                cos, sin = vlm.model.model.language_model.rotary_emb(x, torch.arange(p)[None])
                query, key = apply_rotary_pos_emb(query, key, cos, sin)
            scores = (query[:, :, q : q + 1] @ key.transpose(2, 3)[..., : q + 1]) * 32**-0.5
            if LAYER_TYPES[layer] == "sliding_attention":
                scores[..., : q + 1 - SLIDING_WINDOW] = float("-inf")
            return scores.softmax(-1)[0, :, 0]

    torch.testing.assert_close(pattern(FULL, rotate=False), full[:, q, : q + 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pattern(SLIDING, rotate=True), sliding[:, q, : q + 1], atol=1e-5, rtol=1e-5)
    assert (pattern(SLIDING, rotate=False) - sliding[:, q, : q + 1]).abs().max() > 1e-3


def test_logits_are_not_multiplied_by_the_text_configs_logit_scale(vlm):
    """``AyaVisionForConditionalGeneration`` decodes with ``lm_head(norm(x))`` alone, although its Cohere2 text config
    carries a logit scale (which ``Cohere2ForCausalLM`` would apply); vlmbind's unembedding matches the forward."""
    assert vlm.model.config.text_config.logit_scale == LOGIT_SCALE != 1
    assert vlm.adapter.final_logit_softcap() is None
    batch = vlm.prepare(draw_scene(0), PROMPT)
    last = f"blocks.{vlm.n_layers - 1}.hook_resid_post"
    run = vlm.run(batch, sites=[last])
    with torch.no_grad():
        plain = vlm.model.lm_head(vlm.adapter.final_norm_module()(run[last]))
    torch.testing.assert_close(run.logits, plain, atol=1e-6, rtol=1e-6)
    assert (run.logits - LOGIT_SCALE * plain).abs().max() > 0.1
    torch.testing.assert_close(unembed(vlm, run[last][0]), run.logits[0].float(), atol=1e-5, rtol=1e-5)


# ---- interventions ------------------------------------------------------------------------------------------------
def test_identity_interventions_at_image_and_tag_tokens_are_exact(vlm):
    batch = vlm.prepare(draw_scene(0, (448, 224)), PROMPT)
    ti, layer = batch.index[0], FULL
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
    """One head in every layer (sliding and full), in the default, packed and batched layouts."""
    task = check_exact_equals_naive(vlm, condition)
    if condition == "id_selection":
        assert task.positions.tolist() == [task.score_position]
    else:
        assert task.positions.max() < task.score_position - 1
    ti = task.batch.index[0]
    assert len(ti.grids) > 2 and task.positions.min() > ti.image_positions.max()  # tiles and a global image before

