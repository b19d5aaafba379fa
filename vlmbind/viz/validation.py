"""The validation figure: each condition's exact scores with the reference heads marked, and each method's AUROC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .figures import DIVERGING_SCALE, full_title


def validation_figure(methods: Sequence[dict[str, Any]], scores: Sequence[dict[str, Any]],
                      pca: Sequence[dict[str, Any]], *, model: str, reference: str | None) -> Any:
    """Top row: per scene condition, the exact per-head scores (layers x heads; one colour scale shared by all
    panels, so a weak condition looks weak) with reference heads ringed. Bottom row: AUROC and recall@k per method
    and condition, and the PCA of the first reference head's last-token output, each scene drawn in its missing
    object's colour (its cell and shape on hover).

    Args:
        methods, scores, pca: :class:`~vlmbind.analysis.validate.ValidationResult`'s tables.
        model: the model's name.
        reference: where the reference heads come from.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    conditions = list(dict.fromkeys(r["condition"] for r in methods))
    exact = [r for r in scores if r["method"] == "exact"]
    cols = max(len(conditions), 2)
    fig = make_subplots(rows=2, cols=cols, subplot_titles=[*conditions, *[""] * (cols - len(conditions)),
                                                            "AUROC per method",
                                                            "PCA of a reference head's output"],
                        vertical_spacing=0.18)
    bound = max((abs(r["score"]) for r in exact), default=1.0) or 1.0
    for c, condition in enumerate(conditions, start=1):
        rows = [r for r in exact if r["condition"] == condition]
        if not rows:
            continue
        layers = max(r["layer"] for r in rows) + 1
        heads = max(r["head"] for r in rows) + 1
        z = np.zeros((layers, heads))
        err = np.zeros((layers, heads))
        for r in rows:
            z[r["layer"], r["head"]] = r["score"]
            err[r["layer"], r["head"]] = r["stderr"]
        text = [[f"{z[l, h]!r} ± {err[l, h]:.3g}" for h in range(heads)] for l in range(layers)]
        fig.add_trace(go.Heatmap(z=z, x=list(range(heads)), y=list(range(layers)), zmin=-bound, zmax=bound,
                                 colorscale=DIVERGING_SCALE, showscale=c == 1, text=text,
                                 hovertemplate="layer %{y}, head %{x}<br>score %{text}<extra></extra>"),
                      row=1, col=c)
        marked = [r for r in rows if r["reference"]]
        if marked:
            fig.add_trace(go.Scatter(x=[r["head"] for r in marked], y=[r["layer"] for r in marked], mode="markers",
                                     marker={"symbol": "circle-open", "size": 22, "color": "black",
                                             "line": {"width": 3}},
                                     name="reference head", showlegend=c == 1, hoverinfo="skip"), row=1, col=c)
        fig.update_xaxes(title_text="head", row=1, col=c)
        fig.update_yaxes(title_text="layer", row=1, col=c)
    for method in dict.fromkeys(r["method"] for r in methods):
        rows = [r for r in methods if r["method"] == method]
        fig.add_trace(go.Bar(x=[r["condition"] for r in rows], y=[r["auroc"] for r in rows], name=method,
                             customdata=[[r["recall_at_k"], " ".join(map(str, r["planted_ranks"]))] for r in rows],
                             hovertemplate=method + "<br>%{x}: AUROC %{y}<br>recall@k %{customdata[0]}<br>ranks "
                                           "%{customdata[1]}<extra></extra>"), row=2, col=1)
    fig.update_yaxes(range=[0, 1.02], title_text="AUROC", row=2, col=1)
    if pca:
        head = pca[0]["head"]
        points = [p for p in pca if p["head"] == head]
        fig.add_trace(go.Scatter(x=[p["pc1"] for p in points], y=[p["pc2"] for p in points], mode="markers",
                                 marker={"color": [p["colour"] for p in points], "size": 6,
                                         "line": {"width": 0.5, "color": "#444"}},
                                 text=[f"missing {p['colour']} {p['shape']} in cell {p['cell']}" for p in points],
                                 hovertemplate="%{text}<extra></extra>", name=f"head {head}", showlegend=False),
                      row=2, col=2)
        explained = points[0]["explained"]
        fig.update_xaxes(title_text=f"head {head}: PC1 ({100 * explained[0]:.0f}%)", row=2, col=2)
        fig.update_yaxes(title_text=f"PC2 ({100 * explained[1]:.0f}%)", row=2, col=2)
    n = max((r["n_pairs"] for r in methods), default=0)
    title = "Methods against " + (f"reference heads ({reference})" if reference else "no reference heads")
    fig.update_layout(title={"text": full_title(title, model, n)}, template="plotly_white", barmode="group",
                      width=360 * cols, height=780, legend={"orientation": "h", "y": -0.1})
    return fig
