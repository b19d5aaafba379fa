"""PbP's search heads on a pointing model: attention_swap mediation on its own traces, ablation of the top heads on
counting, and attention-centroid tracking on visual search.

    python circuits/search_heads/run.py [--model organism-p2a] [--pairs 32] [--n-eval 64] [--seed 0] [--out DIR]

On a real checkpoint pass its directory or hub id; it must point (Point-to-Answer, e.g. a Molmo checkpoint, or a
model fine-tuned with ``vlmbind.organisms.finetune_lora`` in the p2a regime), or attention_swap has no traces.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import vlmbind as vb
from vlmbind.analysis import point_swap_pairs, track, tracking_dataset
from vlmbind.core.io import write_json_atomic

HERE = Path(__file__).parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-p2a")
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ablation-seeds", type=int, default=5, help="random-k draws (from the heads outside the top-k)")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    vlm = vb.load(args.model)
    out = Path(args.out)
    swaps = point_swap_pairs(vlm, args.pairs, args.seed)
    scores = vb.locate(vlm, swaps)
    scores.save(out / "attention_swap")
    attribution = vb.locate(vlm, swaps, method="attribution", verify_top=0)
    counting = tracking_dataset(vlm, "count", args.n_eval, args.seed + 1)
    k = min(5, vlm.n_layers * vlm.n_heads // 2)
    ablation = vb.ablation_study(vlm, counting, scores, k=k, seeds=tuple(range(args.ablation_seeds)))
    ablation.save(out / "ablation_count")
    traced = track(vlm, tracking_dataset(vlm, "search", args.n_eval, args.seed + 2))
    traced.save(out / "track_search")
    summary = {
        "model": vlm.name, "pairs": len(swaps), "skipped_traces": len(swaps.skipped),
        "top_heads": [(f"{l}.{h}", float(scores.scores[l, h])) for l, h in scores.top(5)],
        "attribution_recall_top5": attribution.recall(scores, 5),
        "attribution_recall_top10": attribution.recall(scores, 10),
        "ablation_count": ablation.summary()["accuracy"],
        "track_search": {"valley_layer": traced.valley_layer, "rmse_by_layer": [float(v) for v in traced.rmse_mean],
                         "n_points": traced.n_points},
    }
    write_json_atomic(summary, out / "summary.json")
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
