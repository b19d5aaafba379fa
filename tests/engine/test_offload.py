"""Models bigger than one device: a model split by accelerate (``device_map`` with CPU and disk offload) gives the
same captures, interventions, ablations and patching scores as the same weights loaded whole.

There is no GPU here, so the split is forced: a tiny Qwen2.5-VL saved to disk is loaded with an explicit device map
that keeps some decoder layers on the CPU and offloads the vision tower, the other decoder layers and the LM head to
disk (their parameters wait on the meta device, accelerate's hooks load them for each call). Every family is also
loaded with ``device_map="auto"`` and a small ``max_memory``.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

import vlmbind as vb
from vlmbind.analysis.mediation import scene_task
from vlmbind.engine.hooks import AblateHeads, AddToHeads, PatchHeads, ZeroImageAttention
from vlmbind.engine.patching import PatchTask, exact_diffs, naive_diffs
from vlmbind.tiny import TINY_NAMES

S = vb.stimuli
OFFLOADED_LAYERS = (1, 3)
DEVICE_MAP = {
    "model.visual": "disk",  # the model's first parameter then lies on meta: vlm.device must not follow it
    "model.language_model.embed_tokens": "cpu",
    "model.language_model.rotary_emb": "cpu",
    "model.language_model.layers.0": "cpu",
    "model.language_model.layers.1": "disk",
    "model.language_model.layers.2": "cpu",
    "model.language_model.layers.3": "disk",
    "model.language_model.norm": "cpu",
    "lm_head": "disk",
}
CANVAS = S.Canvas(image_size=112, grid=3)  # 16 image tokens on Qwen: keeps the file fast
SITES = ["blocks.*.attn.hook_z", "blocks.*.attn.hook_pattern", "blocks.*.hook_resid_pre", "blocks.*.hook_resid_post",
         "vision.blocks.1.hook_resid_post", "projector.hook_out"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(plain, offloaded)``: the same saved tiny Qwen2.5-VL, loaded whole and split over CPU and disk."""
    root = tmp_path_factory.mktemp("offload")
    built = vb.load("tiny-qwen2_5_vl")
    built.model.save_pretrained(root / "model")
    built.processor.save_pretrained(root / "model")
    plain = vb.load(str(root / "model"))
    offloaded = vb.load(str(root / "model"), device_map=DEVICE_MAP, offload_folder=str(root / "offload"))
    yield plain, offloaded
    shutil.rmtree(root, ignore_errors=True)


def _batch(vlm: vb.VLM, n: int = 2, seed: int = 3) -> vb.models.Batch:
    examples = list(S.scene_description(n, seed, n_objects=3, canvas=CANVAS))
    return vlm.prepare([e.image for e in examples], [e.prompt for e in examples])


def test_the_model_is_really_split(pair):
    plain, off = pair
    assert set(off.model.hf_device_map.values()) == {"cpu", "disk"}
    for layer in OFFLOADED_LAYERS:
        module = off.adapter.layer(layer)
        assert hasattr(module, "_hf_hook") and hasattr(off.adapter.o_proj_module(layer), "_hf_hook")
        assert off.adapter.o_proj_module(layer)._hf_hook.offload  # weights are loaded from disk for each call
        assert all(p.device.type == "meta" for p in module.parameters())
    assert all(p.device.type == "cpu" for p in off.adapter.layer(0).parameters())
    assert next(off.model.parameters()).device.type == "meta"
    # inputs go where the embeddings execute, never to meta
    assert off.device == plain.device == torch.device("cpu")
    assert not hasattr(plain.model, "hf_device_map") or set(plain.model.hf_device_map.values()) == {"cpu"}


def test_captures_are_identical(pair):
    plain, off = pair
    a, b = plain.run(_batch(plain), sites=SITES), off.run(_batch(off), sites=SITES)
    assert set(a.cache) == set(b.cache) and len(a.cache) == 4 * 4 + 2
    for name in a.cache:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(a.logits, b.logits)
    # vb.capture streams the same tensors
    examples = list(S.scene_description(3, 5, n_objects=3, canvas=CANVAS))
    ca = vb.capture(plain, examples, ["blocks.3.attn.hook_z", "blocks.2.hook_resid_post"], tokens="all")
    cb = vb.capture(off, examples, ["blocks.3.attn.hook_z", "blocks.2.hook_resid_post"], tokens="all")
    for site in ca.sites:
        for i in range(len(examples)):
            assert torch.equal(ca.tensor(site, i), cb.tensor(site, i)), (site, i)


def test_interventions_give_identical_logits(pair):
    plain, off = pair
    bp, bo = _batch(plain), _batch(off)
    d = plain.adapter.d_head
    gen = torch.Generator().manual_seed(0)
    means = plain.head_means(bp, 3, [0, 2])
    assert torch.equal(means, off.head_means(bo, 3, [0, 2]))
    cases = [
        [PatchHeads(layer=1, heads=[0, 2], positions=[-1, -2], values=5 * torch.randn(2, 2, d, generator=gen))],
        [AblateHeads(layer=3, heads=[1], mode="zero")],
        [AblateHeads(layer=3, heads=[0, 2], mode="mean", means=means, positions=[-1])],
        [AddToHeads(layer=1, heads=[3], positions=[-1], vector=torch.randn(d, generator=gen), alpha=4.0)],
        [ZeroImageAttention(layer=3, heads=[0, 1], renormalize=True)],
    ]
    clean = plain.logits(bp)
    for interventions in cases:
        expected = plain.logits(bp, interventions)
        assert (expected - clean).abs().max() > 1e-4, interventions  # the edit does something
        assert torch.equal(off.logits(bo, interventions), expected), interventions
    # generation re-runs the hooks at every step, on the cached keys and values of the offloaded layers
    steps = [AddToHeads(layer=3, heads=[0], positions=[-1], vector=torch.randn(d, generator=gen), alpha=8.0)]
    with plain.intervene(steps):
        text_plain, captured_plain = plain.generate(bp, 4, sites="blocks.3.attn.hook_z")
    with off.intervene(steps):
        text_off, captured_off = off.generate(bo, 4, sites="blocks.3.attn.hook_z")
    assert text_off == text_plain
    steps_plain, steps_off = captured_plain["blocks.3.attn.hook_z"], captured_off["blocks.3.attn.hook_z"]
    assert len(steps_off) == len(steps_plain) == 4
    assert all(torch.equal(a, b) for a, b in zip(steps_plain, steps_off))


def test_ablation_is_identical(pair):
    plain, off = pair
    bp, bo = _batch(plain), _batch(off)
    clean = plain.logits(bp)
    for mode in ("image_attention", "zero"):
        with plain.ablate("1.0,3.2", mode=mode):
            expected = plain.logits(bp)
        with off.ablate("1.0,3.2", mode=mode):
            got = off.logits(bo)
        assert (expected - clean).abs().max() > 1e-3
        assert torch.equal(got, expected), mode


def _strong_task(vlm: vb.VLM, seed: int = 0) -> PatchTask:
    """A scene task whose counterfactual values are pushed far from the clean ones (effects of O(0.1-1) logits on
    random weights, so a tolerance means something)."""
    task = scene_task(vlm, S.scene_pairs(1, "id_selection", seed, n_objects=3, canvas=CANVAS)[0], range(vlm.n_layers))
    gen = torch.Generator().manual_seed(seed)
    return replace(task, values={l: v + 30.0 * v.std() * torch.randn(v.shape, generator=gen)
                                 for l, v in task.values.items()})


def test_exact_sweep_under_offload_equals_the_plain_model(pair):
    plain, off = pair
    forwards = [off.adapter.layer(l).__dict__.get("forward") for l in range(off.n_layers)]
    # locate on scene pairs, layers 1 and 3 (both on disk): exact under offload == exact and naive on the plain
    pairs = S.scene_pairs(2, "id_selection", 0, n_objects=3, canvas=CANVAS)
    naive = vb.locate(plain, pairs, method="naive", layers=[1, 3])
    exact = vb.locate(plain, pairs, method="exact", layers=[1, 3])
    offloaded = vb.locate(off, pairs, method="exact", layers=[1, 3])
    span = np.ptp(naive.per_pair)
    assert span > 1e-3
    np.testing.assert_allclose(offloaded.per_pair, exact.per_pair, atol=1e-6)
    np.testing.assert_allclose(offloaded.per_pair, naive.per_pair, atol=max(1e-4 * span, 1e-5))
    # every layout (single pass, packed across chunks, batched rows), with effects far above the tolerance
    heads = [(l, h) for l in (1, 2, 3) for h in range(0, off.n_heads, 2)]
    task_plain, task_off = _strong_task(plain), _strong_task(off)
    clean, reference = naive_diffs(plain, task_plain, heads)
    effects = reference - clean
    assert np.abs(effects).max() > 0.1
    for kwargs in ({}, {"max_tokens": 7}, {"layout": "packed"}, {"layout": "batched", "max_rows": 5}):
        c, got = exact_diffs(off, task_off, heads, **kwargs)
        assert c == pytest.approx(clean, abs=1e-6)
        np.testing.assert_allclose(got - c, effects, atol=1e-4 * np.ptp(effects) + 1e-6, err_msg=str(kwargs))
    # a patch at an image position: no prefix to reuse, whole-prompt rows started at the patched layer
    positions = np.array([int(task_plain.batch.index[0].image_positions[3]), task_plain.score_position])
    values = {l: torch.randn(2, off.n_heads, off.adapter.d_head, generator=torch.Generator().manual_seed(l))
              for l in range(off.n_layers)}
    early = [(1, 0), (3, 2)]
    c, naive_early = naive_diffs(plain, replace(task_plain, positions=positions, values=values), early)
    co, exact_early = exact_diffs(off, replace(task_off, positions=positions, values=values), early)
    np.testing.assert_allclose(exact_early - co, naive_early - c, atol=1e-6)
    # the skipped layers got accelerate's forward back, and its hooks still load the offloaded weights
    assert [off.adapter.layer(l).__dict__.get("forward") for l in range(off.n_layers)] == forwards
    assert all(hasattr(off.adapter.layer(l), "_hf_hook") for l in OFFLOADED_LAYERS)
    assert all(p.device.type == "meta" for l in OFFLOADED_LAYERS for p in off.adapter.layer(l).parameters())


# LLaVA-OneVision's image_newline is a bare parameter of the model: accelerate names it and warns
@pytest.mark.filterwarnings("ignore:The following device_map keys do not match")
@pytest.mark.parametrize("name", TINY_NAMES)
def test_device_map_auto_on_every_family(name, tmp_path):
    built = vb.load(name)
    built.model.save_pretrained(tmp_path / "model")
    built.processor.save_pretrained(tmp_path / "model")
    size = sum(p.numel() * p.element_size() for p in built.model.parameters())
    plain = vb.load(str(tmp_path / "model"))
    off = vb.load(str(tmp_path / "model"), device_map="auto", max_memory={"cpu": size // 2},
                  offload_folder=str(tmp_path / "offload"))
    assert "disk" in off.model.hf_device_map.values()
    assert any(p.device.type == "meta" for p in off.adapter.layer(off.n_layers - 1).parameters())
    assert hasattr(off.adapter.layer(off.n_layers - 1), "_hf_hook")
    assert off.device == torch.device("cpu")
    assert torch.equal(off.logits(_batch(off, 1)), plain.logits(_batch(plain, 1)))
    pairs = S.scene_pairs(1, "id_selection", 0, n_objects=3, canvas=CANVAS)
    naive = vb.locate(plain, pairs, method="naive", layers=[off.n_layers - 1])
    exact = vb.locate(off, pairs, method="exact", layers=[off.n_layers - 1])
    np.testing.assert_allclose(exact.per_pair, naive.per_pair, atol=max(1e-4 * np.ptp(naive.per_pair), 1e-5))
