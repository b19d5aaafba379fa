"""The exact fast patching path equals the naive one-forward-per-head reference on every family, in both layouts,
across chunk boundaries, with stale rope_deltas, and when the patch lies before the image; attribution patching is
the first-order limit of the naive effect; nothing stays hooked after an error."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import get_tiny

import vlmbind as vb
from vlmbind.analysis.mediation import scene_task
from vlmbind.analysis.patching import PatchTask, attribution_diffs, exact_diffs, naive_diffs
from vlmbind.tiny import TINY_NAMES

S = vb.stimuli


def strong_task(vlm, condition: str, seed: int = 0) -> PatchTask:
    """A scene task whose counterfactual values are pushed far from the clean ones, so that head effects reach
    0.002-1 logits and a tolerance of 1e-4 of their range means something on random weights. ``mid_prompt``: the
    id_selection task patched at the two positions before the last one (a span the suffix must carry forward)."""
    mid = condition == "mid_prompt"
    task = scene_task(vlm, S.scene_pairs(1, "id_selection" if mid else condition, seed, n_objects=3)[0],
                      range(vlm.n_layers))
    if mid:
        task = replace(task, positions=np.array([task.score_position - 2, task.score_position - 1]))
        z = vlm.capture(task.batch, "blocks.*.attn.hook_z")
        task.values = {l: z[f"blocks.{l}.attn.hook_z"][0, task.positions] for l in range(vlm.n_layers)}
    gen = torch.Generator().manual_seed(seed)
    values = {l: v + 30.0 * v.std() * torch.randn(v.shape, generator=gen) for l, v in task.values.items()}
    return replace(task, values=values)


def all_heads(vlm):
    return [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads)]


@pytest.mark.parametrize("name", TINY_NAMES)
@pytest.mark.parametrize("condition", ["mid_prompt", "id_selection"])
def test_exact_equals_naive_on_every_family(name, condition):
    vlm = get_tiny(name)
    task = strong_task(vlm, condition)
    heads = all_heads(vlm)
    clean, naive = naive_diffs(vlm, task, heads)
    effects = naive - clean
    assert np.abs(effects).max() > 2e-3, "effects too small for the comparison to mean anything"
    variants = [{}]
    if name in ("tiny-qwen2_5_vl", "tiny-gemma3"):  # M-RoPE; sliding windows shorter than the prefix
        variants += [{"max_tokens": 7}, {"layout": "batched", "max_rows": 5}]
    for kwargs in variants:
        c, exact = exact_diffs(vlm, task, heads, **kwargs)
        assert c == pytest.approx(clean, abs=1e-5)
        np.testing.assert_allclose(exact - c, effects, atol=1e-4 * np.ptp(effects) + 1e-6, err_msg=str(kwargs))


def test_exact_equals_naive_on_the_organism_and_on_its_scenes():
    from vlmbind.evaluate import training_defaults

    vlm = vb.load("organism-p2a")
    kwargs = training_defaults(vlm, "scene", {"n_objects": 3})
    for condition in ("id_selection", "feature_retrieval", "id_retrieval"):
        pairs = S.scene_pairs(3, condition, 1, **kwargs)
        naive = vb.locate(vlm, pairs, method="naive")
        exact = vb.locate(vlm, pairs, method="exact")
        span = np.ptp(naive.per_pair)
        # float32 logits of magnitude ~20 carry ~2e-6 of rounding, whatever the path
        np.testing.assert_allclose(exact.per_pair, naive.per_pair, atol=max(1e-4 * span, 1e-5))


def test_stale_rope_deltas_do_not_matter():
    vlm = get_tiny("tiny-qwen2_5_vl")
    task = strong_task(vlm, "id_selection")
    heads = all_heads(vlm)[:6]
    clean, naive = naive_diffs(vlm, task, heads)
    other = vlm.prepare(S.scene_description(1, 5, n_objects=4)[0].image, "a much longer and different prompt here")
    vlm.model.model.rope_deltas = None
    vlm.model(**other.inputs, use_cache=True)  # leaves this prompt's rope_deltas on the model
    assert vlm.model.model.rope_deltas is not None
    _, exact = exact_diffs(vlm, task, heads)
    np.testing.assert_allclose(exact, naive, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen2_5_vl"])
def test_patch_before_the_image_falls_back_and_stays_exact(name):
    vlm = get_tiny(name)
    task = strong_task(vlm, "id_selection")
    index = task.batch.index[0]
    positions = np.array([int(index.image_positions[3]), task.score_position])
    values = {l: torch.randn(2, vlm.n_heads, vlm.adapter.d_head, generator=torch.Generator().manual_seed(l))
              for l in range(vlm.n_layers)}
    task = replace(task, positions=positions, values=values)
    heads = [(0, 1), (2, 3), (3, 0)]
    clean, naive = naive_diffs(vlm, task, heads)
    c, exact = exact_diffs(vlm, task, heads)
    np.testing.assert_allclose(exact - c, naive - clean, atol=1e-5)


def test_attribution_is_the_first_order_limit():
    vlm = get_tiny("tiny-llava")
    task = scene_task(vlm, S.scene_pairs(1, "id_selection", 0, n_objects=3)[0], range(vlm.n_layers))
    clean_z = vlm.capture(task.batch, "blocks.*.attn.hook_z")
    gen = torch.Generator().manual_seed(0)
    eps = 1e-2
    values = {l: clean_z[f"blocks.{l}.attn.hook_z"][0, task.positions]
              + eps * torch.randn(len(task.positions), vlm.n_heads, vlm.adapter.d_head, generator=gen)
              for l in range(vlm.n_layers)}
    task = replace(task, values=values)
    heads = all_heads(vlm)
    c, naive = naive_diffs(vlm, task, heads)
    ca, attribution = attribution_diffs(vlm, task, heads)
    assert ca == pytest.approx(c, abs=1e-5)
    assert np.abs(naive - c).max() > 1e-4
    np.testing.assert_allclose(attribution - ca, naive - c, atol=0.05 * np.abs(naive - c).max())


def test_locate_methods_agree_and_attribution_is_reported():
    vlm = get_tiny("tiny-molmo2")
    pairs = S.scene_pairs(2, "feature_retrieval", 3, n_objects=3)
    exact = vb.locate(vlm, pairs)
    assert exact.method == "exact"
    naive = vb.locate(vlm, pairs, method="naive")
    np.testing.assert_allclose(exact.per_pair, naive.per_pair, atol=1e-5)
    attribution = vb.locate(vlm, pairs, method="attribution")
    assert attribution.per_pair.shape == naive.per_pair.shape
    assert np.corrcoef(attribution.scores.ravel(), naive.scores.ravel())[0, 1] > 0.5


def test_errors_leave_no_hooks_and_no_skipped_layers():
    vlm = get_tiny("tiny-qwen2_5_vl")
    task = strong_task(vlm, "id_selection")
    bad = replace(task, values={l: v[:, :, :3] for l, v in task.values.items()})  # wrong d_head
    with pytest.raises(Exception):
        exact_diffs(vlm, bad, all_heads(vlm))
    for module in vlm.model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
        assert "forward" not in module.__dict__
    fresh = exact_diffs(vlm, task, all_heads(vlm)[:3])
    np.testing.assert_allclose(fresh[1], naive_diffs(vlm, task, all_heads(vlm)[:3])[1], atol=1e-5)
    with pytest.raises(vb.InputError, match="layout"):
        exact_diffs(vlm, task, all_heads(vlm), layout="diagonal")
