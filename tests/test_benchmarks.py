"""The locate benchmark runs and its bookkeeping is right: every method is timed on the same pairs, ratios are
naive's time over the method's, and exact's scores equal naive's."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_locate_benchmark_json():
    bench = load_benchmark("locate")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench.main(["--cases", "organism", "--pairs", "1", "--no-nnsight", "--json", "--threads", "1"]) == 0
    rows = [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]
    assert [r["condition"] for r in rows] == ["id_selection", "id_retrieval"]
    for r in rows:
        assert set(r["seconds"]) == {"naive", "exact", "attribution"}
        for method, seconds in r["seconds"].items():
            assert r["ratio_to_naive"][method] == pytest.approx(r["seconds"]["naive"] / seconds)
        assert r["max_abs_diff_to_naive"]["exact"] <= max(1e-4 * r["score_range"], 1e-5)
        assert r["top10_recall_vs_naive"]["naive"] == 1.0 and r["heads"] == 16


def test_small_benchmark_model_has_the_stated_shape():
    bench = load_benchmark("locate")
    vlm = bench.small_qwen()
    from vlmbind.stimuli import Canvas, scene_pairs

    pair = scene_pairs(1, "id_selection", 0, n_objects=3, canvas=Canvas(image_size=448, grid=3))[0]
    index = vlm.prepare(pair.clean.image, pair.clean.prompt).index[0]
    assert (vlm.n_layers, vlm.n_heads, vlm.adapter.d_model) == (8, 8, 256)
    assert index.image_positions.size == 256
