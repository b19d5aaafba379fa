"""Mistral3 (Pixtral tower): the variable-size grid of ``[IMG]`` tokens with ``[IMG_BREAK]`` / ``[IMG_END]`` between
rows, its boxes, the vision-row map through the patch merger, what the language model receives, painting locality,
exact == naive patching, nnsight and TransformerLens.

Hand computations (tiny processor: ``longest_edge = 224``, 14 px patches, 2x2 merge, so sides are rounded up to
multiples of 28):

* 224 x 224 is kept: 16 x 16 patches, an 8 x 8 token grid, token ``(r, c)`` covering ``[28c, 28c + 28) x [28r, ...)``.
  The sequence is ``<s>``, then 8 rows of 8 ``[IMG]`` each followed by ``[IMG_BREAK]`` (the last by ``[IMG_END]``):
  token ``(r, c)`` at position ``1 + 9r + c``, 72 image-block tokens.
* 320 x 224 (W x H): the longest edge is over 224, ``ratio = 320 / 224``, so ``floor(224 / ratio) = 156`` rows, rounded
  up to 168, and 224 columns: a 6 x 8 grid, a token covering ``28 * 320 / 224 = 40`` px across and
  ``28 * 224 / 168 = 37.33`` px down.
* 448 x 300: ``ratio = 2``, ``150 -> 168`` rows and 224 columns: 6 x 8 again, ``56`` px across and ``50`` px down.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import check_exact_equals_naive, painted_cell_changes
from helpers import PROMPT, draw_scene, expected_boxes, get_tiny

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config

NAME = "tiny-mistral3"
TWO_PROMPTS = [PROMPT, "the red object is a"]


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    return get_tiny(NAME)


def _token_id(vlm: vb.VLM, token: str) -> int:
    return int(vlm.adapter.tokenizer.convert_tokens_to_ids(token))


# ---- declarations -------------------------------------------------------------------------------------------------
def test_declared_paths_and_shapes(vlm):
    a = vlm.adapter
    assert adapter_class_for_config(vlm.model.config) is type(a)
    paths = a.declared_paths()
    assert paths["projector"] is vlm.model.model.multi_modal_projector
    assert paths["vision_blocks"] is vlm.model.model.vision_tower.transformer.layers and a.n_vision_layers == 2
    assert type(a.vision_block(0).attention).__name__ == "PixtralAttention"
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model) == (4, 4, 2, 32, 128)
    assert a.token_side == 28 and a.transformer_lens_bridge


# ---- the token grid -----------------------------------------------------------------------------------------------
def test_square_grid_with_breaks_and_end(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    assert [(g.name, g.shape) for g in ti.grids] == [("image", (8, 8))]
    block = 1 + np.arange(8 * 9).reshape(8, 9)  # after <s>: 8 rows of 8 [IMG] and one closing token
    np.testing.assert_array_equal(ti.grid().positions, block[:, :8])
    closing = ti.input_ids[block[:, 8]]
    assert (closing[:-1] == _token_id(vlm, "[IMG_BREAK]")).all() and closing[-1] == _token_id(vlm, "[IMG_END]")
    # the break and end tokens are special and in no cell; the prompt follows the image block
    assert (ti.roles[block[:, 8]] == "special").all()
    assert all(ti.cell(int(p)) is None and ti.box(int(p)) is None for p in block[:, 8])
    assert ti.roles[0] == "special" and (ti.roles[73:] == "text").all()
    edges = 28.0 * np.arange(9)
    np.testing.assert_allclose(ti.grid().boxes, expected_boxes(edges, edges))
    assert vlm.adapter.resized_size(batch.inputs, 0) == (224, 224)


def test_chat_prompt_has_one_bos_and_the_same_grid(vlm):
    """The chat template writes ``<s>`` itself, so chat texts are tokenized without the tokenizer's BOS."""
    ti = vlm.prepare(draw_scene(0), PROMPT, chat=True).index[0]
    assert ti.input_ids[:2].tolist() == [_token_id(vlm, "<s>"), _token_id(vlm, "[INST]")]
    assert (ti.input_ids == _token_id(vlm, "<s>")).sum() == 1
    assert ti.grid().shape == (8, 8) and ti.input_ids[-1] == _token_id(vlm, "[/INST]")


@pytest.mark.parametrize(("size", "resized", "cell_w", "cell_h"), [
    ((320, 224), (224, 168), 40.0, 28 * 224 / 168),
    ((448, 300), (224, 168), 56.0, 50.0),
    ((224, 320), (168, 224), 28 * 224 / 168, 40.0),
])
def test_non_square_images_are_shrunk_and_rounded_up_to_28(vlm, size, resized, cell_w, cell_h):
    batch = vlm.prepare(draw_scene(1, size), PROMPT)
    ti = batch.index[0]
    rows, cols = resized[1] // 28, resized[0] // 28
    assert ti.grid().shape == (rows, cols)
    assert batch.inputs["image_sizes"][0].tolist() == [resized[1], resized[0]]
    assert vlm.adapter.resized_size(batch.inputs, 0) == resized
    np.testing.assert_allclose(ti.grid().boxes, expected_boxes(cell_w * np.arange(cols + 1),
                                                                cell_h * np.arange(rows + 1)))
    assert (ti.roles == "special").sum() == 1 + rows  # <s>, one break per row but the last, [IMG_END]
    assert ti.roles[ti.grid().positions[-1, -1] + 1] == "special"


def test_vision_rows_merge_into_the_projector_rows(vlm):
    """Regrouping the last block's rows by ``vision_row_tokens`` (each token's 2x2 patches in raster order) and
    applying the projector by hand (norm, concatenation channel-major as ``unfold`` does, merging layer, MLP) gives
    ``projector.hook_out``."""
    batch = vlm.prepare(draw_scene(2, (320, 224)), PROMPT)
    last = f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post"
    cache = vlm.run(batch, sites=[last, "projector.hook_out"]).cache
    rows = cache[last].reshape(-1, cache[last].shape[-1])
    owner = vlm.adapter.vision_row_tokens(batch.inputs, 0)
    assert len(owner) == rows.shape[0] == 12 * 16
    np.testing.assert_array_equal(np.bincount(owner), np.full(48, 4))
    assert owner[:4].tolist() == [0, 0, 1, 1] and owner[16:18].tolist() == [0, 0]  # patch row 1 joins tokens 0, 1
    proj = vlm.model.model.multi_modal_projector
    with torch.no_grad():
        grouped = proj.norm(rows)[torch.as_tensor(np.argsort(owner, kind="stable"))].reshape(48, 4, -1)
        merged = proj.patch_merger.merging_layer(grouped.transpose(1, 2).reshape(48, -1))
        out = proj.linear_2(proj.act(proj.linear_1(merged)))
    torch.testing.assert_close(out, cache["projector.hook_out"], atol=1e-5, rtol=1e-5)


# ---- what the language model receives -----------------------------------------------------------------------------
def test_features_land_where_the_index_says(vlm):
    """The projector's rows, in order, are the layer-0 input at the grid's positions, image after image; the break
    and end tokens keep their own embeddings."""
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    out = vlm.run(batch, sites=["projector.hook_out", "blocks.0.hook_resid_pre"])
    features, resid = out["projector.hook_out"], out["blocks.0.hook_resid_pre"]
    assert features.shape == (64 + 48, vlm.adapter.d_model)
    cursor = 0
    embed = vlm.model.get_input_embeddings()
    for row, ti in enumerate(batch.index):
        cells = ti.grid().positions.reshape(-1)
        torch.testing.assert_close(resid[row, cells], features[cursor : cursor + len(cells)], atol=0, rtol=0)
        cursor += len(cells)
        special = torch.as_tensor(ti.positions("special"))
        with torch.no_grad():
            torch.testing.assert_close(resid[row, special], embed(batch.inputs["input_ids"][row, special]),
                                       atol=0, rtol=0)


@pytest.mark.parametrize(("size", "cell"), [((224, 224), (2, 3)), ((320, 224), (4, 6))])
def test_painting_a_cell_changes_only_the_tokens_covering_it(vlm, size, cell):
    """With the tower's attention silenced each token's features see only its own 2x2 patches, so painting the
    middle of a cell's box (30% margins: resampling reaches a few pixels past a box edge) changes exactly the
    positions ``positions_covering`` returns."""
    p = painted_cell_changes(vlm, draw_scene(3, size), None, cell)
    assert len(p.expected) == 1 and p.expected[0] == p.index.grid().positions[cell]
    np.testing.assert_array_equal(p.changed, p.expected)


# ---- interventions ------------------------------------------------------------------------------------------------
def test_identity_interventions_are_exact(vlm):
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    clean = vlm.logits(batch)
    heads = list(range(vlm.n_heads))
    z = vlm.capture(batch, "blocks.2.attn.hook_z")["blocks.2.attn.hook_z"]
    self_patch = vb.PatchHeads(layer=2, heads=heads, positions=list(range(batch.seq_len)), values=z)
    torch.testing.assert_close(vlm.logits(batch, [self_patch]), clean, atol=0, rtol=0)
    zero_alpha = vb.AddToHeads(layer=1, heads=heads, positions=[-1], vector=torch.ones(vlm.adapter.d_head), alpha=0.0)
    torch.testing.assert_close(vlm.logits(batch, [zero_alpha]), clean, atol=0, rtol=0)


@pytest.mark.parametrize("condition", [
    "id_selection",  # the last token
    "id_retrieval",  # a mid-prompt span: the second-to-last object's name
])
def test_exact_equals_naive_across_layouts(vlm, condition):
    task = check_exact_equals_naive(vlm, condition)
    assert len(task.positions) == (1 if condition == "id_selection" else 2)


# ---- nnsight and TransformerLens ----------------------------------------------------------------------------------
def test_nnsight_sees_the_same_projector_rows_and_residual_stream(vlm):
    a = vlm.adapter
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    nn_model = vlm.nnsight()
    with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
        # in execution order, as nnsight requires: the projector runs before the text layers
        rows = vlm.nnsight_module(nn_model, a.projector).output.save()
        pre = vlm.nnsight_module(nn_model, f"{a.text_layers}.1").input.save()
    out = vlm.run(batch, sites=["projector.hook_out", "blocks.1.hook_resid_pre"])
    torch.testing.assert_close(out["projector.hook_out"], rows, atol=0, rtol=0)
    torch.testing.assert_close(out["blocks.1.hook_resid_pre"], pre, atol=0, rtol=0)


def test_transformer_lens_bridge_agrees(vlm):
    """Same logits as HF on a left-padded batch of two image sizes; vlmbind's sites equal the bridge's hooks of the
    same name and the projector equals the bridge's ``vision_projector``; a head ablation agrees."""
    from vlmbind.engine.interop import bridge_inputs, transformer_lens_bridge

    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    assert batch.inputs["attention_mask"].min() == 0, "the batch should be left-padded"
    bridge = transformer_lens_bridge(vlm)
    ids, kwargs = bridge_inputs(vlm, batch)
    sites = [f"blocks.{l}.{h}" for l in range(vlm.n_layers)
             for h in ("attn.hook_z", "attn.hook_pattern", "hook_resid_pre", "hook_resid_post", "hook_mlp_out")]
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=sites + ["vision_projector.hook_out"], **kwargs)
    torch.testing.assert_close(logits, vlm.logits(batch), atol=1e-5, rtol=0)
    ours = vlm.run(batch, sites=sites + ["projector.hook_out"]).cache
    for name in sites:
        torch.testing.assert_close(ours[name], cache[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(ours["projector.hook_out"], cache["vision_projector.hook_out"], atol=1e-5, rtol=0)
    layer, head = 1, 2

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    ablated = vlm.logits(batch, interventions=[vb.AblateHeads(layer=layer, heads=[head], mode="zero")])
    with torch.no_grad():
        theirs = bridge.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)], **kwargs)
    torch.testing.assert_close(ablated, theirs, atol=1e-5, rtol=0)
    assert (ablated - logits).abs().max() > 1e-3
