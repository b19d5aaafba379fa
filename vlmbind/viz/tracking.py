"""Figures of attention-centroid tracking, from :class:`~vlmbind.analysis.tracking.TrackResult`'s arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from .figures import full_title, image_data_uri


def rmse_figure(rmse_heads: np.ndarray, rmse_mean: np.ndarray, best_heads: Sequence[tuple[int, int, float]], *,
                task: str, threshold: float, query: str, valley_layer: int | None, model: str, n_points: int) -> Any:
    """RMSE by layer for head-averaged maps (``rmse_mean``, ``L``), every head's RMSE (``rmse_heads``, ``L H``) and
    the best head per layer (``(layer, head, rmse)``)."""
    import plotly.graph_objects as go

    n_layers, n_heads = rmse_heads.shape

    layers = list(range(n_layers))
    heads = rmse_heads
    fig = go.Figure()
    xs = [l for l in layers for _ in range(n_heads)]
    fig.add_trace(go.Scatter(
        x=xs, y=heads.reshape(-1).tolist(), mode="markers", name="each head",
        marker={"color": "rgba(120,120,120,0.55)", "size": 7},
        customdata=[[h, repr(float(v))] for row in heads for h, v in enumerate(row)],
        hovertemplate="layer %{x}, head %{customdata[0]}<br>rmse = %{customdata[1]}<extra></extra>",
    ))
    best = list(best_heads)
    fig.add_trace(go.Scatter(
        x=[b[0] for b in best], y=[b[2] for b in best], mode="lines+markers", name="best head",
        line={"dash": "dash", "color": "#2ca02c"},
        customdata=[[b[1], repr(b[2])] for b in best],
        hovertemplate="layer %{x}: best head %{customdata[0]}<br>rmse = %{customdata[1]}<extra></extra>",
    ))
    mean = rmse_mean
    fig.add_trace(go.Scatter(
        x=layers, y=mean.tolist(), mode="lines+markers", name="head-averaged maps",
        line={"color": "#1f77b4", "width": 3},
        customdata=[repr(float(v)) for v in mean],
        hovertemplate="layer %{x}<br>rmse = %{customdata}<extra></extra>",
    ))
    valley = valley_layer
    title = f"Attention-centroid RMSE by layer ({task}, threshold {threshold:g}, query {query})"
    if valley is not None:
        title += f"; valley at layer {valley}"
    fig.update_layout(
        title={"text": full_title(title, model, n_points)},
        xaxis={"title": {"text": "layer"}, "dtick": 1 if n_layers <= 48 else None},
        yaxis={"title": {"text": "RMSE (canvas cells)"}, "rangemode": "tozero"},
        template="plotly_white", width=760, height=460,
    )
    return fig


def points_figure(image: Image.Image, points: np.ndarray, centroids: np.ndarray, *, size: float, rows: int,
                  cols: int, layer: int, example_id: str, output: str, model: str) -> Any:
    """One example's generated points (``n 2``, canvas cells) and centroids at ``layer`` (``n 2``) drawn over its
    image (a ``size`` px canvas of ``rows x cols`` cells), each centroid joined to its point."""
    import plotly.graph_objects as go

    n = len(points)
    cw, ch = size / cols, size / rows
    to_px = lambda a: ((a[:, 0] + 0.5) * cw, (a[:, 1] + 0.5) * ch)  # noqa: E731
    px, py = to_px(points) if n else ([], [])
    cx, cy = to_px(centroids) if n else ([], [])
    fig = go.Figure()
    for k in range(n):
        if np.isfinite(centroids[k]).all():
            fig.add_trace(go.Scatter(x=[px[k], cx[k]], y=[py[k], cy[k]], mode="lines", showlegend=False,
                                     line={"color": "rgba(0,0,0,0.5)", "width": 1}, hoverinfo="skip"))
    labels = [str(k + 1) for k in range(n)]
    fig.add_trace(go.Scatter(
        x=list(px), y=list(py), mode="markers+text", name="generated point", text=labels,
        textposition="top center", marker={"symbol": "x", "size": 12, "color": "#d62728"},
        customdata=[[f"({p[0]:g}, {p[1]:g})"] for p in points],
        hovertemplate="point %{text}: %{customdata[0]}<extra></extra>",
    ))
    fig.add_trace(go.Scatter(
        x=list(cx), y=list(cy), mode="markers", name=f"centroid, layer {layer} (head-averaged)",
        marker={"symbol": "circle-open", "size": 12, "color": "#1f77b4", "line": {"width": 2}},
        customdata=[[str(k + 1), repr(float(c[0])), repr(float(c[1]))] for k, c in enumerate(centroids)],
        hovertemplate="point %{customdata[0]}: centroid (%{customdata[1]}, %{customdata[2]})<extra></extra>",
    ))
    width, height = image.size
    fig.update_layout(
        title={"text": f"{example_id}: {output.strip()[:80]}<br><sup>{model}, layer {layer}</sup>"},
        images=[{"source": image_data_uri(image), "xref": "x", "yref": "y", "x": 0, "y": 0, "sizex": width,
                 "sizey": height, "sizing": "stretch", "layer": "below"}],
        xaxis={"range": [0, width], "showgrid": False, "zeroline": False, "title": {"text": "x (pixels)"}},
        yaxis={"range": [height, 0], "showgrid": False, "zeroline": False, "scaleanchor": "x",
               "title": {"text": "y (pixels)"}},
        template="plotly_white", width=640, height=620,
    )
    return fig
