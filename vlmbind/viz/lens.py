"""Figures of the logit lens over the image grid (:class:`~vlmbind.analysis.lens.LensResult`), from its tables."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .figures import SEQUENTIAL_SCALE, full_title

# the most word panels one figure draws side by side before wrapping to a new row
_PANELS_PER_ROW = 4
_LAYER_COLOURS = {"colour": "#d62728", "shape": "#1f77b4"}


def _label(token: str) -> str:
    """A token as cell text: HTML-escaped, whitespace made visible, kept short."""
    shown = token.replace(" ", "\u2423").replace("\n", "\\n").replace("\t", "\\t")
    shown = shown if len(shown) <= 8 else shown[:7] + "\u2026"
    return html.escape(shown)


def lens_grid_figure(cells: pd.DataFrame, *, words: Sequence[str], layers: Sequence[str], example: str, grid: str,
                     object_names: dict[int, str], model: str) -> Any:
    """One example's image-token grid per layer (a slider), one panel per word, each cell coloured by the word's
    lens probability and labelled with its top token.

    Args:
        cells: the example's rows of ``lens.csv`` on one grid (``layer, row, col, position, objects, top_token,
            top_prob`` and ``p_<word>`` for each of ``words``).
        words: the words drawn, one panel each.
        layers: the layer labels in slider order (``embed``, ``0``, ...).
        example: the example's id; grid: the grid's name (titles).
        object_names: object index -> ``"red square"`` (hover text of the cells an object covers).
        model: the model's name.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    words = list(words)
    n_rows = int(cells["row"].max()) + 1 if len(cells) else 0
    n_cols = int(cells["col"].max()) + 1 if len(cells) else 0
    panels_across = min(len(words), _PANELS_PER_ROW) or 1
    panels_down = max(1, math.ceil(len(words) / panels_across))
    fig = make_subplots(rows=panels_down, cols=panels_across, subplot_titles=[f"p({w!r})" for w in words],
                        horizontal_spacing=0.04, vertical_spacing=0.12)
    top = max([float(cells[f"p_{w}"].max()) for w in words if len(cells)] or [1.0])
    top = top if top > 0 else 1.0
    traces_per_layer = len(words)
    for d, layer in enumerate(layers):
        rows = cells[cells["layer"] == layer]
        z_cells = np.full((n_rows, n_cols), np.nan)
        text = [["" for _ in range(n_cols)] for _ in range(n_rows)]
        custom: list[list[list[Any]]] = [[["", "", "", "", ""] for _ in range(n_cols)] for _ in range(n_rows)]
        for r, c, pos, tok, tp, objs in zip(rows["row"], rows["col"], rows["position"], rows["top_token"],
                                             rows["top_prob"], rows["objects"]):
            text[int(r)][int(c)] = _label(str(tok))
            names = ", ".join(object_names.get(int(k), k) for k in str(objs).split(";") if k) or "background"
            custom[int(r)][int(c)] = [int(pos), html.escape(repr(str(tok))), repr(float(tp)), names, ""]
        for k, w in enumerate(words):
            z = z_cells.copy()
            panel_custom = [[list(cell) for cell in line] for line in custom]
            for r, c, p in zip(rows["row"], rows["col"], rows[f"p_{w}"]):
                z[int(r), int(c)] = float(p)
                panel_custom[int(r)][int(c)][4] = repr(float(p))
            fig.add_trace(go.Heatmap(
                z=z.tolist(), text=text, texttemplate="%{text}", textfont={"size": 9},
                customdata=panel_custom, coloraxis="coloraxis", visible=d == 0, name=f"layer {layer}, {w}",
                hovertemplate=(f"layer {html.escape(str(layer))}, row %{{y}}, col %{{x}}<br>position "
                               "%{customdata[0]} (%{customdata[3]})<br>"
                               f"p({html.escape(w)}) = %{{customdata[4]}}<br>top token %{{customdata[1]}}, "
                               "p = %{customdata[2]}<extra></extra>"),
            ), row=k // panels_across + 1, col=k % panels_across + 1)
    # the cells an object covers, outlined in every panel (the same on every layer)
    first = cells[cells["layer"] == layers[0]] if len(layers) else cells
    covered = sorted({(int(r), int(c)) for r, c, objs in zip(first["row"], first["col"], first["objects"]) if objs})
    # one layout update (add_shape copies the layout on every call); subplot k's axes are x{k+1}, y{k+1}
    suffix = ["" if k == 0 else str(k + 1) for k in range(len(words))]
    fig.update_layout(shapes=[{"type": "rect", "xref": f"x{s}", "yref": f"y{s}", "x0": c - 0.5, "x1": c + 0.5,
                               "y0": r - 0.5, "y1": r + 0.5, "line": {"color": "#ff7f0e", "width": 2}}
                              for s in suffix for r, c in covered])
    steps = []
    n_traces = traces_per_layer * len(layers)
    for d, layer in enumerate(layers):
        visible = [d * traces_per_layer <= i < (d + 1) * traces_per_layer for i in range(n_traces)]
        steps.append({"method": "update", "label": str(layer), "args": [{"visible": visible}]})
    n_cells = int((cells["layer"] == layers[0]).sum()) if len(layers) else 0
    title = (f"Logit lens over the image grid: example {example}, grid {grid} ({n_rows} x {n_cols}, {n_cells} image "
             "tokens); cell text: top token; outlined: object tokens")
    fig.update_layout(
        title={"text": full_title(html.escape(title), model, None)},
        coloraxis={"colorscale": SEQUENTIAL_SCALE, "cmin": 0.0, "cmax": top,
                   "colorbar": {"title": {"text": "probability"}}},
        sliders=[{"active": 0, "currentvalue": {"prefix": "layer: "}, "steps": steps, "pad": {"t": 30}}],
        template="plotly_white", width=max(420, 260 * panels_across + 120), height=300 * panels_down + 220,
    )
    fig.update_yaxes(autorange="reversed", scaleanchor=None, showgrid=False, title={"text": ""})
    fig.update_xaxes(showgrid=False, side="bottom")
    return fig


def decodable_figure(table: pd.DataFrame, *, layers: Sequence[str], model: str, task: str) -> Any:
    """Share of objects whose colour (left) and shape (right) is decodable at their own image tokens per layer, with
    95% Wilson intervals, beside the same readout at background tokens, its ceiling and chance.

    Args:
        table: ``decodable.csv`` (``layer, feature, share, low, high, n, chance, background_share, background_low,
            background_high, background_n, background_ceiling``).
        layers: the layer labels in order.
        model: the model's name; task: the stimulus task.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    features = [f for f in ("colour", "shape") if (table["feature"] == f).any()]
    fig = make_subplots(rows=1, cols=max(1, len(features)), shared_yaxes=True,
                        subplot_titles=[f"{f} word decodable" for f in features])
    n = 0
    for k, feature in enumerate(features):
        rows = table[table["feature"] == feature].set_index("layer").reindex(list(layers))
        n = max(n, int(rows["n"].max()))
        x = [str(layer) for layer in layers]
        for prefix, name, dash, colour in (("", "object tokens", None, _LAYER_COLOURS[feature]),
                                           ("background_", "background tokens", "dash", "#7f7f7f")):
            share, low, high = (rows[f"{prefix}{c}"].to_numpy(float) for c in ("share", "low", "high"))
            count = rows[f"{prefix}n" if prefix else "n"].to_numpy()
            fig.add_trace(go.Scatter(
                x=x, y=share.tolist(), mode="lines+markers", name=f"{feature}: {name}", line={"dash": dash,
                                                                                            "color": colour},
                error_y={"type": "data", "symmetric": False, "array": (high - share).tolist(),
                         "arrayminus": (share - low).tolist(), "thickness": 1.2},
                customdata=[[repr(float(s)), repr(float(lo)), repr(float(hi)), int(c)]
                            for s, lo, hi, c in zip(share, low, high, count)],
                hovertemplate=(f"layer %{{x}}, {name}<br>share = %{{customdata[0]}}<br>95% interval "
                               "[%{customdata[1]}, %{customdata[2]}]<br>n = %{customdata[3]}<extra></extra>"),
            ), row=1, col=k + 1)
        chance = float(rows["chance"].iloc[0])
        fig.add_trace(go.Scatter(x=x, y=[chance] * len(x), mode="lines", name=f"{feature}: chance {chance:.3g}",
                                 line={"dash": "dot", "color": "#2ca02c"}, hoverinfo="name"), row=1, col=k + 1)
        ceiling = float(rows["background_ceiling"].iloc[0])
        if np.isfinite(ceiling):
            fig.add_trace(go.Scatter(x=x, y=[ceiling] * len(x), mode="lines",
                                     name=f"{feature}: background ceiling {ceiling:.3g}",
                                     line={"dash": "longdashdot", "color": "#bcbd22"}, hoverinfo="name"),
                          row=1, col=k + 1)
        fig.update_xaxes(title={"text": "layer (embed: the projector output)"}, type="category", row=1, col=k + 1)
    title = f"Objects whose word the logit lens decodes at their own image tokens ({task}; 95% Wilson intervals)"
    fig.update_layout(title={"text": full_title(title, model, n)}, yaxis={"title": {"text": "share of objects"},
                                                                         "range": [0, 1.02]},
                      legend={"orientation": "h", "y": -0.3}, template="plotly_white",
                      width=420 * max(1, len(features)) + 80, height=480)
    return fig
