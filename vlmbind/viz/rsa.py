"""RSA and PCA figures, from the tables :mod:`vlmbind.analysis.rsa` computes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..core.errors import InputError

# RSA's model matrices, in the order tables and figures list them
MODEL_MATRICES = ("conjunctive", "compositional", "position")


def rsa_figure(frame: pd.DataFrame, *, similarity: str, model: str) -> Any:
    """r by layer, one panel per component (vision tower, projector, language model), one line per model matrix,
    from an RSA table (site, component, layer, model_matrix, r, spearman, p, n_objects)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    components = [c for c in ("vision", "projector", "lm") if c in set(frame["component"])]
    titles = {"vision": "vision tower", "projector": "projector", "lm": "language model"}
    fig = make_subplots(rows=1, cols=len(components), subplot_titles=[titles[c] for c in components],
                        shared_yaxes=True)
    colours = {"conjunctive": "#d62728", "compositional": "#1f77b4", "position": "#7f7f7f"}
    for k, component in enumerate(components, start=1):
        part = frame[frame["component"] == component]
        for matrix in MODEL_MATRICES:
            rows = part[part["model_matrix"] == matrix].sort_values("layer", na_position="first")
            x = rows["layer"].fillna(0).astype(int).tolist() if component != "projector" else ["out"] * len(rows)
            fig.add_trace(go.Scatter(
                x=x, y=rows["r"], mode="lines+markers", name=matrix, legendgroup=matrix, showlegend=k == 1,
                line={"color": colours[matrix]},
                customdata=np.stack([rows["p"], rows["spearman"]], -1) if len(rows) else None,
                hovertemplate="layer %{x}<br>r %{y:.4f}<br>p %{customdata[0]:.4g}<br>"
                              "Spearman %{customdata[1]:.4f}<extra>" + matrix + "</extra>"), row=1, col=k)
        fig.update_xaxes(title_text="layer", row=1, col=k)
    n = int(frame["n_objects"].max()) if len(frame) else 0
    fig.update_yaxes(title_text="Pearson r with the model matrix", row=1, col=1)
    fig.update_layout(title=f"RSA ({similarity} similarity)<br><sup>{model}, n={n} objects</sup>",
                      template="plotly_white")
    return fig


def pca_figure(frames: list[pd.DataFrame], colour_by: str = "cell", title: str = "PCA of object representations") -> Any:
    """One panel per site (PC1 vs PC2), points coloured by ``cell`` (position), ``colour`` or ``shape``."""
    import plotly.express as px
    from plotly.subplots import make_subplots

    if colour_by not in ("cell", "colour", "shape"):
        raise InputError(f"colour_by must be cell, colour or shape, got {colour_by!r}")
    fig = make_subplots(rows=1, cols=len(frames), subplot_titles=[
        f"{f['site'].iloc[0]} ({100 * (f['evr1'].iloc[0] + f.get('evr2', pd.Series([0])).iloc[0]):.0f}% var)"
        for f in frames])
    seen = set()
    for k, frame in enumerate(frames, start=1):
        sub = px.scatter(frame, x="pc1", y="pc2", color=colour_by, hover_data=["colour", "shape", "cell"])
        for trace in sub.data:
            trace.showlegend = trace.name not in seen
            seen.add(trace.name)
            trace.legendgroup = trace.name
            fig.add_trace(trace, row=1, col=k)
        fig.update_xaxes(title_text="PC1", row=1, col=k)
        fig.update_yaxes(title_text="PC2", row=1, col=k)
    fig.update_layout(title=f"{title}, coloured by {colour_by}", template="plotly_white")
    return fig
