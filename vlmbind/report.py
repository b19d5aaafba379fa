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


def demo_report_html(summary: dict[str, Any], frame: pd.DataFrame, heatmap: Any, overlay: Any, causal: str = "") -> str:
    """One offline page: provenance, the two figures (plotly.js embedded once), the tables, and the causal overview's
    sections when given."""
    esc = html.escape
    chosen = summary["head"]
    # plotly.js goes into the first figure only; the second reuses it
    heatmap_div = heatmap.to_html(full_html=False, include_plotlyjs=True, div_id="vlmbind-heatmap")
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
<h1>vlmbind demo: attention from the last token to the image</h1>
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
