"""Figures of relevancy maps and their deletion / insertion curves, from
:class:`~vlmbind.analysis.relevancy.RelevancyResult`'s tables (plain arrays and frames; no model)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .figures import DIVERGING_SCALE, full_title, image_data_uri

RANDOM = "random"
# one colour per method (the random map grey), in the order of vlmbind.core.choices.RELEVANCY_METHODS
COLOURS = {"gradient_attention": "#1f77b4", "rollout": "#ff7f0e", "input_x_gradient": "#2ca02c", RANDOM: "#7f7f7f"}


def _axis(index: int, letter: str) -> str:
    """A subplot's axis reference (``x``, ``x2``, ...) from its 1-based index in make_subplots' row-major order."""
    return letter if index == 1 else f"{letter}{index}"


def _scaled(values: np.ndarray) -> np.ndarray:
    """``values / max |values|`` (all zeros stay zeros)."""
    values = np.asarray(values, dtype=float)
    top = float(np.abs(values).max()) if values.size else 0.0
    return values / top if top > 0 else np.zeros_like(values)


def _shown_token(token: str, width: int = 8) -> str:
    """A token as the strip writes it: line breaks and tabs visible, long tokens cut (hover shows them whole)."""
    token = token.replace("\n", "\u23ce").replace("\t", "\u21e5") or "\u2205"
    return token if len(token) <= width else token[: width - 1] + "\u2026"


def relevancy_figure(shown: Sequence[Mapping[str, Any]], methods: Sequence[str], *, model: str, n: int,
                     target_rule: str) -> Any:
    """Per shown example, one row of images (one per method) with the map's image-token part laid over the image,
    and below it the prompt's other tokens as a strip coloured by the same map.

    Args:
        shown: per example ``id``, ``label`` (prompt -> answer), ``image`` (PIL), ``boxes`` (``rows cols 4`` pixel
            boxes of the grid's cells), ``cells`` (method -> ``rows cols`` values), ``tokens`` (the text tokens in
            prompt order) and ``text_values`` (method -> one value per text token).
        methods: the map methods, one column each.
        model: the model's name (title).
        n: examples in the run (title).
        target_rule: what the maps explain (title).

    Returns:
        The figure. Each part (image, text) is scaled to its own largest ``|value|`` on one diverging scale from -1
        to 1 (non-negative maps use its upper half); hover shows the exact value.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    methods = list(methods)
    n_cols = max(1, len(methods))
    n_rows = 2 * max(1, len(shown))
    titles = []
    for ex in shown:
        titles += [f"{ex['id']}: {m}" for m in methods]
        titles += [ex.get("label", "") if j == 0 else "" for j in range(len(methods))]
    fig = make_subplots(rows=n_rows, cols=n_cols, subplot_titles=titles or None, vertical_spacing=0.05 / len(shown)
                        if shown else 0.05, horizontal_spacing=0.03,
                        row_heights=[w for _ in shown for w in (0.82, 0.18)] or None)
    images = []
    for k, ex in enumerate(shown):
        image = ex["image"]
        width, height = image.size
        boxes = np.asarray(ex["boxes"], dtype=float)
        col_centres = ((boxes[0, :, 0] + boxes[0, :, 2]) / 2).tolist()
        row_centres = ((boxes[:, 0, 1] + boxes[:, 0, 3]) / 2).tolist()
        uri = image_data_uri(image)
        tokens = [_shown_token(t) for t in ex["tokens"]]
        whole = [_shown_token(t, 10**6) for t in ex["tokens"]]
        for j, method in enumerate(methods):
            top, bottom = 2 * k + 1, 2 * k + 2
            values = np.asarray(ex["cells"][method], dtype=float)
            fig.add_trace(go.Heatmap(
                z=_scaled(values).tolist(), x=col_centres, y=row_centres, coloraxis="coloraxis", opacity=0.6,
                customdata=[[repr(float(v)) for v in row] for row in values], xgap=0, ygap=0,
                hovertemplate=f"{method}<br>cell (%{{y:.0f}}, %{{x:.0f}}) px<br>value = %{{customdata}}<extra></extra>",
            ), row=top, col=j + 1)
            index = (top - 1) * n_cols + j + 1
            images.append({"source": uri, "xref": _axis(index, "x"), "yref": _axis(index, "y"), "x": 0, "y": 0,
                           "sizex": width, "sizey": height, "sizing": "stretch", "layer": "below"})
            fig.update_xaxes(range=[0, width], showticklabels=False, showgrid=False, zeroline=False, row=top,
                             col=j + 1)
            fig.update_yaxes(range=[height, 0], showticklabels=False, showgrid=False, zeroline=False,
                             scaleanchor=_axis(index, "x"), row=top, col=j + 1)
            text_values = np.asarray(ex["text_values"][method], dtype=float)
            fig.add_trace(go.Heatmap(
                z=[_scaled(text_values).tolist()], x=list(range(len(tokens))), y=[0], text=[tokens],
                texttemplate="%{text}", textfont={"size": 9}, coloraxis="coloraxis",
                customdata=[[[w, repr(float(v))] for w, v in zip(whole, text_values)]], xgap=1,
                hovertemplate="token %{x}: %{customdata[0]}<br>value = %{customdata[1]}<extra></extra>",
            ), row=bottom, col=j + 1)
            fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, row=bottom, col=j + 1)
            fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False, row=bottom, col=j + 1)
    title = f"Relevancy maps of {target_rule}: image tokens on the image, the other prompt tokens below"
    fig.update_layout(
        title={"text": full_title(title, model, n)}, images=images, template="plotly_white",
        coloraxis={"colorscale": DIVERGING_SCALE, "cmin": -1.0, "cmax": 1.0, "cmid": 0.0,
                   "colorbar": {"title": {"text": "value / max |value|<br>(image, text apart)"}}},
        width=300 * n_cols + 160, height=380 * max(1, len(shown)) + 120,
    )
    return fig


def curves_figure(means: pd.DataFrame, aucs: Mapping[str, Mapping[str, float]], *, model: str, n: int,
                  target_rule: str) -> Any:
    """Mean deletion and insertion curves per method (the random map dashed), with AUCs in the legend.

    Args:
        means: ``method, kind, fraction, prob, stderr``: the target's mean probability over examples at each fraction
            of cells deleted / inserted, and its standard error.
        aucs: method -> kind -> mean area under the curve.
        model: the model's name (title).
        n: examples (title).
        target_rule: what probability the curves follow (title).
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    kinds = ("deletion", "insertion")
    titles = ("deletion: most relevant cells painted out first (lower AUC is better)",
              "insertion: most relevant cells painted in first (higher AUC is better)")
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles)
    methods = list(dict.fromkeys(means["method"].tolist()))
    for col, kind in enumerate(kinds, start=1):
        for method in methods:
            part = means[(means["method"] == method) & (means["kind"] == kind)].sort_values("fraction")
            if part.empty:
                continue
            area = aucs.get(method, {})
            label = (f"{method}: deletion AUC {area.get('deletion', float('nan')):.3f}, insertion AUC "
                     f"{area.get('insertion', float('nan')):.3f}")
            fig.add_trace(go.Scatter(
                x=part["fraction"].tolist(), y=part["prob"].tolist(), mode="lines+markers",
                name=label, legendgroup=method, showlegend=col == 1,
                line={"color": COLOURS.get(method, "#9467bd"), "dash": "dash" if method == RANDOM else "solid"},
                error_y={"type": "data", "array": part["stderr"].tolist(), "visible": True, "thickness": 1},
                customdata=[[repr(float(p)), repr(float(s))] for p, s in zip(part["prob"], part["stderr"])],
                hovertemplate=(f"{method}, {kind}<br>fraction %{{x}}<br>mean p = %{{customdata[0]}}"
                               "<br>stderr = %{customdata[1]}<extra></extra>"),
            ), row=1, col=col)
        fig.update_xaxes(title={"text": "fraction of image cells"}, range=[-0.02, 1.02], row=1, col=col)
        fig.update_yaxes(title={"text": "p(target)"}, rangemode="tozero", row=1, col=col)
    fig.update_layout(title={"text": full_title(f"Deletion and insertion curves of {target_rule}", model, n)},
                      template="plotly_white", width=1100, height=520,
                      legend={"orientation": "h", "y": -0.2})
    return fig


__all__ = ["COLOURS", "curves_figure", "relevancy_figure"]
