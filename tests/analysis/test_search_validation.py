"""Search-head validation: attention_swap scores by every method (naive equal to exact), tracking rows that agree
with the tracking result they come from, ablation on counting, and a benchmark table built from what the
validations ran (a method added to them appears without a change to the table code)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import shared_organism

from vlmbind.analysis.benchmark import BenchmarkResult, benchmark_rows, separation
from vlmbind.analysis.search_validation import tracking_rows, validate_search
from vlmbind.analysis.tracking import track, tracking_dataset
from vlmbind.analysis.validate import ValidationResult, validate
from vlmbind.core.errors import InputError


@pytest.fixture(scope="module")
def searched():
    vlm = shared_organism("organism-p2a")
    return vlm, validate_search(vlm, reference={"search": ["2.0"]}, reference_source="given", n_pairs=3,
                                methods=("exact", "naive", "attribution"), modes=("zero",), n_eval=6,
                                ablation_seeds=2, n_track=4, naive_heads=4)


def test_search_validation_scores_every_method_and_naive_equals_exact(searched):
    _vlm, result = searched
    assert [r["method"] for r in result.methods] == ["exact", "attribution"]
    assert all(r["condition"] == "search" and r["heads"] == ["2.0"] for r in result.methods)
    check = result.naive_check["search"]
    assert "2.0" in check["heads"] and len(check["heads"]) == 4
    assert check["max_abs_difference"] < 1e-4
    exact = [r for r in result.scores if r["method"] == "exact"]
    assert len(exact) == 16 and sum(r["reference"] for r in exact) == 1
    # the ranks are the scores' order
    best = max(exact, key=lambda r: r["score"])
    assert result.methods[0]["top_heads"][0] == f"{best['layer']}.{best['head']}"


def test_tracking_rows_are_the_tracking_results_rmse_and_half_cell_shares(searched):
    vlm, result = searched
    again = track(vlm, tracking_dataset(vlm, "count", 4, 1001))
    rows = tracking_rows(again, [(2, 0)])
    assert [(r["layer"], r["head"]) for r in rows] == [(l, h) for l in range(4) for h in range(4)]
    np.testing.assert_allclose([r["rmse"] for r in rows], again.rmse_heads.ravel(), rtol=0, atol=1e-12)
    distance = np.linalg.norm(again.head_centroids[:, 2, 0] - again.points, axis=-1)
    assert rows[8]["within_half_cell"] == pytest.approx(float(np.mean(distance[np.isfinite(distance)] <= 0.5)))
    assert rows[8]["within_low"] <= rows[8]["within_half_cell"] <= rows[8]["within_high"]
    assert result.tracking == rows  # the validation tracked the same displays (seed + 1)
    summary = result.tracking_summary()
    assert summary["reference"][0]["head"] == "2.0"
    assert summary["best_rmse"] == min(r["rmse"] for r in rows if np.isfinite(r["rmse"]))


def test_search_ablation_runs_on_counting_and_the_result_round_trips(searched, tmp_path):
    _vlm, result = searched
    arms = {a["arm"] for a in result.ablation}
    assert {"clean", "top", "random", "bottom"} <= arms and {a["mode"] for a in result.ablation} == {"zero"}
    assert all(a["n"] == 6 for a in result.ablation)
    assert result.params["ablation_scored"] == "whole trace"  # the points are what a search head writes
    result.save(tmp_path, figure=False)
    loaded = ValidationResult.load(tmp_path)
    assert loaded.tracking == result.tracking and loaded.methods == result.methods
    assert "search" in (tmp_path / "methods.csv").read_text() and (tmp_path / "tracking.csv").is_file()


def test_search_references_are_checked_by_name():
    vlm = shared_organism("organism-p2a")
    with pytest.raises(InputError, match="not \\['id_selection'\\]"):
        validate_search(vlm, reference={"id_selection": ["2.0"]})
    with pytest.raises(InputError, match="do not exist"):
        validate_search(vlm, reference={"search": ["7.0"]})
    with pytest.raises(InputError, match="n_track"):
        validate_search(vlm, reference={"search": ["2.0"]}, n_track=0)


def test_scene_validation_refuses_a_model_whose_planted_heads_search():
    vlm = shared_organism("organism-p2a")
    vlm_training = vlm.training
    try:
        vlm.training = {**vlm_training, "planted": {"search": ["2.1"]}}
        with pytest.raises(InputError, match="validate_search"):
            validate(vlm)
    finally:
        vlm.training = vlm_training


def test_benchmark_rows_come_from_what_the_validation_ran(searched):
    _vlm, result = searched
    rows = benchmark_rows(result, "planted")
    methods = [r["method"] for r in rows]
    assert methods == ["exact", "attribution", "tracking", "ablation:zero"]
    node = rows[0]
    assert node["auroc"] == result.methods[0]["auroc"] and node["family"] == "node"
    ablation = rows[-1]
    found = separation([a for a in result.ablation if a["mode"] == "zero"])
    assert (ablation["separation"], ablation["separation_low"], ablation["separation_high"]) == found
    # a method the validation ran that this module has never heard of appears as a row of its own
    extra = ValidationResult(model="m", reference="planted", heads=result.heads,
                             methods=[{**result.methods[0], "method": "new_method"}], params=result.params)
    assert [r["method"] for r in benchmark_rows(extra, "twin")] == ["new_method"]
    table = BenchmarkResult(rows=rows + benchmark_rows(extra, "twin"), organisms={"m": None}).markdown()
    assert "| m | twin | new_method | search |" in table
    assert table.count("\n") == len(rows) + 2


def test_separation_is_random_minus_top_with_an_interval_around_it():
    arms = [{"arm": "top", "accuracy": 0.1, "n": 50}, {"arm": "random", "accuracy": 0.8, "n": 50},
            {"arm": "random", "accuracy": 0.9, "n": 50}, {"arm": "clean", "accuracy": 1.0, "n": 50}]
    value, low, high = separation(arms)
    assert value == pytest.approx(0.75) and low < 0.75 < high
    assert separation(arms[:1]) is None
