"""Shared image features in organism training: each distinct image goes through the vision tower once per optimiser
step, and the result equals the plain path (one vision forward per model forward): same logits, the same gradients
up to the order of float sums, the same training run; an optimiser step or a no-grad entry never serves a stale or
graph-less feature; the model's own method is back after the block, also after an error. Evaluation's strictness
shares (one unpatched and one source run for all head sets) equal one call per head."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import shared_organism
from test_siit import _planting_config

import vlmbind as vb
from vlmbind.core.errors import TrainingError
from vlmbind.organisms.data import BatchBuilder, training_canvas
from vlmbind.organisms.model import shared_image_features
from vlmbind.organisms.siit.evaluation import answer_changes, answer_changes_per_set
from vlmbind.organisms.siit.interchange import HeadInterchange
from vlmbind.organisms.siit.pairs import interchange_batch
from vlmbind.stimuli import scene_pairs

POOLS = {"colours": ("red", "green", "blue", "yellow"), "shapes": ("square", "circle", "triangle", "star")}


@pytest.fixture(scope="module")
def organism():
    vlm = shared_organism("organism-vsm")
    canvas = training_canvas(vlm.training)
    builder = BatchBuilder(vlm.processor)
    pairs = scene_pairs(4, "id_selection", 3, n_objects=(3, 4), canvas=canvas, **POOLS)
    return vlm, builder, interchange_batch(builder, pairs, "counterfactual"), pairs


def _loss(model, batch):
    """Three forwards, two of them on the same images: the shape of a SIIT step (base, source, patched base)."""
    base = model(**batch.base.inputs, use_cache=False).logits
    source = model(**batch.source.inputs, use_cache=False).logits
    again = model(**batch.base.inputs, use_cache=False).logits
    return base.square().mean() + 0.5 * source.abs().mean() + again.mean()


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_shared_features_equal_the_plain_forward_and_its_gradients(organism):
    vlm, _, batch, _ = organism
    model = vlm.model
    model.train()
    try:
        plain = _loss(model, batch)
        plain.backward()
        expected = _grads(model)
        with shared_image_features(model) as cache:
            shared = _loss(model, batch)
        shared.backward()
        got = _grads(model)
    finally:
        model.eval()
    assert shared.item() == plain.item()  # the first forward encodes the images in the same batch as plain
    n = len(batch.base.inputs["image_grid_thw"])
    assert cache.images_in == 3 * n and cache.images_encoded == 2 * n  # the base images once, not twice
    assert set(got) == set(expected)
    assert any(name.startswith("model.visual") for name in got)  # the vision tower is in the graph through the cache
    for name, grad in expected.items():  # summed in another order: equal to float precision of the largest entry
        assert float((got[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-12, name


def test_a_no_grad_entry_does_not_serve_a_forward_that_needs_the_graph(organism):
    vlm, _, batch, _ = organism
    model = vlm.model
    with shared_image_features(model) as cache:
        with torch.no_grad():
            model(**batch.base.inputs, use_cache=False)
        loss = model(**batch.base.inputs, use_cache=False).logits.square().mean()
        with torch.no_grad():  # a graph entry serves a no-grad forward
            model(**batch.base.inputs, use_cache=False)
    n = len(batch.base.inputs["image_grid_thw"])
    assert cache.images_encoded == 2 * n and cache.images_in == 3 * n
    loss.backward()
    grads = _grads(model)
    assert float(grads["model.visual.patch_embed.proj.weight"].abs().max()) > 0


def test_an_optimiser_step_inside_the_block_empties_the_cache(organism):
    _, _, batch, _ = organism
    model = vb.load("organism-vsm").model  # a copy of its own: the step changes the weights
    optimiser = torch.optim.SGD(model.model.visual.parameters(), lr=0.5)
    with shared_image_features(model) as cache:
        model(**batch.base.inputs, use_cache=False).logits.square().mean().backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        with torch.no_grad():
            after = model(**batch.base.inputs, use_cache=False).logits
    with torch.no_grad():
        plain = model(**batch.base.inputs, use_cache=False).logits
    n = len(batch.base.inputs["image_grid_thw"])
    assert cache.images_encoded == 2 * n
    assert torch.equal(after, plain)


def test_the_models_own_method_is_back_after_an_error_and_blocks_do_not_nest(organism):
    vlm, _, batch, _ = organism
    model = vlm.model
    with pytest.raises(RuntimeError, match="boom"):
        with shared_image_features(model):
            raise RuntimeError("boom")
    assert "get_image_features" not in vars(model.model)
    with shared_image_features(model):
        with pytest.raises(TrainingError, match="already active"):
            with shared_image_features(model):
                pass
    assert "get_image_features" not in vars(model.model)


def test_images_in_any_dtype_are_fingerprinted_and_told_apart():
    from vlmbind.organisms.model import _ImageFeatureCache

    image = torch.rand(144, 1176)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        same = _ImageFeatureCache._fingerprint(image.to(dtype), (1, 12, 12))
        assert same == _ImageFeatureCache._fingerprint(image.clone().to(dtype), (1, 12, 12))
        other = image.clone()
        other[0, 0] += 1.0  # the sampled entries include the first one
        assert same != _ImageFeatureCache._fingerprint(other.to(dtype), (1, 12, 12))


def test_strictness_shares_for_many_head_sets_equal_one_call_per_set(organism):
    vlm, builder, _, pairs = organism
    interchange = HeadInterchange(vlm.model, vlm.processor)
    pairs = scene_pairs(12, "feature_retrieval", 8, n_objects=3, canvas=training_canvas(vlm.training),
                        **POOLS)
    head_sets = [[(0, 1)], [(5, 2)], [(2, 3), (3, 1)], [(6, 0)]]
    for positions in ("all", "last"):
        together = answer_changes_per_set(vlm.model, interchange, builder, pairs, head_sets, positions=positions,
                                          batch_size=5)
        alone = [answer_changes(vlm.model, interchange, builder, pairs, heads, positions=positions, batch_size=5)
                 for heads in head_sets]
        assert together == alone
    assert together[1] > 0  # the planted feature-retrieval head moves answers: the comparison is not all zeros


def test_training_with_shared_features_equals_the_plain_path(tmp_path):
    """A SIIT run (IIT, strictness, ablation and readout losses, three optimiser steps per step) with shared image
    features gives the plain run's losses and evaluation up to float-sum order."""
    from vlmbind.organisms.training.run import train

    siit = {"alignments": {"feature_retrieval": ["1.1"], "id_selection": ["1.0", "0.3"]}, "pairs": 4,
            "objects": [3, 3], "aggregation_heads": ["0.3"], "selection_weight": 1.0,
            "selection_attention_weight": 1.0, "source_grad": True, "gather_interchange_weight": 1.0,
            "single_loss": False, "strict_sampling": "sample_all", "ablation_strict_weight": 1.0}
    config = _planting_config(steps=6, batch_size=8, warmup=2, eval_every=6, eval_size=8, checkpoint_every=6,
                              siit=siit, attn_implementation="eager")
    shared = train(config, tmp_path / "shared", progress=False, threads=1)
    plain = train(config, tmp_path / "plain", progress=False, threads=1, share_image_features=False)
    assert len(shared.losses) == len(plain.losses) == 6
    for a, b in zip(shared.losses, plain.losses):
        assert math.isclose(a, b, rel_tol=1e-4), (shared.losses, plain.losses)
    for variable, row in plain.evals[-1]["siit"].items():
        for key, value in row.items():
            assert shared.evals[-1]["siit"][variable][key] == pytest.approx(value, abs=1e-6), (variable, key)
