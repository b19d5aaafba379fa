"""GLM-4.1V / GLM-4.6V: the 28 px token grid and its boxes, the token layout and M-RoPE positions, causal attention
over the image block, the sandwich norms behind ``hook_attn_out`` / ``hook_mlp_out``, the tower's rows, painting
locality, exact == naive patching; and the two other model types one adapter covers (``glm46v``, ``glm4v_moe``).

Hand computations (tiny processor: pixel bounds ``2 * 224**2``, which GLM's resize compares with ``2 * h * w``; 14 px
patches, 2x2 merge, so resized sides are multiples of 28):

* 224 x 224 is kept: 16 x 16 patches (``image_grid_thw = (1, 16, 16)``), an 8 x 8 token grid, token ``(r, c)``
  covering ``[28c, 28c + 28) x [28r, 28r + 28)``. The raw prompt is ``<|begin_of_image|>``, the 64 image tokens,
  ``<|end_of_image|>``, then the text: image positions 1..64.
* 320 x 224 (W x H): rounded to multiples of 28 it is 308 x 224, and ``2 * 308 * 224 > 2 * 224**2``, so both sides are
  divided by ``beta = sqrt(320 * 224 / 224**2) = 1.1952`` and floored to multiples of 28: ``floor(267.7 / 28) = 9``
  and ``floor(187.4 / 28) = 6`` give 252 x 168, ``image_grid_thw = (1, 12, 18)``, a 6 x 9 grid of 54 tokens; a token
  covers ``28 * 320 / 252 = 35.56`` original px across and ``28 * 224 / 168 = 37.33`` down.
* M-RoPE: ``<|begin_of_image|>`` (the row's first token) is ``(0, 0, 0)``; the image run starts at ``s = 1`` and
  token ``(r, c)`` is ``(1, 1 + r, 1 + c)``; the text resumes at ``s + max(rows, cols)``, so ``<|end_of_image|>`` is
  ``(9, 9, 9)`` after the 8 x 8 grid and ``(10, 10, 10)`` after the 6 x 9 one, and every later token steps by one on
  all three axes: 64 image tokens advance the position by 8, 54 by 9.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
import transformers
from family_checks import check_chat_grids, check_exact_equals_naive, painted_cell_changes
from helpers import PROMPT, draw_scene, expected_boxes

import vlmbind as vb
from vlmbind.adapters.glm4v import Glm4vAdapter
from vlmbind.core.errors import UnsupportedModelError
from vlmbind.engine.interop import transformer_lens_bridge
from vlmbind.tiny.common import random_model
from vlmbind.tiny.glm4v import finish_glm4v, glm4v_configs, glm4v_processor, glm_tokenizer

TWO_PROMPTS = [PROMPT, "the red object is a"]


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    # a private instance: HF's output_attentions installs permanent capture hooks, which would leak into the
    # session-wide tiny model that the hook-hygiene tests count hooks on
    return vb.load("tiny-glm4v")


def _other_type(model_type: str) -> vb.VLM:
    """A tiny ``glm46v`` or ``glm4v_moe`` model with tiny-glm4v's sizes and tokenizer (the MoE: 4 routed experts,
    2 per token, one shared expert, layer 0 dense)."""
    tok = glm_tokenizer()
    kwargs = glm4v_configs(tok)
    if model_type == "glm46v":
        config_cls, model_cls, processor_cls = (transformers.Glm46VConfig, transformers.Glm46VForConditionalGeneration,
                                                transformers.Glm46VProcessor)
    else:
        kwargs["text_config"].update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                     n_shared_experts=1, first_k_dense_replace=1)
        config_cls, model_cls, processor_cls = (transformers.Glm4vMoeConfig,
                                                transformers.Glm4vMoeForConditionalGeneration,
                                                transformers.Glm4vProcessor)
    model = finish_glm4v(random_model(model_cls, config_cls(**kwargs), seed=0, attn_implementation="eager"), seed=0)
    return vb.VLM(model, glm4v_processor(tok, processor_cls=processor_cls), name=f"tiny {model_type}",
                  source="tiny (test)")


@pytest.fixture(scope="module")
def glm46v() -> vb.VLM:
    return _other_type("glm46v")


@pytest.fixture(scope="module")
def moe() -> vb.VLM:
    return _other_type("glm4v_moe")


def _ids(vlm: vb.VLM, *tokens: str) -> list[int]:
    return [vlm.adapter.tokenizer.convert_tokens_to_ids(t) for t in tokens]


# ---- declarations -------------------------------------------------------------------------------------------------
def test_declarations_and_sandwich_norms(vlm):
    a = vlm.adapter
    assert type(a) is Glm4vAdapter
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model, a.n_vision_layers) == (4, 4, 2, 32, 128, 2)
    paths = a.declared_paths()
    assert paths["projector"] is vlm.model.model.visual.merger
    assert paths["vision_blocks"] is vlm.model.model.visual.blocks
    assert a.attn_out_module(2) is a.layer(2).post_self_attn_layernorm
    assert a.mlp_out_module(2) is a.layer(2).post_mlp_layernorm
    assert a.image_token_id == _ids(vlm, "<|image|>")[0]
    assert vlm.model.config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]


def test_each_model_type_loads_with_its_own_class():
    classes = {t: Glm4vAdapter.model_class_for(transformers.AutoConfig.for_model(t)) for t in Glm4vAdapter.model_types}
    assert classes == {"glm4v": "Glm4vForConditionalGeneration", "glm46v": "Glm46VForConditionalGeneration",
                       "glm4v_moe": "Glm4vMoeForConditionalGeneration"}


# ---- the token grid -----------------------------------------------------------------------------------------------
def test_square_grid_boxes_and_token_layout(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    begin, end = _ids(vlm, "<|begin_of_image|>", "<|end_of_image|>")
    assert [(g.name, g.shape) for g in ti.grids] == [("image", (8, 8))]
    assert batch.inputs["image_grid_thw"][0].tolist() == [1, 16, 16]
    assert ti.input_ids[0] == begin and ti.input_ids[65] == end
    np.testing.assert_array_equal(ti.grid().positions, np.arange(1, 65).reshape(8, 8))
    assert list(ti.roles[[0, 65]]) == ["special", "special"] and set(ti.roles[66:]) == {"text"}
    edges = 28.0 * np.arange(9)
    np.testing.assert_allclose(ti.grid().boxes, expected_boxes(edges, edges))
    assert vlm.adapter.resized_size(batch.inputs, 0) == (224, 224)


def test_non_square_image_is_resized_to_multiples_of_28(vlm):
    batch = vlm.prepare(draw_scene(1, (320, 224)), PROMPT)
    grid = batch.index[0].grid()
    assert grid.shape == (6, 9)
    assert batch.inputs["image_grid_thw"][0].tolist() == [1, 12, 18]
    assert vlm.adapter.resized_size(batch.inputs, 0) == (252, 168)
    np.testing.assert_allclose(grid.boxes, expected_boxes(320 / 9 * np.arange(10), 224 / 6 * np.arange(7)))


def test_image_tokens_are_the_projector_rows(vlm):
    """One image token per merged feature: 64 + 54 rows, and they are the layer-0 input at the image tokens."""
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    out = vlm.run(batch, sites=["projector.hook_out", "blocks.0.hook_resid_pre"])
    image = batch.inputs["input_ids"] == vlm.adapter.image_token_id
    assert int(image.sum()) == out["projector.hook_out"].shape[0] == 64 + 54
    assert [len(ti.image_positions) for ti in batch.index] == [64, 54]
    torch.testing.assert_close(out["blocks.0.hook_resid_pre"][image], out["projector.hook_out"], atol=0, rtol=0)


def test_mrope_positions_follow_the_grid(vlm):
    """The hand-computed 3-D positions; they are what the model uses (passing them changes nothing) and they matter
    (1-D positions change the logits)."""
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    positions = vlm.adapter.position_ids(batch.inputs)
    for row, (rows, cols) in enumerate([(8, 8), (6, 9)]):
        ti = batch.index[row]
        start = int(ti.image_positions[0]) - 1  # <|begin_of_image|>
        p = positions[:, row].numpy()
        assert (p[:, start] == 0).all()
        r, c = np.divmod(np.arange(rows * cols), cols)
        np.testing.assert_array_equal(p[:, ti.image_positions], np.stack([np.ones_like(r), 1 + r, 1 + c]))
        after = 1 + max(rows, cols)  # <|end_of_image|>, then one step per token
        n_after = len(ti.input_ids) - start - 1 - rows * cols
        np.testing.assert_array_equal(p[:, start + 1 + rows * cols:], np.tile(after + np.arange(n_after), (3, 1)))
    with torch.no_grad():
        own = vlm.model(**batch.inputs).logits
        given = vlm.model(**batch.inputs, position_ids=positions).logits
        flat = vlm.model(**batch.inputs, position_ids=batch.inputs["attention_mask"].cumsum(-1) - 1).logits
    torch.testing.assert_close(given, own, atol=0, rtol=0)
    assert (flat - own).abs().max() > 1e-3


def test_chat_prompt_keeps_the_grid(vlm):
    check_chat_grids(vlm, "image", "[gMASK]<sop><|user|>\n<|begin_of_image|><|image|>", "<|assistant|>\n")


# ---- attention and the residual stream ----------------------------------------------------------------------------
def test_image_block_is_causal_in_every_layer(vlm):
    """No bidirectional image block: HF's attention never looks ahead, inside the image run or elsewhere, and
    vlmbind's patterns are HF's."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, output_attentions=True)
    patterns = vlm.run(batch, sites=["blocks.*.attn.hook_pattern"])
    image = batch.index[0].image_positions
    for layer, attn in enumerate(ref.attentions):
        ahead = torch.triu(torch.ones(attn.shape[-2:], dtype=torch.bool), diagonal=1)
        assert (attn[0][:, ahead] == 0).all()
        assert (attn[0][:, image[:, None], image[None, :]].sum(-1) > 0.01).all()  # image tokens do look at each other
        torch.testing.assert_close(patterns[f"blocks.{layer}.attn.hook_pattern"], attn, atol=1e-6, rtol=0)


def test_attn_and_mlp_outputs_are_the_sandwich_normed_branches(vlm):
    """``hook_attn_out`` is ``post_self_attn_layernorm`` of the attention's output (which differs from it), and the
    residual stream is the sum of what the layers add."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    raw = {}
    handles = [vlm.adapter.attention_module(l).register_forward_hook(
        lambda m, args, out, l=l: raw.__setitem__(l, out[0])) for l in range(vlm.n_layers)]
    try:
        out = vlm.run(batch, sites=["blocks.*.hook_attn_out", "blocks.*.hook_mlp_out", "blocks.*.hook_resid_pre",
                                    "blocks.*.hook_resid_post"])
    finally:
        for h in handles:
            h.remove()
    for l in range(vlm.n_layers):
        block = vlm.adapter.layer(l)
        with torch.no_grad():
            normed = block.post_self_attn_layernorm(raw[l])
        torch.testing.assert_close(out[f"blocks.{l}.hook_attn_out"], normed, atol=1e-6, rtol=0)
        assert (normed - raw[l]).abs().max() > 1e-2
        added = out[f"blocks.{l}.hook_attn_out"] + out[f"blocks.{l}.hook_mlp_out"]
        torch.testing.assert_close(out[f"blocks.{l}.hook_resid_pre"] + added, out[f"blocks.{l}.hook_resid_post"],
                                   atol=1e-5, rtol=0)


# ---- the vision tower ---------------------------------------------------------------------------------------------
def test_vision_rows_merge_into_the_projector_rows(vlm):
    """The last block's rows, grouped by ``vision_row_tokens`` and put through the tower's tail (post norm, 2x2
    downsample conv, merger), are the projector's rows."""
    batch = vlm.prepare(draw_scene(2, (320, 224)), PROMPT)
    last = f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post"
    cache = vlm.run(batch, sites=[last, "projector.hook_out"]).cache
    owner = vlm.adapter.vision_row_tokens(batch.inputs, 0)
    np.testing.assert_array_equal(np.bincount(owner), np.full(54, 4))
    visual = vlm.model.model.visual
    rows = cache[last][torch.as_tensor(np.argsort(owner, kind="stable"))]
    with torch.no_grad():
        groups = visual.post_layernorm(rows).view(-1, 2, 2, rows.shape[-1]).permute(0, 3, 1, 2)
        merged = visual.merger(visual.downsample(groups).view(-1, vlm.adapter.d_model))
    torch.testing.assert_close(merged, cache["projector.hook_out"], atol=1e-5, rtol=1e-5)


def test_painting_a_cell_changes_only_the_token_covering_it(vlm):
    p = painted_cell_changes(vlm, draw_scene(3, (320, 224)), None, (3, 6))
    assert len(p.expected) == 1 and p.expected[0] == p.index.grid().positions[3, 6]
    np.testing.assert_array_equal(p.changed, p.expected)


# ---- exact == naive -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("condition", ["id_selection", "id_retrieval"])
def test_exact_equals_naive(vlm, condition):
    task = check_exact_equals_naive(vlm, condition)
    # id_selection patches the last token; id_retrieval a two-token span mid-prompt
    assert len(task.positions) == (1 if condition == "id_selection" else 2)


# ---- the other model types ----------------------------------------------------------------------------------------
def test_glm46v_resolves_round_trips_and_patches_exactly(glm46v):
    a = glm46v.adapter
    assert type(a) is Glm4vAdapter and type(glm46v.model).__name__ == "Glm46VForConditionalGeneration"
    assert a.attn_out_module(0) is a.layer(0).post_self_attn_layernorm
    assert glm46v.prepare(draw_scene(0), PROMPT).index[0].grid().shape == (8, 8)
    check_exact_equals_naive(glm46v, "id_selection", heads=((1, 2), (3, 3)), layouts=({},))
    with tempfile.TemporaryDirectory() as folder:
        glm46v.model.save_pretrained(folder)
        glm46v.processor.save_pretrained(folder)
        loaded = vb.load(folder, attn_implementation="eager")
    assert type(loaded.model).__name__ == "Glm46VForConditionalGeneration"
    batch = glm46v.prepare(draw_scene(1), PROMPT, chat=False)
    torch.testing.assert_close(loaded.logits(batch), glm46v.logits(batch), atol=1e-6, rtol=0)


def test_moe_layers_have_no_sandwich_norms(moe):
    """glm4v_moe: attention and the MoE block (layers 1-3; layer 0 is dense) add their outputs as they are, so those
    are ``hook_attn_out`` / ``hook_mlp_out`` and the residual stream is their sum."""
    a = moe.adapter
    assert a.attn_out_module(1) is a.attention_module(1)
    assert type(a.mlp_out_module(1)).__name__ == "Glm4vMoeTextMoE"
    assert type(a.mlp_out_module(0)).__name__ == "Glm4vMoeTextMLP"
    out = moe.run(moe.prepare(draw_scene(0), PROMPT), sites=["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post",
                                                             "blocks.*.hook_attn_out", "blocks.*.hook_mlp_out"])
    for l in range(moe.n_layers):
        added = out[f"blocks.{l}.hook_attn_out"] + out[f"blocks.{l}.hook_mlp_out"]
        torch.testing.assert_close(out[f"blocks.{l}.hook_resid_pre"] + added, out[f"blocks.{l}.hook_resid_post"],
                                   atol=1e-5, rtol=0)
        assert out[f"blocks.{l}.hook_mlp_out"].abs().max() > 1e-1


@pytest.mark.parametrize("which", ["glm46v", "moe"])
def test_transformer_lens_refuses_the_types_it_does_not_bridge(which, request):
    other = request.getfixturevalue(which)
    with pytest.raises(UnsupportedModelError, match="no bridge for GLM-4.1V / GLM-4.6V"):
        transformer_lens_bridge(other)
