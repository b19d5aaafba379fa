"""Kimi-K2.5: the padded token grid and its boxes, the media block's layout, what the projector inserts, multi-head
latent attention (patterns from 48-dim queries and keys, 32-dim values and z), the dense-then-MoE MLPs, painting
locality, exact == naive patching and nnsight.

Hand computations (tiny processor: 14 px patches, a 2x2 merge, so padded sides are multiples of 28; ``max_patches =
256``; ``navit_resize`` counts ``floor(side / 14)`` patches, shrinks both sides by ``sqrt(256 / count)`` when the count
is over 256, floors to whole pixels, then pads the bottom and right to multiples of 28):

* 224 x 224: 16 x 16 = 256 patches, kept; an 8 x 8 token grid, token ``(r, c)`` covering ``[28c, 28c + 28) x [28r,
  28r + 28)``.
* 448 x 448: 32 x 32 = 1024 patches, scale ``sqrt(256 / 1024) = 0.5``, resized to 224 x 224: an 8 x 8 grid of 56 px
  cells.
* 320 x 224 (W x H): 22 x 16 = 352 patches, scale ``s = sqrt(256 / 352) = 0.85280``; ``floor(320 s) = 272``,
  ``floor(224 s) = 191``, padded to 280 x 196: 20 x 14 patches, a 7 x 10 grid of 70 tokens. A token covers
  ``28 * 320 / 272 = 32.941`` original px across and ``28 * 224 / 191 = 32.838`` down; the last column and row reach
  into the padding and are clipped to the image (``[296.47, 320]`` and ``[197.03, 224]``).

Sequence layout (raw prompt): ``<|media_begin|>``, the word ``image`` (plain text tokens), ``<|media_content|>``, the
image tokens (``<|media_pad|>`` expanded to one per 2x2 patch group, in raster order), ``<|media_end|>``, the prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import check_chat_grids, check_exact_equals_naive, check_prepare_refused, painted_cell_changes
from helpers import PROMPT, draw_scene, expected_boxes
from PIL import Image

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.adapters.kimi_k25 import KimiK25Adapter
from vlmbind.core.errors import SiteError
from vlmbind.engine.hooks import STATE_EDITS
from vlmbind.engine.paths import all_edges

NAME = "tiny-kimi_k25"
TWO_PROMPTS = [PROMPT, "the red object is a"]
QK_WIDTH = 32 + 16  # qk_nope_head_dim + qk_rope_head_dim


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    # a private instance: HF's output_attentions installs permanent capture hooks, which would leak into the
    # session-wide tiny model that the hook-hygiene tests count hooks on
    return vb.load(NAME)


def _ids(vlm: vb.VLM) -> dict[str, int]:
    tok = vlm.adapter.tokenizer
    return {t: tok.convert_tokens_to_ids(t) for t in ("<|media_begin|>", "<|media_content|>", "<|media_pad|>",
                                                     "<|media_end|>")}


# ---- declarations -------------------------------------------------------------------------------------------------
def test_declared_paths_shapes_and_mlp_kinds(vlm):
    a, inner = vlm.adapter, vlm.model.model
    assert adapter_class_for_config(vlm.model.config) is KimiK25Adapter and isinstance(a, KimiK25Adapter)
    paths = a.declared_paths()
    assert paths["projector"] is inner.mm_projector
    assert paths["vision_blocks"] is inner.vision_tower.layers and a.n_vision_layers == 2
    assert paths["text_layers"] is inner.language_model.layers
    # d_head is the value width (o_proj's input is 4 heads x 32), not the 48 of queries and keys
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model) == (4, 4, 4, 32, 128)
    attn = a.attention_module(0)
    assert attn.qk_head_dim == QK_WIDTH and attn.v_head_dim == a.d_head and a.o_proj_module(0).in_features == 128
    assert type(a.mlp_module(0)).__name__ == "DeepseekV3MLP"
    for layer in (1, 2, 3):
        moe = a.mlp_module(layer)
        assert type(moe).__name__ == "DeepseekV3MoE" and moe.experts.num_experts == 4 and moe.gate.top_k == 2
    assert a.layer_kind(0) == "multi-head latent attention, dense MLP"
    assert a.layer_kind(3) == "multi-head latent attention, mixture of experts"


# ---- the token grid -----------------------------------------------------------------------------------------------
def test_square_grid_boxes_and_token_layout(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti, ids = batch.index[0], _ids(vlm)
    assert [(g.name, g.shape) for g in ti.grids] == [("image", (8, 8))]
    assert batch.inputs["image_grid_thw"].tolist() == [[1, 16, 16]]
    begin, content, end = (int(np.flatnonzero(ti.input_ids == ids[t])[0])
                           for t in ("<|media_begin|>", "<|media_content|>", "<|media_end|>"))
    assert begin == 0 and vlm.adapter.tokenizer.decode(ti.input_ids[begin + 1 : content]) == "image"
    # the 64 image tokens are the run between <|media_content|> and <|media_end|>, in raster order
    np.testing.assert_array_equal(ti.grid().positions, np.arange(content + 1, end).reshape(8, 8))
    assert end == content + 65
    assert ti.roles[begin] == ti.roles[content] == ti.roles[end] == "special"
    assert (ti.roles[begin + 1 : content] == "text").all() and (ti.roles[end + 1 :] == "text").all()
    assert ti.cell(end) is None and ti.cell(content + 1 + 8 * 2 + 5) == ("image", 0, 2, 5)
    edges = 28.0 * np.arange(9)
    np.testing.assert_allclose(ti.grid().boxes, expected_boxes(edges, edges))


def test_a_large_square_image_shrinks_to_the_patch_budget(vlm):
    batch = vlm.prepare(draw_scene(3, (448, 448)), PROMPT)
    assert batch.inputs["image_grid_thw"].tolist() == [[1, 16, 16]]
    edges = 56.0 * np.arange(9)
    np.testing.assert_allclose(batch.index[0].grid().boxes, expected_boxes(edges, edges))


def test_non_square_image_is_shrunk_then_padded(vlm):
    batch = vlm.prepare(draw_scene(1, (320, 224)), PROMPT)
    grid = batch.index[0].grid()
    assert batch.inputs["image_grid_thw"].tolist() == [[1, 14, 20]]
    assert grid.shape == (7, 10)
    xs = np.minimum(28 * np.arange(11) * 320 / 272, 320)
    ys = np.minimum(28 * np.arange(8) * 224 / 191, 224)
    np.testing.assert_allclose(grid.boxes, expected_boxes(xs, ys))
    np.testing.assert_allclose(grid.boxes[-1, -1], [296.470588, 197.026178, 320, 224], atol=1e-5)


def test_image_token_count_equals_inserted_features(vlm):
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    out = vlm.run(batch, sites=["projector.hook_out", "blocks.0.hook_resid_pre"])
    features = out["projector.hook_out"].reshape(-1, vlm.adapter.d_model)
    image = batch.inputs["input_ids"] == vlm.adapter.image_token_id
    assert [len(ti.image_positions) for ti in batch.index] == [64, 70]
    assert int(image.sum()) == features.shape[0] == 134
    torch.testing.assert_close(out["blocks.0.hook_resid_pre"][image], features, atol=0, rtol=0)


def test_vision_rows_merge_into_the_projector_rows(vlm):
    """The tower's rows are patches in raster order: regrouping the last block's rows by ``vision_row_tokens``
    (after the tower's final norm) and projecting each 2x2 group gives the projector's rows."""
    batch = vlm.prepare(draw_scene(2, (320, 224)), PROMPT)
    last = f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post"
    cache = vlm.run(batch, sites=[last, "projector.hook_out"]).cache
    owner = vlm.adapter.vision_row_tokens(batch.inputs, 0)
    np.testing.assert_array_equal(owner[[0, 1, 2, 20, 21, 40]], [0, 0, 1, 0, 0, 10])
    np.testing.assert_array_equal(np.bincount(owner), np.full(70, 4))
    tower = vlm.model.model.vision_tower
    with torch.no_grad():
        rows = tower.final_layernorm(cache[last])[torch.as_tensor(np.argsort(owner, kind="stable"))]
        merged = vlm.model.model.mm_projector(rows.view(70, 4, -1)).squeeze(1)
    torch.testing.assert_close(merged, cache["projector.hook_out"].reshape(70, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("size", "cell"), [((224, 224), (2, 5)), ((320, 224), (6, 9))])
def test_painting_a_cell_changes_exactly_the_tokens_covering_it(vlm, size, cell):
    """The last cell of the 320 x 224 grid reaches into the padding: its clipped box still holds the paint."""
    p = painted_cell_changes(vlm, draw_scene(4, size), None, cell)
    assert p.position in p.changed
    np.testing.assert_array_equal(p.changed, p.expected)


# ---- multi-head latent attention ----------------------------------------------------------------------------------
def test_patterns_come_from_wide_queries_and_keys_and_z_from_values(vlm):
    """The queries and keys vlmbind's eager attention sees are 48 wide (the last 16, the rotary key, shared by every
    head), the values 32: the pattern is ``softmax(q k^T / sqrt(48))`` under the causal mask (image tokens included),
    ``hook_z`` is ``pattern @ v``, and both equal HF's eager outputs."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    layer, seen = 1, {}

    def keep(q, k, v):
        seen.update(q=q.detach(), k=k.detach(), v=v.detach())
        return q, k, v

    attn = vlm.adapter.attention_module(layer)
    setattr(attn, STATE_EDITS, [keep])
    try:
        out = vlm.run(batch, sites=[f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_z"])
    finally:
        attn.__dict__.pop(STATE_EDITS)
    q, k, v = seen["q"][0], seen["k"][0], seen["v"][0]
    assert q.shape[-1] == k.shape[-1] == QK_WIDTH and v.shape[-1] == vlm.adapter.d_head and k.shape[0] == 4
    torch.testing.assert_close(k[:, :, 32:], k[:1, :, 32:].expand(4, -1, -1), atol=0, rtol=0)
    assert (k[0, :, :32] - k[1, :, :32]).abs().max() > 1e-2  # the no-rope part is each head's own
    n = q.shape[1]
    scores = (q @ k.transpose(-1, -2)) * QK_WIDTH**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    pattern = out[f"blocks.{layer}.attn.hook_pattern"][0]
    torch.testing.assert_close(pattern, scores.softmax(-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[f"blocks.{layer}.attn.hook_z"][0], (pattern @ v).transpose(0, 1),
                               atol=1e-6, rtol=1e-5)
    first = int(batch.index[0].image_positions[0])
    assert (pattern[:, first, first + 1 :] == 0).all()  # image tokens attend causally
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, use_cache=False, output_attentions=True)
    every = vlm.capture(batch, "blocks.*.attn.hook_pattern")
    for l in range(vlm.n_layers):
        torch.testing.assert_close(every[f"blocks.{l}.attn.hook_pattern"], ref.attentions[l], atol=1e-6, rtol=1e-5)


def test_hook_z_equals_nnsight_o_proj_input(vlm):
    batch = vlm.prepare([draw_scene(0), draw_scene(1, (320, 224))], TWO_PROMPTS)
    nn_model = vlm.nnsight()
    with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
        o_input = vlm.nnsight_module(nn_model, vlm.adapter.o_proj_path(2)).input.save()
    z = vlm.capture(batch, "blocks.2.attn.hook_z")["blocks.2.attn.hook_z"]
    assert z.shape[-2:] == (4, 32)
    torch.testing.assert_close(z.flatten(-2), o_input, atol=0, rtol=0)


def test_path_patching_receivers_are_refused_by_name(vlm):
    assert all(vlm.adapter.path_channels(l) == () for l in range(vlm.n_layers))
    with pytest.raises(SiteError, match="shared latent"):
        vlm.adapter.channel_module(2, "k")
    # senders still reach the logits directly
    assert {e.channel for e in all_edges(vlm, senders=[(0, 1)])} == {"logits"}


# ---- mixture of experts -------------------------------------------------------------------------------------------
def test_moe_layers_route_each_token_to_two_experts_plus_the_shared_one(vlm):
    """Layers 1-3 route every token to 2 of 4 experts, decisively (the second choice's sigmoid score clears the third
    by a margin far above float error), with weights summing to ``routed_scaling_factor``; ``hook_mlp_out`` is the
    shared expert's output plus the chosen experts' weighted outputs, computed here from the stacked weights."""
    batch = vlm.prepare(draw_scene(0), PROMPT)
    a, routed, inputs = vlm.adapter, {}, {}
    handles = []
    for layer in (1, 2, 3):
        moe = a.mlp_module(layer)
        handles.append(moe.gate.register_forward_hook(lambda m, i, o, l=layer: routed.__setitem__(l, o)))
        handles.append(moe.register_forward_pre_hook(lambda m, i, l=layer: inputs.__setitem__(l, i[0].detach())))
    try:
        out = vlm.run(batch, sites="blocks.*.hook_mlp_out")
    finally:
        for h in handles:
            h.remove()
    scale = float(vlm.model.config.text_config.routed_scaling_factor)
    for layer in (1, 2, 3):
        logits, weights, chosen = routed[layer]
        scores = logits.sigmoid().sort(-1, descending=True).values
        assert chosen.shape == (batch.seq_len, 2) and (chosen[:, 0] != chosen[:, 1]).all()
        assert (scores[:, 1] - scores[:, 2]).min() > 1e-5
        torch.testing.assert_close(weights.sum(-1), torch.full((batch.seq_len,), scale), atol=1e-5, rtol=0)
        assert len(chosen.unique()) == 4  # no expert is left out of a whole prompt
    moe, x = a.mlp_module(2), inputs[2][0]
    _, weights, chosen = routed[2]
    expected = moe.shared_experts(x)
    for e in range(4):
        gate, up = (x @ moe.experts.gate_up_proj[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ moe.experts.down_proj[e].T
        expected = expected + y * (weights * (chosen == e)).sum(-1, keepdim=True)
    torch.testing.assert_close(out["blocks.2.hook_mlp_out"][0], expected.detach(), atol=1e-5, rtol=1e-5)


# ---- exact == naive ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("condition", ["id_selection", "id_retrieval"])
def test_exact_equals_naive(vlm, condition):
    task = check_exact_equals_naive(vlm, condition)
    assert len(task.positions) == (1 if condition == "id_selection" else 2)


# ---- prompts and refusals -----------------------------------------------------------------------------------------
def test_chat_prompt_keeps_the_plain_grid(vlm):
    check_chat_grids(vlm, "image", "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|>",
                     "<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_processor_settings_that_move_the_tokens_are_refused(vlm):
    ip = vlm.processor.image_processor
    check_prepare_refused(vlm, ip, "do_resize", False, "do_resize")
    check_prepare_refused(vlm, ip, "merge_size", 4, "merge_size")


def test_an_image_of_any_size_is_placed_exactly(vlm):
    """Odd sizes: shrink (or not), floor, pad; the grid covers the whole image."""
    for size in ((100, 37), (500, 90), (29, 300)):
        ti = vlm.prepare(Image.new("RGB", size, "white"), PROMPT).index[0]
        boxes = ti.grid().boxes
        assert boxes[0, 0, :2].tolist() == [0, 0] and boxes[-1, -1, 2:].tolist() == list(size)
        assert (boxes[..., 2] > boxes[..., 0]).all() and (boxes[..., 3] > boxes[..., 1]).all()
