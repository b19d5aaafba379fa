"""Qwen3.5: a hybrid language model (Gated DeltaNet layers 0 and 2, softmax attention layers 1 and 3) on Qwen3-VL's
vision tower without DeepStack. What holds on both layer kinds (per-head z, patching, ablation), what only the
softmax layers have (patterns, image_attention) and the named errors elsewhere, exact == naive without prefix-cache
reuse, painting locality, nnsight and TransformerLens; and the MoE variant's sparse block.

Hand computations (tiny processor: ``min_pixels = max_pixels = 224**2``, 16 px patches, 2x2 merge), as for Qwen3-VL:

* 224 x 224 is kept: a 7 x 7 token grid, token ``(r, c)`` covering ``[32c, 32c + 32) x [32r, 32r + 32)``.
* 320 x 224 (W x H) exceeds 224**2 px, so both sides are divided by ``sqrt(320 * 224 / 224**2) = 1.195`` and floored
  to multiples of 32: 256 x 160, a 5 x 8 grid; a token covers ``32 * 320 / 256 = 40`` px across and
  ``32 * 224 / 160 = 44.8`` down.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import PROMPT, draw_scene, expected_boxes, get_tiny, silenced_vision_attention
from PIL import ImageDraw
from transformers import DynamicCache

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.analysis.mediation import scene_task
from vlmbind.core.errors import HeadLayoutError, InputError, InterventionError, NoAttentionPatternError, SiteError
from vlmbind.core.sites import resolve_sites
from vlmbind.engine.patching import (
    attribution_diffs,
    exact_diffs,
    integrated_gradients_diffs,
    naive_diffs,
    packable,
    prefix_end,
)
from vlmbind.tiny.qwen3_5 import build_qwen3_5

LINEAR, FULL = (0, 2), (1, 3)
TWO_PROMPTS = [PROMPT, "the red object is a"]


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    return get_tiny("tiny-qwen3_5")


@pytest.fixture(scope="module")
def batch(vlm):
    """A left-padded batch of two."""
    return vlm.prepare([draw_scene(0), draw_scene(1)], TWO_PROMPTS)


@pytest.fixture(scope="module")
def one(vlm):
    """One prompt: half a forward's cost (a DeltaNet forward on CPU is the slow part of this file)."""
    return vlm.prepare(draw_scene(0), PROMPT)


def _slice_hook(head: int, d_head: int, value):
    """A plain forward pre-hook writing ``value`` (``B P D`` or a scalar) into one head's slice of the projection's
    input: the reference for vlmbind's head edits."""
    def hook(module, args):
        x = args[0].clone()
        x[..., head * d_head:(head + 1) * d_head] = value
        return (x, *args[1:])
    return hook


# ---- declarations -------------------------------------------------------------------------------------------------
def test_declared_paths_and_the_two_layer_kinds(vlm):
    a, text = vlm.adapter, vlm.model.model.language_model
    assert adapter_class_for_config(vlm.model.config) is type(a)
    assert [a.layer_kind(l) for l in range(4)] == ["linear_attention", "full_attention"] * 2
    assert a.pattern_layers() == list(FULL) and a.recurrent_layers() == list(LINEAR) and a.head_layers() == [0, 1, 2, 3]
    paths = a.declared_paths()
    assert paths["projector"] is vlm.model.model.visual.merger and a.n_deepstack == 0
    assert paths["vision_blocks"] is vlm.model.model.visual.blocks and a.n_vision_layers == 3
    assert paths["linear_o_proj"] is text.layers[0].linear_attn.out_proj
    assert paths["o_proj"] is text.layers[1].self_attn.o_proj
    for layer in LINEAR:
        assert type(a.attention_module(layer)).__name__ == "Qwen3_5GatedDeltaNet"
        assert a.o_proj_module(layer) is vlm.model.get_submodule(a.o_proj_path(layer))
    for layer in FULL:
        assert type(a.attention_module(layer)).__name__ == "Qwen3_5Attention"
        assert a.o_proj_path(layer).endswith(f"{layer}.self_attn.o_proj")
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model) == (4, 4, 2, 32, 128)


def test_shapes_on_both_layer_kinds(vlm, one):
    batch = one
    b, p = batch.inputs["input_ids"].shape
    out = vlm.run(batch, sites=["blocks.*.attn.hook_z", "blocks.*.attn.hook_pattern", "blocks.*.hook_attn_out"])
    assert sorted(k for k in out.cache if k.endswith("hook_pattern")) == [f"blocks.{l}.attn.hook_pattern" for l in FULL]
    for layer in range(4):
        assert out[f"blocks.{layer}.attn.hook_z"].shape == (b, p, 4, 32)
        assert out[f"blocks.{layer}.hook_attn_out"].shape == (b, p, 128)
    for layer in FULL:
        assert out[f"blocks.{layer}.attn.hook_pattern"].shape == (b, 4, p, p)


def test_deltanet_z_is_the_gated_norm_of_each_head_alone(vlm, one):
    """z of a DeltaNet layer is ``out_proj``'s input; head h's slice is the delta-rule output of head h alone,
    RMS-normed over that head and gated by its own slice of ``in_proj_z``: nothing mixes heads before ``out_proj``."""
    mixer = vlm.adapter.attention_module(0)
    seen = {}
    handle = mixer.norm.register_forward_hook(lambda m, args, out: seen.update(core=args[0], gate=args[1], out=out))
    try:
        z = vlm.capture(one, "blocks.0.attn.hook_z")["blocks.0.attn.hook_z"]
    finally:
        handle.remove()
    b, p = z.shape[:2]
    assert seen["core"].shape == seen["gate"].shape == (b * p * 4, 32)  # one row per (token, head): per-head norm
    torch.testing.assert_close(z, seen["out"].reshape(b, p, 4, 32), atol=0, rtol=0)


# ---- identity interventions ---------------------------------------------------------------------------------------
def test_identity_interventions_are_exact_on_both_kinds(vlm, one):
    batch = one
    sites = ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]  # a DeltaNet layer and a softmax one
    run = vlm.run(batch, sites=sites)
    patches = [vb.PatchHeads(layer=l, heads=[0, 3], positions=[-2, -1], values=run[s][:, -2:][:, :, [0, 3]])
               for l, s in zip((0, 1), sites)]
    adds = [vb.AddToHeads(layer=l, heads=[1], positions=[-1], vector=torch.ones(32), alpha=0.0) for l in (0, 1)]
    for interventions in (patches, adds):
        torch.testing.assert_close(vlm.logits(batch, interventions), run.logits, atol=0, rtol=0)


# ---- heads of a DeltaNet layer ------------------------------------------------------------------------------------
def test_deltanet_head_edits_equal_a_plain_hook_on_out_proj(vlm, one):
    """Patching and zero-ablating head 2 of DeltaNet layer 2 (mean ablation writes another constant) give exactly the logits of a plain forward
    pre-hook writing that head's slice of ``out_proj``'s input: the edit reaches the output only through the head,
    and leaves the layer's other heads as they were."""
    layer, head = 2, 2
    site = f"blocks.{layer}.attn.hook_z"
    out_proj = vlm.adapter.o_proj_module(layer)
    clean = vlm.run(one, sites=site)
    z_other = vlm.capture(vlm.prepare(draw_scene(5), PROMPT), site)[site]
    positions = list(range(z_other.shape[1]))
    cases = [
        (vb.PatchHeads(layer=layer, heads=[head], positions=positions, values=z_other[:, :, [head]]),
         z_other[:, :, head]),
        (vb.AblateHeads(layer=layer, heads=[head], mode="zero"), 0.0),
    ]
    for intervention, value in cases:
        ours = vlm.run(one, sites=site, interventions=[intervention])
        handle = out_proj.register_forward_pre_hook(_slice_hook(head, 32, value))
        try:
            with torch.no_grad():
                theirs = vlm.model(**one.inputs, use_cache=False).logits
        finally:
            handle.remove()
        torch.testing.assert_close(ours.logits, theirs, atol=0, rtol=0, msg=lambda m, i=intervention: f"{i}: {m}")
        assert (ours.logits - clean.logits).abs().max() > 1e-3, intervention
        torch.testing.assert_close(ours[site][:, :, [0, 1, 3]], clean[site][:, :, [0, 1, 3]], atol=0, rtol=0)


# ---- patterns exist on the softmax layers only ---------------------------------------------------------------------
def test_patterns_and_image_attention_on_deltanet_layers_are_named_errors(vlm, one):
    batch = one
    for layer in LINEAR:
        with pytest.raises(NoAttentionPatternError, match=rf"layer {layer} .*linear_attention.*layers \[1, 3\]"):
            vlm.capture(batch, f"blocks.{layer}.attn.hook_pattern")
        with pytest.raises(NoAttentionPatternError, match=r"layers \[1, 3\] have them"):
            vlm.logits(batch, [vb.ZeroImageAttention(layer=layer, heads=[0])])
        with pytest.raises(NoAttentionPatternError, match="linear_attention"):
            with vlm.ablate([(layer, 1)], mode="image_attention"):
                pass
    # a wildcard skips them; the error is both a SiteError and an InterventionError
    assert [s.layer for s in vlm.sites("blocks.*.attn.hook_pattern")] == list(FULL)
    assert issubclass(NoAttentionPatternError, SiteError) and issubclass(NoAttentionPatternError, InterventionError)
    # on the softmax layers it is accepted (tests/engine/test_hooks.py runs it on every family's layer 1)
    vb.ZeroImageAttention(layer=FULL[0], heads=[0]).check(vlm.adapter)


def test_deltanet_heads_unlike_the_attention_heads_are_refused_by_name():
    """Checkpoints have twice as many DeltaNet value heads as attention heads, of half the width: the same
    ``out_proj`` width, so a reshape would merge pairs of heads silently. Those layers' per-head sites refuse."""
    model, processor = build_qwen3_5(0, linear_value_heads=8, vision_depth=1)
    a = adapter_class_for_config(model.config)(model, processor)
    assert a.o_proj_module(0).in_features == a.o_proj_module(1).in_features == 4 * 32
    assert a.head_layers() == list(FULL)
    absent = a.absent_sites()
    with pytest.raises(HeadLayoutError, match=r"layer 0 .*4 heads of 32.*layers \[1, 3\]"):
        resolve_sites("blocks.0.attn.hook_z", a.n_layers, a.n_vision_layers, absent=absent)
    with pytest.raises(HeadLayoutError, match="layer 2"):
        vb.AblateHeads(layer=2, heads=[0]).check(a)
    hits = resolve_sites("blocks.*.attn.hook_z", a.n_layers, a.n_vision_layers, absent=absent)
    assert [s.layer for s in hits] == list(FULL)
    # every locate method, gradient ones included, refuses those layers' heads even given values of the right shape
    odd = vb.VLM(model, processor, "odd-deltanet", "test")
    pair = vb.stimuli.scene_pairs(1, "id_selection", 0, n_objects=3)[0]
    task = scene_task(odd, pair, list(FULL))
    task = replace(task, values={**task.values, 0: torch.zeros_like(task.values[FULL[0]])})
    for method in (naive_diffs, exact_diffs, attribution_diffs, integrated_gradients_diffs):
        with pytest.raises(HeadLayoutError, match=r"cannot patch heads of layer 0: .*layers \[1, 3\]"):
            method(odd, task, [(0, 1), (1, 0)])
    assert np.isfinite(attribution_diffs(odd, task, [(1, 0)])[1]).all()


def test_the_moe_variant_runs_the_same_declarations():
    """Qwen3.5-MoE: same layer kinds and named errors; ``hook_mlp_out`` is the sparse block's whole output (routed
    experts plus the gated shared expert); DeltaNet head ablation equals a plain hook on ``out_proj``. (The generic
    tests run it through everything else.)"""
    moe = get_tiny("tiny-qwen3_5_moe")
    model, a = moe.model, moe.adapter
    assert type(a).__name__ == "Qwen35MoeAdapter" and a.pattern_layers() == list(FULL)
    block = a.mlp_module(0)
    assert type(block).__name__ == "Qwen3_5MoeSparseMoeBlock"
    one = moe.prepare(draw_scene(0), PROMPT)
    seen = []
    handle = block.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        run = moe.run(one, sites=["blocks.0.hook_mlp_out"], interventions=[vb.AblateHeads(layer=0, heads=[1])])
    finally:
        handle.remove()
    torch.testing.assert_close(run["blocks.0.hook_mlp_out"], seen[0], atol=0, rtol=0)
    handle = a.o_proj_module(0).register_forward_pre_hook(_slice_hook(1, 32, 0.0))
    try:
        with torch.no_grad():
            theirs = model(**one.inputs, use_cache=False).logits
    finally:
        handle.remove()
    torch.testing.assert_close(run.logits, theirs, atol=0, rtol=0)
    with pytest.raises(NoAttentionPatternError, match="layer 2"):
        moe.sites("blocks.2.attn.hook_pattern")


# ---- the token grid -----------------------------------------------------------------------------------------------
def test_square_grid_boxes_and_token_layout(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti, tok = batch.index[0], vlm.adapter.tokenizer
    assert [(g.name, g.shape) for g in ti.grids] == [("image", (7, 7))]
    start = int(np.flatnonzero(ti.input_ids == tok.convert_tokens_to_ids("<|vision_start|>"))[0])
    end = int(np.flatnonzero(ti.input_ids == tok.convert_tokens_to_ids("<|vision_end|>"))[0])
    np.testing.assert_array_equal(ti.grid().positions, np.arange(start + 1, end).reshape(7, 7))
    edges = 32.0 * np.arange(8)
    np.testing.assert_allclose(ti.grid().boxes, expected_boxes(edges, edges))


def test_non_square_image_is_resized_to_multiples_of_32(vlm):
    batch = vlm.prepare(draw_scene(1, (320, 224)), PROMPT)
    grid = batch.index[0].grid()
    assert grid.shape == (5, 8) and batch.inputs["image_grid_thw"][0].tolist() == [1, 10, 16]
    np.testing.assert_allclose(grid.boxes, expected_boxes(40.0 * np.arange(9), 44.8 * np.arange(6)))


def test_painting_a_cell_changes_only_the_token_covering_it(vlm):
    """With the tower's attention silenced, painting the middle of cell (3, 6)'s box changes exactly the position
    ``positions_covering`` returns in the layer-0 input."""
    image = draw_scene(3, (320, 224))
    clean = vlm.prepare(image, PROMPT)
    ti = clean.index[0]
    x0, y0, x1, y1 = ti.grid().boxes[3, 6]
    mx, my = 0.3 * (x1 - x0), 0.3 * (y1 - y0)
    box = (x0 + mx, y0 + my, x1 - mx, y1 - my)
    painted = image.copy()
    ImageDraw.Draw(painted).rectangle(
        [int(np.ceil(box[0])), int(np.ceil(box[1])), int(np.floor(box[2])) - 1, int(np.floor(box[3])) - 1],
        fill=(255, 0, 255))
    with silenced_vision_attention(vlm):
        before, after = (vlm.capture(b, "blocks.0.hook_resid_pre")["blocks.0.hook_resid_pre"][0]
                         for b in (clean, vlm.prepare(painted, PROMPT)))
    expected = ti.positions_covering(box)
    assert len(expected) == 1 and expected[0] == ti.grid().positions[3, 6]
    np.testing.assert_array_equal(np.flatnonzero((before - after).abs().amax(-1).numpy() > 1e-6), expected)


# ---- exact == naive, without prefix-cache reuse ----------------------------------------------------------------------
def test_the_deltanet_cache_cannot_be_cut_back_to_a_prefix(vlm, one):
    """Why the exact method reuses no prefix here: after the whole prompt, a DeltaNet layer's cache holds its
    recurrent state at the end, not the prefix's, and keys cannot be sliced off it as an attention cache's can."""
    batch = one
    inputs = vlm.model_inputs(batch)
    positions = vlm.adapter.position_ids(inputs)
    start = int(batch.index[0].image_positions.max()) + 3
    with torch.no_grad():
        full = vlm.model(**inputs, position_ids=positions, past_key_values=DynamicCache(config=vlm.model.config),
                         use_cache=True).past_key_values
        prefix_inputs = {k: (v[:, :start] if torch.is_tensor(v) and v.shape == inputs["input_ids"].shape else v)
                         for k, v in inputs.items()}
        prefix = vlm.model(**prefix_inputs, position_ids=positions[..., :start],
                           past_key_values=DynamicCache(config=vlm.model.config), use_cache=True).past_key_values
    state_full, state_prefix = full.layers[0].recurrent_states[0], prefix.layers[0].recurrent_states[0]
    assert state_full.shape == state_prefix.shape and (state_full - state_prefix).abs().max() > 1e-3
    assert prefix_end(vlm, batch, inputs, start) == 0 and not packable(vlm)


def _pushed(task, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return replace(task, values={l: v + 30.0 * v.std() * torch.randn(v.shape, generator=gen)
                                 for l, v in task.values.items()})


# the last token; a mid-prompt span; a DeltaNet head and a softmax head each
@pytest.mark.parametrize(("condition", "heads"), [("id_selection", [(0, 1), (3, 3)]),
                                                  ("id_retrieval", [(1, 2), (2, 0)])])
def test_exact_equals_naive_on_both_layer_kinds(vlm, condition, heads):
    pair = vb.stimuli.scene_pairs(1, condition, 0, n_objects=3)[0]
    task = _pushed(scene_task(vlm, pair, range(vlm.n_layers)))
    assert len(task.positions) == (1 if condition == "id_selection" else 2)
    clean, naive = naive_diffs(vlm, task, heads)
    effects = naive - clean
    assert np.abs(effects).max() > 2e-3, "effects too small for the comparison to mean anything"
    # auto and batched both fall back to whole-prompt runs from each head's layer (prefix_end is 0)
    c, exact = exact_diffs(vlm, task, heads, layout="batched")
    assert c == pytest.approx(clean, abs=1e-5)
    np.testing.assert_allclose(exact - c, effects, atol=1e-4 * np.ptp(effects) + 1e-6)
    for layout in ("packed", "single"):
        with pytest.raises(InputError, match=layout):
            exact_diffs(vlm, task, heads, layout=layout)


# ---- nnsight and TransformerLens ----------------------------------------------------------------------------------
def test_nnsight_sees_the_same_z_on_both_kinds(vlm, one):
    nn_model = vlm.nnsight()
    with torch.no_grad(), nn_model.trace(**one.inputs, use_cache=False):
        # no comprehension: nnsight traces the block's own statements
        saved_linear = vlm.nnsight_module(nn_model, vlm.adapter.o_proj_path(0)).input.save()
        saved_full = vlm.nnsight_module(nn_model, vlm.adapter.o_proj_path(1)).input.save()
    out = vlm.run(one, sites=["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"])
    b, p = one.inputs["input_ids"].shape
    for layer, x in zip((0, 1), (saved_linear, saved_full)):
        torch.testing.assert_close(out[f"blocks.{layer}.attn.hook_z"], x.reshape(b, p, 4, 32), atol=0, rtol=0)


def test_transformer_lens_deltanet_hooks_agree(vlm, batch):
    """TL names the DeltaNet mixer ``blocks.{l}.linear_attn``, with no ``hook_z``: its recurrence output and gate,
    through the layer's own gated norm, give vlmbind's z there, and its output is vlmbind's ``hook_attn_out``
    (tests/engine/test_transformer_lens.py checks the shared names on every layer, attn.* on the softmax ones)."""
    from vlmbind.engine.interop import bridge_inputs, transformer_lens_bridge

    bridge = transformer_lens_bridge(vlm)
    ids, kwargs = bridge_inputs(vlm, batch)
    names = [f"blocks.0.linear_attn.{h}" for h in ("hook_recurrence_out", "hook_gate_input", "hook_out")]
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=names, **kwargs)
        hf = vlm.model(**batch.inputs, use_cache=False).logits
        torch.testing.assert_close(logits, hf, atol=1e-5, rtol=0)
        core, gate, mixer_out = (cache[n] for n in names)
        z = vlm.adapter.attention_module(0).norm(core.reshape(-1, 32), gate.reshape(-1, 32)).reshape(core.shape)
    ours = vlm.run(batch, sites=["blocks.0.attn.hook_z", "blocks.0.hook_attn_out"])
    torch.testing.assert_close(ours["blocks.0.attn.hook_z"], z, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["blocks.0.hook_attn_out"], mixer_out, atol=1e-5, rtol=0)
