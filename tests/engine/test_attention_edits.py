"""Attention steering and knockout (scores edited before the softmax): the steered row is the clean row restricted to
the chosen keys and renormalised, a knockout the clean row without them, renormalised; steering to every key is the
identity, bit for bit; a cached generation steers the same absolute positions as full forwards; bad input is refused
by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny

import vlmbind as vb
from vlmbind.core.errors import NoAttentionPatternError
from vlmbind.engine.decoding import greedy_decode
from vlmbind.engine.hooks import SCORE_EDITS

# M-RoPE, a bidirectional image block with sliding layers, cross-attention keys
FAMILIES = ("tiny-qwen2_5_vl", "tiny-gemma3", "tiny-mllama")


def _setup(name: str):
    vlm = get_tiny(name)
    batch = vlm.prepare([draw_scene(0), draw_scene(3)], [PROMPT, "the red object is a"])
    a = vlm.adapter
    layer = a.cross_attention_layers()[0] if a.cross_attention_layers() else a.pattern_layers()[-1]
    if a.image_tokens_in_sequence:
        keys = [ti.image_positions[::3] for ti in batch.index]
    else:
        keys = [np.arange(0, len(ti.key_grids[0].positions.reshape(-1)), 3) for ti in batch.index]
    return vlm, batch, layer, keys


@pytest.mark.parametrize("name", FAMILIES)
def test_steered_and_blocked_rows_are_the_clean_row_restricted_and_renormalised(name):
    vlm, batch, layer, keys = _setup(name)
    site = vlm.adapter.pattern_site(layer)
    clean = vlm.run(batch, sites=site)[site]
    last = [[ti.last_position] for ti in batch.index]
    heads = [0, vlm.n_heads - 1]
    for kind in (vb.SteerAttention, vb.BlockAttention):
        edited = vlm.run(batch, sites=site, interventions=[
            kind(layer=layer, heads=heads, keys=keys, query_positions=last)])[site]
        for row, ti in enumerate(batch.index):
            q = ti.last_position
            named = torch.zeros(clean.shape[-1], dtype=torch.bool)
            named[torch.as_tensor(keys[row])] = True
            kept = named if kind is vb.SteerAttention else ~named
            for h in heads:
                expected = torch.where(kept, clean[row, h, q], torch.zeros(()))
                torch.testing.assert_close(edited[row, h, q], expected / expected.sum(), atol=2e-6, rtol=1e-4)
            other = [h for h in range(vlm.n_heads) if h not in heads]
            torch.testing.assert_close(edited[row, other], clean[row, other], atol=0, rtol=0)
            earlier = [p for p in range(clean.shape[2]) if p != q]
            torch.testing.assert_close(edited[row][:, earlier], clean[row][:, earlier], atol=0, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_steering_to_every_key_is_exact(name):
    vlm, batch, layer, _ = _setup(name)
    site = vlm.adapter.pattern_site(layer)
    reference = vlm.run(batch, sites=site)  # vlmbind's eager attention, no edit
    every = np.arange(reference[site].shape[-1])
    for queries in (None, [[ti.last_position] for ti in batch.index]):
        steered = vlm.run(batch, sites=site, interventions=[
            vb.SteerAttention(layer=layer, heads=list(range(vlm.n_heads)), keys=every, query_positions=queries)])
        torch.testing.assert_close(steered.logits, reference.logits, atol=0, rtol=0)
    assert not any(hasattr(m, SCORE_EDITS) for m in vlm.model.modules())


def test_cached_generation_steers_the_same_positions_as_full_forwards():
    vlm, batch, layer, keys = _setup("tiny-qwen2_5_vl")
    last = torch.as_tensor(batch.last_positions)[:, None]
    steps = 3
    heads = list(range(vlm.n_heads))
    site = vlm.adapter.pattern_site(layer)
    cached, caps = vlm.generate(batch, steps, sites=site, interventions=[vb.SteerAttention(
        layer=layer, heads=heads, keys=keys, query_positions=last + torch.arange(steps)[None])])
    full = greedy_decode(vlm, batch, (), steps, step_interventions=lambda s: [vb.SteerAttention(
        layer=layer, heads=heads, keys=keys, query_positions=last + torch.arange(s + 1)[None])])
    assert cached == full
    for step, pattern in enumerate(caps[site]):  # every step's newest query attends to the keys only
        for row in range(len(batch)):
            outside = np.setdiff1d(np.arange(pattern.shape[-1]), keys[row])
            assert pattern[row, :, -1, outside].abs().max() == 0, step
            assert pattern[row, :, -1, keys[row]].sum(-1).sub(1).abs().max() < 1e-5


def test_bad_steering_is_refused_by_name():
    vlm, batch, layer, _ = _setup("tiny-qwen2_5_vl")
    late = [[len(ti) - 1] for ti in batch.index]
    with pytest.raises(vb.InterventionError, match="sees none of the keys"):
        vlm.logits(batch, [vb.SteerAttention(layer=layer, heads=[0], keys=late, query_positions=[[1], [1]])])
    with pytest.raises(vb.InterventionError, match="fall outside"):
        vlm.logits(batch, [vb.SteerAttention(layer=layer, heads=[0], keys=[10_000])])
    with pytest.raises(vb.InterventionError, match="one list per row"):
        vlm.logits(batch, [vb.BlockAttention(layer=layer, heads=[0], keys=[[1], [2], [3]])])
    with pytest.raises(vb.InterventionError, match="names no key"):
        vlm.logits(batch, [vb.BlockAttention(layer=layer, heads=[0], keys=[[1], []])])
    hybrid = get_tiny("tiny-qwen3_5")
    linear = next(l for l in range(hybrid.n_layers) if l not in hybrid.adapter.pattern_layers())
    with pytest.raises(NoAttentionPatternError):
        hybrid.logits(hybrid.prepare(draw_scene(0), PROMPT), [vb.SteerAttention(layer=linear, heads=[0], keys=[0])])
    assert not any(hasattr(m, SCORE_EDITS) for m in vlm.model.modules())
