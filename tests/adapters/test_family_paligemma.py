"""PaliGemma (2) specifics: the patch grid and its boxes, the prefix-LM mask, appended (answer) tokens, and the exact
patching method on a bidirectional prefix.

The tiny model stretches every image to 112 x 112 and cuts 7 x 7 SigLIP patches of 16 px, one language-model token a
patch (a linear projector, no pooling). The processor writes ``<image>`` * 49, ``<bos>``, the prompt and ``\\n``;
``token_type_ids`` are 0 on all of it (the bidirectional prefix) and 1 on appended answer tokens (causal).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import assert_exact_equals_naive, painted_cell_changes, pushed
from helpers import PROMPT, draw_scene
from PIL import Image

import vlmbind as vb
from vlmbind.adapters.base import ModelAdapter
from vlmbind.engine.batches import append_tokens
from vlmbind.engine.decoding import generate_ids, greedy_decode
from vlmbind.engine.interop import transformer_lens_architectures
from vlmbind.engine.patching import PatchTask, exact_diffs, naive_diffs, packable, prefix_end

FULL_LAYER = 1  # layer_types alternate sliding (0, 2) and full (1, 3)


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    # a private instance: output_attentions installs permanent capture hooks (see test_family_gemma3.py)
    return vb.load("tiny-paligemma")


def _pattern(vlm, batch, layer=FULL_LAYER) -> torch.Tensor:
    return vlm.capture(batch, f"blocks.{layer}.attn.hook_pattern")[f"blocks.{layer}.attn.hook_pattern"][0]


def _with_answer(vlm, batch, n: int = 3) -> vb.Batch:
    """``batch`` with ``n`` answer tokens appended (token type 1, as generation appends them)."""
    tokens = torch.tensor([[10 + k for k in range(n)]] * len(batch))
    return vb.Batch(inputs=append_tokens(vlm.adapter, batch.inputs, tokens), index=batch.index,
                    prompts=batch.prompts, images=batch.images)


# ---- declarations and the token layout ----------------------------------------------------------------------------
def test_declared_paths_shapes_and_post_norms(vlm):
    a = vlm.adapter
    paths = a.declared_paths()
    assert len(paths["text_layers"]) == 4 and len(paths["vision_blocks"]) == 2
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model) == (4, 4, 2, 32, 128)
    assert isinstance(paths["projector"].linear, torch.nn.Linear)
    # Gemma-2 (PaliGemma 2): the attention / MLP outputs are the post-norms, as in TransformerLens
    assert a.attn_out_module(0) is a.layer(0).post_attention_layernorm
    assert a.mlp_out_module(0) is a.layer(0).post_feedforward_layernorm
    assert a.bidirectional_image and not a.transformer_lens_bridge
    # HF's Gemma-2 has no sdpa (it cannot soft-cap): a PaliGemma 2 checkpoint loads with eager attention
    assert type(a).default_attn_implementation(vlm.model.config) == "eager"
    # the installed TransformerLens has no PaliGemma bridge (tests/engine/test_transformer_lens.py checks it refuses)
    assert "PaliGemmaForConditionalGeneration" not in transformer_lens_architectures()


def test_square_grid_boxes_and_token_layout(vlm):
    batch = vlm.prepare(Image.new("RGB", (112, 112), "white"), PROMPT)
    ti = batch.index[0]
    grid = ti.grid("image", 0)
    assert grid.shape == (7, 7)
    np.testing.assert_array_equal(grid.boxes[0, 0], [0, 0, 16, 16])
    np.testing.assert_array_equal(grid.boxes[2, 5], [80, 32, 96, 48])
    np.testing.assert_array_equal(grid.positions.ravel(), np.arange(49))
    ids = batch.inputs["input_ids"][0]
    tok = vlm.adapter.tokenizer
    # <image>*49 <bos> prompt \n: the processor inserts the BOS after the image and ends the prompt with a newline
    assert int(ids[49]) == tok.bos_token_id and ti.roles[49] == "special"
    assert tok.decode(ids[50:]) == PROMPT + "\n"
    assert (batch.inputs["token_type_ids"] == 0).all()
    assert "labels" not in batch.inputs  # the processor's training labels never reach the forward


def test_non_square_image_is_stretched(vlm):
    # 160 x 80 is stretched to 112 x 112: a cell is 160/7 x 80/7 original px
    grid = vlm.prepare(Image.new("RGB", (160, 80), "white"), PROMPT).index[0].grid()
    np.testing.assert_allclose(grid.boxes[6, 6], [160 * 6 / 7, 80 * 6 / 7, 160, 80])
    np.testing.assert_allclose(grid.boxes[..., 2] - grid.boxes[..., 0], 160 / 7)


@pytest.mark.parametrize("size, cell", [((112, 112), (3, 4)), ((200, 120), (5, 1))])
def test_painting_a_cell_changes_only_the_tokens_covering_it(vlm, size, cell):
    """With the tower's attention silenced each feature sees only its own patch, so painting the middle of a cell's
    box changes exactly the positions ``positions_covering`` returns."""
    p = painted_cell_changes(vlm, draw_scene(3, size), None, cell)
    np.testing.assert_array_equal(p.changed, p.expected)
    assert len(p.changed) == 1


def test_vision_rows_are_the_image_tokens(vlm):
    batch = vlm.prepare(draw_scene(0, (112, 112)), PROMPT)
    np.testing.assert_array_equal(vlm.adapter.vision_row_tokens(batch.inputs, 0), np.arange(49))


# ---- the prefix-LM mask -------------------------------------------------------------------------------------------
def test_prefix_is_bidirectional_and_the_answer_causal(vlm):
    batch = _with_answer(vlm, vlm.prepare(draw_scene(0, (112, 112)), PROMPT))
    tti = batch.inputs["token_type_ids"][0]
    assert tti[-3:].tolist() == [1, 1, 1] and (tti[:-3] == 0).all()
    last_prompt = batch.seq_len - 4  # the prompt's "\n"
    pattern = _pattern(vlm, batch)
    # the first image token sees the end of the prompt, never the answer; the answer is causal
    assert (pattern[:, 0, last_prompt] > 0).all()
    assert (pattern[:, : last_prompt + 1, last_prompt + 1 :] == 0).all()
    assert (pattern[:, -3, -2:] == 0).all() and (pattern[:, -3, : last_prompt + 1] > 0).all()
    # a sliding layer's window does not cut the prefix (HF ORs the prefix block onto it) but cuts the answer
    sliding = _pattern(vlm, batch, layer=0)
    assert (sliding[:, 0, last_prompt] > 0).all() and (sliding[:, -1, :10] == 0).all()
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, use_cache=False, output_attentions=True)
    torch.testing.assert_close(pattern, ref.attentions[FULL_LAYER][0], atol=1e-6, rtol=0)


def test_forward_kwargs_restore_dropped_token_type_ids(vlm):
    batch = vlm.prepare(draw_scene(0, (112, 112)), PROMPT)
    full = vlm.logits(batch)
    dropped = {k: v for k, v in batch.inputs.items() if k != "token_type_ids"}
    with torch.no_grad():  # without them HF silently runs a causal mask
        causal = vlm.model(**dropped, use_cache=False).logits
    assert (causal[0, -1] - full[0, -1]).abs().max() > 1e-3
    batch.inputs = dropped
    torch.testing.assert_close(vlm.logits(batch), full, atol=0, rtol=0)


def test_greedy_decode_by_full_forwards_equals_generate(vlm):
    """Full forwards on appended tokens (type 1) must equal HF's cached generation, which appends 1s itself: were
    the answer tokens put in the prefix (type 0), the prompt would attend to them."""
    batch = vlm.prepare(draw_scene(0, (112, 112)), PROMPT)
    n = 3
    ids = generate_ids(vlm, batch, n)[0, batch.seq_len:]
    expected = vlm.adapter.tokenizer.decode(ids, skip_special_tokens=True)
    assert greedy_decode(vlm, batch, max_new_tokens=n) == [expected]


# ---- exact patching on a bidirectional prefix ---------------------------------------------------------------------
def _task(vlm, batch, positions, score_position, seed=0) -> PatchTask:
    """The clean z at ``positions`` on every layer, pushed; scored on the clean top two tokens."""
    z = vlm.capture(batch, "blocks.*.attn.hook_z")
    values = {l: z[f"blocks.{l}.attn.hook_z"][0, positions] for l in range(vlm.n_layers)}
    logits = vlm.logits(batch, at=[score_position])[0, 0]
    a, a_star = (int(t) for t in logits.topk(2).indices)
    return pushed(PatchTask(batch=batch, positions=np.asarray(positions), values=values,
                            score_position=score_position, a=a, a_star=a_star), seed)


# every layer, a few heads (tests/engine/test_patching.py runs all of them): a patch in the prefix costs two full
# forwards
HEADS = [(0, 1), (1, 3), (2, 2), (3, 0)]


def _assert_exact_equals_naive(vlm, task, layouts=("auto", "batched")):
    return assert_exact_equals_naive(vlm, task, HEADS, [{"layout": layout} for layout in layouts])


@pytest.mark.parametrize("where", ["last_token", "mid_prompt_span"])
def test_exact_equals_naive_inside_the_bidirectional_prefix(vlm, where):
    """A patch inside the prefix changes positions before it (they attend to it): no cached prefix is reusable, so
    the exact method runs the whole prompt from the patched layer."""
    batch = vlm.prepare(draw_scene(0, (112, 112)), PROMPT)
    last = batch.index[0].last_position
    positions = [last] if where == "last_token" else [last - 6, last - 5, last - 4]
    task = _task(vlm, batch, positions, last)
    assert prefix_end(vlm, batch, vlm.model_inputs(batch), int(min(positions))) == 0
    _assert_exact_equals_naive(vlm, task)


def test_a_cached_prefix_would_be_wrong_inside_the_bidirectional_prefix(vlm, monkeypatch):
    """The finding behind PaliGemmaAdapter.bidirectional_positions: with the generic rule (bidirectional positions
    are those marked nonzero in token_type_ids; PaliGemma marks the causal ones) the exact method cached the prefix
    before a text patch, and disagreed with the naive reference."""
    batch = vlm.prepare(draw_scene(0, (112, 112)), PROMPT)
    last = batch.index[0].last_position
    task = _task(vlm, batch, [last - 6, last - 5, last - 4], last)
    heads = [(1, 0), (2, 3), (3, 1)]
    clean, naive = naive_diffs(vlm, task, heads)
    monkeypatch.setattr(type(vlm.adapter), "bidirectional_positions", ModelAdapter.bidirectional_positions)
    assert prefix_end(vlm, batch, vlm.model_inputs(batch), last - 6) == last - 6
    c, stale = exact_diffs(vlm, task, heads, layout="batched")
    assert np.abs((stale - c) - (naive - clean)).max() > 1e-3


def test_exact_reuses_the_prefix_for_a_patch_in_the_causal_answer(vlm):
    """After the prefix (appended answer tokens, causal) the prefix cache is exact: reused, in both layouts."""
    batch = _with_answer(vlm, vlm.prepare(draw_scene(0, (112, 112)), PROMPT), n=4)
    last = batch.seq_len - 1
    positions = [last - 2, last - 1]
    task = _task(vlm, batch, positions, last)
    assert prefix_end(vlm, batch, vlm.model_inputs(batch), last - 2) == last - 2
    _assert_exact_equals_naive(vlm, task, layouts=("batched", "auto"))
    # PaliGemma 2's forward gives a custom 4-D mask to its sliding layers too: no packed layout, no single pass
    assert not packable(vlm)
    for layout in ("single", "packed"):
        with pytest.raises(vb.InputError, match=layout):
            exact_diffs(vlm, task, [(0, 0)], layout=layout)


# ---- nnsight ------------------------------------------------------------------------------------------------------
def test_nnsight_sees_the_same_residual_stream(vlm):
    a = vlm.adapter
    batch = vlm.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "is"])
    nn_model = vlm.nnsight()
    with torch.no_grad(), nn_model.trace(**vlm.model_inputs(batch), use_cache=False):
        post = vlm.nnsight_module(nn_model, f"{a.text_layers}.0").output.save()
        pre = vlm.nnsight_module(nn_model, f"{a.text_layers}.2").input.save()
    out = vlm.run(batch, sites=["blocks.0.hook_resid_post", "blocks.2.hook_resid_pre"])
    post = post[0] if isinstance(post, tuple) else post
    torch.testing.assert_close(out["blocks.0.hook_resid_post"], post, atol=0, rtol=0)
    torch.testing.assert_close(out["blocks.2.hook_resid_pre"], pre, atol=0, rtol=0)
