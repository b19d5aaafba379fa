"""All-heads mediation sweeps: naive, exact, attribution and a plain nnsight loop, timed in one run.

Cases: the shipped organism (``organism-p2a``, 4 x 4 heads, its training scenes) and a small Qwen2.5-VL (8 layers x 8
heads, hidden 256, 256 image tokens from a 448 px image, random weights with the text layers re-drawn at std 0.2 so head
effects are O(0.1-1) logits), each for a last-token condition (id_selection) and a mid-prompt span (id_retrieval).
Every method runs end to end on the same pairs, from the pairs to the scores (aligning, the counterfactual run, the
clean run, the sweep); the nnsight loop captures the counterfactual z in one trace and then runs one trace per head,
as a user would write it. "Sweep" times the methods again given each pair's task (the aligned clean prompt and the
counterfactual z at the patch positions), which all methods build identically: one counterfactual forward per pair
that no method can avoid, so end-to-end ratios are capped near (heads + 2) / 2. Ratios are to naive, from this one
run; the score difference is the largest absolute difference to naive's per-pair scores, also relative to naive's
score range.

    python benchmarks/locate.py [--pairs 2] [--json] [--cases organism,small] [--save]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py

import vlmbind as vb
from vlmbind.analysis import locate
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.analysis.mediation import aligned_scene_pair, scene_task
from vlmbind.engine.patching import METHOD_FUNCTIONS
from vlmbind.stimuli import Canvas, scene_pairs

CONDITIONS = {"last_token": "id_selection", "mid_prompt": "id_retrieval"}


def small_qwen() -> vb.VLM:
    """The 8 x 8-head, hidden-256 Qwen2.5-VL with 256 image tokens (448 px images)."""
    from vlmbind.engine.vlm import VLM
    from vlmbind.tiny.qwen import build_qwen_vl

    model, processor = build_qwen_vl("qwen2_5_vl", 0, 448, layers=8, hidden=256, heads=8, kv_heads=4,
                                     text_init_std=0.2, attn_implementation="sdpa")
    return VLM(model, processor, "small-qwen2_5_vl-8x8", "benchmarks/locate.py")


def nnsight_loop(vlm: vb.VLM, pairs: list) -> np.ndarray:
    """Per-pair scores from plain nnsight traces: one for the counterfactual, one clean, one per head."""
    nn_model = vlm.nnsight()
    a_ = vlm.adapter
    d = a_.d_head
    out = np.zeros((len(pairs), vlm.n_layers, vlm.n_heads))
    for i, pair in enumerate(pairs):
        clean, cf, pos, a, a_star = aligned_scene_pair(vlm, pair)
        pos = pos.tolist()
        paths = [a_.o_proj_path(layer) for layer in range(vlm.n_layers)]
        z_cf: list = []
        with torch.no_grad(), nn_model.trace(**cf.inputs, use_cache=False):
            for path in paths:
                z_cf.append(vlm.nnsight_module(nn_model, path).input.save())
        with torch.no_grad(), nn_model.trace(**clean.inputs, use_cache=False):
            clean_logits = nn_model.output.logits.save()
        base = float(clean_logits[0, -1, a_star] - clean_logits[0, -1, a])
        for layer, path in enumerate(paths):
            for head in range(vlm.n_heads):
                with torch.no_grad(), nn_model.trace(**clean.inputs, use_cache=False):
                    x = vlm.nnsight_module(nn_model, path).input
                    for p in pos:
                        x[:, p, head * d:(head + 1) * d] = z_cf[layer][:, p, head * d:(head + 1) * d]
                    logits = nn_model.output.logits.save()
                out[i, layer, head] = float(logits[0, -1, a_star] - logits[0, -1, a]) - base
    return out


def run_case(vlm: vb.VLM, pairs: list, methods: list[str]) -> dict:
    """End to end (pairs -> scores, what a user waits for) and sweep only (the same, given each pair's task: the
    aligned clean prompt and the counterfactual z, which every method builds identically)."""
    heads = [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads)]
    for method in methods:  # warm-up on one pair so first-call costs hit nobody
        if method != "nnsight_loop":
            locate(vlm, pairs[:1], method=method, verify_top=0)
    seconds, per_pair = {}, {}
    for method in methods:
        start = time.perf_counter()
        if method == "nnsight_loop":
            per_pair[method] = nnsight_loop(vlm, pairs)
        else:
            per_pair[method] = locate(vlm, pairs, method=method, verify_top=0).per_pair
        seconds[method] = time.perf_counter() - start
    start = time.perf_counter()
    tasks = [scene_task(vlm, pair, range(vlm.n_layers)) for pair in pairs]
    task_seconds = time.perf_counter() - start
    sweep = {}
    for method in methods:
        if method == "nnsight_loop":
            continue
        start = time.perf_counter()
        for task in tasks:
            METHOD_FUNCTIONS[method](vlm, task, heads)
        sweep[method] = time.perf_counter() - start
    ref = per_pair["naive"]
    span = float(np.ptp(ref)) or 1.0
    diff = {m: float(np.abs(v - ref).max()) for m, v in per_pair.items()}
    top = set(np.argsort(-ref.mean(0), axis=None, kind="stable")[:10].tolist())
    recall = {m: len(top & set(np.argsort(-v.mean(0), axis=None, kind="stable")[:10].tolist())) / 10
              for m, v in per_pair.items()}
    return {
        "seconds": seconds,
        "ratio_to_naive": {m: seconds["naive"] / s for m, s in seconds.items()},
        "task_seconds": task_seconds,
        "sweep_seconds": sweep,
        "sweep_ratio_to_naive": {m: sweep["naive"] / s for m, s in sweep.items()},
        "max_abs_diff_to_naive": diff,
        "max_rel_diff_to_naive": {m: v / span for m, v in diff.items()},
        "top10_recall_vs_naive": recall,
        "score_range": span,
    }


def phases(vlm: vb.VLM, pair) -> dict:
    """Where exact's time goes on one pair (seconds): building the task (alignment + counterfactual run) and the sweep,
    against one plain forward of the clean prompt."""
    from vlmbind.engine.patching import exact_diffs

    heads = [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads)]
    t = time.perf_counter()
    task = scene_task(vlm, pair, range(vlm.n_layers))
    t_task = time.perf_counter() - t
    t = time.perf_counter()
    exact_diffs(vlm, task, heads)
    t_sweep = time.perf_counter() - t
    t = time.perf_counter()
    vlm.logits(task.batch)
    t_forward = time.perf_counter() - t
    return {"task": t_task, "exact_sweep": t_sweep, "one_forward": t_forward}


def table(rows: list[dict]) -> str:
    """The per-case table: seconds and ratios to naive end to end and given the tasks, and the scores' agreement."""
    lines = [f"{'case':9s} {'condition':13s} {'method':13s} {'seconds':>8s} {'x naive':>8s} {'sweep s':>8s} "
             f"{'x naive':>8s} {'max|d|':>9s} {'rel':>8s} {'top10':>6s}"]
    for r in rows:
        for m, s in r["seconds"].items():
            sw = r["sweep_seconds"].get(m)
            sweep = f"{sw:8.3f} {r['sweep_ratio_to_naive'][m]:8.1f}" if sw is not None else f"{'-':>8s} {'-':>8s}"
            lines.append(f"{r['case']:9s} {r['condition']:13s} {m:13s} {s:8.2f} {r['ratio_to_naive'][m]:8.1f} "
                         f"{sweep} {r['max_abs_diff_to_naive'][m]:9.2e} {r['max_rel_diff_to_naive'][m]:8.1e} "
                         f"{r['top10_recall_vs_naive'][m]:6.1f}")
        p = r["phases"]
        lines.append(f"{'':9s} {'':13s} one pair: task {p['task']:.3f} s, exact sweep {p['exact_sweep']:.3f} s, "
                     f"one forward {p['one_forward']:.3f} s; {r['tokens']} tokens, {r['heads']} heads")
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    rows = record["result"]["rows"]
    models = ", ".join(dict.fromkeys(f"{r['model']} ({r['heads']} heads, {r['tokens']} tokens)" for r in rows))
    return (heading(record, "all-heads sweeps, per pair") + "\n\n"
            f"Models: {models}; {rows[0]['pairs']} pairs per condition. \"seconds\": end to end from the pairs "
            "(alignment, counterfactual run, sweep); \"sweep\": the same given each pair's task (aligned clean prompt "
            "+ counterfactual z), which every method builds the same way. One counterfactual forward per pair is "
            "unavoidable for every method, so end-to-end ratios are capped near (heads + 2) / 2. \"max|d|\" and "
            "\"rel\": the largest absolute difference to naive's per-pair scores, and relative to naive's score "
            "range; \"top10\": recall of naive's ten best heads.\n\n" + code_block(table(rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--cases", default="organism,small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-nnsight", action="store_true", help="skip the nnsight loop (slowest)")
    parser.add_argument("--json", action="store_true", help="one JSON object per case on stdout")
    add_save_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = ["naive", "exact", "attribution"] + ([] if args.no_nnsight else ["nnsight_loop"])
    rows = []
    for case in args.cases.split(","):
        if case == "organism":
            vlm = vb.load("organism-p2a")
            kwargs = training_defaults(vlm, "scene", {"n_objects": 3})
        elif case == "small":
            vlm = small_qwen()
            kwargs = {"n_objects": 3, "canvas": Canvas(image_size=448, grid=3)}
        else:
            parser.error(f"unknown case {case!r}; cases: organism, small")
        for kind, condition in CONDITIONS.items():
            pairs = list(scene_pairs(args.pairs, condition, 0, **kwargs))
            result = run_case(vlm, pairs, methods)
            result.update(case=case, model=vlm.name, condition=condition, kind=kind, pairs=len(pairs),
                          heads=vlm.n_layers * vlm.n_heads, tokens=pairs and vlm.prepare(
                              pairs[0].clean.image, pairs[0].clean.prompt).seq_len,
                          phases=phases(vlm, pairs[0]), threads=args.threads)
            rows.append(result)
            if args.json:
                print(json.dumps(result), flush=True)
    if not args.json:
        print(table(rows))
    if args.save_run:
        save("locate", argv if argv is not None else sys.argv[1:], {"rows": rows}, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
