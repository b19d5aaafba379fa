"""Role-mean ablation: a head's z replaced by its mean over the tokens of the same role (image / text / special).

References: the means against numpy over the captured z; the ablation against a plain torch pre-hook on ``o_proj``
written here (no vlmbind hook); the cached ``generate`` path against full-sequence greedy decoding.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny, shared_organism

import vlmbind as vb
from vlmbind.analysis.ablation import ablation_study
from vlmbind.analysis.evaluation import evaluate, training_defaults
from vlmbind.engine.decoding import greedy_decode
from vlmbind.stimuli import scene_description

LAYER, HEADS = 1, [0, 2]


@pytest.fixture(scope="module")
def tiny():
    return get_tiny("tiny-qwen2_5_vl")


@pytest.fixture(scope="module")
def batch(tiny):
    # two prompts of different lengths: the shorter row is left-padded
    return tiny.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "the red object is a"])


def _module(model, path):
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def test_role_means_equal_numpy_means_over_each_role(tiny, batch):
    means = tiny.head_means(batch, LAYER, HEADS, by_role=True)
    z = tiny.capture(batch, tiny.adapter.z_site(LAYER))[tiny.adapter.z_site(LAYER)][:, :, HEADS].numpy()
    roles = np.stack([ti.roles for ti in batch.index])
    assert (roles == "pad").any(), "the fixture must contain padding, which no role mean may include"
    assert set(means) == set(roles.ravel()) - {"pad"}
    for role, mean in means.items():
        np.testing.assert_allclose(mean.numpy(), z[roles == role].mean(0), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(means["image"], means["text"]), "image and text means must differ for the test to bite"


def test_role_mean_ablation_equals_a_hand_written_o_proj_hook(tiny, batch):
    means = tiny.head_means(batch, LAYER, HEADS, by_role=True)
    d = tiny.adapter.d_head
    roles = np.stack([ti.roles for ti in batch.index])

    def replace(module, args):
        x = args[0].clone()
        for row in range(x.shape[0]):
            for pos in range(x.shape[1]):
                if roles[row, pos] == "pad":
                    continue
                for i, head in enumerate(HEADS):
                    x[row, pos, head * d:(head + 1) * d] = means[roles[row, pos]][i]
        return (x, *args[1:])

    handle = _module(tiny.model, tiny.adapter.o_proj_path(LAYER)).register_forward_pre_hook(replace)
    try:
        with torch.no_grad():
            reference = tiny.model(**tiny.model_inputs(batch), use_cache=False).logits
    finally:
        handle.remove()
    with tiny.ablate([(LAYER, h) for h in HEADS], mode="role_mean", means={LAYER: means}):
        ablated = tiny.run(batch).logits
    torch.testing.assert_close(ablated, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ablated, tiny.run(batch).logits, atol=1e-4), "the ablation must change the logits"


def test_role_mean_ablation_writes_each_roles_mean_and_keeps_padding(tiny, batch):
    means = tiny.head_means(batch, LAYER, HEADS, by_role=True)
    site = tiny.adapter.z_site(LAYER)
    clean = tiny.capture(batch, site)[site]
    edit = vb.AblateHeads(layer=LAYER, heads=HEADS, mode="role_mean", means=means)
    out = tiny.run(batch, sites=[site], interventions=[edit])[site]
    roles = np.stack([ti.roles for ti in batch.index])
    for role, mean in means.items():
        rows = out[torch.as_tensor(roles == role)][:, HEADS]
        torch.testing.assert_close(rows, mean.expand(len(rows), -1, -1), atol=0, rtol=0)
    pad = torch.as_tensor(roles == "pad")
    torch.testing.assert_close(out[pad], clean[pad], atol=0, rtol=0)
    others = [h for h in range(tiny.n_heads) if h not in HEADS]
    torch.testing.assert_close(out[:, :, others], clean[:, :, others], atol=0, rtol=0)


def test_role_mean_positions_restrict_the_edit(tiny, batch):
    means = tiny.head_means(batch, LAYER, HEADS, by_role=True)
    site = tiny.adapter.z_site(LAYER)
    clean = tiny.capture(batch, site)[site]
    edit = vb.AblateHeads(layer=LAYER, heads=HEADS, mode="role_mean", means=means, positions=[-1])
    out = tiny.run(batch, sites=[site], interventions=[edit])[site]
    torch.testing.assert_close(out[:, :-1], clean[:, :-1], atol=0, rtol=0)
    last_role = batch.index[0].roles[-1]
    torch.testing.assert_close(out[0, -1, HEADS], means[last_role], atol=0, rtol=0)


def test_cached_generation_equals_full_sequence_decoding(tiny, batch):
    """Decode steps on the key/value cache see one generated token at a time; full forwards see the prompt plus
    the tokens so far: both must fill generated tokens with the text mean."""
    means = {LAYER: tiny.head_means(batch, LAYER, HEADS, by_role=True)}
    heads = [(LAYER, h) for h in HEADS]
    with tiny.ablate(heads, mode="role_mean", means=means):
        cached, _ = tiny.generate(batch, max_new_tokens=4)
    items = [vb.AblateHeads(layer=LAYER, heads=HEADS, mode="role_mean", means=means[LAYER])]
    assert greedy_decode(tiny, batch, items, 4) == cached


def test_role_mean_refuses_missing_roles_and_plain_tensors(tiny, batch):
    means = tiny.head_means(batch, LAYER, HEADS, by_role=True)
    no_image = {r: m for r, m in means.items() if r != "image"}
    edit = vb.AblateHeads(layer=LAYER, heads=HEADS, mode="role_mean", means=no_image)
    with pytest.raises(vb.InterventionError, match="'image' tokens but the means cover only"):
        tiny.run(batch, interventions=[edit])
    with pytest.raises(vb.InterventionError, match="role -> \\(heads, d_head\\)"):
        vb.AblateHeads(layer=LAYER, heads=HEADS, mode="role_mean", means=means["text"])
    with pytest.raises(vb.InputError, match="per_position or by_role"):
        tiny.head_means(batch, LAYER, HEADS, per_position=True, by_role=True)
    assert not tiny.active


def test_ablation_study_role_mean_uses_the_datasets_role_means():
    """On a shipped organism (accuracies far from 0, so the comparison bites): the top arm's accuracy equals
    evaluating under role means computed by hand on the same examples."""
    organism = shared_organism("organism-vsm")
    data = scene_description(16, 3, **training_defaults(organism, "scene", {"n_objects": 3}))
    heads = [(0, 0), (2, 1)]
    frame = pd.DataFrame([{"layer": l, "head": h, "score": float((l, h) in heads)}
                          for l in range(organism.n_layers) for h in range(organism.n_heads)])
    study = ablation_study(organism, data, frame, k=2, mode="role_mean", seeds=(0,))
    arms = {a["arm"]: a for a in study.arms}
    assert arms["clean"]["accuracy"] >= 0.5
    assert sorted(arms["top"]["heads"]) == [f"{l}.{h}" for l, h in heads]
    ref_batch = organism.prepare([e.image for e in data], [e.prompt for e in data])
    means = {l: organism.head_means(ref_batch, l, [h for ll, h in heads if ll == l], by_role=True) for l, _ in heads}
    with organism.ablate(heads, mode="role_mean", means=means):
        expected = evaluate(organism, data)
    assert arms["top"]["accuracy"] == expected.accuracy and arms["top"]["n"] == expected.n
