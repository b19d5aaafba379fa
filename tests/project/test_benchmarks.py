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
    saved_run = (ROOT / "benchmarks" / "saved" / "locate.json").read_bytes()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench.main(["--cases", "organism", "--pairs", "1", "--json", "--threads", "1"]) == 0
    assert (ROOT / "benchmarks" / "saved" / "locate.json").read_bytes() == saved_run  # saved only with --save
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


def test_the_nnsight_loop_scores_the_prompts_locate_scores_in_either_format():
    """The plain nnsight loop is the benchmark's independent reference: in the chat format too (a model's default
    when it has a chat template, as the benchmark's small model does) it must patch the prompts locate patches and
    give naive's scores."""
    from helpers import get_tiny

    from vlmbind.stimuli import scene_pairs

    bench = load_benchmark("locate")
    vlm = get_tiny("tiny-qwen2_5_vl")
    pairs = list(scene_pairs(1, "id_selection", 0, n_objects=3))
    try:
        for fmt in ("raw", "chat"):
            vlm.use_prompt_format(fmt)
            r = bench.run_case(vlm, pairs, ["naive", "nnsight_loop"])
            assert r["score_range"] > 1e-3, fmt
            assert r["max_abs_diff_to_naive"]["nnsight_loop"] <= max(1e-4 * r["score_range"], 1e-5), (fmt, r)
    finally:
        vlm.use_prompt_format(None)


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


def test_memory_saved_run_meets_the_budget():
    memory = load_benchmark("memory")
    saved = json.loads((ROOT / "benchmarks" / "saved" / "memory.json").read_text())["result"]
    rows = {r["job"]: r for r in saved["rows"]}
    assert set(rows) == set(memory.JOBS) and saved["budget_bytes"] == memory.BUDGET_BYTES
    assert rows["locate"]["tokens"] > 1200  # a real prompt length, not a tiny one
    assert all(rows[j]["extra_bytes"] <= memory.BUDGET_BYTES for j in ("locate", "eval"))
    # the straightforward full-logits forward needs at least its logits: 2 rows x tokens x 151,665 floats
    assert rows["full_logits"]["extra_bytes"] >= 2 * rows["full_logits"]["tokens"] * 151_665 * 4


def test_results_page_is_rendered_from_the_saved_runs():
    """benchmarks/RESULTS.md is exactly what the saved runs render (nothing typed by hand), every benchmark has a
    saved run, and each section names the command that produced it."""
    saved = load_benchmark("saved")
    runs = sorted(p.stem for p in (ROOT / "benchmarks" / "saved").glob("*.json"))
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "saved")
    assert runs == scripts, "save a run of the new benchmark: python benchmarks/<name>.py --save"
    page = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert page == saved.results_page(), "run python benchmarks/saved.py after changing a benchmark's render"
    for name in runs:
        record = json.loads((ROOT / "benchmarks" / "saved" / f"{name}.json").read_text())
        assert record["benchmark"] == name and record["command"].startswith(f"python benchmarks/{name}.py")
        assert f"## `{record['command'].removeprefix('python ')}`" in page
    assert saved.main(["--check"]) == 0


def test_save_is_off_unless_asked_also_after_nnsight_gave_every_object_a_save_method():
    import argparse

    import nnsight  # noqa: F401  (its import adds object.save)

    parser = argparse.ArgumentParser()
    load_benchmark("saved").add_save_option(parser)
    assert parser.parse_args([]).save_run is False and parser.parse_args(["--save"]).save_run is True


def test_save_writes_the_run_and_the_page_again(tmp_path):
    """--save's bookkeeping, in a scratch folder: the record holds the command and the machine, and the page gets
    the run's section (rendered by the benchmark) after the introduction, once however often it is saved."""
    saved = load_benchmark("saved")
    result = {"model": "organism-vsm", "head_sets": ["2.3 3.1"], "n_estimate": 8, "n_eval": 2, "alphas": [1.0],
              "sequential_s": 2.0, "shared_s": 1.0, "ratio": 2.0, "equal": True}
    for _ in range(2):
        record = saved.save("edits", ["--n-estimate", "8"], result, threads=1, saved=tmp_path / "saved",
                            results=tmp_path / "RESULTS.md")
    assert record["command"] == "python benchmarks/edits.py --n-estimate 8"
    assert record["machine"]["threads"] == 1 and record["machine"]["cores"] >= 1
    assert json.loads((tmp_path / "saved" / "edits.json").read_text()) == record
    page = (tmp_path / "RESULTS.md").read_text()
    assert page.startswith(saved.INTRO) and page.count("## `benchmarks/edits.py --n-estimate 8`") == 1
    assert "x2.00   same rows: True" in page


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
    "circuit": (["--pairs", "1", "--sender-layers", "5", "--cases", "text -> last", "--json"], None,
                lambda rows: rows[0]["edges"] == 4 * (1 + 3 * 4) and rows[0]["max_abs_difference"] < 1e-4
                and rows[0]["speedup"] > 0),
    "hooks": (["--repeats", "1", "--json", "{tmp}/hooks.json", "tiny-qwen2_5_vl"], "hooks.json",
              lambda rows: rows[0]["vlmbind_overhead_ratio"] > 0 and rows[0]["nnsight_over_vlmbind_ratio"] > 0),
    "precision": (["--pairs", "1", "--threads", "1", "--families", "qwen2_5_vl", "--out", "{tmp}/precision.json"],
                  "precision.json",
                  lambda s: len(s["rows"]) == 2 and all(-1 <= r["spearman"] <= 1 for r in s["rows"])),
    "probe_size": (["--n-train", "32", "--n-val", "8", "--n-test", "8", "--families", "linear", "--threads", "1",
                    "--out", "{tmp}/probe"], "probe/probe_size.json",
                   lambda s: [x["stage"] for x in s["stages"]] == ["generate", "capture", "fit linear"]),
    "startup": (["--repeats", "1", "--json"], None,
                lambda rows: [(r["command"].split()[1], r["exit_codes"]) for r in rows[-1]["rows"]]
                == [("-c", [0]), ("--help", [0]), ("models", [0]), ("export", [2])]),
    "training": (["--stages", "1", "--steps", "2", "--strictness-pairs", "2", "--json"], None,
                 lambda rows: len(rows[-1]["stages"]) == 1 and rows[-1]["strictness"]["pairs_per_variable"] == 2),
    # here the CPU against itself: the two runs must be the same run
    "training_device": (["--steps", "1", "--device", "cpu", "--json"], None,
                        lambda rows: rows[-1]["stage"] and rows[-1]["max_loss_difference"] == 0.0),
    # two timed steps: a per-step time is a difference of two runs, too noisy at this size to have a sign
    "two_processes": (["--stages", "1", "--steps", "2", "--json"], None,
                      lambda rows: {"1 process, 1 thread", "1 process, 2 threads", "2 processes, 1 thread each",
                                    "threads_x", "processes_x"} <= set(rows[-1]["stages"][0])),
}
# scripts run at a small size by the tests above
COVERED_ABOVE = {"locate": test_locate_benchmark_json, "gpu": test_gpu_benchmark_ci_scale_runs_on_cpu,
                 "edits": test_edits_benchmark_compares_the_shared_estimation_with_one_study_per_set,
                 "memory": test_memory_saved_run_meets_the_budget,
                 "saved": test_results_page_is_rendered_from_the_saved_runs}


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *argv], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if written:
        result = json.loads((tmp_path / written).read_text())
    else:
        result = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
    assert check(result), result
