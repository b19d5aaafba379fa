"""The HTML pages vlmbind writes: the demo's report (:func:`demo_report_html`), with the causal and representational
overviews' sections in it."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from .viz import frame_to_html_table

_REPORT_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table.vb-table, table.vb-prov { border-collapse: collapse; font-size: 0.9em; }
table.vb-table td, table.vb-table th, table.vb-prov td, table.vb-prov th { padding: 2px 10px; text-align: right; }
table.vb-prov th, table.vb-prov td { text-align: left; vertical-align: top; }
table.vb-table tr:nth-child(even) { background: #f6f6f6; }
code { background: #f3f3f3; padding: 0 3px; }
.figs { display: flex; flex-wrap: wrap; gap: 1em; }
"""


def demo_report_html(summary: dict[str, Any], frame: pd.DataFrame, heatmap: Any, overlay: Any, causal: str = "",
                     validation: str = "") -> str:
    """One offline page: the validation on a planted organism when given, provenance, the two figures (plotly.js
    embedded once), the tables, and the causal overview's sections when given."""
    esc = html.escape
    chosen = summary["head"]
    # plotly.js goes into the first figure on the page only (the validation's, when it opens the page)
    heatmap_div = heatmap.to_html(full_html=False, include_plotlyjs=not validation, div_id="vlmbind-heatmap")
    overlay_div = overlay.to_html(full_html=False, include_plotlyjs=False, div_id="vlmbind-overlay")
    pivot = frame.pivot(index="layer", columns="head", values="mass")
    pivot.columns = [f"head {h}" for h in pivot.columns]
    pivot.index.name = "layer"
    predictions = pd.DataFrame(summary["top_predictions"])
    objects = pd.DataFrame(summary["scene"]["objects"])
    provenance = [
        ("model", f"{summary['model']} ({summary['family']})"),
        ("weights", summary["model_source"]),
        ("shape", f"{summary['layers']} layers x {summary['heads']} heads"),
        ("scene seed", str(summary["seed"])),
        ("prompt", summary["prompt"]),
        ("image tokens", f"{summary['image_tokens']} (last token at position {summary['last_position']})"),
        ("command", summary["command"]),
        ("versions", ", ".join(f"{k} {v}" for k, v in summary["versions"].items())),
    ]
    prov_rows = "\n".join(f"<tr><th>{esc(k)}</th><td><code>{esc(v)}</code></td></tr>" for k, v in provenance)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>vlmbind demo: {esc(summary['model'])}, seed {summary['seed']}</title>
<style>{_REPORT_CSS}</style>
</head>
<body>
<h1>vlmbind demo: {esc(summary['model'])}</h1>
{validation}
<h2>Attention from the last token to the image</h2>
<p>Each head's attention mass from the last prompt token to the image tokens (the sum of its attention weights over
the image positions). The overlay shows the head with the largest mass, <b>L{chosen['layer']}.H{chosen['head']}</b>
(mass {chosen['mass']:.4f}), over the {esc(chosen['grid'])} grid of image tokens.</p>
<h2>Provenance</h2>
<table class="vb-prov">
{prov_rows}
</table>
<h2>Figures</h2>
<div class="figs">
<div class="fig">{heatmap_div}</div>
<div class="fig">{overlay_div}</div>
</div>
<h2>Top next-token predictions</h2>
{frame_to_html_table(predictions, index=False)}
<h2>Scene</h2>
{frame_to_html_table(objects, index=False)}
<h2>Attention mass (layer x head)</h2>
<p>The same values as <code>attention_mass.csv</code> (full precision there).</p>
{frame_to_html_table(pivot)}
{causal}
</body>
</html>
"""


def validation_sections(result: Any, model: str) -> str:
    """The report's opening: every method against the heads planted in an organism, and what that means for the
    model the rest of the page is about (plotly.js is put on the page here, so this must come first)."""
    esc = html.escape
    rows = [{"condition": r["condition"], "method": r["method"], "planted heads": " ".join(r["heads"]) or "-",
             "ranks": " ".join(map(str, r["planted_ranks"])) or "-", "recall@k": r["recall_at_k"],
             "AUROC": r["auroc"], "planted / max other": r["ratio"], "top heads": " ".join(r["top_heads"]),
             "pairs": r["n_pairs"], "seconds": r["seconds"]} for r in result.methods]
    ablation = pd.DataFrame([{"mode": mode, **{k: v for k, v in arms.items()}}
                             for mode, arms in result.ablation_summary().items()])
    planted = ", ".join(f"{c}: {' '.join(h)}" for c, h in result.heads.items()) or "none"
    figure = result.figure().to_html(full_html=False, include_plotlyjs=True, div_id="vlmbind-validation")
    parts = [
        "<h2>How do I know the methods work? Validation on a planted organism</h2>",
        f"<p><b>{esc(result.model)}</b> had a mechanism trained into chosen heads by SIIT ({esc(planted)}); its "
        "training record says which. Each method below ran on fresh scene pairs (seed "
        f"{result.params['seed']}, {result.params['n_objects']} objects, a count the planting held out) and is "
        "scored by where it ranks the planted heads among all heads (rank 1 = highest score). A planted mechanism "
        "checks the methods; it says nothing about how pretrained VLMs work.</p>",
        frame_to_html_table(pd.DataFrame(rows), index=False, float_format="{:.3f}"),
        "<p>Ablation of each condition's top-k exact heads against random-k heads from the rest (mean and lowest "
        "over seeds) and the bottom-k by |score|, scene-description accuracy:</p>",
        frame_to_html_table(ablation, index=False, float_format="{:.3f}"),
        f'<div class="fig">{figure}</div>',
        f"<p>The rest of this page is about <b>{esc(model)}</b>, where nothing was planted. Its scene description "
        "can be solved by a census (subtracting the described colours and shapes from those in view), which needs "
        "no binding, and the sections below say which heads it uses and what they look at.</p>",
    ]
    return "\n".join(parts)


def causal_sections(overview: Any) -> str:
    """The causal overview's report sections (plotly.js must already be on the page)."""
    esc = html.escape
    parts = ["<h2>Located heads (exact head-level mediation)</h2>",
             "<p>Each head's mean score over counterfactual pairs: the patched run's logit difference between the "
             "counterfactual and the clean answer, minus the clean run's (docs/methods.md section 4), computed with "
             "the exact fast method. Attribution patching's top-k recall against it is listed beside.</p>",
             '<div class="figs">']
    for condition, scores in overview.scores.items():
        parts.append(f'<div class="fig">{scores.figure().to_html(full_html=False, include_plotlyjs=False)}</div>')
    parts.append("</div>")
    table = pd.DataFrame([
        {"condition": c, "pairs": s.n, "top heads": ", ".join(f"{l}.{h} ({s.scores[l, h]:+.3f})"
                                                               for l, h in s.top(5)),
         "attribution recall@5": overview.recall.get(c, {}).get("top5", float("nan")),
         "attribution recall@10": overview.recall.get(c, {}).get("top10", float("nan"))}
        for c, s in overview.scores.items()])
    parts.append(frame_to_html_table(table, index=False, float_format="{:.2f}"))
    if overview.looks is not None:
        parts += ["<h2>Where the top heads look</h2>",
                  "<p>From the last prompt token of scene descriptions: the head's attention mass on the image, "
                  "and the share of it on the missing object versus one described object. A ratio near 1 means no "
                  "preference for the missing object: such a head can change the answer when patched without "
                  "retrieving anything by position (e.g. by summing the colours in view).</p>",
                  frame_to_html_table(overview.looks, index=False, float_format="{:.3f}")]
    if overview.ablations:
        rows = []
        for name, r in overview.ablations.items():
            acc = r.summary()["accuracy"]
            rows.append({"study": name, "mode": r.mode, "k": r.k, "top heads": ", ".join(r.arms[1]["heads"]),
                         **{f"{arm} accuracy": acc[arm] for arm in ("clean", "top", "random", "bottom")}})
        parts += ["<h2>Ablation: top-k located heads vs random-k vs bottom-k</h2>",
                  "<p>Task accuracy with the heads' attention to image tokens zeroed after the softmax (not "
                  "renormalised); random-k is the mean over three seeds.</p>",
                  frame_to_html_table(pd.DataFrame(rows), index=False, float_format="{:.3f}")]
    if overview.edit is not None:
        parts += ["<h2>Position-ID edit</h2>",
                  f"<p>z_h += alpha (d_t - d_o) at heads {esc(', '.join(overview.edit.summary()['heads']))}, at the "
                  "last prompt token; efficacy is the share of outputs that switch to the object at cell t. The "
                  "control adds an empty cell's ID instead.</p>",
                  f'<div class="fig">{overview.edit.figure().to_html(full_html=False, include_plotlyjs=False)}</div>']
    if overview.skipped:
        parts += ["<h2>Skipped</h2>", "<ul>"] + [f"<li><b>{esc(k)}</b>: {esc(v)}</li>"
                                                 for k, v in overview.skipped.items()] + ["</ul>"]
    if overview.commands:
        parts += ["<h2>Commands that regenerate these parts</h2>", "<ul>"] + [
            f"<li>{esc(k)}: <code>{esc(v)}</code></li>" for k, v in overview.commands.items()] + ["</ul>"]
    return "\n".join(parts)


def representation_sections(overview: Any) -> str:
    """The representational overview's report sections (plotly.js must already be on the page)."""
    esc = html.escape
    parts = []
    if overview.rsa is not None:
        parts += ["<h2>RSA by layer (single-object set)</h2>",
                  "<p>Pearson r between each site's object-similarity matrix and the compositional, conjunctive "
                  "and position model matrices (docs/methods.md section 2); p-values from a permutation test.</p>",
                  f'<div class="fig">{overview.rsa.figure().to_html(full_html=False, include_plotlyjs=False)}</div>']
    if overview.track is not None:
        parts += ["<h2>Attention-centroid tracking</h2>",
                  f"<p>RMSE (canvas cells) between each layer's thresholded attention centroid and the point the "
                  f"model writes, over {overview.track.n_points} points; valley at layer {overview.track.valley_layer}.</p>",
                  f'<div class="fig">{overview.track.figure().to_html(full_html=False, include_plotlyjs=False)}</div>']
    if overview.probes is not None:
        cols = [c for c in ("site", "family", "CE_O", "CE_F", "B_O", "B_O_prior", "margin_O", "margin_O_se",
                            "finding", "B_star_OF", "beta_O", "beta_star_OF", "n_train", "n_val", "n_test")
                if c in overview.probes.frame.columns]
        parts += ["<h2>Binding information (BalancedColorShape probes)</h2>",
                  "<p>B_O = H(O) - CE_O and B*_OF = H(O|F) - (CE_O - CE_F) in bits, with the test split's exact "
                  "entropies; CE is the probe's test cross-entropy (docs/methods.md section 6), so each B is a lower "
                  "bound: a negative value means this probe found no information it could generalise to the "
                  "test split's unseen feature codes (a probe that only knows the codes' structure scores "
                  "CE_F = 2 log2 28 = 9.6 bits). B_O_prior is the same recipe on a representation that carries "
                  "nothing (the estimator's floor on this split); margin_O is the probe's gain over it, with its "
                  "standard error over the test split.</p>",
                  frame_to_html_table(overview.probes.frame[cols], index=False, float_format="{:.3f}")]
    if overview.skipped:
        parts += ["<h2>Skipped (representations)</h2>", "<ul>"] + [
            f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in overview.skipped.items()] + ["</ul>"]
    if overview.commands:
        parts += ["<h2>Commands that regenerate the representational parts</h2>", "<ul>"] + [
            f"<li>{esc(k)}: <code>{esc(v)}</code></li>" for k, v in overview.commands.items()] + ["</ul>"]
    return "\n".join(parts)
