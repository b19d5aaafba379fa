"""Gemma-4 specifics: the aspect-kept pooled grid and its boxes, the token layout and roles, what the projector
inserts, the bidirectional image block on sliding layers only, sliding windows, the full layers' shared key / value
head, the layer scalars, wider full-attention heads and MoE (the 26B-A4B's shape), exact == naive patching, and
the refusals (path patching, the E2B / E4B configs).

Hand computations (tiny processor: 16 px patches pooled 2 x 2, so resized sides are multiples of 32 px, and a budget
of 70 soft tokens = 280 patches = 280 * 16**2 = 71680 px):

* 224 x 224: ``f = sqrt(71680 / 224**2) = 1.195``, ``224 f = 267.7`` floors to 8 * 32 = 256: 256 x 256 px, an
  8 x 8 grid; a token covers 32 resized px = ``32 * 224 / 256 = 28`` original px, so cell (r, c) is
  ``[28c, 28c + 28) x [28r, 28r + 28)``.
* 320 x 160 (W x H): ``f = sqrt(71680 / 51200) = 1.183``, ``320 f = 378.6`` floors to 11 * 32 = 352 and
  ``160 f = 189.3`` to 5 * 32 = 160: 352 x 160 px, 5 rows x 11 columns; a token covers ``32 * 320 / 352 = 320 / 11``
  original px across and ``32 * 160 / 160 = 32`` down.
* A raw prompt is ``<bos>`` + ``<|image|>`` + text; the processor expands ``<|image|>`` into ``<|image>``, the
  image's soft tokens and ``<image|>``: for one 224 px image ``<bos>`` at 0, ``<|image>`` at 1, the 64 soft tokens
  at 2..65, ``<image|>`` at 66, the text from 67. The two images above give 64 + 55 = 119 projector rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from family_checks import assert_exact_equals_naive, check_chat_grids, check_exact_equals_naive, painted_cell_changes
from helpers import PROMPT, draw_scene, expected_boxes
from PIL import Image
from transformers import Gemma4Config

import vlmbind as vb
from vlmbind.adapters.gemma4 import Gemma4Adapter
from vlmbind.analysis.mediation import scene_task
from vlmbind.core.errors import InputError, UnsupportedModelError
from vlmbind.engine.paths import PathTask, all_edges, naive_path_diffs
from vlmbind.tiny.gemma4 import SLIDING_WINDOW, build_gemma4

SLIDING, FULL = 0, 1


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    # a private instance: HF's output_attentions installs permanent capture hooks, which would leak into the
    # session-wide tiny model that the hook-hygiene tests count hooks on
    return vb.load("tiny-gemma4")


def _ids(vlm: vb.VLM) -> dict[str, int]:
    tok = vlm.adapter.tokenizer
    return {t: tok.convert_tokens_to_ids(t) for t in ("<bos>", "<|image>", "<image|>", "<|image|>")}


# ---- grids and boxes ----------------------------------------------------------------------------------------------
def test_square_image_grid_and_boxes(vlm):
    ti = vlm.prepare(Image.new("RGB", (224, 224), "white"), PROMPT).index[0]
    grid = ti.grid("image", 0)
    assert len(ti.grids) == 1 and grid.shape == (8, 8)
    edges = np.arange(9) * 28.0
    np.testing.assert_allclose(grid.boxes, expected_boxes(edges, edges))
    assert ti.cell(int(grid.positions[2, 5])) == ("image", 0, 2, 5)
    np.testing.assert_allclose(grid.boxes[2, 5], [140, 56, 168, 84])
    np.testing.assert_array_equal(ti.positions_covering((145, 60, 160, 80)), [grid.positions[2, 5]])


def test_non_square_image_keeps_its_aspect(vlm):
    ti = vlm.prepare(Image.new("RGB", (320, 160), "white"), PROMPT).index[0]
    grid = ti.grid()
    assert grid.shape == (5, 11)  # 352 x 160 resized px, 32 px a token
    np.testing.assert_allclose(grid.boxes, expected_boxes(np.arange(12) * 320 / 11, np.arange(6) * 32.0))
    np.testing.assert_allclose(grid.boxes[4, 10], [3200 / 11, 128, 320, 160])
    assert ti.image_sizes == [(320, 160)]


def test_painting_a_cell_changes_only_the_tokens_that_cover_it(vlm):
    # a non-square image, so the per-axis scales (1.1 across, 1 down) are both exercised
    p = painted_cell_changes(vlm, draw_scene(3, (320, 160)), None, (2, 6))
    assert len(p.expected) == 1 and p.position in p.expected
    np.testing.assert_array_equal(p.changed, p.expected)


# ---- tokens -------------------------------------------------------------------------------------------------------
def test_token_layout_and_roles(vlm):
    batch = vlm.prepare(draw_scene(0), "what colour is the circle ?")
    ti, ids = batch.index[0], _ids(vlm)
    assert ti.input_ids[:2].tolist() == [ids["<bos>"], ids["<|image>"]] and ti.input_ids[66] == ids["<image|>"]
    np.testing.assert_array_equal(ti.image_positions, np.arange(2, 66))
    np.testing.assert_array_equal(ti.grid().positions.reshape(-1), np.arange(2, 66))  # raster order
    assert (ti.roles[[0, 1, 66]] == "special").all() and ti.cell(1) is None and ti.cell(66) is None
    assert (ti.roles[67:] == "text").all() and ti.text.strip() == "what colour is the circle ?"


def test_image_tokens_are_the_features_the_projector_inserts(vlm):
    batch = vlm.prepare([draw_scene(0), Image.new("RGB", (320, 160), "white")], [PROMPT, "is"])
    assert [len(ti.image_positions) for ti in batch.index] == [64, 55]
    # padded to the budget: 70 tokens * 4 patches of 16 * 16 * 3 values
    assert tuple(batch.inputs["pixel_values"].shape) == (2, 280, 768)
    out = vlm.run(batch, sites=["projector.hook_out", "blocks.0.hook_resid_pre"])
    features = out["projector.hook_out"]  # the tower drops the padding: one row per image token of the batch
    assert tuple(features.shape) == (119, vlm.adapter.d_model)
    received = torch.cat([out["blocks.0.hook_resid_pre"][r, torch.as_tensor(ti.image_positions)]
                          for r, ti in enumerate(batch.index)])
    torch.testing.assert_close(received, features, atol=1e-6, rtol=0)
    types = batch.inputs["mm_token_type_ids"]
    np.testing.assert_array_equal(types.numpy() == 1, batch.inputs["input_ids"].numpy() == vlm.adapter.image_token_id)


def test_two_images_of_different_shapes_in_one_prompt(vlm):
    rows = [[draw_scene(0), Image.new("RGB", (320, 160), "white")], [draw_scene(2)]]
    batch = vlm.prepare(rows, ["compare the two images", "is"])
    first, second = batch.index
    assert [(g.image, g.shape) for g in first.grids] == [(0, (8, 8)), (1, (5, 11))]
    assert [(g.image, g.shape) for g in second.grids] == [(0, (8, 8))]
    # the second image's block starts after the first's <image|> and its own <|image>
    assert first.grids[1].positions.min() == first.grids[0].positions.max() + 3
    np.testing.assert_allclose(first.grids[1].boxes[4, 10], [3200 / 11, 128, 320, 160])
    alone = vlm.logits(vlm.prepare(rows[1], "is"))
    torch.testing.assert_close(vlm.logits(batch)[1, -1], alone[0, -1], atol=1e-4, rtol=1e-4)


def test_image_tokens_that_make_no_grid_are_refused(vlm):
    inputs = dict(vlm.processor(images=[[draw_scene(0)]], text=["<|image|>is"], return_tensors="pt"))
    roles = vlm.adapter.roles(inputs["input_ids"][0].numpy(), inputs["attention_mask"][0].numpy())
    assert len(vlm.adapter.image_grids(inputs, 0, roles, [0], [(224, 224)])[0].positions.reshape(-1)) == 64
    roles[65] = "text"  # one soft token short of the resized image's 8 x 8 (a truncated prompt)
    with pytest.raises(InputError, match="63 image tokens do not make one pooled grid"):
        vlm.adapter.image_grids(inputs, 0, roles, [0], [(224, 224)])


def test_chat_template_keeps_the_grid(vlm):
    check_chat_grids(vlm, "image", "<bos><|turn>user\n<|image>", "<|turn>model\n")
    chat = vlm.prepare(draw_scene(0), PROMPT, chat=True).index[0]
    assert (chat.input_ids == _ids(vlm)["<bos>"]).sum() == 1


# ---- attention ----------------------------------------------------------------------------------------------------
def test_image_block_is_bidirectional_on_sliding_layers_only(vlm):
    text_config = vlm.model.config.text_config
    assert text_config.use_bidirectional_attention == "vision"
    assert [text_config.layer_types[l] for l in (SLIDING, FULL)] == ["sliding_attention", "full_attention"]
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    first, last = int(ti.image_positions[0]), int(ti.image_positions[-1])
    sites = [f"blocks.{SLIDING}.attn.hook_pattern", f"blocks.{FULL}.attn.hook_pattern"]
    captured = vlm.capture(batch, sites)
    sliding, full = (captured[s][0] for s in sites)
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, use_cache=False, output_attentions=True)
    torch.testing.assert_close(sliding, ref.attentions[SLIDING][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(full, ref.attentions[FULL][0], atol=1e-6, rtol=0)
    # sliding: the first image token sees the whole block ahead (the window only bounds the past), no text after it
    assert (sliding[:, first, last] > 0).all() and (sliding[:, first, last + 1 :] == 0).all()
    assert (sliding[:, last, : last - SLIDING_WINDOW + 1] == 0).all()
    # full: causal everywhere, the image block included
    assert (full[:, first, first + 1 :] == 0).all() and (full[:, first, :first + 1] > 0).all()
    q = ti.last_position
    np.testing.assert_array_equal(np.flatnonzero(sliding[0, q].numpy() > 0), np.arange(q - SLIDING_WINDOW + 1, q + 1))


def test_dropped_mm_token_type_ids_are_restored(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    full = vlm.logits(batch)
    inputs = {k: v for k, v in batch.inputs.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        causal = vlm.model(**inputs, use_cache=False).logits  # HF alone: a silently causal image block
    assert (causal[0, -1] - full[0, -1]).abs().max() > 1e-3
    batch.inputs = inputs
    assert int(vlm.adapter.forward_kwargs(batch.inputs)["mm_token_type_ids"].sum()) == 64
    torch.testing.assert_close(vlm.logits(batch), full, atol=0, rtol=0)


def test_generate_keeps_the_bidirectional_prefill(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    site = f"blocks.{vlm.n_layers - 1}.hook_resid_post"
    texts, captured = vlm.generate(batch, max_new_tokens=2, sites=site)
    torch.testing.assert_close(captured[site][0], vlm.capture(batch, site)[site], atol=1e-5, rtol=1e-5)
    first = int(vlm.logits(batch)[0, -1].argmax())
    assert texts[0].startswith(vlm.adapter.tokenizer.decode([first], skip_special_tokens=True))


def test_full_layers_share_one_key_value_head_without_v_proj(vlm):
    a = vlm.adapter
    sliding, full = a.attention_module(SLIDING), a.attention_module(FULL)
    assert sliding.v_proj is not None and full.v_proj is None  # attention_k_eq_v: the keys are the values
    assert (sliding.k_proj.out_features, full.k_proj.out_features) == (2 * 32, 1 * 32)
    assert a.path_channels(SLIDING) == ("q", "k", "v") and a.path_channels(FULL) == ("q", "k")
    assert a.n_kv_heads == 2 and a.d_head == 32


# ---- the residual stream ------------------------------------------------------------------------------------------
def test_layer_scalars_scale_the_whole_residual_stream(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    out = vlm.run(batch, sites=["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", "blocks.*.hook_attn_out",
                                "blocks.*.hook_mlp_out"])
    for layer in range(vlm.n_layers):
        scale = vlm.adapter.residual_scale(layer)
        assert scale is vlm.adapter.layer(layer).layer_scalar and 0.5 <= float(scale) < 1.0
        added = sum(out[f"blocks.{layer}.{h}"] for h in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out"))
        post = out[f"blocks.{layer}.hook_resid_post"]
        torch.testing.assert_close(scale * added, post, atol=1e-5, rtol=1e-5)
        assert (added - post).abs().max() > 1e-2  # without the scale the sum is not the stream
    assert vlm.adapter.final_logit_softcap() == 30.0
    assert vlm.logits(batch).abs().max() < 30.0


def test_path_patching_is_refused_by_name(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    last = batch.index[0].last_position
    task = PathTask(batch, np.array([last]), np.array([last]), {0: torch.zeros(1, vlm.n_heads, 32)}, last, 5, 6)
    with pytest.raises(UnsupportedModelError, match="rescale the whole residual stream"):
        naive_path_diffs(vlm, task, all_edges(vlm, senders=[(0, 1)]))


# ---- exact == naive -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("condition", [
    "id_selection",  # the last token
    "id_retrieval",  # a mid-prompt span: an earlier object's name
])
def test_exact_equals_naive(vlm, condition):
    """One head in every layer (sliding and full), in the default, packed and batched layouts."""
    task = check_exact_equals_naive(vlm, condition)
    assert len(task.positions) == (1 if condition == "id_selection" else 2)
    assert task.positions.min() > task.batch.index[0].image_positions.max()  # the prefix cache holds the image


def test_the_26b_shape_wider_full_heads_and_moe():
    """Full-attention heads twice as wide as the sliding ones (the checkpoints: 512 and 256) and an MoE block beside
    the dense MLP: per-layer head widths, hook_mlp_out holding both branches, exact == naive on both layer kinds."""
    model, processor = build_gemma4(0, text_overrides=dict(global_head_dim=64, enable_moe_block=True, num_experts=4,
                                                           top_k_experts=2, moe_intermediate_size=64))
    wide = vb.VLM(model, processor, name="tiny-gemma4 (26B-A4B shape)", source="tiny (random, seed 0)")
    a = wide.adapter
    assert [a.layer_d_head(l) for l in range(4)] == [32, 64, 32, 64] and a.d_head == 32
    batch = wide.prepare(draw_scene(0), PROMPT)
    sites = ["blocks.*.attn.hook_z", "blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", "blocks.*.hook_attn_out",
             "blocks.*.hook_mlp_out"]
    out = wide.run(batch, sites=sites).cache
    for layer in range(4):
        assert tuple(out[f"blocks.{layer}.attn.hook_z"].shape) == (1, batch.seq_len, 4, a.layer_d_head(layer))
        added = sum(out[f"blocks.{layer}.{h}"] for h in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out"))
        torch.testing.assert_close(a.residual_scale(layer) * added, out[f"blocks.{layer}.hook_resid_post"],
                                   atol=1e-5, rtol=1e-5)
    experts = a.layer(2).experts
    with torch.no_grad():
        saved = experts.down_proj.clone()
        experts.down_proj.zero_()
        without = wide.capture(batch, "blocks.2.hook_mlp_out")["blocks.2.hook_mlp_out"]
        experts.down_proj.copy_(saved)
    assert (without - out["blocks.2.hook_mlp_out"]).abs().max() > 1e-2  # the experts' branch is in hook_mlp_out
    pair = vb.stimuli.scene_pairs(1, "id_selection", 0, n_objects=3)[0]
    task = scene_task(wide, pair, range(4))
    assert tuple(task.values[FULL].shape) == (1, 4, 64)
    gen = torch.Generator().manual_seed(0)
    task.values = {l: v + 30.0 * v.std() * torch.randn(v.shape, generator=gen) for l, v in task.values.items()}
    assert_exact_equals_naive(wide, task, heads=((0, 1), (1, 2), (3, 3)), layouts=({},))


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_per_layer_embeddings_and_kv_sharing_are_refused_before_loading(tmp_path):
    """E2B / E4B configs: refused from the config alone (the folder holds no weights, which would be a load error)."""
    text = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    for overrides in ({"hidden_size_per_layer_input": 16}, {"num_kv_shared_layers": 2}):
        config = Gemma4Config(text_config={**text, **overrides})
        folder = tmp_path / next(iter(overrides))
        config.save_pretrained(folder)
        with pytest.raises(UnsupportedModelError, match="per-layer embeddings .* KV sharing"):
            vb.load(str(folder))
        with pytest.raises(UnsupportedModelError, match="gemma-4-31B-it"):
            Gemma4Adapter(SimpleNamespace(config=config), None)
