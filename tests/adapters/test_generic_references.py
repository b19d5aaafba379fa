"""vlmbind's captures and interventions against independent references: HF outputs and nnsight traces."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPT, draw_scene

import vlmbind as vb
from vlmbind.engine.hooks import ATTENTION_IMPL


@pytest.fixture
def batch(tiny):
    return tiny.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "the red object is a"])


def test_patterns_and_residuals_equal_hf_outputs(tiny, batch):
    ref = tiny.model(**batch.inputs, output_attentions=True, output_hidden_states=True, use_cache=False)
    out = tiny.run(batch, sites=["blocks.*attn.hook_pattern", "blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"])
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    hidden = ref.hidden_states  # embeddings, then each layer's output (the last after the final norm)
    # Qwen3-VL's DeepStack adds image features between layers 0..k-1 and 1..k: there the next layer's input is not
    # HF's hidden state (tests/adapters/test_family_qwen3_vl.py checks that the difference is exactly the injection)
    injected = len(getattr(tiny.adapter, "deepstack_vision_layers", ()))
    # HF records one pattern per softmax layer: the declared pattern layers, in order (every layer but Qwen3.5's
    # DeltaNet; Llama-3.2-Vision's cross-attention layers record theirs over the image keys, cross_attn.hook_pattern)
    patterns = tiny.adapter.pattern_layers()
    assert len(ref.attentions) == len(patterns)
    for layer, reference in zip(patterns, ref.attentions):
        torch.testing.assert_close(out[tiny.adapter.pattern_site(layer)], reference, atol=1e-6, rtol=0)
    for layer in range(tiny.n_layers):
        if not 0 < layer <= injected:
            torch.testing.assert_close(out[f"blocks.{layer}.hook_resid_pre"], hidden[layer], atol=1e-6, rtol=0)
        if layer < tiny.n_layers - 1:
            torch.testing.assert_close(out[f"blocks.{layer}.hook_resid_post"], hidden[layer + 1], atol=1e-6, rtol=0)


def test_vlmbind_eager_equals_hf_eager_and_sdpa_patterns_work(tiny, batch):
    """Pattern capture switches the text model to vlmbind's eager function; logits must not move."""
    patterns = tiny.adapter.pattern_layers()
    first, second = patterns[0], patterns[1 % len(patterns)]
    eager = tiny.logits(batch)
    with_pattern = tiny.run(batch, sites=tiny.adapter.pattern_site(first))
    torch.testing.assert_close(with_pattern.logits, eager, atol=1e-6, rtol=0)
    cfg = tiny.adapter.text_config
    before = cfg._attn_implementation
    cfg._attn_implementation = "sdpa"
    try:
        sdpa = tiny.run(batch, sites=tiny.adapter.pattern_site(second))
        assert cfg._attn_implementation == "sdpa"
    finally:
        cfg._attn_implementation = before
    assert cfg._attn_implementation != ATTENTION_IMPL
    ref = tiny.model(**batch.inputs, output_attentions=True, use_cache=False)
    torch.testing.assert_close(sdpa[tiny.adapter.pattern_site(second)], ref.attentions[patterns.index(second)],
                               atol=1e-6, rtol=0)


def test_z_equals_nnsight_o_proj_input(tiny, batch):
    nn_model = tiny.nnsight()
    saved = []
    with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
        for layer in range(tiny.n_layers):
            o_proj = tiny.nnsight_module(nn_model, tiny.adapter.o_proj_path(layer))
            saved.append(o_proj.input.save())
    out = tiny.run(batch, sites="blocks.*attn.hook_z")  # attn.hook_z and cross_attn.hook_z
    b, p = batch.inputs["input_ids"].shape
    for layer in range(tiny.n_layers):
        ref = saved[layer].reshape(b, p, tiny.n_heads, tiny.adapter.d_head)
        torch.testing.assert_close(out[tiny.adapter.z_site(layer)], ref, atol=0, rtol=0)


def test_head_patch_equals_nnsight_patch(tiny):
    clean = tiny.prepare(draw_scene(0), PROMPT)
    corrupt = tiny.prepare(draw_scene(7), PROMPT)
    layer, head, d = tiny.n_layers - 2, 1, tiny.adapter.d_head
    positions = [-1, -2]
    site = tiny.adapter.z_site(layer)  # Llama-3.2-Vision: layer 3 is a cross-attention layer
    z_corrupt = tiny.capture(corrupt, site)[site]
    values = z_corrupt[:, positions][:, :, [head]]
    ours = tiny.logits(clean, [vb.PatchHeads(layer=layer, heads=[head], positions=positions, values=values)])

    nn_model = tiny.nnsight()
    path = tiny.adapter.o_proj_path(layer)
    seq = clean.seq_len
    with torch.no_grad(), nn_model.trace(**clean.inputs, use_cache=False):
        x = tiny.nnsight_module(nn_model, path).input
        for k, pos in enumerate(positions):
            x[:, seq + pos, head * d : (head + 1) * d] = values[:, k, 0]
        logits = nn_model.output.logits.save()
    torch.testing.assert_close(ours, logits, atol=1e-6, rtol=0)
    clean_logits = tiny.logits(clean)
    assert (ours - clean_logits).abs().max() > 1e-4, "the patch must change something for the test to mean anything"


def test_identity_interventions_are_exact(tiny, batch):
    clean = tiny.logits(batch)
    layer = 1
    heads = list(range(tiny.n_heads))
    site = tiny.adapter.z_site(layer)
    z = tiny.capture(batch, site)[site]
    self_patch = vb.PatchHeads(layer=layer, heads=heads, positions=list(range(batch.seq_len)), values=z)
    torch.testing.assert_close(tiny.logits(batch, [self_patch]), clean, atol=0, rtol=0)
    zero_alpha = vb.AddToHeads(layer=layer, heads=heads, positions=[-1], vector=torch.ones(tiny.adapter.d_head),
                               alpha=0.0)
    torch.testing.assert_close(tiny.logits(batch, [zero_alpha]), clean, atol=0, rtol=0)
    one = tiny.prepare(draw_scene(0), PROMPT)
    means = tiny.head_means(one, layer, heads, per_position=True)
    mean_self = vb.AblateHeads(layer=layer, heads=heads, mode="mean", means=means)
    torch.testing.assert_close(tiny.logits(one, [mean_self]), tiny.logits(one), atol=0, rtol=0)


def test_residual_stream_decomposes(tiny, batch):
    """resid_post = resid_pre + attn_out + mlp_out: the two outputs are exactly what each block adds (times the
    scale a Gemma-4 layer puts on the whole residual stream at its end, ``adapter.residual_scale``)."""
    sites = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", "blocks.*.hook_attn_out", "blocks.*.hook_mlp_out"]
    out = tiny.run(batch, sites=sites)
    for layer in range(tiny.n_layers):
        total = out[f"blocks.{layer}.hook_resid_pre"] + out[f"blocks.{layer}.hook_attn_out"] + out[
            f"blocks.{layer}.hook_mlp_out"]
        scale = tiny.adapter.residual_scale(layer)
        total = total if scale is None else scale * total
        torch.testing.assert_close(total, out[f"blocks.{layer}.hook_resid_post"], atol=1e-5, rtol=1e-5)


def test_projector_rows_are_what_the_language_model_receives(tiny, batch):
    """``projector.hook_out`` holds the features the language model receives at its image tokens, in sequence order
    (Qwen2.5-VL: after the tower undoes its window permutation; Molmo2 adds them to the image tokens' embeddings),
    except where the adapter says the model regroups them afterwards (LLaVA-OneVision's tiles)."""
    out = tiny.run(batch, sites=["projector.hook_out", "blocks.0.hook_resid_pre"])
    rows = out["projector.hook_out"].reshape(len(batch), -1, tiny.adapter.d_model)
    # hyper-connection families (Qwen4-Exp) copy the embeddings into each of their residual streams: the first
    received = out["blocks.0.hook_resid_pre"][..., : tiny.adapter.d_model]
    if tiny.family == "molmo2":
        received = received - tiny.model.get_input_embeddings()(batch.inputs["input_ids"])
    matches = []
    for i, index in enumerate(batch.index):
        got = received[i, torch.as_tensor(index.image_positions)]
        matches.append(got.shape == rows[i].shape and torch.allclose(got, rows[i], atol=1e-5))
    assert all(matches) == tiny.adapter.projector_in_sequence_order, tiny.family
