"""The README's tables, rendered from the saved results of ``run.py`` (never typed by hand).

    python circuits/binding_information/tables.py           # rewrite the README between its table markers
    python circuits/binding_information/tables.py --check   # exit 1 when the README and the results disagree
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
import readme_tables  # noqa: E402  (circuits/readme_tables.py, shared by the circuits' tables)

RESULTS = HERE / "results"
README = HERE / "README.md"
BEGIN, END = readme_tables.BEGIN, readme_tables.END
POOLED = ("linear", "quadratic", "dnn", "shared_factor")
LADDER = (*POOLED, "attention")


def _site(site: str) -> str:
    parts = site.split(".")
    if site.startswith("vision.blocks."):
        return f"vision block {parts[2]}"
    if site.startswith("blocks."):
        return f"LM layer {parts[1]}"
    return parts[0]


def _models() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir()) if RESULTS.is_dir() else []


def _bits(r: pd.Series) -> str:
    return f"{r['B_O']:.2f} ({r['margin_O']:+.2f} +- {r['margin_O_se']:.2f})"


def _grid(frame: pd.DataFrame, sites: list[str], cell, pixels: pd.DataFrame | None = None) -> list[str]:
    """A site x family markdown table of ``cell(row)``, with the no-model pixel row last when given."""
    lines = ["| site | " + " | ".join(LADDER) + " |", "|---|" + "---|" * len(LADDER)]
    for site in sites:
        cells = []
        for family in LADDER:
            row = frame[(frame["site"] == site) & (frame["family"] == family)]
            cells.append("not run" if row.empty else cell(row.iloc[0]))
        lines.append(f"| {_site(site)} | " + " | ".join(cells) + " |")
    if pixels is not None:
        cells = [cell(pixels.loc[f]) if f in pixels.index else "not run" for f in LADDER]
        lines.append(f"| {pixels['site'].iloc[0]}, no model | " + " | ".join(cells) + " |")
    return lines


def ladder_tables(model: str, world: str) -> str:
    path = RESULTS / model / f"ladder-{world}" / "probe.csv"
    if not path.is_file():
        return ""
    frame = pd.read_csv(path)
    sites = list(dict.fromkeys(frame["site"]))
    pixels = _pixels(model, world)
    first = frame.iloc[0]
    h = f"H(O) = {first['H_O']:.2f}, H(O|F) = {first['H_O'] - first['H_F']:.2f} bits"
    lines = [f"**{model}, world `{world}`** ({int(first['n_train'])} / {int(first['n_val'])} / "
             f"{int(first['n_test'])} images; {h}). B_O in bits with its margin over the prior-only probe "
             "(+- 1 SE over test images); a negative B_O is reported as it is: the estimator found no information "
             "beyond its prior.", "",
             *_grid(frame, sites, _bits, pixels)]
    lines += ["", f"beta_O = B_O / H(O) and B*_OF (bits; H(O|F) = {first['H_O'] - first['H_F']:.2f}), {model}: "
                  "B*_OF above H(O|F) means the feature probe failed on the unseen test codes (CE_F above H(F)), "
                  "so read B_O first.", "",
              *_grid(frame, sites, lambda r: f"{r['beta_O']:.2f} / {r['B_star_OF']:.2f}")]
    lines += ["", f"Train vs test CE_O (bits) of the object probe, {model}: the gap is what the probe learnt about "
                  "the training split's feature codes that does not carry over to the unseen test codes.", "",
              *_grid(frame, sites, lambda r: f"{r['CE_O_train']:.2f} / {r['CE_O']:.2f}", pixels)]
    lines += ["", f"Summary (mean of tokens, best pooled family) vs spatial tokens (attention probe), {model}; FBP's "
                  "[CLS] holds under half of what its spatial tokens give (a ratio below 0.5), and its shared-factor probe "
                  "differs from the full quadratic one by about 2.4 bits:", "",
              "| site | best pooled | its B_O | attention B_O (start kept) | summary / spatial | "
              "shared_factor - quadratic |",
              "|---|---|---|---|---|---|"]
    for site in sites:
        part = frame[(frame["site"] == site)]
        pooled = part[part["family"].isin(POOLED)]
        spatial = part[part["family"] == "attention"]
        if pooled.empty or spatial.empty:
            continue
        best = pooled.loc[pooled["B_O"].idxmax()]
        att = float(spatial.iloc[0]["B_O"])
        share = f"{float(best['B_O']) / att:.2f}" if att > 0 else "n/a (spatial bound below zero)"
        by = part.set_index("family")["B_O"]
        gap = f"{by['shared_factor'] - by['quadratic']:+.2f}" if {"shared_factor", "quadratic"} <= set(by.index) \
            else "not run"
        start = spatial.iloc[0].get("start")
        start = start if isinstance(start, str) else "cold only"
        lines.append(f"| {_site(site)} | {best['family']} | {best['B_O']:.2f} | {att:.2f} ({start}) | {share} | "
                     f"{gap} |")
    return "\n".join(lines)


def _pixels(model: str, world: str) -> pd.DataFrame | None:
    path = RESULTS / model / f"ladder-{world}" / "pixels.csv"
    return pd.read_csv(path).set_index("family", drop=False) if path.is_file() else None


def same_object_table(model: str) -> str:
    path = RESULTS / model / "same_object" / "same_object.csv"
    if not path.is_file():
        return ""
    frame = pd.read_csv(path)
    first = frame.iloc[0]
    lines = [f"**{model}, IsSameObject** ({int(first['n_train'])} / {int(first['n_val'])} / {int(first['n_test'])} "
             f"images, {int(first['n_pairs_test'])} balanced test pairs). Test accuracy; the margin is over the "
             "strongest class baseline (+- 1 SE, pairs clustered by image); the class + adjacency reference and the "
             "linear readout of each token's row / column (chance in brackets) are beside it. The twin probes are "
             "the same families on pairs of the duplicated class's tokens only, where class cannot help: the best "
             "family's accuracy, then its margin (+- 1 SE) over the rule that needs no place, \"a pair covering the "
             "same part of two objects is two objects\" (its accuracy in brackets; 'not same' gives 0.5).", "",
             "| site | linear | diag_quadratic | quadratic | same class | same colour | same shape | best margin | "
             "class + adjacency | row readout | column readout | twins told apart |", "|---|" + "---|" * 11]
    for site in dict.fromkeys(frame["site"]):
        part = frame[frame["site"] == site].set_index("family")
        acc = [f"{part.loc[f, 'accuracy']:.3f}" if f in part.index else "not run"
               for f in ("linear", "diag_quadratic", "quadratic")]
        best = part.loc[part["margin"].idxmax()]
        r = part.iloc[0]
        lines.append(f"| {_site(site)} | " + " | ".join(acc) + f" | {r['baseline_same_class']:.3f} | "
                     f"{r['baseline_same_colour']:.3f} | {r['baseline_same_shape']:.3f} | "
                     f"{best['margin']:+.3f} +- {best['margin_se']:.3f} ({best.name}) | "
                     f"{r['reference_same_class_adjacent']:.3f} | {r['row_readout']:.2f} ({r['row_chance']:.2f}) | "
                     f"{r['col_readout']:.2f} ({r['col_chance']:.2f}) | {_twins(part)} |")
    return "\n".join(lines)


def _twins(part: pd.DataFrame) -> str:
    if "twin_margin" not in part.columns or part["twin_margin"].isna().all():
        return "not run"
    best = part.loc[part["twin_accuracy"].idxmax()]
    return (f"{best['twin_accuracy']:.3f}, {best['twin_margin']:+.3f} +- {best['twin_margin_se']:.3f} "
            f"({best['twin_different_part']:.3f}; {best.name})")


def rsa_table(model: str) -> str:
    path = RESULTS / model / "rsa" / "rsa.csv"
    if not path.is_file():
        return ""
    frame = pd.read_csv(path)
    table = frame.pivot_table(index="site", columns="model_matrix", values="r", sort=False)
    p = frame.pivot_table(index="site", columns="model_matrix", values="p", sort=False)
    n = int(frame["n_objects"].iloc[0])
    lines = [f"**{model}, RSA** ({n} single objects, Pearson r with the model matrix; p from 1000 permutations in "
             "brackets)", "", "| site | compositional | conjunctive | position |", "|---|---|---|---|"]
    order = sorted(table.index, key=lambda s: (not s.startswith("vision"), not s.startswith("projector"), s))
    for site in order:
        cells = [f"{table.loc[site, m]:.2f} (p {p.loc[site, m]:.3f})" for m in ("compositional", "conjunctive",
                                                                                 "position")]
        lines.append(f"| {_site(site)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render() -> str:
    blocks = []
    for model in _models():
        for part in (rsa_table(model), ladder_tables(model, "organism"), ladder_tables(model, "fbp"),
                     same_object_table(model)):
            if part:
                blocks.append(part)
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    return readme_tables.main(README, RESULTS, render, "circuits/binding_information/tables.py", argv)


if __name__ == "__main__":
    sys.exit(main())
