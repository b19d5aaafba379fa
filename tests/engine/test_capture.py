"""Capture: what is stored equals a direct run, shards bound memory, an interrupted run resumes to identical files,
object pooling equals a hand computation, and bad calls are named errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import get_tiny, shared_organism

import vlmbind as vb
import vlmbind.engine.activations as cap
from vlmbind.core.errors import NoImageTokensError
from vlmbind.engine.activations import ActivationSet, capture
from vlmbind.stimuli.core import object_token_positions
from vlmbind.tiny import TINY_NAMES

S = vb.stimuli
SITES = ["blocks.1.hook_resid_post", "projector.hook_out", "vision.blocks.0.hook_resid_post"]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_stored_rows_equal_a_direct_run(name, tmp_path):
    vlm = get_tiny(name)
    data = list(S.scene_description(3, 0, n_objects=3))
    if not vlm.adapter.image_tokens_in_sequence:
        # Llama-3.2-Vision: no image tokens in the sequence; refused by name before anything is written
        with pytest.raises(NoImageTokensError, match="tokens='last'"):
            capture(vlm, data, SITES, out=tmp_path / "a", batch_size=2, shard_size=2)
        assert not (tmp_path / "a").exists()
        last = capture(vlm, data, SITES[:1], tokens="last")
        batch = vlm.prepare(data[0].image, data[0].prompt)
        torch.testing.assert_close(last.tensor(SITES[0], 0),
                                   vlm.run(batch, sites=SITES[:1]).cache[SITES[0]][0, [-1]], atol=1e-5, rtol=0)
        return
    acts = capture(vlm, data, SITES, out=tmp_path / "a", batch_size=2, shard_size=2)
    assert len(acts) == 3 and acts.complete and sorted(acts.sites) == sorted(SITES)
    for i, ex in enumerate(data):
        batch = vlm.prepare(ex.image, ex.prompt)
        ref = vlm.run(batch, sites=SITES).cache
        index = batch.index[0]
        torch.testing.assert_close(acts.tensor("blocks.1.hook_resid_post", i),
                                   ref["blocks.1.hook_resid_post"][0, index.image_positions], atol=1e-5, rtol=0)
        for site in SITES[1:]:
            torch.testing.assert_close(acts.tensor(site, i), ref[site].reshape(-1, ref[site].shape[-1]),
                                       atol=1e-5, rtol=0)
        covered = object_token_positions(index, ex.objects)
        owner = acts.token_objects(i)
        for k, positions in enumerate(covered):
            stored = acts.token_table(i)["position"][owner == k]
            assert set(stored.tolist()) <= set(positions.tolist()) and len(stored) > 0
    frame, x = acts.objects("blocks.1.hook_resid_post")
    first = acts.tensor("blocks.1.hook_resid_post", 0)[torch.as_tensor(acts.token_objects(0) == 0)].mean(0)
    np.testing.assert_allclose(x[0], first.numpy(), atol=1e-6)
    assert (frame["colour"].iloc[0], frame["shape"].iloc[0]) == (data[0].objects[0].colour, data[0].objects[0].shape)
    if not vlm.adapter.projector_in_sequence_order:
        with pytest.raises(vb.InputError, match="not the language model's image tokens"):
            acts.objects("projector.hook_out")


def test_in_memory_and_on_disk_agree_and_modes(tmp_path):
    vlm = get_tiny("tiny-qwen2_5_vl")
    data = S.scene_description(4, 1, n_objects=3)
    memory = capture(vlm, data, "blocks.*.hook_resid_post", tokens="last")
    disk = capture(vlm, data, "blocks.*.hook_resid_post", tokens="last", out=tmp_path / "d", shard_size=3)
    reloaded = ActivationSet.load(tmp_path / "d")
    for site in memory.sites:
        np.testing.assert_array_equal(memory.pooled(site), reloaded.pooled(site))
        np.testing.assert_array_equal(disk.pooled(site, "last"), reloaded.pooled(site, "last"))
    batch = vlm.prepare([e.image for e in data], [e.prompt for e in data])
    ref = vlm.run(batch, sites="blocks.2.hook_resid_post").cache["blocks.2.hook_resid_post"][:, -1]
    np.testing.assert_allclose(memory.pooled("blocks.2.hook_resid_post"), ref.numpy(), atol=1e-5)
    every = capture(vlm, list(data)[:1], "blocks.0.hook_resid_post", tokens="all")
    assert every.tensor("blocks.0.hook_resid_post", 0).shape[0] == batch.index[0].last_position + 1
    tokens, mask = capture(vlm, data, "blocks.0.hook_resid_post").stacked("blocks.0.hook_resid_post")
    assert tokens.shape[:2] == mask.shape and mask.all()


def test_image_mean_capture_keeps_the_pooled_vectors_and_refuses_tokens(tmp_path):
    """tokens='image_mean' stores one row per example and site: the mean of what 'image' keeps, so every pooled
    probe reads the same numbers from a token count's fraction of the disk; token reads are refused by name."""
    vlm = get_tiny("tiny-qwen2_5_vl")
    data = S.scene_description(4, 2, n_objects=3)
    full = capture(vlm, data, SITES, out=tmp_path / "full", shard_size=3)
    means = capture(vlm, data, SITES, out=tmp_path / "means", shard_size=3, tokens="image_mean")
    for site in SITES:
        assert means.tensor(site, 0).shape == (1, full.tensor(site, 0).shape[-1])
        np.testing.assert_allclose(means.pooled(site), full.pooled(site), atol=1e-6, rtol=1e-6)
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("full", "means")}
    assert size["means"] * 4 < size["full"]
    for read in (lambda: means.stacked(SITES[0]), lambda: means.objects(SITES[0]),
                 lambda: means.per_token(SITES[0], 0)):
        with pytest.raises(vb.InputError, match="tokens='image_mean'.*tokens='image'"):
            read()
    # half precision: the mean is taken in float32 before it is stored
    half = capture(vlm, data, SITES[:1], tokens="image_mean", dtype=torch.bfloat16)
    np.testing.assert_allclose(half.pooled(SITES[0]), full.pooled(SITES[0]), rtol=1e-2, atol=1e-2)


def test_memory_holds_one_shard_whatever_the_size(tmp_path, monkeypatch):
    vlm = get_tiny("tiny-qwen2_5_vl")
    written = []
    real = cap.save_safetensors
    monkeypatch.setattr(cap, "save_safetensors",
                        lambda tensors, path: written.append(len(tensors)) or real(tensors, path))
    for n in (4, 12):
        written.clear()
        acts = capture(vlm, S.scene_description(n, 2, n_objects=3), SITES, out=tmp_path / f"n{n}", shard_size=4,
                       batch_size=2)
        # every write holds one shard's examples (4 x (3 sites + the token table)), never the whole set
        assert written == [4 * (len(SITES) + 1)] * (n // 4)
        assert acts._memory is None and len(acts) == n


def test_interrupted_capture_resumes_to_identical_files(tmp_path, monkeypatch):
    vlm = get_tiny("tiny-gemma3")
    data = S.scene_description(6, 3, n_objects=3)
    capture(vlm, data, SITES, out=tmp_path / "ref", shard_size=2)
    real = cap.write_json_atomic
    calls = {"manifests": 0}

    def crash_after_first_shard(value, path, **kwargs):
        real(value, path, **kwargs)
        if str(path).endswith(cap.MANIFEST):
            calls["manifests"] += 1
            if calls["manifests"] == 1:
                raise KeyboardInterrupt("killed")

    monkeypatch.setattr(cap, "write_json_atomic", crash_after_first_shard)
    with pytest.raises(KeyboardInterrupt):
        capture(vlm, data, SITES, out=tmp_path / "run", shard_size=2)
    monkeypatch.setattr(cap, "write_json_atomic", real)
    partial = ActivationSet.load(tmp_path / "run")
    assert len(partial) == 2 and not partial.complete
    with pytest.raises(vb.InputError, match="resume"):
        capture(vlm, data, SITES, out=tmp_path / "run", shard_size=2)
    with pytest.raises(vb.InputError, match="sites"):
        capture(vlm, data, SITES[:1], out=tmp_path / "run", shard_size=2, resume=True)
    done = capture(vlm, data, SITES, out=tmp_path / "run", shard_size=2, resume=True)
    assert done.complete
    for f in sorted((tmp_path / "ref").iterdir()):
        assert (tmp_path / "run" / f.name).read_bytes() == f.read_bytes(), f.name
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]  # no temp files left


def test_bad_calls(tmp_path):
    vlm = get_tiny("tiny-qwen2_5_vl")
    data = S.scene_description(2, 0)
    with pytest.raises(vb.InputError, match="tokens"):
        capture(vlm, data, SITES, tokens="objects")
    with pytest.raises(vb.SiteError):
        capture(vlm, data, "blocks.1.hook_resid_mid")
    with pytest.raises(vb.InputError, match="at least one example"):
        capture(vlm, [], SITES)
    with pytest.raises(vb.InputError, match="attention patterns"):  # '*' includes query x key maps
        capture(vlm, data, "*", out=tmp_path / "star")
    assert not (tmp_path / "star").exists()
    with pytest.raises(vb.InputError, match="not an example"):
        capture(vlm, ["a string"], SITES)
    acts = capture(vlm, data, SITES[:1])
    with pytest.raises(vb.InputError, match="was not captured"):
        acts.tensor("blocks.2.hook_resid_post", 0)
    with pytest.raises(vb.InputError, match="out of range"):
        acts.tensor(SITES[0], 5)
    with pytest.raises(vb.InputError, match="not a vlmbind activation set"):
        ActivationSet.load(tmp_path)
    (tmp_path / cap.MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(vb.InputError, match="format"):
        ActivationSet.load(tmp_path)


def test_overwrite_replaces_a_capture_and_leaves_other_files(tmp_path):
    from vlmbind.core.errors import InputError
    from vlmbind.stimuli.colorshape import balanced_color_shape

    vlm = shared_organism("organism-p2a")
    first = balanced_color_shape(3, 0, world="organism")
    vb.capture(vlm, first, ["blocks.0.hook_resid_post"], out=tmp_path, shard_size=2)
    (tmp_path / "notes.txt").write_text("mine")
    second = balanced_color_shape(2, 5, world="organism")
    with pytest.raises(InputError, match="overwrite=True"):
        vb.capture(vlm, second, ["blocks.0.hook_resid_post"], out=tmp_path)
    with pytest.raises(InputError, match="contradict"):
        vb.capture(vlm, second, ["blocks.0.hook_resid_post"], out=tmp_path, overwrite=True, resume=True)
    acts = vb.capture(vlm, second, ["blocks.0.hook_resid_post"], out=tmp_path, overwrite=True)
    again = vb.ActivationSet.load(tmp_path)
    assert len(again) == len(acts) == 2 and [m["id"] for m in again.examples] == [e.id for e in second]
    assert sorted(p.name for p in tmp_path.glob("shard-*.safetensors")) == ["shard-00000.safetensors"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
