"""Tests of relevancy maps, their deletion / insertion curves and the knockout (``vlmbind.analysis.relevancy``).

References are independent of the code under test: the model's own ``output_attentions`` (the patterns and, through
autograd, their gradients) with Chefer's rule and rollout written in numpy; input x gradient against
``torch.autograd.grad`` on a LLaVA forward whose ``inputs_embeds`` are built by hand (text embeddings with the
vision features scattered in); the curves against a constructed case (an order that deletes the target object's
cells first must beat its reverse on the organism).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny, shared_organism

from vlmbind.analysis import relevancy as rel
from vlmbind.core.errors import InputError, NoImageTokensError
from vlmbind.stimuli.core import Canvas
from vlmbind.stimuli.tasks import generate


def _two_rows(vlm):
    """Two rows of different lengths (the shorter one left-padded)."""
    return vlm.prepare([draw_scene(1), draw_scene(2)], [PROMPT + " and a long tail of words to pad the row", PROMPT])


def _chefer(attentions, grads, keep, last):
    relevance = np.eye(len(keep))
    for a, g in zip(attentions, grads):
        a, g = a[:, keep][:, :, keep], g[:, keep][:, :, keep]
        relevance = relevance + np.maximum(a * g, 0).mean(0) @ relevance
    return relevance[last]


def _rollout(attentions, keep, last):
    relevance = np.eye(len(keep))
    for a in attentions:
        mixed = 0.5 * a[:, keep][:, :, keep].mean(0) + 0.5 * np.eye(len(keep))
        relevance = (mixed / mixed.sum(-1, keepdims=True)) @ relevance
    return relevance[last]


@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-gemma3"])
def test_attention_maps_equal_numpy_over_hf_output_attentions(name):
    vlm = get_tiny(name)
    batch = _two_rows(vlm)
    targets = [7, 11]
    maps = rel.relevancy_maps(vlm, batch, targets, ("gradient_attention", "rollout"))
    # the captured patterns are HF's own
    captured = vlm.run(batch, sites="blocks.*.attn.hook_pattern").cache
    with torch.enable_grad():
        out = vlm.model(**vlm.model_inputs(batch), output_attentions=True, use_cache=False)
        metric = out.logits[torch.arange(2), -1, torch.tensor(targets)].sum()
        grads = torch.autograd.grad(metric, list(out.attentions))
    attentions = [a.detach().double().numpy() for a in out.attentions]
    for layer, a in enumerate(attentions):
        np.testing.assert_allclose(captured[f"blocks.{layer}.attn.hook_pattern"].double().numpy(), a, atol=1e-6)
    grads = [g.double().numpy() for g in grads]
    for r, ti in enumerate(batch.index):
        keep = np.flatnonzero(ti.roles != "pad")
        assert len(maps[r]["rollout"]) == len(keep)
        np.testing.assert_allclose(maps[r]["rollout"], _rollout([a[r] for a in attentions], keep, len(keep) - 1),
                                   rtol=1e-5, atol=1e-8)
        assert maps[r]["rollout"].sum() == pytest.approx(1.0)  # a product of row-stochastic matrices
        np.testing.assert_allclose(maps[r]["gradient_attention"],
                                   _chefer([a[r] for a in attentions], [g[r] for g in grads], keep, len(keep) - 1),
                                   rtol=1e-4, atol=1e-7)


def test_input_x_gradient_equals_autograd_on_hand_built_embeddings():
    vlm = get_tiny("tiny-llava")
    batch = vlm.prepare([draw_scene(3)], [PROMPT])
    target = 9
    got = rel.relevancy_maps(vlm, batch, [target], ("input_x_gradient",))[0]["input_x_gradient"]
    model, cfg = vlm.model, vlm.model.config
    inputs = vlm.model_inputs(batch)
    ids = inputs["input_ids"]
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                               vision_feature_layer=cfg.vision_feature_layer,
                                               vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        feats = torch.cat(list(feats.pooler_output))
        embeds = model.get_input_embeddings()(ids).clone()
        embeds[ids == cfg.image_token_id] = feats.to(embeds.dtype)
    leaf = embeds.requires_grad_(True)
    with torch.enable_grad():
        logit = model(inputs_embeds=leaf, attention_mask=inputs["attention_mask"]).logits[0, -1, target]
        (grad,) = torch.autograd.grad(logit, leaf)
    np.testing.assert_allclose(got, (leaf * grad).sum(-1)[0].detach().double().numpy(), rtol=1e-5, atol=1e-8)


def test_hybrid_maps_skip_linear_layers_and_no_image_tokens_is_refused():
    vlm = get_tiny("tiny-qwen3_5")
    assert rel._softmax_layers(vlm.adapter) == vlm.adapter.pattern_layers() != list(range(vlm.n_layers))
    maps = rel.relevancy_maps(vlm, vlm.prepare([draw_scene(0)], [PROMPT]), [5])[0]
    assert all(np.isfinite(v).all() for v in maps.values())
    assert maps["rollout"].sum() == pytest.approx(1.0)
    with pytest.raises(NoImageTokensError, match="cross-attention"):
        rel.relevancy_maps(get_tiny("tiny-mllama"), get_tiny("tiny-mllama").prepare([draw_scene(0)], [PROMPT]), [5])


def test_no_hook_stays_after_an_error():
    vlm = get_tiny("tiny-qwen2_5_vl")
    batch = vlm.prepare([draw_scene(0)], [PROMPT])
    with pytest.raises(IndexError):
        rel.relevancy_maps(vlm, batch, [10**9])  # fails after the forward, inside the gradient pass
    assert not vlm.adapter.layer(0)._forward_pre_hooks
    with pytest.raises(InputError, match="not relevancy methods"):
        rel.relevancy_maps(vlm, batch, [1], ("rollout", "saliency"))


def test_painting_and_bootstrap():
    image = draw_scene(0)
    assert rel.background_colour(image) == (255, 255, 255)
    boxes = np.array([[0, 0, 112, 112], [112, 0, 224, 112], [0, 112, 112, 224], [112, 112, 224, 224]], float)
    deleted = np.asarray(rel.paint_cells(image, boxes, [0, 3], (255, 255, 255), "deletion"))
    inserted = np.asarray(rel.paint_cells(image, boxes, [0, 3], (255, 255, 255), "insertion"))
    original = np.asarray(image)
    assert (deleted[:112, :112] == 255).all() and (deleted[:112, 112:] == original[:112, 112:]).all()
    assert (inserted[:112, :112] == original[:112, :112]).all() and (inserted[:112, 112:] == 255).all()
    mean, lo, hi, n = rel.bootstrap_mean([1.0, 2.0, 3.0, float("nan")], seed=0)
    assert (mean, n) == (2.0, 3) and 1.0 <= lo < 2.0 < hi <= 3.0
    assert rel.bootstrap_mean([], 0)[3] == 0 and rel.bootstrap_mean([4.0], 0)[:3] == (4.0, 4.0, 4.0)


def test_deleting_the_target_first_beats_its_reverse_on_the_organism():
    vlm = shared_organism("organism-p2a")
    data = rel.relevancy_dataset(vlm, "query", 3, seed=2)
    orders, targets = [], []
    for e in data:
        g = vlm.prepare([e.image], [e.prompt]).index[0].grid()
        boxes = g.boxes.reshape(-1, 4)
        first = rel._cells_of_box(boxes, e.objects[e.fields["target"]].box)
        rest = [c for c in range(len(boxes)) if c not in first]
        orders.append({"target_first": first + rest, "target_last": (first + rest)[::-1]})
        targets.append(vlm.answer_ids(e.answer, chat=False)[0])
    curves = rel.deletion_insertion(vlm, list(data), orders, targets, fractions=2, batch_size=32)
    auc = rel.curve_scores(curves).pivot_table(index=["example", "kind"], columns="method", values="auc")
    deletion, insertion = auc.xs("deletion", level="kind"), auc.xs("insertion", level="kind")
    assert (deletion["target_first"] < deletion["target_last"]).all()
    assert (insertion["target_first"] > insertion["target_last"]).all()


@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-llava", "tiny-gemma3"])
def test_relevancy_runs_and_draws_its_figures_on_three_families(name, tmp_path):
    vlm = get_tiny(name)
    data = generate("query", 2, 0, {"canvas": Canvas(image_size=224, grid=3)})
    result = rel.relevancy(vlm, data, fractions=1, random_maps=1, knockout_queries="last", batch_size=8)
    n_cells = int(np.prod(result.examples[0]["grid_shape"]))
    assert set(result.maps["method"]) == set(rel.METHODS) and result.n == 2
    assert len(result.curves) == 2 * 2 * (len(rel.METHODS) + 1) * 2  # examples x kinds x orders x fractions
    assert set(result.curves["cells"]) == {0, n_cells}
    fig = result.figure()
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert len(heatmaps) == 2 * 2 * len(rel.METHODS) and len(fig.layout.images) == 2 * len(rel.METHODS)
    assert len(result.curves_figure().data) == 2 * (len(rel.METHODS) + 1)
    scores = result.scores()
    assert scores["method"].tolist() == [*rel.METHODS, rel.RANDOM] and (scores["n"] == 2).all()


def test_relevancy_refuses_bad_arguments():
    vlm = get_tiny("tiny-qwen2_5_vl")
    data = generate("query", 1, 0, {"canvas": Canvas(image_size=224, grid=3)})
    with pytest.raises(InputError, match="target 'model'"):
        rel.relevancy(vlm, data, target="model")
    with pytest.raises(InputError, match="fractions must be an int >= 1"):
        rel.relevancy(vlm, data, fractions=0)
    with pytest.raises(InputError, match="knockout_queries 'first'"):
        rel.relevancy(vlm, data, knockout_queries="first")
    with pytest.raises(InputError, match="relevancy runs on query, scene"):
        rel.relevancy_dataset(vlm, "count", 2)
