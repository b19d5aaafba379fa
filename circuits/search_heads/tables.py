"""The README's tables, rendered from the saved results of ``run.py`` (never typed by hand).

    python circuits/search_heads/tables.py           # rewrite the README between its table markers
    python circuits/search_heads/tables.py --check   # exit 1 when the README and the results disagree
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
import readme_tables  # noqa: E402  (circuits/readme_tables.py, shared by the circuits' tables)

RESULTS = HERE / "results"
README = HERE / "README.md"


def centre_baseline(centroids: dict) -> float:
    """RMSE (canvas cells) of always answering the grid's centre, over the same points as the centroids."""
    rows, cols = centroids["canvas"]["grid"]
    points = np.array([p["point"] for e in centroids["examples"] for p in _points(e)], dtype=float)
    centre = np.array([(cols - 1) / 2, (rows - 1) / 2])
    return float(np.sqrt(((points - centre) ** 2).sum(1).mean()))


def _points(example: dict) -> list[dict]:
    points = example["points"]
    if isinstance(points, str):  # saved as the repr of a list of dicts
        import ast

        points = ast.literal_eval(points)
    return points


def render() -> str:
    summary = json.loads((RESULTS / "summary.json").read_text())
    scores = pd.read_csv(RESULTS / "attention_swap" / "scores.csv")
    ablation = json.loads((RESULTS / "ablation_count" / "results.json").read_text())
    track = json.loads((RESULTS / "track_search" / "summary.json").read_text())
    centroids = json.loads((RESULTS / "track_search" / "centroids.json").read_text())
    rmse = track["rmse_mean"]
    n_sig = int(scores["significant"].sum())
    lines = [f"## {summary['model']} ({summary['pairs']} trace pairs, seed 0; {ablation['intervals']['clean']['n']} "
             f"counting and {track['n_examples']} search displays)", "",
             f"attention_swap, exact mediation: {n_sig} of {len(scores)} heads significant (BH q < 0.05); "
             f"attribution recall vs exact: top-5 {summary['attribution_recall_top5']:.1f}, "
             f"top-10 {summary['attribution_recall_top10']:.1f}.", "", *readme_tables.head_table(scores), "",
             f"Counting accuracy with the top-{ablation['k']} attention_swap heads' attention to the image ablated "
             f"({ablation['mode']}, not renormalised):", "", *readme_tables.ablation_table(ablation), "",
             f"Centroid RMSE on search by layer (canvas cells, {track['n_points']} points; always-centre baseline "
             f"{centre_baseline(centroids):.2f}):", "",
             "| layer | " + " | ".join(str(i) for i in range(len(rmse))) + " |", "|---|" + "---|" * len(rmse),
             "| RMSE | " + " | ".join(f"{v:.2f}" for v in rmse) + " |", "",
             f"RMSE valley: layer {track['valley_layer']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return readme_tables.main(README, RESULTS, render, "circuits/search_heads/tables.py", argv)


if __name__ == "__main__":
    sys.exit(main())
