"""The README's tables, rendered from the saved results of ``run.py`` (never typed by hand).

    python circuits/position_ids/tables.py           # rewrite the README between its table markers
    python circuits/position_ids/tables.py --check   # exit 1 when the README and the results disagree
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
import readme_tables  # noqa: E402  (circuits/readme_tables.py, shared by the circuits' tables)

RESULTS = HERE / "results"
README = HERE / "README.md"
CONDITIONS = ("feature_retrieval", "id_selection", "id_retrieval")


def render() -> str:
    summary = json.loads((RESULTS / "summary.json").read_text())
    lines = [f"## {summary['model']} ({summary['pairs']} pairs per condition, seed {summary['seed']})", ""]
    for condition in CONDITIONS:
        scores = pd.read_csv(RESULTS / condition / "scores.csv")
        n = int(scores["n"].iloc[0])
        lines += [f"**{condition}** (exact mediation, n={n} pairs): {int(scores['significant'].sum())} of "
                  f"{len(scores)} heads significant (BH q < 0.05); largest |score| "
                  f"{scores['score'].abs().max():.4f}.", "", *readme_tables.head_table(scores, digits=4), ""]
    for condition in ("feature_retrieval", "id_selection"):
        ablation = json.loads((RESULTS / f"ablation_{condition}" / "results.json").read_text())
        lines += [f"Scene description with the top-{ablation['k']} {condition} heads' attention to the image ablated "
                  f"({ablation['mode']}, not renormalised):", "", *readme_tables.ablation_table(ablation), ""]
    lines += ["Last-token test (all heads of layers 0..k patched at the last token from the id_selection "
              f"counterfactual, {summary['pairs']} pairs):", "", "| layers | mean change of the logit difference | "
              "answers flipped |", "|---|---|---|"]
    lines += [f"| {r['layers']} | {r['mean_change']:+.3f} | {r['flipped']:.2f} |" for r in summary["last_token_test"]]
    edit = json.loads((RESULTS / "edit" / "results.json").read_text())
    rows = [r for r in edit["rows"]]
    alphas = sorted({r["alpha"] for r in rows})
    lines += ["", f"Position-ID edit at heads {', '.join(edit['heads'])} (efficacy: share of answers that switch to "
              f"the object at the target cell; n={edit['n_used']} examples):", "",
              "| alpha | " + " | ".join(f"{a:g}" for a in alphas) + " |", "|---|" + "---|" * len(alphas)]
    for arm in ("edit", "control"):
        by_alpha = {r["alpha"]: r["efficacy"] for r in rows if r["arm"] == arm}
        lines.append(f"| {arm} | " + " | ".join(f"{by_alpha[a]:.2f}" for a in alphas) + " |")
    looks = pd.DataFrame(summary["where_heads_look"])
    lines += ["", "Where the top heads look from the last token (share of their image attention on the missing object "
              "vs one described object; a ratio near 1 is no preference):", "",
              "| head | image mass | missing-object share | described share | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r.layer}.{r.head} | {r.image_mass:.2f} | {r.target_share:.3f} | {r.described_share:.3f} | "
              f"{r.target_ratio:.2f} |" for r in looks.itertuples()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return readme_tables.main(README, RESULTS, render, "circuits/position_ids/tables.py", argv)


if __name__ == "__main__":
    sys.exit(main())
