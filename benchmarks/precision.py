"""bfloat16 vs float32 head scores on the real-vocabulary tiny models (real-sized logits), one run.

For each family and condition: exact mediation scores of every head on the same pairs with float32 weights and with
bfloat16 weights (scores are always computed in float32 from the logits), then the Spearman correlation of the
per-head mean scores, the overlap of the top-5 heads, and the median relative difference of the scores that matter
(|float32 score| above a tenth of the largest). The figures are written to ``vlmbind/engine/precision.json``
(read by the warning ``vlmbind`` prints when a user scores in bfloat16); ``--save`` also saves the run and its
section of ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/precision.py [--pairs 8] [--threads 2] [--save]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

import vlmbind as vb
from vlmbind.analysis import locate
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.core.io import write_json_atomic
from vlmbind.stimuli.scenes import scene_pairs
from vlmbind.tiny import real

from saved import add_save_option, heading, save  # benchmarks/saved.py

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "vlmbind" / "engine" / "precision.json"
CONDITIONS = ("id_selection", "feature_retrieval")


def compare(family: str, n_pairs: int) -> list[dict]:
    model, processor = real.build(family)
    rows = []
    for condition in CONDITIONS:
        scores = {}
        for dtype in (torch.float32, torch.bfloat16):
            vlm = vb.VLM(model.to(dtype), processor, name=f"real-{family}", source="benchmark")
            pairs = scene_pairs(n_pairs, condition, 11, **training_defaults(vlm, "scene", {"n_objects": 3}))
            scores[dtype] = locate(vlm, pairs, method="exact", prompt_format="chat").scores.ravel()
        f32, b16 = scores[torch.float32], scores[torch.bfloat16]
        big = np.abs(f32) > 0.1 * np.abs(f32).max()
        top = lambda s: set(np.argsort(-s)[:5].tolist())  # noqa: E731
        rows.append({"family": family, "condition": condition, "n_pairs": n_pairs, "heads": int(f32.size),
                     "spearman": float(spearmanr(f32, b16).statistic), "top5_overlap": len(top(f32) & top(b16)),
                     "median_relative_difference": float(np.median(np.abs(b16[big] - f32[big]) / np.abs(f32[big]))),
                     "max_abs_fp32_score": float(np.abs(f32).max())})
        model.to(torch.float32)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| family | condition | pairs | Spearman (bf16 vs fp32) | top-5 overlap | median relative difference |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['condition']} | {r['n_pairs']} | {r['spearman']:.3f} | "
                     f"{r['top5_overlap']}/5 | {100 * r['median_relative_difference']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--families", default=",".join(real.FAMILIES),
                        help="real-vocabulary families, comma-separated")
    parser.add_argument("--out", type=Path, default=OUT,
                        help="the precision table vlmbind reads (default: the package's)")
    add_save_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = [r for family in args.families.split(",") for r in compare(family, args.pairs)]
    summary = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "rows": rows,
               "median_spearman": float(np.median([r["spearman"] for r in rows])),
               "min_spearman": float(min(r["spearman"] for r in rows)),
               "median_top5_overlap": float(np.median([r["top5_overlap"] for r in rows])),
               "median_relative_difference": float(np.median([r["median_relative_difference"] for r in rows])),
               "seconds": round(time.perf_counter() - start, 1)}
    write_json_atomic(summary, args.out)
    print(table(rows))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.save_run:
        save("precision", argv if argv is not None else sys.argv[1:], summary, threads=args.threads)
    return 0


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    summary = record["result"]
    return (heading(record, "bfloat16 vs float32 head scores") + "\n\n"
            "Real-vocabulary tiny models (`vlmbind.tiny.real`, logits with a standard deviation of 8), chat prompts, "
            "exact mediation of every head on the same pairs with float32 and with bfloat16 weights. Relative "
            "differences are over the heads whose float32 score exceeds a tenth of the largest.\n\n"
            f"{table(summary['rows'])}\n\nMedian Spearman {summary['median_spearman']:.3f} (lowest "
            f"{summary['min_spearman']:.3f}), median top-5 overlap {summary['median_top5_overlap']:.0f}/5, median "
            f"relative difference {100 * summary['median_relative_difference']:.1f}%; {summary['seconds']} s.")

if __name__ == "__main__":
    sys.exit(main())
