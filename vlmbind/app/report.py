"""The HTML pages vlmbind writes: the demo's report (:func:`demo_report_html`), with the causal and representational
overviews' sections in it."""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd

from ..analysis.ablation import POOL_LABELS, wilson_interval
from ..viz import frame_to_html_table
from ..viz.figures import plotlyjs_bundle, share_colour_scale

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
section.findings { background: #f4f8fb; border-left: 4px solid #1f77b4; padding: 0.2em 1em 0.6em; }
section.findings h2 { margin-top: 0.6em; border: none; }
"""


def plotlyjs_tag(src: str | None) -> str:
    """The page's one plotly.js ``<script>``: a reference to ``src`` (a ``plotly.min.js`` beside the results), or
    the library inline when ``src`` is None (a page that must stand alone)."""
    if src is not None:
        return f'<script charset="utf-8" src="{html.escape(src)}"></script>'
    return f'<script charset="utf-8">{plotlyjs_bundle()}</script>'


def demo_report_html(summary: dict[str, Any], frame: pd.DataFrame, heatmap: Any, overlay: Any, causal: str = "",
                     validation: str = "", findings: str = "", plotlyjs: str | None = None) -> str:
    """One offline page: what was found (``findings``, see :func:`findings_section`), the validation on a planted
    organism when given, provenance, the two figures, the tables, and the causal overview's sections when given.
    plotly.js is loaded once in the page's head, from ``plotlyjs`` (a relative ``src``) or inline when None."""
    esc = html.escape
    chosen = summary["head"]
    heatmap_div = heatmap.to_html(full_html=False, include_plotlyjs=False, div_id="vlmbind-heatmap")
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
{plotlyjs_tag(plotlyjs)}
</head>
<body>
<h1>vlmbind demo: {esc(summary['model'])}</h1>
{findings}
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


def validation_sections(result: Any, model: str, steering: list[Any] | None = None) -> str:
    """The report's opening: every method against the heads planted in an organism (with ``steering``, each planted
    head steered: :func:`steering_section`), and what that means for the model the rest of the page is about."""
    esc = html.escape
    rows = [{"condition": r["condition"], "method": r["method"], "planted heads": " ".join(r["heads"]) or "-",
             "ranks": " ".join(map(str, r["planted_ranks"])) or "-", "recall@k": r["recall_at_k"],
             "AUROC": r["auroc"], "planted / max other": r["ratio"], "top heads": " ".join(r["top_heads"]),
             "pairs": r["n_pairs"], "seconds": r["seconds"]} for r in result.methods]
    ablation = pd.DataFrame([{"mode": mode, **{k: v for k, v in arms.items()}}
                             for mode, arms in result.ablation_summary().items()])
    planted = ", ".join(f"{c}: {' '.join(h)}" for c, h in result.heads.items()) or "none"
    figure = result.figure().to_html(full_html=False, include_plotlyjs=False, div_id="vlmbind-validation")
    parts = [
        "<h2>How do I know the methods work? Validation on a planted organism</h2>",
        f"<p><b>{esc(result.model)}</b> had a mechanism trained into chosen heads by SIIT ({esc(planted)}); its "
        "training record says which. Each method below ran on fresh scene pairs (seed "
        f"{result.params['seed']}, {result.params['n_objects']} objects, a count the planting held out) and is "
        "scored by where it ranks the planted heads among all heads (rank 1 = highest score). A planted mechanism "
        "checks the methods; it says nothing about how pretrained VLMs work.</p>",
        frame_to_html_table(pd.DataFrame(rows), index=False, float_format="{:.3f}"),
        "<p>Ablation of each condition's top-k exact heads against random-k heads from the rest (mean and lowest "
        "over seeds), random-k heads from the top-k's own layers (<code>random_same_layers</code>, where run) and "
        "the bottom-k by |score|, scene-description accuracy:</p>",
        frame_to_html_table(ablation, index=False, float_format="{:.3f}"),
        _edit_line(result),
        steering_section(steering or []),
        f'<div class="fig">{figure}</div>',
        f"<p>The rest of this page is about <b>{esc(model)}</b>, where nothing was planted. Its scene description "
        "can be solved by a census (subtracting the described colours and shapes from those in view), which needs "
        "no binding, and the sections below say which heads it uses and what they look at.</p>",
    ]
    return "\n".join(parts)


def steering_section(results: list[Any]) -> str:
    """Each planted head steered alone to a described object on the planted organism, beside as many random heads."""
    if not results:
        return ""
    rows = []
    for r in results:
        s = r.summary()
        gaze = r.gaze.set_index(["layer", "head"])
        rows.append({"heads": " ".join(s["heads"]), "names the object steered to": _share_text(s, "efficacy"),
                     "random heads, same push": _share_text(s, "random_heads_efficacy"),
                     "gaze": " ".join(f"{gaze.loc[tuple(int(v) for v in h.split('.')), 'gaze']:.2f}"
                                      for h in s["heads"]),
                     "scenes": s["n_counted"], "identity exact": s["identity_exact"]})
    chance = float(results[0].gaze["chance"].iloc[0]) if len(results[0].gaze) else float("nan")
    return "\n".join([
        "<p>Attention steering: each planted head alone, its attention masked before the softmax to a described "
        "object's image tokens at the last prompt token and every answer token. The answer names that object where "
        "the head's attention carries the selection; random heads given the same push do not move it. Gaze: the "
        f"share of the head's image attention on the missing object (chance {chance:.3f}).</p>",
        frame_to_html_table(pd.DataFrame(rows), index=False, float_format="{:.3f}")])


def _share_text(summary: dict[str, Any], key: str) -> str:
    value, interval = summary.get(key), summary.get(f"{key}_interval")
    if value is None:
        return "-"
    n = summary["n_counted"] if key == "efficacy" else summary["random_heads_n"]
    return f"{value:.2f} [{interval[0]:.2f}, {interval[1]:.2f}] (n={n})"


def _edit_line(result: Any) -> str:
    esc = html.escape
    if result.edit_heads():
        where = " and every answer position" if result.params.get("edit_positions") == "answer" else ""
        parts = []
        for heads in result.edit_heads():
            edit = result.edit_summary(heads)
            chance = (f", {edit['control_chance']:.2f} of it expected by chance from answers that fall back on a "
                      "described object") if edit.get("control_chance") is not None else ""
            random = (f", and {edit['random_control']:.2f} for a random direction of the edit's size"
                      if edit.get("random_control") is not None else "")
            parts.append(f"at {esc(heads)}: efficacy {edit['efficacy']:.2f} at alpha {edit['alpha']:g}, against "
                         f"{edit['control'] or 0:.2f} for the empty-cell control{chance}{random} (n={edit['n']})")
        return (f"<p>Position-ID edit at the ID-selection heads (the prompt's last position{where}; together, then "
                f"each alone): {'; '.join(parts)}.</p>")
    if result.skipped.get("edit"):
        return f"<p>Position-ID edit skipped: {esc(result.skipped['edit'])}</p>"
    return ""


def causal_sections(overview: Any) -> str:
    """The causal overview's report sections (plotly.js must already be on the page)."""
    esc = html.escape
    parts = ["<h2>Located heads (exact head-level mediation)</h2>",
             "<p>Each head's mean score over counterfactual pairs: the patched run's logit difference between the "
             "counterfactual and the clean answer, minus the clean run's (docs/methods.md section 4), computed with "
             "the exact fast method. Attribution patching's top-k recall against it is listed beside. The "
             "heatmaps share one colour scale, so a pale condition has small scores; the table gives each "
             "condition's own largest |score|.</p>",
             '<div class="figs">']
    figures = [scores.figure() for scores in overview.scores.values()]
    share_colour_scale(figures)
    for fig in figures:
        parts.append(f'<div class="fig">{fig.to_html(full_html=False, include_plotlyjs=False)}</div>')
    parts.append("</div>")
    table = pd.DataFrame([
        {"condition": c, "pairs": s.n, "max |score|": float(np.abs(s.scores).max()),
         "top heads (mean [95% interval], * significant)": s.ranking_text(5),
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
            iv = r.intervals()
            rows.append({"study": name, "mode": r.mode, "k": r.k, "top heads": ", ".join(r.arms[1]["heads"]),
                         **{f"{arm}": f"{iv[arm]['accuracy']:.3f} [{iv[arm]['low']:.2f}, {iv[arm]['high']:.2f}]"
                            for arm in ("clean", "top", *r.random_arms(), "bottom")},
                         "random per seed": " ".join(f"{a['accuracy']:.2f}" for a in r.random_seeds()),
                         "random pool": POOL_LABELS[r.random_from],
                         "bottom by": r.bottom_label,
                         "n": iv["clean"]["n"]})
        parts += ["<h2>Ablation: top-k located heads vs random-k vs bottom-k</h2>",
                  "<p>Task accuracy with the heads' attention to image tokens zeroed after the softmax (not "
                  "renormalised), with 95% intervals: Wilson over the n examples for clean, top and bottom; for "
                  "random-k the mean over seeds with a t-interval over the seeds, each seed listed beside.</p>",
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
    if overview.lens is not None:
        rows = []
        for layer in overview.lens.layers:
            row: dict[str, Any] = {"layer": layer}
            for r in overview.lens.decodable[overview.lens.decodable["layer"] == layer].itertuples():
                row[f"{r.feature} at the object"] = f"{r.share:.2f} [{r.low:.2f}, {r.high:.2f}]"
                row[f"{r.feature} at background"] = f"{r.background_share:.2f}"
            rows.append(row)
        n = int(overview.lens.decodable["n"].max()) if len(overview.lens.decodable) else 0
        decodable = overview.lens.decodable_figure().to_html(full_html=False, include_plotlyjs=False)
        parts += ["<h2>Logit lens over the image grid</h2>",
                  f"<p>Each image token's residual after each layer (and the projector's output, <code>embed</code>) "
                  f"decoded through the final norm and the unembedding. Per layer, the share of {n} objects whose "
                  "colour (shape) word is the top word of the colour (shape) pool at the object's own image tokens, "
                  "with its 95% Wilson interval, beside the same readout at background tokens (chance: one over the "
                  "pool).</p>",
                  frame_to_html_table(pd.DataFrame(rows), index=False),
                  f'<div class="fig">{decodable}</div>']
    if overview.relevancy is not None:
        scores = overview.relevancy.scores()
        table = pd.DataFrame([{
            "map": r["method"], "n": r["n"], "deletion AUC": r["deletion_auc"],
            "minus random (lower is better)": _interval_text(r, "deletion_vs_random"),
            "insertion AUC": r["insertion_auc"],
            "minus random (higher is better)": _interval_text(r, "insertion_vs_random"),
            "knockout: answers changed": r["knockout_changed"]} for r in scores.to_dict("records")])
        curves = overview.relevancy.curves_figure().to_html(full_html=False, include_plotlyjs=False)
        parts += ["<h2>Relevancy maps (query task)</h2>",
                  "<p>Gradient-weighted attention, attention rollout and input x gradient explain the answer's first "
                  "token over image and prompt tokens; each map's cells are painted out in its order (deletion) or "
                  "painted back onto a blank image (insertion), against random orders of the same cells (paired "
                  "differences, 95% bootstrap intervals over examples), and the text's attention to its top cells "
                  "is blocked against random cells.</p>",
                  frame_to_html_table(table, index=False, float_format="{:.3f}"), f'<div class="fig">{curves}</div>']
    if overview.skipped:
        parts += ["<h2>Skipped (representations)</h2>", "<ul>"] + [
            f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in overview.skipped.items()] + ["</ul>"]
    if overview.commands:
        parts += ["<h2>Commands that regenerate the representational parts</h2>", "<ul>"] + [
            f"<li>{esc(k)}: <code>{esc(v)}</code></li>" for k, v in overview.commands.items()] + ["</ul>"]
    return "\n".join(parts)


def _interval_text(row: dict[str, Any], key: str) -> str:
    value, low, high = row.get(key), row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if value is None or value != value:  # random against itself
        return "-"
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def _wilson_text(accuracy: float, n: int) -> str:
    low, high = wilson_interval(accuracy, n)
    return f"{accuracy:.2f} [{low:.2f}, {high:.2f}]"


def findings(causal: Any = None, validation: Any = None) -> list[str]:
    """Two to four sentences stating what the demo measured, built from the results' own numbers: the planted
    heads' ranks (``validation``), the located heads per condition with 95% intervals and significance, the
    ablation with intervals, and the position-ID edit against its control."""
    out: list[str] = []
    if validation is not None:
        exact = [r for r in validation.methods if r["method"] == "exact" and r["heads"]]
        n_heads = len({(r["layer"], r["head"]) for r in validation.scores}) or None
        parts = [f"{r['condition']} head{'s' if len(r['heads']) > 1 else ''} {' '.join(r['heads'])} at rank "
                 f"{', '.join(map(str, r['planted_ranks']))} of {n_heads} (AUROC {r['auroc']:.2f}, "
                 f"n={r['n_pairs']} pairs)" for r in exact]
        if parts:
            out.append(f"Validation on {validation.model}, where the mechanism was trained in: exact mediation puts "
                       f"the planted {'; '.join(parts)}.")
    if causal is not None and causal.scores:
        found, empty = [], []
        for condition, s in causal.scores.items():
            u = s.uncertainty()
            significant = s.significant_top()
            if np.isnan(u["ci_low"]).all():  # results saved without per-pair scores
                l, h = s.top(1)[0]
                found.append(f"{condition}: top head {l}.{h} {s.scores[l, h]:+.3f} (no interval: the saved "
                             f"results lack per-pair scores; n={s.n} pairs)")
            elif significant:
                l, h = significant[0]
                found.append(f"{condition}: head {l}.{h} {s.scores[l, h]:+.3f} [{u['ci_low'][l, h]:+.3f}, "
                             f"{u['ci_high'][l, h]:+.3f}] ({len(significant)} of {s.scores.size} heads significant, "
                             f"n={s.n} pairs)")
            else:
                empty.append(f"{condition} (n={s.n} pairs)")
        sentence = f"On {causal.model}, " + ("; ".join(found) if found else "no condition has a significant head")
        if empty:
            sentence += f"; no head separates from zero after correction for {', '.join(empty)}"
        out.append(sentence + " (mean score in logits, 95% bootstrap interval).")
        # the headline study: the one where the top-k hurt most against random-k; the table has every one
        studies = sorted(causal.ablations.items(), key=lambda kv: kv[1].accuracy("top") - kv[1].accuracy("random"))
        for name, r in studies[:1]:
            iv = r.intervals()
            rnd = iv["random"]
            out.append(
                f"Ablating the top-{r.k} heads of {name} ({r.mode}) takes accuracy from "
                f"{_wilson_text(iv['clean']['accuracy'], iv['clean']['n'])} to "
                f"{_wilson_text(iv['top']['accuracy'], iv['top']['n'])}; {r.k} random heads "
                f"{POOL_LABELS[r.random_from] if r.random_from != 'all' else ''} give {rnd['accuracy']:.2f} "
                f"[{rnd['low']:.2f}, {rnd['high']:.2f}] over {rnd['seeds']} seeds (lowest {rnd['lowest']:.2f}; "
                f"n={iv['clean']['n']} examples).".replace("  ", " "))
        if causal.edit is not None:
            s = causal.edit.summary()
            alphas = [a for a in s["efficacy"] if float(a) != 0]
            if alphas:
                best = max(alphas, key=lambda a: s["efficacy"][a])
                eff, ctl, n = s["efficacy"][best], s["control_efficacy"].get(best, float("nan")), s["n_used"]
                separated = wilson_interval(eff, n)[0] > wilson_interval(ctl, n)[1]
                out.append(f"The position-ID edit at heads {', '.join(s['heads'])} switches "
                           f"{_wilson_text(eff, n)} of answers at its best alpha ({best}); the empty-cell control "
                           f"switches {_wilson_text(ctl, n)} ({'the edit is above it' if separated else 'not separated'}"
                           f"; n={n} examples).")
    return out


def findings_section(causal: Any = None, validation: Any = None) -> str:
    """The report's opening section: :func:`findings` as a short list."""
    items = findings(causal, validation)
    if not items:
        return ""
    body = "\n".join(f"<li>{html.escape(t)}</li>" for t in items)
    return f'<section class="findings">\n<h2>What was found</h2>\n<ul>\n{body}\n</ul>\n</section>'
