"""The locate benchmark runs and its bookkeeping is right: every method is timed on the same pairs, ratios are
naive's time over the method's, and exact's scores equal naive's."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_locate_benchmark_json():
    bench = load_benchmark("locate")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench.main(["--cases", "organism", "--pairs", "1", "--json", "--threads", "1"]) == 0
    rows = [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]
    assert [r["condition"] for r in rows] == ["id_selection", "id_retrieval"]
    for r in rows:
        assert set(r["seconds"]) == {"naive", "exact", "attribution", "nnsight_loop"}
        # the plain nnsight loop is an independent reference: it must give naive's scores
        assert r["max_abs_diff_to_naive"]["nnsight_loop"] <= max(1e-4 * r["score_range"], 1e-5)
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


def test_gpu_benchmark_ci_scale_runs_on_cpu(tmp_path):
    """The 7B benchmark's scaled-down twin, as a fresh process on CPU: every method timed on both conditions, exact
    equal to naive on the sampled heads, and the ratios consistent with the seconds (no GPU needed)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--scale", "ci", "--device", "cpu",
                           "--threads", "1", "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["scale"], result["device"], result["dtype"]) == ("ci", "cpu", "float32")
    assert result["within_time_limit"] and not result.get("skipped")
    assert [c["kind"] for c in result["conditions"]] == ["last_token", "mid_prompt"]
    for c in result["conditions"]:
        assert c["skipped"] == [] and c["heads"] == 16 and c["image_tokens"] == 64
        assert set(c["seconds"]) == {"naive", "exact", "attribution"}
        assert c["exact"]["fastest"] in c["exact"]["seconds"] and "layout=batched" in c["exact"]["seconds"]
        naive = c["seconds"]["naive"]
        for method, seconds in c["seconds"].items():
            assert seconds > 0 and c["speedup_vs_naive"][method] == pytest.approx(naive / seconds)
            assert c["heads_per_second"][method] == pytest.approx(16 / seconds)
        # a full naive sweep is heads + 1 forwards at the measured cost per forward
        assert naive == pytest.approx(c["naive"]["seconds_per_forward"] * 17)
        check = c["exact_vs_naive"]
        assert check["heads_compared"] == 16 and not c["naive"]["truncated"]
        assert check["effect_range"] > 1e-2, "effects too small for the comparison to mean anything"
        assert check["matches"] and check["max_abs_diff"] <= max(1e-4 * check["effect_range"], 1e-5)
    assert c["suffix"] > 1  # the mid-prompt condition patches a span before the last token


def test_memory_results_come_from_the_saved_run_and_meet_the_budget(tmp_path, monkeypatch):
    memory = load_benchmark("memory")
    saved = json.loads((ROOT / "benchmarks" / "memory.json").read_text())
    rows = {r["job"]: r for r in saved["rows"]}
    assert set(rows) == set(memory.JOBS) and saved["budget_bytes"] == memory.BUDGET_BYTES
    assert rows["locate"]["tokens"] > 1200  # a real prompt length, not a tiny one
    assert all(rows[j]["extra_bytes"] <= memory.BUDGET_BYTES for j in ("locate", "eval"))
    # the straightforward full-logits forward needs at least its logits: 2 rows x tokens x 151,665 floats
    assert rows["full_logits"]["extra_bytes"] >= 2 * rows["full_logits"]["tokens"] * 151_665 * 4
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n")
    monkeypatch.setattr(memory, "RESULTS", results)
    memory.write_results(saved)
    memory.write_results(saved)  # replaces its block, never appends a second
    text = results.read_text()
    assert text.count(memory.BEGIN) == 1
    assert f"| locate | {rows['locate']['tokens']} | {rows['locate']['extra_bytes'] / 2**30:.2f} GiB |" in text
    assert text.split(memory.BEGIN)[1] in (ROOT / "benchmarks" / "RESULTS.md").read_text()  # RESULTS.md is current


def test_edits_benchmark_compares_the_shared_estimation_with_one_study_per_set():
    """benchmarks/edits.py on a small case: both ways give the same rows, and the shared run is timed beside."""
    out = load_benchmark("edits").run("organism-vsm", n_estimate=96, n_eval=6)
    assert out["equal"] is True and out["head_sets"] == ["2.3 3.1", "2.3", "3.1"]
    assert out["sequential_s"] > 0 and out["shared_s"] > 0 and out["ratio"] == pytest.approx(
        out["sequential_s"] / out["shared_s"], rel=0.02)


def test_training_benchmark_compares_strictness_per_head_with_per_set():
    """benchmarks/training.py's evaluation table on a small case: both ways give the same shares over every
    unplanted head of the shipped organism-vsm, and both are timed."""
    out = load_benchmark("training").strictness_evaluation(threads=1, n_pairs=4)
    assert out["equal"] is True and out["heads"] == 24 and out["pairs_per_variable"] == 4
    assert out["variables"] == ["feature_retrieval", "id_retrieval", "id_selection"]
    assert out["per_head_s"] > 0 and out["per_set_s"] > 0


# ----------------------------------------------------------------------------------------------------------------
# every benchmark script runs here at a small size, as a fresh process, so none can rot unnoticed
# ----------------------------------------------------------------------------------------------------------------
# script -> (arguments, the JSON file it writes under {tmp} or None for JSON lines on stdout, a check of that JSON)
SMALL_RUNS = {
    "capture": (["--n", "4", "--repeats", "1", "--batch-size", "2", "--threads", "1", "--json", "tiny-qwen2_5_vl"],
                None, lambda rows: rows[0]["overhead"] > 0 and rows[0]["bytes_written"] > 0),
    "hooks": (["--repeats", "1", "--json", "{tmp}/hooks.json", "tiny-qwen2_5_vl"], "hooks.json",
              lambda rows: rows[0]["vlmbind_overhead_ratio"] > 0 and rows[0]["nnsight_over_vlmbind_ratio"] > 0),
    "precision": (["--pairs", "1", "--threads", "1", "--families", "qwen2_5_vl", "--out", "{tmp}/precision.json",
                   "--results", "{tmp}/RESULTS.md"], "precision.json",
                  lambda s: len(s["rows"]) == 2 and all(-1 <= r["spearman"] <= 1 for r in s["rows"])),
    "probe_size": (["--n-train", "32", "--n-val", "8", "--n-test", "8", "--families", "linear", "--threads", "1",
                    "--out", "{tmp}/probe"], "probe/probe_size.json",
                   lambda s: [x["stage"] for x in s["stages"]] == ["generate", "capture", "fit linear"]),
    "training": (["--stages", "1", "--steps", "2", "--json"], None, lambda rows: len(rows[-1]["stages"]) == 1),
    # two timed steps: a per-step time is a difference of two runs, too noisy at this size to have a sign
    "two_processes": (["--stages", "1", "--steps", "2", "--json"], None,
                      lambda rows: {"1 process, 1 thread", "1 process, 2 threads", "2 processes, 1 thread each",
                                    "threads_x", "processes_x"} <= set(rows[-1]["stages"][0])),
}
# scripts run at a small size by the tests above
COVERED_ABOVE = {"locate": test_locate_benchmark_json, "gpu": test_gpu_benchmark_ci_scale_runs_on_cpu,
                 "edits": test_edits_benchmark_compares_the_shared_estimation_with_one_study_per_set,
                 "memory": test_memory_results_come_from_the_saved_run_and_meet_the_budget}


def test_every_benchmark_script_is_run_by_the_suite():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts == set(SMALL_RUNS) | set(COVERED_ABOVE), "give the new benchmark a small run in SMALL_RUNS"


def test_benchmarks_use_only_public_names():
    """A benchmark imports vlmbind's names (and a sibling benchmark's) as a user would: none with a leading
    underscore."""
    import ast

    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    private = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and ((node.module or "").split(".")[0] == "vlmbind"
                                                     or node.module in scripts):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


@pytest.mark.parametrize("script", sorted(SMALL_RUNS))
def test_benchmark_script_runs_at_a_small_size(script, tmp_path):
    import os
    import subprocess
    import sys

    argv, written, check = SMALL_RUNS[script]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if script == "precision":
        (tmp_path / "RESULTS.md").write_text("# results\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *argv], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if written:
        result = json.loads((tmp_path / written).read_text())
    else:
        result = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
    assert check(result), result
    if script == "precision":
        assert "precision table: begin" in (tmp_path / "RESULTS.md").read_text()
