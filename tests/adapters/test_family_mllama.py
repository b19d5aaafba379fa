"""Llama-3.2-Vision (``mllama``): the image enters through cross-attention layers only. The sites of those layers
(``cross_attn.hook_z`` / ``hook_pattern``) against HF's outputs and nnsight, their gated contributions to the residual
stream, head interventions on cross-attention heads against plain ``o_proj`` hooks, the named refusals (no image
tokens in the sequence), the key grids and their pixel boxes against the tower's own locality, appended tokens
against HF's generation, and exact == naive without prefix-cache reuse.

Hand computations (tiny processor: 56 px tiles of 4 x 4 patches of 14 px, at most 4 tiles; a tile's keys are its
CLS then its 16 patches, 17 a tile):

* 112 x 112 is upscaled by 1 into a 2 x 2 canvas of 112 x 112: an 8 x 8 grid of keys, cell ``(r, c)`` covering
  ``[14c, 14c + 14) x [14r, 14r + 14)``; key ``(r, c)`` is ``17 * tile + 1 + 4 * (r % 4) + c % 4`` with
  ``tile = 2 * (r // 4) + c // 4``.
* 200 x 60 (W x H): no canvas holds it at scale >= 1, the largest downscale is the 1 x 4 canvas (56 x 224 px, scale
  ``min(56 / 60, 224 / 200) = 0.933``); it is resized to 186 x 56 (``floor(200 * 56 / 60)``) and padded right to
  224: a 4 x 16 grid whose columns cover ``14 * 200 / 186`` original px each; columns 14 and 15 lie in the padding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import assert_exact_equals_naive, pushed
from helpers import PROMPT, draw_scene, get_tiny, silenced_vision_attention
from PIL import Image, ImageDraw
from transformers import DynamicCache

import vlmbind as vb
from vlmbind.adapters.capabilities import capability_cells
from vlmbind.adapters.mllama import MllamaAdapter
from vlmbind.analysis import tracking
from vlmbind.analysis.mediation import scene_task
from vlmbind.core.errors import NoImageTokensError, SiteError
from vlmbind.engine.batches import append_tokens
from vlmbind.engine.decoding import generate_ids, greedy_decode
from vlmbind.engine.interop import transformer_lens_architectures
from vlmbind.engine.patching import PatchTask, exact_diffs, naive_diffs, prefix_end

CROSS, SELF = (1, 3), (0, 2, 4)
KEYS_PER_TILE = 17


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    return get_tiny("tiny-mllama")


@pytest.fixture(scope="module")
def one(vlm):
    return vlm.prepare(draw_scene(0, (112, 112)), PROMPT)


def _chat(vlm, image=None) -> vb.Batch:
    """A chat prompt: the header tokens before ``<|image|>`` see no image."""
    return vlm.prepare(image or draw_scene(0, (112, 112)), PROMPT, chat=True)


# ---- declarations ---------------------------------------------------------------------------------------------------
def test_declared_paths_and_the_two_layer_kinds(vlm):
    a = vlm.adapter
    paths = a.declared_paths()
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model) == (5, 4, 2, 32, 128)
    assert a.cross_attention_layers() == list(CROSS)
    assert [a.layer_kind(l) for l in range(5)] == ["full_attention", "cross_attention"] * 2 + ["full_attention"]
    for layer in CROSS:
        assert a.attention_module(layer) is a.layer(layer).cross_attn
        assert a.o_proj_module(layer) is a.layer(layer).cross_attn.o_proj
        assert vlm.model.get_submodule(a.o_proj_path(layer)) is a.o_proj_module(layer)
        assert a.z_site(layer) == f"blocks.{layer}.cross_attn.hook_z"
    assert paths["cross_attention"] is a.layer(1).cross_attn and paths["attention"] is a.layer(0).self_attn
    # the tower: 2 local layers, then the gated global one
    assert a.n_vision_layers == 3 and a.vision_block(2) is vlm.model.model.vision_model.global_transformer.layers[0]
    assert not a.image_tokens_in_sequence and not a.projector_in_sequence_order and not a.reuses_prefix_cache()
    assert "MllamaForConditionalGeneration" not in transformer_lens_architectures()


def test_sites_of_each_layer_kind_and_their_named_errors(vlm):
    assert [s.layer for s in vlm.sites("blocks.*.cross_attn.hook_z")] == list(CROSS)
    assert [s.layer for s in vlm.sites("blocks.*.attn.hook_z")] == list(SELF)
    assert [s.name for s in vlm.sites("blocks.*attn.hook_pattern")] == [
        vlm.adapter.pattern_site(l) for l in range(5)]
    with pytest.raises(SiteError, match=r"layer 1 is a cross-attention layer.*'blocks.1.cross_attn.hook_z'"):
        vlm.sites("blocks.1.attn.hook_z")
    with pytest.raises(SiteError, match=r"layer 2 is not a cross-attention layer.*\[1, 3\]"):
        vlm.sites("blocks.2.cross_attn.hook_pattern")
    # a family without cross-attention says so
    with pytest.raises(SiteError, match="has no cross-attention layers"):
        get_tiny("tiny-llava").sites("blocks.0.cross_attn.hook_z")


def test_capability_cells_say_what_does_not_apply():
    cells = capability_cells(MllamaAdapter)
    assert cells["ablation"].startswith("yes") and "image_attention n/a because" in cells["ablation"]
    assert cells["TransformerLens"].startswith("no: ")
    assert "cross_attn.hook_z" in cells["capture"]
    assert cells["object tokens"].startswith("n/a because the image never enters")
    assert capability_cells(type(get_tiny("tiny-llava").adapter))["object tokens"] == "yes"


# ---- the cross-attention sites against HF and nnsight ---------------------------------------------------------------
def test_cross_attention_patterns_equal_hf_and_cover_the_image_keys(vlm, one):
    out = vlm.run(one, sites=["blocks.*attn.hook_pattern", "projector.hook_out"])
    keys = out["projector.hook_out"].shape[1:-1].numel()
    assert keys == 4 * KEYS_PER_TILE
    with torch.no_grad():
        ref = vlm.model(**one.inputs, output_attentions=True, use_cache=False).attentions
    p = one.seq_len
    for layer in range(5):
        pattern = out[vlm.adapter.pattern_site(layer)]
        assert pattern.shape == (1, 4, p, keys if layer in CROSS else p)
        torch.testing.assert_close(pattern, ref[layer], atol=1e-6, rtol=0)


def test_the_keys_are_the_projector_rows(vlm, one):
    """``projector.hook_out`` is what every cross-attention layer reads: its k_proj of those rows (k-normed) is the
    layer's cached keys."""
    a = vlm.adapter
    rows = vlm.capture(one, "projector.hook_out")["projector.hook_out"].reshape(1, -1, a.d_model)
    with torch.no_grad():
        cache = vlm.model(**one.inputs, past_key_values=DynamicCache(config=vlm.model.config),
                          use_cache=True).past_key_values
        attn = a.attention_module(CROSS[0])
        keys = attn.k_norm(attn.k_proj(rows).view(1, -1, a.n_kv_heads, a.d_head).transpose(1, 2))
    torch.testing.assert_close(cache.layers[CROSS[0]].keys, keys, atol=1e-6, rtol=0)
    # the cache hazard behind reuses_prefix_cache: a cross layer caches image keys, not the prompt's positions
    assert cache.layers[CROSS[0]].keys.shape[-2] == 4 * KEYS_PER_TILE != one.seq_len == cache.layers[0].keys.shape[-2]


def test_gated_outputs_decompose_the_residual_stream(vlm):
    """At a cross-attention layer what the attention and the MLP add passes through tanh gates, and the MLP's is
    zeroed on rows that see no image: hook_attn_out / hook_mlp_out are those gated contributions."""
    batch = _chat(vlm)
    sites = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", "blocks.*.hook_attn_out", "blocks.*.hook_mlp_out",
             "blocks.*attn.hook_z"]
    out = vlm.run(batch, sites=sites)
    for layer in range(5):
        total = out[f"blocks.{layer}.hook_resid_pre"] + out[f"blocks.{layer}.hook_attn_out"] + out[
            f"blocks.{layer}.hook_mlp_out"]
        torch.testing.assert_close(total, out[f"blocks.{layer}.hook_resid_post"], atol=1e-5, rtol=1e-5)
    before = int(np.flatnonzero(batch.inputs["input_ids"][0].numpy() == vlm.adapter.image_token_id)[0])
    assert before > 0
    for layer in CROSS:
        # rows before <|image|>: HF attends uniformly over the image keys there (z is not zero) but masks the MLP
        assert out[f"blocks.{layer}.hook_mlp_out"][0, :before].abs().max() == 0
        assert out[f"blocks.{layer}.hook_mlp_out"][0, before:].abs().amax(-1).min() > 0
        assert out[f"blocks.{layer}.cross_attn.hook_z"][0, :before].abs().max() > 0
        gate = vlm.adapter.layer(layer).cross_attn_attn_gate.tanh()
        ungated = vlm.adapter.o_proj_module(layer)(out[f"blocks.{layer}.cross_attn.hook_z"].flatten(2))
        torch.testing.assert_close(out[f"blocks.{layer}.hook_attn_out"], gate * ungated, atol=1e-6, rtol=0)


def test_cross_attention_z_equals_nnsight_o_proj_input(vlm, one):
    nn_model = vlm.nnsight()
    with torch.no_grad(), nn_model.trace(**one.inputs, use_cache=False):
        saved = vlm.nnsight_module(nn_model, vlm.adapter.o_proj_path(CROSS[1])).input.save()
    z = vlm.capture(one, f"blocks.{CROSS[1]}.cross_attn.hook_z")[f"blocks.{CROSS[1]}.cross_attn.hook_z"]
    torch.testing.assert_close(z, saved.reshape(z.shape), atol=0, rtol=0)


# ---- interventions on cross-attention heads ---------------------------------------------------------------------------
def _slice_hook(head: int, d: int, value):
    def hook(module, args):
        x = args[0].clone()
        x[..., head * d:(head + 1) * d] = value
        return (x, *args[1:])
    return hook


def test_cross_head_edits_equal_a_plain_hook_on_its_o_proj(vlm, one):
    layer, head = CROSS[0], 2
    site = f"blocks.{layer}.cross_attn.hook_z"
    clean = vlm.run(one, sites=site)
    z_other = vlm.capture(vlm.prepare(draw_scene(5, (112, 112)), PROMPT), site)[site]
    positions = list(range(z_other.shape[1]))
    cases = [(vb.PatchHeads(layer=layer, heads=[head], positions=positions, values=z_other[:, :, [head]]),
              z_other[:, :, head]),
             (vb.AblateHeads(layer=layer, heads=[head], mode="zero"), 0.0)]
    for intervention, value in cases:
        ours = vlm.run(one, sites=site, interventions=[intervention])
        handle = vlm.adapter.o_proj_module(layer).register_forward_pre_hook(_slice_hook(head, 32, value))
        try:
            with torch.no_grad():
                theirs = vlm.model(**one.inputs, use_cache=False).logits
        finally:
            handle.remove()
        torch.testing.assert_close(ours.logits, theirs, atol=0, rtol=0)
        assert (ours.logits - clean.logits).abs().max() > 1e-3, intervention
        torch.testing.assert_close(ours[site][:, :, [0, 1, 3]], clean[site][:, :, [0, 1, 3]], atol=0, rtol=0)


def test_identity_interventions_on_cross_heads_are_exact(vlm, one):
    clean = vlm.logits(one)
    for layer in (CROSS[0], SELF[1]):
        site = vlm.adapter.z_site(layer)
        z = vlm.capture(one, site)[site]
        same = vb.PatchHeads(layer=layer, heads=[0, 1, 2, 3], positions=list(range(one.seq_len)), values=z)
        means = vlm.head_means(one, layer, [0, 3], per_position=True)
        mean_self = vb.AblateHeads(layer=layer, heads=[0, 3], mode="mean", means=means)
        for intervention in (same, mean_self):
            torch.testing.assert_close(vlm.logits(one, [intervention]), clean, atol=0, rtol=0)


def test_image_attention_and_image_token_captures_are_refused_by_name(vlm, one):
    assert one.index[0].image_positions.size == 0 and one.index[0].grids == []
    for layer in (SELF[0], CROSS[0]):
        with pytest.raises(NoImageTokensError, match=r"cross-attention layers \[1, 3\].*AblateHeads\(mode='zero'\)"):
            vlm.logits(one, [vb.ZeroImageAttention(layer=layer, heads=[0])])
    with pytest.raises(NoImageTokensError, match="tokens='last'"):
        vb.capture(vlm, list(vb.stimuli.scene_description(1, 0, n_objects=3)), "blocks.2.hook_resid_post")
    assert vlm.active == []


def test_zero_ablating_every_cross_head_removes_the_image(vlm):
    """Every key of a cross-attention head is an image key, and the cross layers' MLPs read only what those heads
    wrote on top of the text: with every cross head zeroed, two images give the same logits."""
    heads = [(l, h) for l in CROSS for h in range(4)]
    a, b = (vlm.prepare(draw_scene(s, (112, 112)), PROMPT) for s in (0, 5))
    assert (vlm.logits(a) - vlm.logits(b)).abs().max() > 1e-3
    with vlm.ablate(heads, mode="zero"):
        torch.testing.assert_close(vlm.logits(a), vlm.logits(b), atol=1e-6, rtol=0)


# ---- key grids and boxes ---------------------------------------------------------------------------------------------
def test_square_image_key_grid(vlm):
    grid, = vlm.prepare(Image.new("RGB", (112, 112), "white"), PROMPT).index[0].key_grids
    assert grid.shape == (8, 8) and grid.name == "keys"
    r, c = np.divmod(np.arange(64), 8)
    tile = 2 * (r // 4) + c // 4
    np.testing.assert_array_equal(grid.positions.ravel(), KEYS_PER_TILE * tile + 1 + 4 * (r % 4) + c % 4)
    np.testing.assert_array_equal(grid.boxes[2, 5], [70, 28, 84, 42])
    assert 0 not in grid.positions and KEYS_PER_TILE not in grid.positions  # CLS keys are in no cell


def test_wide_image_is_downscaled_into_a_row_of_tiles_and_padded(vlm):
    batch = vlm.prepare(Image.new("RGB", (200, 60), "white"), PROMPT)
    grid, = batch.index[0].key_grids
    assert int(batch.inputs["aspect_ratio_ids"][0, 0]) == 4  # the 1 x 4 layout
    assert grid.shape == (4, 16)
    width = 14 * 200 / 186
    np.testing.assert_allclose(grid.boxes[1, 3], [3 * width, 14 * 60 / 56, 4 * width, 28 * 60 / 56])
    np.testing.assert_allclose(grid.boxes[0, 13], [13 * width, 0, 200, 15])
    assert (grid.boxes[:, 14:, 0] == 200).all() and (grid.boxes[:, 14:, 2] == 200).all()  # the padding
    np.testing.assert_array_equal(grid.positions[0, [0, 4, 15]], [1, 18, 3 * KEYS_PER_TILE + 4])


@pytest.mark.parametrize("size, cell", [((112, 112), (5, 2)), ((200, 60), (2, 9))])
def test_painting_a_cell_changes_only_the_keys_covering_it(vlm, size, cell):
    """With the tower's attention silenced (local and global layers), painting the middle of a cell changes the
    projector row of that key only."""
    image = draw_scene(3, size) if min(size) > 60 else Image.new("RGB", size, (230, 230, 230))
    index = vlm.prepare(image, PROMPT).index[0]
    grid, = index.key_grids
    x0, y0, x1, y1 = grid.boxes[cell]
    box = (round(x0 + 0.35 * (x1 - x0)), round(y0 + 0.35 * (y1 - y0)), round(x1 - 0.35 * (x1 - x0)),
           round(y1 - 0.35 * (y1 - y0)))
    painted = image.copy()
    ImageDraw.Draw(painted).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=(255, 0, 255))
    with silenced_vision_attention(vlm):
        rows = [vlm.capture(vlm.prepare(im, PROMPT), "projector.hook_out")["projector.hook_out"].reshape(-1, 128)
                for im in (image, painted)]
    changed = np.flatnonzero((rows[0] - rows[1]).abs().amax(-1).numpy() > 1e-6)
    np.testing.assert_array_equal(changed, index.keys_covering(box))
    assert changed.tolist() == [int(grid.positions[cell])]


# ---- appended tokens and generation ----------------------------------------------------------------------------------
def test_appended_tokens_repeat_the_last_cross_attention_mask_row(vlm, one):
    inputs = append_tokens(vlm.adapter, one.inputs, torch.tensor([[10, 11]]))
    mask = inputs["cross_attention_mask"]
    assert mask.shape[1] == one.seq_len + 2
    assert torch.equal(mask[:, -2:], one.inputs["cross_attention_mask"][:, -1:].expand(-1, 2, -1, -1))


def test_greedy_decode_by_full_forwards_equals_generate(vlm):
    """Full forwards on appended tokens equal HF's cached generation, which reads the image keys from the cache."""
    batch = _chat(vlm)
    ids = generate_ids(vlm, batch, 3)[0, batch.seq_len:]
    assert greedy_decode(vlm, batch, max_new_tokens=3) == [vlm.adapter.tokenizer.decode(ids, skip_special_tokens=True)]


# ---- exact == naive, without prefix-cache reuse ------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["last_token", "mid_prompt_span"])
def test_exact_equals_naive_on_both_layer_kinds(vlm, one, where):
    last = one.index[0].last_position
    positions = np.array([last] if where == "last_token" else [last - 5, last - 4, last - 3])
    z = vlm.capture(one, "blocks.*attn.hook_z")
    values = {l: z[vlm.adapter.z_site(l)][0, positions] for l in range(5)}
    logits = vlm.logits(one, at=[last])[0, 0]
    a, a_star = (int(t) for t in logits.topk(2).indices)
    task = pushed(PatchTask(batch=one, positions=positions, values=values, score_position=last, a=a, a_star=a_star))
    assert prefix_end(vlm, one, vlm.model_inputs(one), int(positions.min())) == 0
    heads = [(0, 1), (1, 2), (2, 0), (3, 3), (4, 1)]
    assert_exact_equals_naive(vlm, task, heads, [{"layout": "auto"}, {"layout": "batched"}])
    clean, naive = naive_diffs(vlm, task, [(1, 0), (3, 1)])
    assert np.abs(naive - clean).min() > 1e-4  # cross-attention heads matter on their own
    c, exact = exact_diffs(vlm, task, [(1, 0), (3, 1)])
    np.testing.assert_allclose(exact - c, naive - clean, atol=1e-6)


# ---- the UI ------------------------------------------------------------------------------------------------------------
def test_ui_overlays_a_cross_attention_head_on_the_key_grid_and_ablates_it(vlm):
    from vlmbind.app.ui import UIController

    ctl = UIController(vlm)
    state = ctl.generate_stimulus(0)[0]
    figure = ctl.overlay(state, "1.2")
    assert "keys grid" in figure.layout.title.text
    assert "attends to no image token" in ctl.overlay(state, "0.1").layout.title.text
    clean = ctl.answer(state, [], "ablate")
    ablated = ctl.answer(state, ["1.2", "3.0"], "ablate")
    assert clean != ablated


@pytest.mark.parametrize("query", ["emit", "self"])
def test_tracking_maps_are_the_cross_attention_over_the_keys(vlm, query):
    """The maps track reads: each generated token's cross-attention over the image keys, equal to HF's
    output_attentions of a full forward on the extended prompt; zero on the self-attention layers."""
    batch = vlm.prepare(draw_scene(1, (112, 112)), PROMPT)
    (ids, maps), = tracking._trace(vlm, batch, 4, query)
    assert len(ids) >= 2 and maps.shape == (len(ids), 5, 4, 4 * KEYS_PER_TILE)
    full = vlm.extend(batch, ids)
    with torch.no_grad():
        out = vlm.model(**vlm.model_inputs(full), output_attentions=True, use_cache=False)
    p = batch.seq_len
    for k in range(len(ids)):
        q = p - 1 + k if query == "emit" else p + k
        for layer in CROSS:
            np.testing.assert_allclose(maps[k, layer], out.attentions[layer][0, :, q].numpy(), rtol=1e-4, atol=1e-6)
    assert (maps[:, list(SELF)] == 0).all()


def test_attention_on_the_pointed_key_tracks_the_point(vlm, monkeypatch):
    """A stand-in trace whose cross-attention peaks on the key under each written point: centroid RMSE 0 at the
    cross-attention layers, none (empty maps) at the self-attention ones."""
    tok = vlm.adapter.tokenizer
    texts = [" (1, 2)", " (3, 0)"]
    split = [tok(t, add_special_tokens=False)["input_ids"] for t in [*texts, " 2"]]
    ids, owners = [t for s in split for t in s], [j for j, s in enumerate(split) for _ in s]

    def fake(vlm_, batch, max_new_tokens, query):
        rows = []
        for r in range(len(batch)):
            grid = batch.index[r].key_grids[0]  # 8 x 8 keys on a 4 x 4 canvas: 2 x 2 keys a canvas cell
            maps = np.full((len(ids), 5, 4, 4 * KEYS_PER_TILE), 1e-4, dtype=np.float32)
            maps[:, list(SELF)] = 0
            for k, j in enumerate(owners):
                x, y = (1, 2) if j == 0 else (3, 0) if j == 1 else (0, 0)
                for layer in CROSS:
                    maps[k, layer][:, grid.positions[2 * y:2 * y + 2, 2 * x:2 * x + 2].ravel()] = 0.5
            rows.append((ids, maps))
        return rows

    monkeypatch.setattr(tracking, "_trace", fake)
    res = tracking.track(vlm, vb.stimuli.counting(2, 0, objects=2, regime="p2a",
                                                  canvas=vb.stimuli.Canvas(image_size=112, grid=4)), point_frame="canvas")
    assert res.n_points == 4 and res.grid == "keys"
    np.testing.assert_allclose(res.rmse_mean[list(CROSS)], 0.0, atol=1e-12)
    assert np.isnan(res.rmse_mean[list(SELF)]).all()


@pytest.mark.parametrize("condition", ["id_retrieval", "id_selection", "feature_retrieval"])
def test_every_vsm_condition_patches_text_positions_and_reaches_cross_heads(vlm, condition):
    """VSM's counterfactual patches sit on text positions (an object's words or the last token), which this family
    has: every condition applies, and a cross-attention head (the image's only way in) changes the score."""
    pair = vb.stimuli.scene_pairs(1, condition, 0, n_objects=3)[0]
    task = pushed(scene_task(vlm, pair, range(vlm.n_layers)))
    roles = task.batch.index[0].roles[task.positions]
    assert (roles == "text").all()
    clean, naive = naive_diffs(vlm, task, [(1, 0), (3, 2)])
    assert np.abs(naive - clean).max() > 1e-4
