"""Qwen3-VL, dense and MoE: the 32 px token grid and its boxes, what the language model receives (the merger's rows,
then the DeepStack injections between layers, and their ``deepstack.{i}.hook_out`` sites), painting locality,
exact == naive patching, nnsight and TransformerLens.

Hand computations (tiny processor: ``min_pixels = max_pixels = 224**2``, 16 px patches, 2x2 merge, so resized sides
are multiples of 32):

* 224 x 224 is kept: 14 x 14 patches, a 7 x 7 token grid, token ``(r, c)`` covering ``[32c, 32c + 32) x [32r, ...)``.
* 320 x 224 (W x H): rounded it would be 320 x 224 = 71680 px > 224**2, so both sides are divided by
  ``beta = sqrt(320 * 224 / 224**2) = 1.195`` and floored to multiples of 32: 256 x 160, a 5 x 8 grid; a token covers
  ``32 * 320 / 256 = 40`` original px across and ``32 * 224 / 160 = 44.8`` down.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from family_checks import check_exact_equals_naive, painted_cell_changes
from helpers import PROMPT, draw_scene, expected_boxes, get_tiny

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.analysis.mediation import scene_task
from vlmbind.core.errors import SiteError
from vlmbind.engine.activations import capture
from vlmbind.engine.patching import exact_diffs, naive_diffs

NAMES = ("tiny-qwen3_vl", "tiny-qwen3_vl_moe")
TWO_PROMPTS = [PROMPT, "the red object is a"]


@pytest.fixture(scope="module", params=NAMES)
def vlm(request) -> vb.VLM:
    return get_tiny(request.param)


@pytest.fixture(scope="module")
def dense() -> vb.VLM:
    return get_tiny("tiny-qwen3_vl")


@pytest.fixture(scope="module")
def moe() -> vb.VLM:
    return get_tiny("tiny-qwen3_vl_moe")


class _DeepStackCapture:
    """Records what each DeepStack merger returns (``N d_model``, image tokens in sequence order) during a call."""

    def __init__(self, vlm: vb.VLM):
        n = len(vlm.adapter.deepstack_vision_layers)
        self.modules = [vlm.adapter.deepstack_merger_module(i) for i in range(n)]
        self.outputs: list[torch.Tensor] = []

    def __enter__(self) -> _DeepStackCapture:
        self.handles = [m.register_forward_hook(lambda mod, args, out: self.outputs.append(out.detach()))
                        for m in self.modules]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


# ---- declarations -------------------------------------------------------------------------------------------------
def test_declared_paths_and_the_moe_blocks(dense, moe):
    for vlm in (dense, moe):
        a = vlm.adapter
        assert adapter_class_for_config(vlm.model.config) is type(a)
        paths = a.declared_paths()
        assert paths["projector"] is vlm.model.model.visual.merger
        assert paths["vision_blocks"] is vlm.model.model.visual.blocks and a.n_vision_layers == 3
        assert a.deepstack_vision_layers == [0, 1] and len(paths["deepstack_mergers"]) == 2
        assert a.deepstack_merger_module(1) is vlm.model.model.visual.deepstack_merger_list[1]
        with pytest.raises(SiteError, match="injections 0..1"):
            a.deepstack_merger_module(2)
        assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model) == (4, 4, 2, 32, 128)
    assert type(dense.adapter.mlp_module(0)).__name__ == "Qwen3VLTextMLP"
    sparse = moe.adapter.mlp_module(0)
    assert type(sparse).__name__ == "Qwen3VLMoeTextSparseMoeBlock"
    assert sparse.experts.num_experts == 4 and sparse.gate.top_k == 2


# ---- the token grid -----------------------------------------------------------------------------------------------
def test_square_grid_boxes_and_token_layout(dense):
    batch = dense.prepare(draw_scene(0), PROMPT)
    ti, tok = batch.index[0], dense.adapter.tokenizer
    assert [(g.name, g.shape) for g in ti.grids] == [("image", (7, 7))]
    start = int(np.flatnonzero(ti.input_ids == tok.convert_tokens_to_ids("<|vision_start|>"))[0])
    end = int(np.flatnonzero(ti.input_ids == tok.convert_tokens_to_ids("<|vision_end|>"))[0])
    # the 49 image tokens are the run between <|vision_start|> and <|vision_end|>, in raster order
    np.testing.assert_array_equal(ti.grid().positions, np.arange(start + 1, end).reshape(7, 7))
    assert ti.roles[start] == "special" and ti.roles[end] == "special"
    edges = 32.0 * np.arange(8)
    np.testing.assert_allclose(ti.grid().boxes, expected_boxes(edges, edges))
    assert dense.adapter.resized_size(batch.inputs, 0) == (224, 224)


def test_non_square_image_is_resized_to_multiples_of_32(dense):
    batch = dense.prepare(draw_scene(1, (320, 224)), PROMPT)
    grid = batch.index[0].grid()
    assert grid.shape == (5, 8)
    assert batch.inputs["image_grid_thw"][0].tolist() == [1, 10, 16]
    assert dense.adapter.resized_size(batch.inputs, 0) == (256, 160)
    np.testing.assert_allclose(grid.boxes, expected_boxes(40.0 * np.arange(9), 44.8 * np.arange(6)))


def test_vision_rows_merge_into_the_projector_rows(vlm):
    """Regrouping the last block's rows by ``vision_row_tokens`` and merging them gives the projector's rows."""
    batch = vlm.prepare(draw_scene(2, (320, 224)), PROMPT)
    last = f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post"
    cache = vlm.run(batch, sites=[last, "projector.hook_out"]).cache
    owner = vlm.adapter.vision_row_tokens(batch.inputs, 0)
    np.testing.assert_array_equal(np.bincount(owner), np.full(40, 4))
    regrouped = cache[last][torch.as_tensor(np.argsort(owner, kind="stable"))]
    with torch.no_grad():
        merged = vlm.model.model.visual.merger(regrouped)
    torch.testing.assert_close(merged, cache["projector.hook_out"], atol=1e-5, rtol=1e-5)


# ---- what the language model receives -----------------------------------------------------------------------------
def test_projector_rows_then_deepstack_injections_reach_the_image_tokens(vlm):
    """``projector.hook_out`` is the layer-0 input at the image tokens; after layer i < 2 the text model adds
    DeepStack merger i's rows there (and nothing elsewhere), so ``resid_pre[i+1] - resid_post[i]`` is exactly that
    injection; later layers hand on their output unchanged. HF's ``hidden_states`` are the layers' outputs."""
    a = vlm.adapter
    batch = vlm.prepare([draw_scene(0), draw_scene(1)], TWO_PROMPTS)
    sites = ["projector.hook_out", "blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"]
    with _DeepStackCapture(vlm) as deepstack:
        out = vlm.run(batch, sites=sites)
    ref = vlm.model(**batch.inputs, output_hidden_states=True, use_cache=False)
    image = batch.inputs["input_ids"] == a.image_token_id  # B P, rows in sequence order (batch row-major)
    features = out["projector.hook_out"]
    assert features.shape == (int(image.sum()), a.d_model) == (98, 128)
    torch.testing.assert_close(out["blocks.0.hook_resid_pre"][image], features, atol=0, rtol=0)
    assert len(deepstack.outputs) == 2 and all(f.shape == features.shape for f in deepstack.outputs)
    for layer in range(a.n_layers - 1):
        post, nxt = out[f"blocks.{layer}.hook_resid_post"], out[f"blocks.{layer + 1}.hook_resid_pre"]
        torch.testing.assert_close(post, ref.hidden_states[layer + 1], atol=1e-6, rtol=0)
        injected = nxt - post
        assert (injected[~image] == 0).all()
        if layer < len(a.deepstack_vision_layers):
            torch.testing.assert_close(injected[image], deepstack.outputs[layer], atol=1e-5, rtol=0)
            assert deepstack.outputs[layer].abs().max() > 1e-2  # the injection is not negligible
        else:
            assert (injected == 0).all()


def test_deepstack_sites_are_the_mergers_rows_the_residual_stream_gains(vlm):
    """``deepstack.{i}.hook_out`` is merger i's output (the same tensor a plain forward hook sees), ``N d_model`` like
    the projector's, and exactly what the residual stream gains at the image tokens between layer i's output and
    layer i+1's input (zero elsewhere)."""
    a = vlm.adapter
    batch = vlm.prepare([draw_scene(0), draw_scene(1)], TWO_PROMPTS)
    sites = ["deepstack.*.hook_out", "projector.hook_out", "blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"]
    with _DeepStackCapture(vlm) as plain:
        out = vlm.run(batch, sites=sites)
    image = batch.inputs["input_ids"] == a.image_token_id
    assert a.n_deepstack == len(plain.outputs) == 2
    for i in range(a.n_deepstack):
        rows = out[f"deepstack.{i}.hook_out"]
        assert rows.shape == out["projector.hook_out"].shape == (98, a.d_model)
        torch.testing.assert_close(rows, plain.outputs[i], atol=0, rtol=0)
        injected = out[f"blocks.{i + 1}.hook_resid_pre"] - out[f"blocks.{i}.hook_resid_post"]
        torch.testing.assert_close(injected[image], rows, atol=1e-5, rtol=0)
        assert (injected[~image] == 0).all()


def test_deepstack_sites_resolve_and_misnamed_ones_are_named_errors(dense):
    names = [s.name for s in dense.sites("deepstack.*.hook_out")]
    assert names == ["deepstack.0.hook_out", "deepstack.1.hook_out"]
    every = [s.name for s in dense.sites("*")]
    assert len(every) == 6 * dense.n_layers + dense.adapter.n_vision_layers + 1 + dense.adapter.n_deepstack
    assert every[-3:] == ["projector.hook_out", *names]
    with pytest.raises(SiteError, match=r"DeepStack injection 2 is out of range.*0\.\.1"):
        dense.sites("deepstack.2.hook_out")
    with pytest.raises(SiteError, match="Did you mean 'deepstack.0.hook_out'"):
        dense.sites("deepstack.0.hook_outt")


def test_a_family_without_deepstack_says_so():
    other = get_tiny("tiny-qwen2_5_vl")
    assert other.adapter.n_deepstack == 0
    assert not [s for s in other.sites("*") if s.component == "deepstack"]
    for name in ("deepstack.0.hook_out", "deepstack.*.hook_out"):
        with pytest.raises(SiteError, match="family has no DeepStack injections"):
            other.sites(name)
    with pytest.raises(SiteError, match="Qwen2.5-VL has no DeepStack injections"):
        other.adapter.deepstack_merger_module(0)


def test_capture_stores_deepstack_rows_aligned_with_the_image_tokens(dense):
    """A capture keeps each example's injection rows as a direct run gives them, one per image token in sequence
    order, so they pool per object like the projector's."""
    data = list(vb.stimuli.scene_description(2, 0, n_objects=3))
    sites = ["projector.hook_out", "deepstack.*.hook_out"]
    acts = capture(dense, data, sites, batch_size=2)
    assert acts.sites == ["projector.hook_out", "deepstack.0.hook_out", "deepstack.1.hook_out"]
    for i, ex in enumerate(data):
        ref = dense.run(dense.prepare(ex.image, ex.prompt), sites=sites).cache
        for site in acts.sites:
            torch.testing.assert_close(acts.tensor(site, i), ref[site], atol=1e-5, rtol=0)
    frame, pooled = acts.objects("deepstack.1.hook_out")
    assert pooled.shape == (len(frame), dense.adapter.d_model) and len(frame) == 6


# ---- painting one cell is local -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "size", "cell"), [
    ("tiny-qwen3_vl", (224, 224), (2, 3)),
    ("tiny-qwen3_vl_moe", (320, 224), (3, 6)),
])
def test_painting_a_cell_changes_only_the_tokens_covering_it(name, size, cell):
    """With the tower's attention silenced each token's features see only its own 2x2 patches, so painting the
    middle of a cell's box (30% margins: resampling reaches a few pixels past a box edge) changes exactly the
    positions ``positions_covering`` returns: in the layer-0 input and in both DeepStack injections."""
    vlm = get_tiny(name)
    p = painted_cell_changes(vlm, draw_scene(3, size), None, cell, record=lambda: _DeepStackCapture(vlm))
    ti, expected = p.index, p.expected
    assert len(expected) == 1 and expected[0] == ti.grid().positions[cell]
    np.testing.assert_array_equal(p.changed, expected)
    clean, painted = (deepstack.outputs for deepstack in p.recorded)
    assert len(clean) == len(painted) == 2
    for before, after in zip(clean, painted):
        rows = np.flatnonzero((before - after).abs().amax(-1).numpy() > 1e-6)
        np.testing.assert_array_equal(ti.image_positions[rows], expected)


# ---- exact == naive -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "condition"), [
    ("tiny-qwen3_vl_moe", "id_selection"),  # the last token
    ("tiny-qwen3_vl", "id_retrieval"),  # a mid-prompt span: the second-to-last object's name
])
def test_exact_equals_naive_across_layouts(name, condition):
    vlm = get_tiny(name)
    task = check_exact_equals_naive(vlm, condition)
    assert len(task.positions) == (1 if condition == "id_selection" else 2)


def test_patch_before_the_image_restarts_inside_the_deepstack_layers_exactly(dense):
    """A patch on an image token has no reusable prefix: each head reruns the prompt from its layer, fed the clean
    residual entering it, which already holds the earlier injections (layers 0 and 1 are inside DeepStack)."""
    pair = vb.stimuli.scene_pairs(1, "id_selection", 0, n_objects=3)[0]
    task = scene_task(dense, pair, range(dense.n_layers))
    index = task.batch.index[0]
    values = {l: torch.randn(2, dense.n_heads, dense.adapter.d_head, generator=torch.Generator().manual_seed(l))
              for l in range(dense.n_layers)}
    task = replace(task, positions=np.array([int(index.image_positions[3]), task.score_position]), values=values)
    heads = [(1, 3), (2, 2)]  # restarts at layer 1 (skipping layer 0 and injection 0) and at 2
    clean, naive = naive_diffs(dense, task, heads)
    c, exact = exact_diffs(dense, task, heads)
    assert np.abs(naive - clean).max() > 2e-3
    np.testing.assert_allclose(exact - c, naive - clean, atol=1e-5)


# ---- nnsight and TransformerLens ----------------------------------------------------------------------------------
def test_nnsight_sees_the_same_residual_stream_and_injection(moe):
    """nnsight's view of layer 0's output, layer 1's input and DeepStack merger 0's output, on the same forward,
    equals vlmbind's ``resid_post`` / ``resid_pre`` captures; the two differ by the merger's rows."""
    a = moe.adapter
    batch = moe.prepare([draw_scene(0), draw_scene(1)], TWO_PROMPTS)
    nn_model = moe.nnsight()
    with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
        # in execution order, as nnsight requires: the vision tower runs before the text layers
        merged = moe.nnsight_module(nn_model, f"{a.deepstack_mergers}.0").output.save()
        post = moe.nnsight_module(nn_model, f"{a.text_layers}.0").output.save()
        pre = moe.nnsight_module(nn_model, f"{a.text_layers}.1").input.save()
    out = moe.run(batch, sites=["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre"])
    torch.testing.assert_close(out["blocks.0.hook_resid_post"], post, atol=0, rtol=0)
    torch.testing.assert_close(out["blocks.1.hook_resid_pre"], pre, atol=0, rtol=0)
    image = batch.inputs["input_ids"] == a.image_token_id
    torch.testing.assert_close((pre - post)[image], merged, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def bridged(vlm) -> dict:
    """A TransformerLens bridge on a copy of the model, and its cache on a left-padded batch of two."""
    from vlmbind.engine.interop import bridge_inputs, transformer_lens_bridge

    batch = vlm.prepare([draw_scene(0), draw_scene(1)], TWO_PROMPTS)
    bridge = transformer_lens_bridge(vlm)
    ids, kwargs = bridge_inputs(vlm, batch)
    sites = [f"blocks.{l}.{h}" for l in range(vlm.n_layers)
             for h in ("attn.hook_z", "attn.hook_pattern", "hook_resid_pre", "hook_resid_post", "hook_mlp_out")]
    vision = ["vision_projector.hook_out"] + [f"vision_encoder.deepstack_mergers.{i}.hook_out" for i in range(2)]
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=sites + vision, **kwargs)
    return dict(batch=batch, bridge=bridge, ids=ids, kwargs=kwargs, logits=logits, cache=cache, sites=sites)


def test_transformer_lens_bridge_agrees(vlm, bridged):
    """Same logits as HF; every vlmbind site equals the bridge's hook of the same name (``hook_mlp_out``: the MoE
    block's routed sum); the projector and DeepStack mergers equal the bridge's vision hooks."""
    batch, cache = bridged["batch"], bridged["cache"]
    assert batch.inputs["attention_mask"].min() == 0, "the batch should be left-padded"
    with torch.no_grad():
        hf = vlm.model(**batch.inputs, use_cache=False).logits
    torch.testing.assert_close(bridged["logits"], hf, atol=1e-5, rtol=0)
    sites = bridged["sites"]
    assert all(name in cache for name in sites), "a hook did not fire on the bridge"
    with _DeepStackCapture(vlm) as deepstack:
        ours = vlm.run(batch, sites=sites + ["projector.hook_out"]).cache
    for name in sites:
        torch.testing.assert_close(ours[name], cache[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(ours["projector.hook_out"], cache["vision_projector.hook_out"], atol=1e-5, rtol=0)
    for i, rows in enumerate(deepstack.outputs):
        torch.testing.assert_close(rows, cache[f"vision_encoder.deepstack_mergers.{i}.hook_out"], atol=1e-5, rtol=0)


def test_transformer_lens_head_ablation_agrees(vlm, bridged):
    layer, head = 1, 2

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    ours = vlm.logits(bridged["batch"], interventions=[vb.AblateHeads(layer=layer, heads=[head], mode="zero")])
    with torch.no_grad():
        theirs = bridged["bridge"].run_with_hooks(
            bridged["ids"], fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)], **bridged["kwargs"])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert (ours - bridged["logits"]).abs().max() > 1e-3

