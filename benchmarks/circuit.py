"""Path patching: the exact method against the four-forward reference, on the same edges of the same pairs, timed in
one run.

Models (``--models``):

* ``organism-vsm`` (the default): 7 x 4 heads, its training scenes, id_selection pairs; the edges are those of the
  senders of ``--sender-layers`` into every later head through q, k and v, and into the logits. The reference runs
  on every edge.
* ``qwen2_5_vl-7b-shape``: Qwen2.5-VL-7B's text decoder widths (hidden 3584, 28 heads, 4 KV heads, intermediate
  18944) cut to 3 decoder layers, the real Qwen2 vocabulary (a 3584 x 151,665 embedding and LM head), a one-block
  vision tower, random seeded weights in float32 on the CPU, and a 112 px image (16 image tokens). Untrained, it has
  no task of its own: the id_selection scene pairs only give two prompts of the same length and two answer tokens
  to score. The edges are those of heads 0, 7, 14 and 21 of layer 0 into every head of layers 1 and 2 through q, k
  and v, and into the logits. The reference would take hours over every edge here, so it runs on ``--naive-edges``
  edges drawn with a fixed seed, and its time is extrapolated to every edge: its one clean forward per pair, timed
  alone, plus the mean cost of a sampled edge times the edge count.

Cases: senders and receivers at every position (``all -> all``: no prefix to reuse) and from the text into the last
token (``text -> last``: a prefix cache to reuse). The reference (``naive_path_diffs``) runs four plain forwards per
edge, as a user would write path patching edge by edge. Ratios are to the reference, from this one run; the score
difference is the largest absolute difference of the per-pair edge scores on the edges the reference ran.

    python benchmarks/circuit.py [--models organism-vsm,qwen2_5_vl-7b-shape] [--pairs 2] [--sender-layers 1,2,3]
                                 [--naive-edges 8] [--json] [--save]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch
from gpu import SCALES  # benchmarks/gpu.py: the 7B shape's widths
from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py

import vlmbind as vb
from vlmbind.analysis.circuits import class_positions
from vlmbind.analysis.evaluation import stimulus_defaults
from vlmbind.analysis.mediation import aligned_scene_pair
from vlmbind.engine.paths import PathTask, all_edges, exact_path_diffs, naive_path_diffs
from vlmbind.engine.vlm import VLM
from vlmbind.tiny.qwen import build_qwen_vl
from vlmbind.tiny.real import real_tokenizer

CASES = {"all -> all": ("all", "all"), "text -> last": ("text", "last")}
MODELS = ("organism-vsm", "qwen2_5_vl-7b-shape")
# Qwen2.5-VL-7B's text decoder cut to 3 layers; one vision block and a 112 px image (16 image tokens) keep a forward
# to seconds
SEVEN_B_SHAPE = replace(SCALES["7b"], layers=3, image_size=112, vision_depth=1)
SEVEN_B_SENDERS = [(0, head) for head in (0, 7, 14, 21)]
EDGE_SAMPLE_SEED = 0


def build_seven_b_shape(seed: int = 0) -> VLM:
    """The 3-layer Qwen2.5-VL of 7B widths with the real Qwen2 tokenizer, random weights, float32, on the CPU."""
    shape = SEVEN_B_SHAPE
    model, processor = build_qwen_vl(
        "qwen2_5_vl", seed, shape.image_size, layers=shape.layers, hidden=shape.hidden,
        intermediate=shape.intermediate, heads=shape.heads, kv_heads=shape.kv_heads, vision_depth=shape.vision_depth,
        vision_hidden=shape.vision_hidden, vision_heads=shape.vision_heads, text_init_std=None,
        attn_implementation="sdpa", tokenizer=real_tokenizer("qwen2_5_vl"))
    model.requires_grad_(False)
    return VLM(model, processor, f"random-qwen2_5_vl-7b-shape-{shape.layers}-layers", "benchmarks/circuit.py")


def path_tasks(vlm: VLM, pairs: list, sender_at: str, receiver_at: str, sender_layers: list[int]) -> list[PathTask]:
    tasks = []
    for pair in pairs:
        clean, counterfactual, patch, a, a_star = aligned_scene_pair(vlm, pair)
        index = clean.index[0]
        tasks.append(PathTask.from_counterfactual(vlm, clean, counterfactual,
                                                  class_positions(index, sender_at, patch),
                                                  class_positions(index, receiver_at, patch),
                                                  sender_layers, a, a_star))
    return tasks


def scores(compute, vlm: VLM, tasks: list[PathTask], edges: list) -> tuple[np.ndarray, float]:
    """Per-pair edge scores (patched minus clean difference) and the wall time of computing them."""
    start = time.perf_counter()
    rows = [np.subtract(*reversed(compute(vlm, task, edges))) for task in tasks]
    return np.array(rows), time.perf_counter() - start


def run_case(vlm: VLM, pairs: list, sender_at: str, receiver_at: str, senders: list[tuple[int, int]],
             naive_edges: int | None = None) -> dict:
    """Both methods on the same tasks; the reference on every edge, or on ``naive_edges`` of them drawn with a fixed
    seed and extrapolated to every edge."""
    edges = all_edges(vlm, senders=senders)
    tasks = path_tasks(vlm, pairs, sender_at, receiver_at, sorted({l for l, _ in senders}))
    if naive_edges is None or naive_edges >= len(edges):
        sampled = np.arange(len(edges))
    else:
        sampled = np.sort(np.random.default_rng(EDGE_SAMPLE_SEED).choice(len(edges), naive_edges, replace=False))
    naive, naive_sampled_s = scores(naive_path_diffs, vlm, tasks, [edges[i] for i in sampled])
    if len(sampled) == len(edges):
        naive_s = naive_sampled_s
    else:
        # the reference's clean forward is once per pair, the rest once per edge
        _, clean_s = scores(naive_path_diffs, vlm, tasks, [])
        naive_s = clean_s + (naive_sampled_s - clean_s) * len(edges) / len(sampled)
    exact, exact_s = scores(exact_path_diffs, vlm, tasks, edges)
    return {"edges": len(edges), "pairs": len(pairs), "naive_edges": len(sampled), "naive_s": naive_s,
            "naive_sampled_s": naive_sampled_s, "exact_s": exact_s, "speedup": naive_s / exact_s,
            "max_abs_difference": float(np.abs(exact[:, sampled] - naive).max()),
            "score_range": float(np.ptp(naive))}


def run_model(name: str, args: argparse.Namespace, sender_layers: list[int], cases: list[str]) -> list[dict]:
    if name == "organism-vsm":
        vlm = vb.load(name)
        image_size, senders, naive_edges = None, [(l, h) for l in sender_layers for h in range(vlm.n_heads)], None
    else:
        vlm = build_seven_b_shape()
        image_size, senders, naive_edges = SEVEN_B_SHAPE.image_size, SEVEN_B_SENDERS, args.naive_edges
    scenes, _ = stimulus_defaults(vlm, "scene", {"n_objects": 3}, image_size)
    pairs = list(vb.stimuli.make_pairs("id_selection", args.pairs, 1000, **scenes))
    rows = []
    for case in cases:
        sender_at, receiver_at = CASES[case]
        rows.append({"model": name, "case": case,
                     **run_case(vlm, pairs, sender_at, receiver_at, senders, naive_edges)})
    return rows


def table(rows: list[dict]) -> str:
    header = (f"{'model':<21}{'case':<14}{'edges':>7}{'pairs':>7}{'naive edges':>13}{'naive s':>10}{'exact s':>10}"
              f"{'naive/exact':>13}{'max |diff|':>12}{'score range':>13}")
    lines = [header]
    for r in rows:
        extrapolated = "*" if r["naive_edges"] < r["edges"] else " "
        lines.append(f"{r['model']:<21}{r['case']:<14}{r['edges']:>7}{r['pairs']:>7}{r['naive_edges']:>13}"
                     f"{r['naive_s']:>9.2f}{extrapolated}{r['exact_s']:>10.2f}{r['speedup']:>12.1f}x"
                     f"{r['max_abs_difference']:>12.1e}{r['score_range']:>13.3g}")
    if any(r["naive_edges"] < r["edges"] for r in rows):
        lines.append("* extrapolated to every edge from the reference's time on its sampled edges (naive edges)")
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    result = record["result"]
    rows = result["rows"]
    models = {r["model"] for r in rows}
    paragraphs = [heading(record, "path patching, exact vs the four-forward reference"),
                  ("Wall time of each method over the same tasks, their ratio, and the largest difference of their "
                   "per-pair edge scores on the edges the reference ran; the score range is that of the reference's "
                   "scores.")]
    if "organism-vsm" in models:
        paragraphs.append(f"organism-vsm: id_selection pairs, the edges of the senders in layers "
                          f"{result['sender_layers']} into every later head (q, k, v) and into the logits; the "
                          "reference runs on every edge.")
    if "qwen2_5_vl-7b-shape" in models:
        shape = result["seven_b_shape"]
        sampled = next(r["naive_edges"] for r in rows if r["model"] == "qwen2_5_vl-7b-shape")
        senders = ", ".join(str(h) for _, h in result["seven_b_senders"])
        paragraphs.append(
            f"qwen2_5_vl-7b-shape: Qwen2.5-VL-7B's text decoder widths (hidden {shape['hidden']}, {shape['heads']} "
            f"heads, {shape['kv_heads']} KV heads, intermediate {shape['intermediate']}) cut to {shape['layers']} "
            "decoder layers, with the real Qwen2 vocabulary (a full-size embedding and LM head), a "
            f"{shape['vision_depth']}-block vision tower and a {shape['image_size']} px image "
            f"({(shape['image_size'] // 28) ** 2} image tokens); random seeded weights in float32 on the CPU. "
            "Untrained, it takes from the id_selection pairs only two same-length prompts and two answer tokens to "
            f"score, hence the small scores. Edges: heads {senders} of layer 0 into every head of the later layers "
            f"(q, k, v) and into the logits. The reference runs on {sampled} of them drawn with a fixed seed; its "
            "time for every edge (*) is its clean forward per pair plus the mean cost of a sampled edge times the "
            "edge count.")
    return "\n\n".join(paragraphs) + "\n\n" + code_block(table(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS[0], help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--sender-layers", default="1,2,3", help="organism-vsm's sender layers")
    parser.add_argument("--naive-edges", type=int, default=8,
                        help="edges the reference runs on for qwen2_5_vl-7b-shape, extrapolated to every edge")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", action="store_true")
    add_save_option(parser)
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",")]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    layers = [int(x) for x in args.sender_layers.split(",")]
    cases = [c.strip() for c in args.cases.split(",")]
    rows = [row for model in models for row in run_model(model, args, layers, cases)]
    print("\n".join(json.dumps(r) for r in rows) if args.json else table(rows))
    if args.save_run:
        shape = {k: getattr(SEVEN_B_SHAPE, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate",
                                                        "vision_depth", "image_size")}
        save("circuit", argv if argv is not None else sys.argv[1:],
             {"rows": rows, "sender_layers": layers, "seven_b_shape": shape, "seven_b_senders": SEVEN_B_SENDERS},
             threads=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
