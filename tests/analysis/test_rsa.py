"""RSA and PCA against scipy / scikit-learn and against representations whose answer is known in closed form."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats
from sklearn.decomposition import PCA
from sklearn.metrics.pairwise import cosine_similarity

import vlmbind as vb
from vlmbind.analysis.rsa import compare, model_matrices, pca, rsa, similarity_matrix
from vlmbind.engine.activations import FORMAT, ActivationSet

COLOURS, SHAPES = ["red", "green", "blue"], ["square", "circle", "star"]


def synthetic_set(vectors: dict[str, list[np.ndarray]], objects: list[dict]) -> ActivationSet:
    """An in-memory set of single-object examples whose one stored token per site is the given vector."""
    n = len(objects)
    memory = {f"{site}|{i}": torch.as_tensor(v[i], dtype=torch.float32)[None] for site, v in vectors.items()
              for i in range(n)}
    memory |= {f"__tokens|{i}": torch.tensor([[0, -1, -1, -1, 0]], dtype=torch.int32) for i in range(n)}
    meta = [{"objects": [o], "grids": []} for o in objects]
    manifest = {"format": FORMAT, "model": "synthetic", "sites": list(vectors), "tokens": "image", "n": n,
                "n_shards": 1, "shards": [{"name": "shard-00000", "start": 0, "n": n}],
                "projector_in_sequence_order": True, "aligned_sites": list(vectors)}
    return ActivationSet(None, manifest, memory, meta)


def grid_objects():
    return [{"colour": c, "shape": s, "row": r, "col": k}
            for r, c in enumerate(COLOURS) for k, s in enumerate(SHAPES)]


def test_model_matrices_by_hand():
    frame = pd.DataFrame([{"colour": "red", "shape": "square", "row": 0, "col": 0},
                          {"colour": "red", "shape": "circle", "row": 0, "col": 3},
                          {"colour": "blue", "shape": "square", "row": 4, "col": 0}])
    m = model_matrices(frame)
    np.testing.assert_array_equal(m["conjunctive"], np.eye(3))
    np.testing.assert_array_equal(m["compositional"], [[1, .5, .5], [.5, 1, 0], [.5, 0, 1]])
    np.testing.assert_allclose(m["position"][0], [1, 1 - 3 / 5, 1 - 4 / 5])


def test_similarity_and_comparison_equal_numpy_scipy_sklearn():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 7))
    np.testing.assert_allclose(similarity_matrix(x, "pearson"), np.corrcoef(x), atol=1e-12)
    np.testing.assert_allclose(similarity_matrix(x, "cosine"), cosine_similarity(x), atol=1e-12)
    model = rng.normal(size=(12, 12))
    model = model + model.T
    sim = similarity_matrix(x)
    got = compare(sim, model, permutations=0)
    rows, cols = np.tril_indices(12, -1)
    assert got["r"] == pytest.approx(stats.pearsonr(sim[rows, cols], model[rows, cols]).statistic)
    assert got["spearman"] == pytest.approx(stats.spearmanr(sim[rows, cols], model[rows, cols]).statistic)
    # a matrix compared with itself beats every permutation: the smallest possible p
    assert compare(model, model, permutations=99)["p"] == pytest.approx(1 / 100)


def test_compositional_code_gives_r_one_and_conjunctive_code_the_other_way():
    objects = grid_objects() * 2
    onehot = {c: np.eye(3)[i] for i, c in enumerate(COLOURS)} | {s: np.eye(3)[i] for i, s in enumerate(SHAPES)}
    compositional = [np.concatenate([onehot[o["colour"]], onehot[o["shape"]]]) for o in objects]
    conj_index = {(c, s): i for i, (c, s) in enumerate((c, s) for c in COLOURS for s in SHAPES)}
    conjunctive = [np.eye(9)[conj_index[(o["colour"], o["shape"])]] for o in objects]
    acts = synthetic_set({"blocks.0.hook_resid_post": compositional, "blocks.1.hook_resid_post": conjunctive},
                         objects)
    result = rsa(acts, similarity="cosine", permutations=200)
    r = result.frame.set_index(["site", "model_matrix"])["r"]
    assert r[("blocks.0.hook_resid_post", "compositional")] == pytest.approx(1.0)
    assert r[("blocks.1.hook_resid_post", "conjunctive")] == pytest.approx(1.0)
    assert r[("blocks.0.hook_resid_post", "conjunctive")] < 0.9
    assert result.frame["p"].min() == pytest.approx(1 / 201)


def test_pca_equals_sklearn(tmp_path):
    rng = np.random.default_rng(1)
    objects = grid_objects()
    vectors = [rng.normal(size=5) for _ in objects]
    acts = synthetic_set({"blocks.0.hook_resid_post": vectors}, objects)
    frame = pca(acts, "blocks.0.hook_resid_post")
    ref = PCA(n_components=2).fit(np.stack(vectors))
    projected = ref.transform(np.stack(vectors))
    for j in range(2):  # components are defined up to sign
        assert np.allclose(frame[f"pc{j + 1}"], projected[:, j], atol=1e-6) or \
            np.allclose(frame[f"pc{j + 1}"], -projected[:, j], atol=1e-6)
    assert frame["evr1"].iloc[0] == pytest.approx(ref.explained_variance_ratio_[0])


def test_rsa_command_on_the_organism(tmp_path, capsys):
    from vlmbind.cli import main

    out = tmp_path / "rsa"
    assert main(["rsa", "--model", "organism-p2a", "--positions", "2", "--permutations", "50",
                 "--sites", "blocks.*.hook_resid_post,vision.blocks.1.hook_resid_post", "--out", str(out),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    frame = pd.read_csv(out / "rsa.csv")
    assert list(frame.columns) == ["site", "component", "layer", "model_matrix", "r", "spearman", "p", "n_objects"]
    assert set(frame["n_objects"]) == {32} and len(frame) == 5 * 3 and summary["n_objects"] == 32
    for name in ("rsa.html", "pca_by_cell.html", "pca_by_colour.html"):
        assert (out / name).stat().st_size > 1000
    assert main(["rsa", "--model", "organism-p2a", "--sites", "blocks.9.hook_resid_post",
                 "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()
    with pytest.raises(vb.InputError, match="similarity"):
        rsa(ActivationSet.load(out / "activations"), similarity="euclid")
