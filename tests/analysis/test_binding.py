"""Probes wired to captured activations: a set whose vectors carry the codes gives the entropies back, one that
carries nothing gives no bits, pairwise probes read the token tables, and `vlmbind probe` runs end to end."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import get_tiny, shared_organism

import vlmbind as vb
from vlmbind.analysis.binding import codes, colorshape_splits, default_sites, probe_sites
from vlmbind.core.errors import NoImageTokensError
from vlmbind.engine.activations import FORMAT, ActivationSet
from vlmbind.probes import ProbeConfig
from vlmbind.stimuli.colorshape import entropies

FAST = ProbeConfig(epochs=40, lr=1e-2, batch_size=128, seed=0)


def memory_set(examples, vectors: dict[str, np.ndarray]) -> ActivationSet:
    """An in-memory set holding one given vector per example per site (no model)."""
    n = len(examples)
    memory = {f"{site}|{i}": torch.as_tensor(v[i], dtype=torch.float32)[None] for site, v in vectors.items()
              for i in range(n)}
    memory |= {f"__tokens|{i}": torch.tensor([[0, -1, -1, -1, -1]], dtype=torch.int32) for i in range(n)}
    meta = [{**e.to_record(), "grids": []} for e in examples]
    manifest = {"format": FORMAT, "model": "synthetic", "sites": list(vectors), "tokens": "image", "n": n,
                "n_shards": 1, "shards": [{"name": "shard-00000", "start": 0, "n": n}], "aligned_sites": []}
    return ActivationSet(None, manifest, memory, meta)


def test_codes_in_the_vectors_come_back_as_bits_and_noise_gives_none():
    examples, split = colorshape_splits(400, 100, 200, seed=1)
    o = np.array([[int(b) for b in e.fields["o_code"]] for e in examples], dtype=np.float32)
    rng = np.random.default_rng(0)
    acts = memory_set(examples, {"knows_o": o, "noise": rng.normal(size=(len(examples), 64))})
    o_read, f_read = codes(acts)
    np.testing.assert_array_equal(o_read, o)
    assert f_read.shape == (len(examples), 16)
    # certain outputs need large logits: a faster recipe than FBP's (which assumes far more data)
    sure = ProbeConfig(epochs=80, lr=5e-2, batch_size=64, seed=0)
    frame = probe_sites(acts, split, families=("linear",), config=sure).frame.set_index("site")
    h = entropies("test")
    # Z = O: the object code is readable, so nearly all of H(O) (and of H(O|F)) is recovered
    assert frame.loc["knows_o", "B_O"] > 0.9 * h["H_O"]
    assert frame.loc["knows_o", "beta_star_OF"] > 0.9
    # noise: no bits (the bound may be negative, never clearly positive)
    assert frame.loc["noise", "B_O"] < 1.0 and frame.loc["noise", "B_star_OF"] < 1.0
    with pytest.raises(vb.InputError, match="unknown probe families"):
        probe_sites(acts, split, families=("cubic",))
    with pytest.raises(vb.InputError, match="split labels"):
        probe_sites(acts, split[:-1])


def test_pairwise_probe_on_an_encoder_capture_reads_the_token_tables():
    from vlmbind.engine.encoders import build_tiny_encoder

    enc = build_tiny_encoder("tiny-clip", patch=8)  # 8 px patches: each 16 px object covers several
    examples, split = colorshape_splits(24, 8, 8, seed=2)
    acts = vb.capture(enc, examples, "vision.blocks.2.hook_resid_post")
    result = probe_sites(acts, split, families=("pairwise",), config=FAST)
    row = result.frame.iloc[0]
    assert row["family"] == "pairwise" and 0.0 <= row["accuracy"] <= 1.0
    owners = [acts.token_objects(i) for i in range(len(acts))]
    assert all((o >= 0).sum() > 0 for o in owners)  # every image has object patches to pair


def test_probe_command_on_the_organism(tmp_path, capsys):
    from vlmbind.cli import main

    out = tmp_path / "probe"
    assert main(["probe", "--model", "organism-p2a", "--n-train", "32", "--n-val", "8", "--n-test", "8",
                 "--epochs", "3", "--family", "linear,attention", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    frame = pd.read_csv(out / "probe.csv")
    vlm = shared_organism("organism-p2a")
    assert list(frame["site"].unique()) == [s.name for s in vlm.sites(default_sites(vlm))]
    assert set(frame["family"]) == {"linear", "attention"} and set(frame["n_test"]) == {8}
    np.testing.assert_allclose(frame["B_O"], frame["H_O"] - frame["CE_O"])
    assert summary["recipe"]["epochs"] == 3 and (out / "probe.html").stat().st_size > 1000
    # the attention probe needs the tokens; pooled families alone capture one mean per image, with the same numbers
    assert json.loads((out / "activations" / "manifest.json").read_text())["tokens"] == "image"
    pooled = tmp_path / "pooled"
    assert main(["probe", "--model", "organism-p2a", "--n-train", "32", "--n-val", "8", "--n-test", "8",
                 "--epochs", "3", "--family", "linear", "--out", str(pooled), "--json"]) == 0
    capsys.readouterr()
    assert json.loads((pooled / "activations" / "manifest.json").read_text())["tokens"] == "image_mean"
    linear = frame[frame["family"] == "linear"].reset_index(drop=True)
    np.testing.assert_allclose(pd.read_csv(pooled / "probe.csv")["B_O"], linear["B_O"], atol=1e-3)
    assert main(["probe", "--model", "organism-p2a", "--family", "cubic", "--out", str(tmp_path / "bad")]) == 2
    assert main(["probe", "--model", "organism-p2a", "--lr", "0", "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("name", [*__import__("vlmbind.tiny", fromlist=["TINY_NAMES"]).TINY_NAMES, "tiny-dinov2"])
def test_rsa_and_probes_run_on_every_family(name):
    from vlmbind.analysis.rsa import rsa
    from vlmbind.stimuli import rsa_set

    vlm = get_tiny(name)
    sites = default_sites(vlm)
    single = list(rsa_set(0, positions_per_conjunction=1))[:8]
    if not getattr(vlm.adapter, "image_tokens_in_sequence", True):
        # Llama-3.2-Vision: no image tokens in the language model's sequence to pool per object; a named error
        with pytest.raises(NoImageTokensError, match="cross-attention"):
            rsa(vb.capture(vlm, single, sites), permutations=10)
        sites = sites[:1]  # the tower's rows still pool per image
    frame = rsa(vb.capture(vlm, single, sites), permutations=10).frame
    assert set(frame["site"]) == {s.name for s in vlm.sites(sites)} and frame["r"].notna().any()
    examples, split = colorshape_splits(6, 3, 3, seed=0)
    acts = vb.capture(vlm, examples, sites[-1])
    result = probe_sites(acts, split, families=("linear",), config=ProbeConfig(epochs=2, seed=0)).frame
    assert len(result) == 1 and np.isfinite(result["CE_O"]).all() and (result["n_test"] == 3).all()
