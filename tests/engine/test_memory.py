"""Memory stays bounded: ``vlmbind locate`` (exact) and ``vb.capture`` to disk keep a peak RSS that does not grow with
the number of pairs or examples, and ``exact_diffs``'s batched layout chunks its experiments so that the copies of the
prefix cache it materialises stay under ``memory_budget``, with the same scores whatever the budget.

Peak RSS is measured in fresh interpreters (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end, printed as
JSON), one small and one large run each, on the shipped organism; ``-s`` prints the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import get_tiny
from test_patching import all_heads, strong_task

from vlmbind.engine.patching import exact_diffs, naive_diffs, prefix_end

ROOT = Path(__file__).resolve().parents[2]
MB = 2**20

# The child reports its peak RSS, and its RSS just before the measured call (imports, model and data loaded).
CHILD_LOCATE = """
import json, resource, sys
from vlmbind.cli import main
n, out = int(sys.argv[1]), sys.argv[2]
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
code = main(["locate", "--model", "organism-p2a", "--condition", "id_selection", "--n-pairs", str(n), "--out", out,
             "--json"])
print("RESULT " + json.dumps({"code": code, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                              "before": before}))
"""

CHILD_CAPTURE = """
import json, resource, sys
import vlmbind as vb
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.stimuli import scene_description
n, out = int(sys.argv[1]), sys.argv[2]
vlm = vb.load("organism-p2a")
data = scene_description(n, 0, **training_defaults(vlm, "scene", {"n_objects": 3}))
# every site the organism has but attention patterns, every token: ~0.6 MB an example, so a capture that kept its
# examples in memory would grow by ~140 MB between the two sizes
sites = [s.name for s in vlm.sites("*") if not s.name.endswith("hook_pattern")]
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
acts = vb.capture(vlm, data, sites, out=out, tokens="all", batch_size=8, shard_size=16)
print("RESULT " + json.dumps({"n": len(acts), "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                              "before": before, "sites": len(sites)}))
"""


def run_child(code: str, n: int, out: Path) -> dict:
    """Run ``code`` with ``n`` and ``out`` in a fresh interpreter; its RESULT line as a dict."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code, str(n), str(out)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def assert_flat(name: str, small: tuple[int, dict], large: tuple[int, dict]) -> None:
    """The larger run's peak lies within max(10 %, 40 MB) of the smaller run's."""
    (n0, r0), (n1, r1) = small, large
    print(f"\n{name}: peak RSS {r0['peak'] / MB:.1f} MB at {n0}, {r1['peak'] / MB:.1f} MB at {n1} "
          f"(before the call {r0['before'] / MB:.1f} / {r1['before'] / MB:.1f} MB; growth during it "
          f"{(r0['peak'] - r0['before']) / MB:.1f} / {(r1['peak'] - r1['before']) / MB:.1f} MB)")
    assert r1["peak"] <= r0["peak"] + max(0.10 * r0["peak"], 40 * MB), f"{name}: peak RSS grows with the data size"


def test_locate_peak_memory_does_not_grow_with_pairs(tmp_path):
    runs = []
    for n in (8, 64):
        out = tmp_path / f"locate-{n}"
        result = run_child(CHILD_LOCATE, n, out)
        assert result["code"] == 0
        scores = (out / "scores.csv").read_text().splitlines()
        assert len(scores) == 1 + 16 and json.loads((out / "summary.json").read_text())["n"] == n
        runs.append((n, result))
    assert_flat("vlmbind locate (exact, organism-p2a)", *runs)


def test_capture_peak_memory_does_not_grow_with_examples(tmp_path):
    runs = []
    for n in (32, 256):
        out = tmp_path / f"capture-{n}"
        result = run_child(CHILD_CAPTURE, n, out)
        assert result["n"] == n
        written = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
        assert len(list(out.glob("shard-*.safetensors"))) == n // 16
        assert written > n * 0.5 * 1e6, "the capture wrote less than the test assumes; the bound would mean nothing"
        runs.append((n, result))
    assert_flat("vb.capture to disk (organism-p2a, 23 sites, all tokens)", *runs)


# ----------------------------------------------------------------------------------------------------------------
# exact_diffs, layout="batched": the materialised prefix cache per forward stays under memory_budget
# ----------------------------------------------------------------------------------------------------------------
class ForwardSpy:
    """Records, for every suffix forward (one that runs on a prefix cache), its rows and the bytes of prefix keys and
    values it materialised: every layer that ran appended its suffix, copying the prefix once per row; the layers
    below the chunk's lowest patched layer are skipped and keep expanded views of the one-row cache (no copy)."""

    def __init__(self, model: torch.nn.Module, prefix: int):
        self.prefix = prefix
        self.calls: list[tuple[int, int]] = []
        self.handle = model.register_forward_hook(self.after, with_kwargs=True)

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        cache, position = kwargs.get("past_key_values"), kwargs.get("cache_position")
        if cache is None or position is None or int(position[0]) == 0:
            return  # not a suffix forward (the clean prompt runs once, from position 0)
        rows = kwargs["input_ids"].shape[0]
        copied = 0
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                if t.shape[-2] > self.prefix:  # this layer ran and appended: torch.cat copied the prefix per row
                    copied += t.shape[0] * t.shape[1] * self.prefix * t.shape[3] * t.element_size()
        self.calls.append((rows, copied))

    def close(self) -> None:
        self.handle.remove()


@pytest.mark.parametrize("name,condition", [("tiny-qwen2_5_vl", "id_selection"), ("tiny-qwen2_5_vl", "mid_prompt"),
                                            ("tiny-kimi_k25", "id_selection")])
def test_batched_layout_keeps_the_prefix_cache_under_the_budget(name, condition):
    """Rows per forward follow the memory budget, measured on the cache rows actually copied: keys and values of
    every layer (grouped-query attention), or Kimi-K2.5's shared latent and rotary key (multi-head latent attention,
    a fraction of its heads' keys and values)."""
    vlm = get_tiny(name)
    task = strong_task(vlm, condition)
    heads = all_heads(vlm)
    a = vlm.adapter
    inputs = vlm.model_inputs(task.batch)
    prefix = prefix_end(vlm, task.batch, inputs, int(task.positions.min()))
    assert prefix > 0
    # one row's copy of the prefix cache, as the adapter declares it
    per_row = sum(a.cache_width(layer) for layer in range(vlm.n_layers)) * prefix * 4
    if name == "tiny-kimi_k25":
        assert per_row < 2 * vlm.n_layers * prefix * a.n_kv_heads * a.d_head * 4 / 4
    clean, naive = naive_diffs(vlm, task, heads)
    results = {}
    for rows_allowed in (1, 3, 7, 64):
        budget = rows_allowed * per_row + per_row // 2  # room for rows_allowed rows, not one more
        spy = ForwardSpy(vlm.model, prefix)
        try:
            c, patched = exact_diffs(vlm, task, heads, layout="batched", memory_budget=budget)
        finally:
            spy.close()
        rows = [r for r, _ in spy.calls]
        expected = min(rows_allowed, len(heads))
        assert sum(rows) == len(heads) and max(rows) == expected, (rows_allowed, rows)
        assert len(rows) == -(-len(heads) // expected)
        assert all(0 < copied <= budget for _, copied in spy.calls), (budget, spy.calls)
        # the chunk of layer-0 heads runs every layer: there the declared width is the cache's own
        assert spy.calls[0][1] == spy.calls[0][0] * per_row
        print(f"\nbatched, {condition}, budget {budget} B ({rows_allowed} rows of {per_row} B): rows per forward "
              f"{rows}, largest materialised prefix copy {max(b for _, b in spy.calls)} B")
        results[rows_allowed] = patched - c
    effects = naive - clean
    assert np.abs(effects).max() > 2e-3
    for rows_allowed, got in results.items():
        np.testing.assert_allclose(got, effects, atol=1e-4 * np.ptp(effects) + 1e-6, err_msg=str(rows_allowed))
        np.testing.assert_allclose(got, results[64], atol=1e-6, err_msg=str(rows_allowed))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_layout_keeps_its_attention_under_the_budget(attn):
    from vlmbind.engine.patching import packed_bytes

    vlm = get_tiny("tiny-qwen2_5_vl")
    task = strong_task(vlm, "mid_prompt")
    heads = all_heads(vlm)
    inputs = vlm.model_inputs(task.batch)
    prefix = prefix_end(vlm, task.batch, inputs, int(task.positions.min()))
    suffix = inputs["input_ids"].shape[1] - prefix
    assert prefix > 0 and suffix > 1
    clean, naive = naive_diffs(vlm, task, heads)
    before = vlm.model.config._attn_implementation
    vlm.model.set_attn_implementation(attn)
    try:
        for blocks_allowed in (1, 2, 5):
            budget = packed_bytes(vlm, prefix, suffix, blocks_allowed)
            masks, logit_rows = [], []

            def spy(module, args, kwargs):
                mask = kwargs.get("attention_mask")
                if isinstance(mask, torch.Tensor) and mask.ndim == 4 and mask.shape[-2] > 1:
                    masks.append(tuple(mask.shape))
            handle = vlm.model.register_forward_pre_hook(spy, with_kwargs=True)
            out_hook = vlm.model.register_forward_hook(lambda m, a, o: logit_rows.append(o.logits.shape[1]))
            try:
                c, patched = exact_diffs(vlm, task, heads, layout="packed", max_tokens=10_000,
                                         memory_budget=budget)
            finally:
                handle.remove(), out_hook.remove()
            packed = [shape for shape in masks if shape[-1] > prefix + suffix or shape[-2] != prefix + suffix]
            blocks = [shape[-2] // suffix for shape in packed]
            assert max(blocks) == blocks_allowed and sum(blocks) == len(heads), blocks
            assert all(packed_bytes(vlm, prefix, suffix, b) <= budget for b in blocks)
            assert set(logit_rows[1:]) <= set(range(1, blocks_allowed + 1))  # logits at the scored rows only
            effects = naive - clean
            np.testing.assert_allclose(patched - c, effects, atol=1e-4 * np.ptp(effects) + 1e-6)
    finally:
        vlm.model.set_attn_implementation(before)


def test_memory_budget_below_one_row_still_runs_one_row_at_a_time():
    vlm = get_tiny("tiny-qwen2_5_vl")
    task = strong_task(vlm, "id_selection")
    heads = all_heads(vlm)[:5]
    spy = ForwardSpy(vlm.model, int(task.positions.min()))
    try:
        _, patched = exact_diffs(vlm, task, heads, layout="batched", memory_budget=1)
    finally:
        spy.close()
    assert [r for r, _ in spy.calls] == [1] * 5
    _, reference = exact_diffs(vlm, task, heads, layout="batched")
    np.testing.assert_allclose(patched, reference, atol=1e-6)
