"""Vision-block rows mapped to the image tokens they are merged into (``ModelAdapter.vision_row_tokens``), checked
against the model's own merger: regrouping the last block's rows by the map and merging them must give the tower's
output, which is in the language model's raster order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import draw_scene, get_tiny, shared_organism

import vlmbind as vb
from vlmbind.core.errors import InputError
from vlmbind.stimuli.colorshape import balanced_color_shape


@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-qwen2_vl", "organism-p2a"])
def test_merging_rows_by_the_map_gives_the_towers_output(name):
    vlm = get_tiny(name) if name.startswith("tiny") else shared_organism(name)
    size = (168, 168) if name.startswith("organism") else (224, 196)
    batch = vlm.prepare([draw_scene(1, size)], ["describe the objects in this image :"])
    last = f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post"
    cache = vlm.run(batch, sites=[last, "projector.hook_out"]).cache
    rows = cache[last].reshape(-1, cache[last].shape[-1])
    owner = vlm.adapter.vision_row_tokens(batch.inputs, 0)
    assert owner is not None and len(owner) == rows.shape[0]
    n_tokens = int(owner.max()) + 1
    assert np.array_equal(np.bincount(owner), np.full(n_tokens, 4))  # each token merges a 2 x 2 group
    regrouped = rows[torch.as_tensor(np.argsort(owner, kind="stable"))]
    merged = vlm.model.model.visual.merger(regrouped)
    expected = cache["projector.hook_out"].reshape(-1, merged.shape[-1])
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)
    if name == "organism-p2a":  # windowed attention: the blocks' order is not raster
        assert not np.array_equal(owner, np.repeat(np.arange(n_tokens), 4))


def test_activation_set_pools_vision_rows_per_image_token(tmp_path):
    vlm = shared_organism("organism-p2a")
    data = balanced_color_shape(3, 0, world="organism")
    acts = vb.capture(vlm, data, ["vision.blocks.0.hook_resid_post", "blocks.0.hook_resid_post"])
    on_disk = vb.capture(vlm, data, ["vision.blocks.0.hook_resid_post", "blocks.0.hook_resid_post"], out=tmp_path,
                         shard_size=2)
    np.testing.assert_array_equal(vb.ActivationSet.load(tmp_path).stacked_per_token("vision.blocks.0.hook_resid_post"),
                                  on_disk.stacked_per_token("vision.blocks.0.hook_resid_post"))
    pooled = acts.stacked_per_token("vision.blocks.0.hook_resid_post")
    assert pooled.shape == (3, 36, 64)
    owner = np.array(acts.manifest["vision_row_tokens"][acts.examples[1]["vision_rows"]])
    assert len(acts.manifest["vision_row_tokens"]) == 1  # one map for same-size images, not one per example
    raw = acts.tensor("vision.blocks.0.hook_resid_post", 1).float().numpy()
    for token in (0, 7, 35):
        np.testing.assert_allclose(pooled[1, token], raw[owner == token].mean(0), rtol=1e-6, atol=1e-6)
    assert acts.per_token("blocks.0.hook_resid_post", 1).shape == (36, 128)  # aligned sites come as stored


def test_a_family_without_the_map_is_refused_by_name():
    vlm = get_tiny("tiny-llava")
    acts = vb.capture(vlm, balanced_color_shape(1, 0, world="organism"), ["vision.blocks.0.hook_resid_post"])
    with pytest.raises(InputError, match="declares no map"):
        acts.per_token("vision.blocks.0.hook_resid_post", 0)
