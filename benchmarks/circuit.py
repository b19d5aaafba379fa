"""Path patching: the exact method against the four-forward reference, on the same edges of the same pairs, timed in
one run.

Cases: organism-vsm (7 x 4 heads, its training scenes, id_selection pairs) with senders and receivers at every
position (``all -> all``, the command's default: no prefix to reuse) and from the text into the last token
(``text -> last``: a prefix cache to reuse); the edges are those of the senders of ``--sender-layers`` into every
later head through q, k and v, and into the logits. The reference (``naive_path_diffs``) runs four plain forwards per
edge, as a user would write path patching edge by edge. Ratios are to the reference, from this one run; the score
difference is the largest absolute difference of the per-pair edge scores.

    python benchmarks/circuit.py [--pairs 2] [--sender-layers 1,2,3] [--json] [--save]
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
from vlmbind.analysis.circuits import class_positions
from vlmbind.analysis.evaluation import stimulus_defaults
from vlmbind.analysis.mediation import aligned_scene_pair
from vlmbind.engine.paths import PathTask, all_edges, exact_path_diffs, naive_path_diffs

CASES = {"all -> all": ("all", "all"), "text -> last": ("text", "last")}


def run_case(vlm: vb.VLM, pairs: list, sender_at: str, receiver_at: str, sender_layers: list[int]) -> dict:
    senders = [(l, h) for l in sender_layers for h in range(vlm.n_heads)]
    edges = all_edges(vlm, senders=senders)
    tasks = []
    for pair in pairs:
        clean, counterfactual, patch, a, a_star = aligned_scene_pair(vlm, pair)
        index = clean.index[0]
        tasks.append(PathTask.from_counterfactual(vlm, clean, counterfactual,
                                                  class_positions(index, sender_at, patch),
                                                  class_positions(index, receiver_at, patch),
                                                  sorted({l for l, _ in senders}), a, a_star))
    out = {}
    scores = {}
    for name, compute in (("naive", naive_path_diffs), ("exact", exact_path_diffs)):
        start = time.perf_counter()
        rows = [np.subtract(*reversed(compute(vlm, task, edges))) for task in tasks]
        out[name] = time.perf_counter() - start
        scores[name] = np.array(rows)
    return {"edges": len(edges), "pairs": len(pairs), "naive_s": out["naive"], "exact_s": out["exact"],
            "speedup": out["naive"] / out["exact"],
            "max_abs_difference": float(np.abs(scores["exact"] - scores["naive"]).max()),
            "score_range": float(np.ptp(scores["naive"]))}


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<14}{'edges':>7}{'pairs':>7}{'naive s':>10}{'exact s':>10}{'naive/exact':>13}"
             f"{'max |diff|':>12}{'score range':>13}"]
    for r in rows:
        lines.append(f"{r['case']:<14}{r['edges']:>7}{r['pairs']:>7}{r['naive_s']:>10.2f}{r['exact_s']:>10.2f}"
                     f"{r['speedup']:>12.1f}x{r['max_abs_difference']:>12.1e}{r['score_range']:>13.2f}")
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    result = record["result"]
    return (heading(record, "path patching, exact vs the four-forward reference") + "\n\n"
            f"organism-vsm, id_selection pairs, the edges of the senders in layers {result['sender_layers']} into "
            "every later head (q, k, v) and into the logits. Wall time of each method over the same tasks, their ratio, "
            "and the largest difference of their per-pair edge scores.\n\n" + code_block(table(result["rows"])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--sender-layers", default="1,2,3")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", action="store_true")
    add_save_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    vlm = vb.load("organism-vsm")
    scenes, _ = stimulus_defaults(vlm, "scene", {"n_objects": 3})
    pairs = list(vb.stimuli.make_pairs("id_selection", args.pairs, 1000, **scenes))
    layers = [int(x) for x in args.sender_layers.split(",")]
    rows = []
    for case in [c.strip() for c in args.cases.split(",")]:
        sender_at, receiver_at = CASES[case]
        rows.append({"case": case, **run_case(vlm, pairs, sender_at, receiver_at, layers)})
    print("\n".join(json.dumps(r) for r in rows) if args.json else table(rows))
    if args.save:
        save("circuit", argv if argv is not None else sys.argv[1:], {"rows": rows, "sender_layers": layers},
             threads=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
