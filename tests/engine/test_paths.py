"""Path patching: the exact method equals the four-forward reference on families with M-RoPE, a bidirectional image
block and post-norms, cross-attention layers and linear-attention layers, through q, k and v and into the logits,
from image and from text positions; a sender patched with its own output changes nothing, exactly; bad edges are
refused and a failure leaves no hook behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import get_tiny

import vlmbind as vb
from vlmbind.analysis.mediation import aligned_scene_pair
from vlmbind.engine.paths import (
    LOGITS,
    Edge,
    PathTask,
    all_edges,
    atp_star_path_diffs,
    attribution_path_diffs,
    exact_path_diffs,
    naive_path_diffs,
)

S = vb.stimuli


def path_task(vlm, senders_at: str, seed: int = 0, strong: bool = True) -> PathTask:
    """An id_selection scene task whose senders sit at the image tokens or at the text tokens and whose receivers
    take every position; ``strong`` pushes the counterfactual values far from the clean ones so that edge effects
    are well above float noise on random weights."""
    pair = S.scene_pairs(1, "id_selection", seed, n_objects=3)[0]
    clean, counterfactual, _, a, a_star = aligned_scene_pair(vlm, pair)
    roles = clean.index[0].roles
    senders = np.flatnonzero(roles == "image") if senders_at == "image" else np.flatnonzero(roles != "image")
    task = PathTask.from_counterfactual(vlm, clean, counterfactual, senders, np.arange(clean.seq_len),
                                        range(vlm.n_layers), a, a_star)
    if strong:
        gen = torch.Generator().manual_seed(seed)
        task.values = {l: v + 30.0 * v.std() * torch.randn(v.shape, generator=gen) for l, v in task.values.items()}
    return task


CASES = [("tiny-qwen2_vl", "text"),   # M-RoPE
         ("tiny-gemma3", "image"),    # bidirectional image block, post-norms, sliding windows
         ("tiny-mllama", "text"),     # cross-attention layers (q only)
         ("tiny-qwen3_5", "text"),    # linear-attention layers (no heads to receive)
         ("tiny-aya_vision", "text")]  # parallel attention and MLP (both read the same normed residual)


@pytest.mark.parametrize("name,senders_at", CASES)
def test_exact_equals_the_reference(name, senders_at):
    vlm = get_tiny(name)
    task = path_task(vlm, senders_at)
    layers = vlm.adapter.head_layers()
    senders = [(layers[0], 1), (layers[1], 2)]
    edges = all_edges(vlm, senders=senders)
    assert {e.channel for e in edges} == {"q", "k", "v", "logits"}
    clean, naive = naive_path_diffs(vlm, task, edges)
    c, exact = exact_path_diffs(vlm, task, edges)
    assert c == pytest.approx(clean, abs=1e-6)
    effects = naive - clean
    reaches_logits = task.score_position in task.sender_positions
    for channel in ("q", "k", "v", "logits"):
        mine = [i for i, e in enumerate(edges) if e.channel == channel]
        if channel == "logits" and not reaches_logits:
            # the residual stream is per position: a write at the image tokens reaches the scored token's logits
            # only through attention, so the direct path is exactly nothing
            assert np.all(exact[mine] == c)
            continue
        assert np.abs(effects[mine]).max() > 1e-3, f"{channel} edges too small for the comparison to mean anything"
    np.testing.assert_allclose(exact - c, effects, atol=1e-4 * np.ptp(effects) + 1e-6)


@pytest.mark.parametrize("name,senders_at", CASES)
def test_attribution_is_the_first_order_limit_of_path_patching(name, senders_at):
    """EAP's estimate of every edge equals exact path patching to first order: with counterfactual sender outputs a
    small step from the clean ones, the two agree up to float noise, through q, k, v (Qwen3.5's gated query
    projection included) and into the logits."""
    vlm = get_tiny(name)
    task = path_task(vlm, senders_at, strong=False)
    z = vlm.capture(task.batch, [vlm.adapter.z_site(l) for l in range(vlm.n_layers)])
    gen = torch.Generator().manual_seed(1)
    task.values = {l: z[vlm.adapter.z_site(l)][0, task.sender_positions] + 1e-2 * torch.randn(v.shape, generator=gen)
                   for l, v in task.values.items()}
    layers = vlm.adapter.head_layers()
    edges = all_edges(vlm, senders=[(layers[0], 1), (layers[1], 2)])
    clean, exact = exact_path_diffs(vlm, task, edges)
    c, estimate = attribution_path_diffs(vlm, task, edges)
    assert c == pytest.approx(clean, abs=1e-6)
    effects = exact - clean
    assert np.abs(effects).max() > 1e-5
    np.testing.assert_allclose(estimate - c, effects, atol=0.02 * np.abs(effects).max() + 1e-6)
    # integrated gradients along so short a path give nearly the same numbers (every head of the sender layers moves
    # at once, so second-order terms remain: a few percent on Qwen3.5's gated linear attention); a bad step count is
    # refused
    _, ig = attribution_path_diffs(vlm, task, edges, steps=2)
    np.testing.assert_allclose(ig - c, effects, atol=0.15 * np.abs(effects).max() + 1e-6)
    with pytest.raises(vb.InputError, match="steps"):
        attribution_path_diffs(vlm, task, edges, steps=0)
    # AtP* computes the receiver's change exactly and linearises only what follows: the same limit, signed without
    # GradDrop; with it, magnitudes, and a direct edge's is its exact effect's
    _, star = atp_star_path_diffs(vlm, task, edges, grad_drop=False)
    np.testing.assert_allclose(star - c, effects, atol=0.02 * np.abs(effects).max() + 1e-6)
    if name != "tiny-qwen2_vl":  # GradDrop costs a backward per layer: one family shows it
        return
    _, dropped = atp_star_path_diffs(vlm, task, edges)
    assert (dropped - c >= 0).all()
    direct = [i for i, e in enumerate(edges) if e.channel == LOGITS]
    np.testing.assert_allclose(dropped[direct] - c, np.abs(effects[direct]), atol=1e-6)


def test_receivers_through_cross_attention_take_only_queries():
    vlm = get_tiny("tiny-mllama")
    cross = vlm.adapter.cross_attention_layers()
    assert vlm.adapter.path_channels(cross[0]) == ("q",)
    edges = all_edges(vlm, senders=[(0, 0)])
    assert {(e.receiver[0], e.channel) for e in edges if e.receiver and e.receiver[0] in cross} == \
        {(l, "q") for l in cross}
    task = path_task(vlm, "text", strong=False)
    with pytest.raises(vb.SiteError, match="k input"):
        exact_path_diffs(vlm, task, [Edge((0, 0), (cross[0], 1), "k")])


def test_a_sender_patched_with_its_own_output_changes_nothing():
    vlm = get_tiny("tiny-qwen2_5_vl")
    task = path_task(vlm, "text", strong=False)
    z = vlm.capture(task.batch, "blocks.*.attn.hook_z")
    task.values = {l: z[vlm.adapter.z_site(l)][0, task.sender_positions] for l in range(vlm.n_layers)}
    edges = all_edges(vlm, senders=[(0, 0), (2, 3)])
    clean, exact = exact_path_diffs(vlm, task, edges)
    assert np.all(exact == clean)
    _, naive = naive_path_diffs(vlm, task, edges[:6])
    np.testing.assert_allclose(naive, clean, atol=1e-6)


def test_bad_edges_are_refused_and_failures_leave_no_hook():
    vlm = get_tiny("tiny-qwen2_5_vl")
    task = path_task(vlm, "text")
    with pytest.raises(vb.InputError, match="after the sender"):
        exact_path_diffs(vlm, task, [Edge((2, 0), (1, 0), "q")])
    with pytest.raises(vb.InputError, match="channel"):
        exact_path_diffs(vlm, task, [Edge((0, 0), (1, 0), "o")])
    with pytest.raises(vb.InputError, match="logits"):
        naive_path_diffs(vlm, task, [Edge((0, 0), None, "q")])
    with pytest.raises(vb.InputError, match="outside|inside"):
        exact_path_diffs(vlm, task, [Edge((0, 9), (1, 0), "q")])
    short = PathTask(task.batch, task.sender_positions, task.receiver_positions,
                     {l: v[:, :, :3] for l, v in task.values.items()}, task.score_position, task.a, task.a_star)
    with pytest.raises(vb.InputError, match="shape"):
        exact_path_diffs(vlm, short, [Edge((0, 0), (1, 0), "q")])

    def hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in vlm.model.modules())

    before = hooks()
    forwards = [vlm.adapter.layer(l).__dict__.get("forward") for l in range(vlm.n_layers)]
    calls = {"n": 0}

    def fail_late(module, args):
        calls["n"] += 1
        if calls["n"] >= 2:  # the clean run passes, the sender's run fails
            raise RuntimeError("boom")

    handle = vlm.adapter.layer(3).register_forward_pre_hook(fail_late)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            exact_path_diffs(vlm, task, all_edges(vlm, senders=[(1, 0)]))
    finally:
        handle.remove()
    assert hooks() == before
    assert [vlm.adapter.layer(l).__dict__.get("forward") for l in range(vlm.n_layers)] == forwards
