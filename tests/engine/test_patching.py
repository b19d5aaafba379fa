"""The exact fast patching path equals the naive one-forward-per-head reference on every family, in both layouts,
across chunk boundaries, with stale rope_deltas, and when the patch lies before the image; attribution patching is
the first-order limit of the naive effect; nothing stays hooked after an error."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import get_tiny, shared_organism

import vlmbind as vb
from vlmbind.analysis.mediation import scene_task
from vlmbind.engine.interventions import PatchHeads
from vlmbind.engine.patching import PatchTask, attribution_diffs, exact_diffs, integrated_gradients_diffs, naive_diffs
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
        z = vlm.capture(task.batch, "blocks.*attn.hook_z")
        task.values = {l: z[vlm.adapter.z_site(l)][0, task.positions] for l in range(vlm.n_layers)}
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
    variants = [{}, {"max_tokens": 1000}]  # auto: single pass where the family allows it, else packed
    if name in ("tiny-qwen2_5_vl", "tiny-gemma3"):  # M-RoPE; sliding windows shorter than the prefix
        variants += [{"max_tokens": 7}, {"layout": "batched", "max_rows": 5}, {"layout": "packed"}]
    if name == "tiny-gemma3":
        with pytest.raises(vb.InputError, match="single"):
            exact_diffs(vlm, task, heads, layout="single")
    for kwargs in variants:
        c, exact = exact_diffs(vlm, task, heads, **kwargs)
        assert c == pytest.approx(clean, abs=1e-5)
        np.testing.assert_allclose(exact - c, effects, atol=1e-4 * np.ptp(effects) + 1e-6, err_msg=str(kwargs))


def test_exact_equals_naive_on_the_organism_and_on_its_scenes():
    from vlmbind.analysis.evaluation import training_defaults

    vlm = shared_organism("organism-p2a")
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


@pytest.mark.parametrize("name", TINY_NAMES)
def test_patch_before_the_image_falls_back_and_stays_exact(name):
    vlm = get_tiny(name)
    task = strong_task(vlm, "id_selection")
    index = task.batch.index[0]
    # Llama-3.2-Vision's image is not in the sequence: its second token then
    first = int(index.image_positions[3]) if index.image_positions.size else 1
    positions = np.array([first, task.score_position])
    values = {l: torch.randn(2, vlm.n_heads, vlm.adapter.d_head, generator=torch.Generator().manual_seed(l))
              for l in range(vlm.n_layers)}
    task = replace(task, positions=positions, values=values)
    heads = [(0, 1), (2, 3), (3, 0), (3, 2)]
    clean, naive = naive_diffs(vlm, task, heads)
    assert np.abs(naive - clean).max() > 1e-3
    for kwargs in ({}, {"max_rows": 3}):  # one chunk of rows, or two starting at different layers
        c, exact = exact_diffs(vlm, task, heads, **kwargs)
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


def _layer_task(vlm, layer, scale):
    """A task patching only ``layer``, its counterfactual values ``scale`` standard deviations from the clean run."""
    task = scene_task(vlm, S.scene_pairs(1, "id_selection", 0, n_objects=3)[0], [layer])
    z = vlm.capture(task.batch, f"blocks.{layer}.attn.hook_z")[f"blocks.{layer}.attn.hook_z"][0, task.positions]
    gen = torch.Generator().manual_seed(layer)
    return replace(task, values={layer: z + scale * z.std() * torch.randn(z.shape, generator=gen)})


def test_integrated_gradients_is_complete_on_one_layer():
    """IG's per-head effects add up to the effect of patching all the layer's heads at once (completeness), where
    the first-order estimate (AtP) misses the curvature; and IG with alphas near 0 is AtP."""
    vlm = get_tiny("tiny-llava")
    layer = 1
    task = _layer_task(vlm, layer, 8.0)
    heads = [(layer, h) for h in range(vlm.n_heads)]
    clean, ig = integrated_gradients_diffs(vlm, task, heads, steps=48)
    patch = PatchHeads(layer=layer, heads=list(range(vlm.n_heads)), positions=task.positions,
                       values=task.values[layer][None])
    logits = vlm.logits(task.batch, [patch])[0, task.score_position].float()
    joint = float(logits[task.a_star] - logits[task.a])
    total = joint - clean
    _, atp = attribution_diffs(vlm, task, heads)
    assert abs(total) > 1e-3
    assert (ig - clean).sum() == pytest.approx(total, rel=0.02, abs=1e-5)
    assert abs((atp - clean).sum() - total) > 5 * abs((ig - clean).sum() - total), "no curvature to test against"
    c1, ig1 = integrated_gradients_diffs(vlm, _layer_task(vlm, layer, 1e-3), heads, steps=1)
    c0, atp0 = attribution_diffs(vlm, _layer_task(vlm, layer, 1e-3), heads)
    assert c1 == pytest.approx(c0, abs=1e-6)
    np.testing.assert_allclose(ig1 - c1, atp0 - c0, atol=1e-3 * np.abs(atp0 - c0).max() + 1e-9)
    with pytest.raises(vb.InputError, match="steps"):
        integrated_gradients_diffs(vlm, task, heads, steps=0)


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
    vlm.nnsight()  # wraps the same model: its layers may carry nnsight's own forward
    task = strong_task(vlm, "id_selection")
    bad = replace(task, values={l: v[:, :, :3] for l, v in task.values.items()})  # wrong d_head

    def hooks():  # other libraries may leave their own hooks on a shared model; count, don't expect zero
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in vlm.model.modules())

    before = hooks()
    forwards = [vlm.adapter.layer(l).__dict__.get("forward") for l in range(vlm.n_layers)]
    with pytest.raises(vb.InputError, match="shape"):
        exact_diffs(vlm, bad, all_heads(vlm))
    with pytest.raises(vb.InputError, match="outside"):
        naive_diffs(vlm, task, [(9, 0)])
    with pytest.raises(vb.InputError, match="inside the prompt"):
        attribution_diffs(vlm, replace(task, score_position=10_000), all_heads(vlm))
    # a failure inside the patched forward leaves nothing behind either (packed: the second forward; single: the
    # only one)
    for layout, fail_at in (("packed", 2), ("single", 1)):
        calls = {"n": 0}

        def fail_in_sweep(module, args):
            calls["n"] += 1
            if calls["n"] >= fail_at:
                raise RuntimeError("boom")

        handle = vlm.adapter.layer(3).register_forward_pre_hook(fail_in_sweep)
        try:
            with pytest.raises(RuntimeError, match="boom"):
                exact_diffs(vlm, task, all_heads(vlm), layout=layout)
        finally:
            handle.remove()
        assert hooks() == before
    # no layer left skipped, and an instance-level forward another library set (nnsight) is back in place
    assert [vlm.adapter.layer(l).__dict__.get("forward") for l in range(vlm.n_layers)] == forwards
    fresh = exact_diffs(vlm, task, all_heads(vlm)[:3])
    np.testing.assert_allclose(fresh[1], naive_diffs(vlm, task, all_heads(vlm)[:3])[1], atol=1e-5)
    with pytest.raises(vb.InputError, match="layout"):
        exact_diffs(vlm, task, all_heads(vlm), layout="diagonal")


# ---- attention_swap (PbP) on the organism's own traces ---------------------------------------------------------
def test_attention_swap_pairs_are_the_models_own_contexts():
    from vlmbind.analysis import point_swap_pairs
    from vlmbind.stimuli.points import parse_points

    vlm = shared_organism("organism-p2a")
    pairs = point_swap_pairs(vlm, 3, 0)
    assert len(pairs) == 3
    tok = vlm.adapter.tokenizer
    for pair in pairs:
        assert pair.step_b < pair.step_a and pair.a != pair.a_star
        assert len(parse_points(pair.text)) >= 2
        task = pair.task(vlm, range(vlm.n_layers))
        # the clean context is the prompt plus the trace up to A's x token, and the model's next token there is A's
        logits = vlm.logits(task.batch)[0, task.score_position]
        assert int(logits.argmax()) == pair.a
        assert tok.decode(pair.trace[: pair.step_a]) == tok.decode(task.batch.inputs["input_ids"][0, -pair.step_a:])
    naive = vb.locate(vlm, pairs, method="naive")
    exact = vb.locate(vlm, pairs, method="exact")
    assert naive.condition == "attention_swap"
    np.testing.assert_allclose(exact.per_pair, naive.per_pair, atol=max(1e-4 * np.ptp(naive.per_pair), 1e-5))
    assert np.ptp(naive.per_pair) > 0.1


def test_attention_swap_refuses_a_model_that_does_not_point():
    from vlmbind.analysis import point_swap_pairs

    with pytest.raises(vb.InputError, match="Point-to-Answer"):
        point_swap_pairs(get_tiny("tiny-qwen2_5_vl"), 1, 0, max_new_tokens=8, max_tries=2)


def test_attribution_is_reported_beside_exact_on_its_top_candidates(tmp_path):
    vlm = shared_organism("organism-p2a")
    from vlmbind.analysis.evaluation import training_defaults

    pairs = S.scene_pairs(3, "feature_retrieval", 2, **training_defaults(vlm, "scene", {"n_objects": 3}))
    attribution = vb.locate(vlm, pairs, method="attribution", verify_top=4)
    exact = vb.locate(vlm, pairs)
    verified = attribution.verified_scores
    assert np.sum(~np.isnan(verified)) == 4
    for layer, head in attribution.top(4):
        assert verified[layer, head] == pytest.approx(exact.scores[layer, head], abs=1e-5)
    summary = attribution.summary()
    assert len(summary["verified"]) == 4 and "verified_spearman" in summary
    assert 0 <= attribution.recall(exact, 5) <= 1 and exact.recall(exact, 5) == 1
    attribution.save(tmp_path)
    assert "exact_score" in (tmp_path / "scores.csv").read_text().splitlines()[0]


def test_locate_command_attention_swap_and_methods(tmp_path, capsys):
    import json

    from vlmbind.cli import main

    out = tmp_path / "swap"
    assert main(["locate", "--model", "organism-p2a", "--condition", "attention_swap", "--n-pairs", "2",
                 "--method", "attribution", "--verify-top", "3", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["condition"] == "attention_swap" and summary["method"] == "attribution"
    assert len(summary["verified"]) == 3
    assert main(["locate", "--model", "organism-p2a", "--condition", "id_selection", "--n-pairs", "1",
                 "--verify-top", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


def test_object_attention_equals_output_attentions():
    from vlmbind.analysis.overview import object_attention
    from vlmbind.stimuli.core import object_token_positions

    vlm = get_tiny("tiny-llava")
    examples = list(S.scene_description(3, 4, n_objects=3))
    heads = [(1, 2), (3, 0)]
    frame = object_attention(vlm, examples, heads)
    for layer, head in heads:
        shares = []
        for ex in examples:
            batch = vlm.prepare(ex.image, ex.prompt)
            with torch.no_grad():
                attn = vlm.model(**batch.inputs, output_attentions=True, use_cache=False).attentions[layer][0, head, -1]
            index = batch.index[0]
            objects = object_token_positions(index, ex.objects)
            mass = float(attn[torch.as_tensor(index.image_positions)].sum())
            target = float(attn[torch.as_tensor(objects[ex.fields["target"]])].sum()) / mass
            shares.append((mass, target))
        row = frame[(frame["layer"] == layer) & (frame["head"] == head)].iloc[0]
        assert row["image_mass"] == pytest.approx(np.mean([m for m, _ in shares]), abs=1e-5)
        assert row["target_share"] == pytest.approx(np.mean([t for _, t in shares]), abs=1e-5)
    with pytest.raises(vb.InputError, match="scene-description"):
        object_attention(vlm, list(S.counting(1, 0)), heads)


def test_logits_are_computed_only_where_scored():
    """No run of locate (any method), capture or generation takes the unembedding over the whole prompt: a real
    vocabulary's logits at 1,300 positions are ~0.4-0.8 GB a row."""
    vlm = get_tiny("tiny-qwen2_5_vl")
    pairs = S.scene_pairs(1, "id_selection", 0, n_objects=3)
    clean = vlm.prepare([pairs[0].clean.image], [pairs[0].clean.prompt])
    widths: list[int] = []
    handle = vlm.model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: widths.append(output.shape[1]))
    try:
        vlm.capture(clean, "blocks.*.attn.hook_z")
        assert widths == [1]
        vlm.generate(clean, 2)
        assert widths[1:] == [1, 1]
        for method in ("exact", "naive", "attribution", "integrated_gradients"):
            widths.clear()
            vb.locate(vlm, pairs, method=method, verify_top=2)
            assert widths and max(widths) < clean.seq_len // 2, (method, widths)
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-gemma3", "tiny-mllama"])
def test_atp_star_is_attribution_to_first_order_and_a_magnitude_with_graddrop(name):
    """The QK fix replaces the linear change of later attention patterns by the exact one: for counterfactual values a
    small step from the clean ones the two agree (bidirectional image block and post-norms, cross-attention layers);
    with GradDrop the score is a mean of magnitudes."""
    from vlmbind.engine.patching import atp_star_diffs

    vlm = get_tiny(name)
    task = strong_task(vlm, "id_selection")
    z = vlm.capture(task.batch, [vlm.adapter.z_site(l) for l in range(vlm.n_layers)])
    gen = torch.Generator().manual_seed(2)
    small = {l: z[vlm.adapter.z_site(l)][0, task.positions] + 1e-2 * torch.randn(v.shape, generator=gen)
             for l, v in task.values.items()}
    task = replace(task, values=small)
    heads = [h for h in all_heads(vlm) if h[0] in vlm.adapter.head_layers() and h[0] not in
             vlm.adapter.cross_attention_layers()][:10]
    clean, linear = attribution_diffs(vlm, task, heads)
    c, fixed = atp_star_diffs(vlm, task, heads, grad_drop=False)
    assert c == pytest.approx(clean, abs=1e-6)
    effects = linear - clean
    assert np.abs(effects).max() > 1e-5
    np.testing.assert_allclose(fixed - c, effects, atol=0.05 * np.abs(effects).max() + 1e-7)
    _, dropped = atp_star_diffs(vlm, task, heads)
    assert np.all(dropped - c >= 0) and np.abs(dropped - c).max() > 0
