"""Running a circuit: with one edge ablated it is path patching of that edge (the four-forward reference) on families
with M-RoPE, a bidirectional image block and post-norms, cross-attention and linear-attention layers, through q, k, v
and into the logits; with none ablated it is the plain forward; several ablated edges compose as the sum of their
counterfactual writes (a reference built from plain forwards and held projections); bad masks are refused and a
failure leaves no hook behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import get_tiny, model_state
from test_paths import CASES, path_task

import vlmbind as vb
from vlmbind.engine.circuit_ablation import circuit_diffs
from vlmbind.engine.interventions import PatchHeads
from vlmbind.engine.patching import first_output, with_first_output
from vlmbind.engine.paths import LOGITS, Edge, all_edges, naive_path_diffs


def one_of_each_channel(edges: list[Edge]) -> list[int]:
    """The first and the last edge of each channel."""
    out = []
    for channel in ("q", "k", "v", LOGITS):
        mine = [i for i, e in enumerate(edges) if e.channel == channel]
        out += sorted({mine[0], mine[-1]}) if mine else []
    return out


@pytest.mark.parametrize("name,senders_at", CASES)
def test_one_ablated_edge_is_path_patching_and_none_is_the_plain_forward(name, senders_at):
    vlm = get_tiny(name)
    task = path_task(vlm, senders_at)
    layers = vlm.adapter.head_layers()
    edges = all_edges(vlm, senders=[(layers[0], 1), (layers[1], 2)])
    chosen = one_of_each_channel(edges)
    masks = [np.arange(len(edges)) != i for i in chosen] + [np.ones(len(edges), dtype=bool)]
    full, ablated = circuit_diffs(vlm, task, edges, masks)
    clean, naive = naive_path_diffs(vlm, task, [edges[i] for i in chosen])
    assert full == pytest.approx(clean, abs=1e-5)
    assert ablated[-1] == full  # nothing ablated: the same forward, bit for bit
    effects = naive - clean
    assert np.abs(effects).max() > 1e-2
    np.testing.assert_allclose(ablated[:-1] - full, effects, atol=1e-4 * np.ptp(effects) + 1e-6)


def test_ablations_compose_as_the_sum_of_counterfactual_writes():
    """Three senders of layer 0 into two heads of layer 1 with their channels mixed (one head's query reads one
    sender's counterfactual, its key two senders', its value none; another head reads one sender's through every
    channel) and one sender's direct edge: against a reference from plain forwards, where each head's z is read with
    the layer's projections held at their outputs on the ablated streams, and every receiver and the direct write
    are then patched into one clean run."""
    vlm = get_tiny("tiny-qwen2_5_vl")
    adapter = vlm.adapter
    task = path_task(vlm, "text")
    s1, s2, s3 = (0, 1), (0, 2), (0, 3)
    ablated = [Edge(s1, (1, 0), "q"), Edge(s1, (1, 0), "k"), Edge(s2, (1, 0), "k"),
               Edge(s3, (1, 3), "q"), Edge(s3, (1, 3), "k"), Edge(s3, (1, 3), "v"), Edge(s2, None, LOGITS)]
    kept = [Edge(s1, (1, 3), "v"), Edge(s2, (2, 1), "q"), Edge(s1, None, LOGITS)]
    edges = ablated + kept
    full, (mine,) = circuit_diffs(vlm, task, edges, [np.array([False] * len(ablated) + [True] * len(kept))])

    at = task.sender_positions
    with torch.no_grad():
        attn_site = "blocks.0.hook_attn_out"
        before = vlm.capture(task.batch, [attn_site])[attn_site]
        writes = {}
        for s in (s1, s2, s3):
            patch = PatchHeads(layer=0, heads=[s[1]], positions=at, values=task.values[0][:, [s[1]]][None])
            writes[s] = vlm.run(task.batch, sites=[attn_site], interventions=[patch], logits_at=[0]).cache[attn_site] \
                - before

        def projections(senders):
            """Layer 1's q / k / v projection outputs when it reads the clean stream plus these senders' writes."""
            delta = sum((writes[s] for s in senders), torch.zeros_like(before))
            seen = {}
            hooks = [adapter.channel_module(1, c).register_forward_hook(
                lambda m, a, o, c=c: seen.__setitem__(c, o.detach())) for c in "qkv"]
            hooks.append(adapter.layer(1).register_forward_pre_hook(
                lambda m, a, kw: ((a[0] + delta, *a[1:]), kw) if a else (a, {**kw, "hidden_states":
                                                                              kw["hidden_states"] + delta}),
                with_kwargs=True))
            try:
                vlm.logits(task.batch, at=[task.score_position])
            finally:
                for h in hooks:
                    h.remove()
            return seen

        def z_with(held):
            hooks = [adapter.channel_module(1, c).register_forward_hook(lambda m, a, o, v=v: v)
                     for c, v in held.items()]
            try:
                return vlm.capture(task.batch, [adapter.z_site(1)])[adapter.z_site(1)][0]
            finally:
                for h in hooks:
                    h.remove()

        clean, only_s1, s1_s2, only_s3 = (projections(s) for s in ([], [s1], [s1, s2], [s3]))
        z_10 = z_with({"q": only_s1["q"], "k": s1_s2["k"], "v": clean["v"]})[:, 0]
        z_13 = z_with(only_s3)[:, 3]
        receivers = task.receiver_positions
        patch = PatchHeads(layer=1, heads=[0, 3], positions=receivers,
                           values=torch.stack([z_10[receivers], z_13[receivers]], 1)[None])
        last = adapter.layer(vlm.n_layers - 1).register_forward_hook(
            lambda m, a, o: with_first_output(o, first_output(o) + writes[s2]))
        try:
            logits = vlm.logits(task.batch, [patch], at=[task.score_position])[0, 0].float()
        finally:
            last.remove()
    reference = float(logits[task.a_star] - logits[task.a])
    assert abs(reference - full) > 1e-2
    assert mine == pytest.approx(reference, abs=1e-4 * abs(reference - full) + 1e-5)


def test_bad_masks_are_refused_and_failures_leave_no_hook():
    vlm = get_tiny("tiny-qwen2_5_vl")
    task = path_task(vlm, "text")
    edges = all_edges(vlm, senders=[(0, 0), (1, 1)])
    with pytest.raises(vb.InputError, match="mask over the"):
        circuit_diffs(vlm, task, edges, [np.ones(3, dtype=bool)])

    before = model_state(vlm.model)["hooks"]
    forwards = [vlm.adapter.layer(l).__dict__.get("forward") for l in range(vlm.n_layers)]
    calls = {"n": 0}

    def fail_late(module, args):
        calls["n"] += 1
        if calls["n"] >= 3:  # the unablated run passes, a circuit's nested receiver run fails
            raise RuntimeError("boom")

    handle = vlm.adapter.layer(2).register_forward_pre_hook(fail_late)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            circuit_diffs(vlm, task, edges, [np.zeros(len(edges), dtype=bool)])
    finally:
        handle.remove()
    assert model_state(vlm.model)["hooks"] == before
    assert [vlm.adapter.layer(l).__dict__.get("forward") for l in range(vlm.n_layers)] == forwards
    assert not any(hasattr(vlm.adapter.attention_module(l), "_vlmbind_state_edits") for l in range(vlm.n_layers))
