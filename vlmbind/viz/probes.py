"""The binding-information figure: B_O per site and probe family, from a probe table (``probe.csv``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def binding_figure(frame: pd.DataFrame, *, model: str) -> Any:
    """B_O in bits per site, one bar group per probe family (pairwise probes, which report accuracy, are left out)."""
    import plotly.graph_objects as go

    part = frame[frame["family"] != "pairwise"]
    fig = go.Figure()
    for family in dict.fromkeys(part["family"]):
        rows = part[part["family"] == family]
        # a bound below zero says the estimator found nothing: the bar says so in words, not only as a sign
        labels = ["no information found" if b < 0 else "" for b in rows["B_O"]]
        fig.add_trace(go.Bar(x=rows["site"], y=rows["B_O"], name=family, text=labels, textposition="outside",
                             customdata=np.stack([rows["beta_O"], rows["B_star_OF"]], -1),
                             hovertemplate="%{x}<br>B_O %{y:.2f} bits<br>beta_O %{customdata[0]:.3f}<br>"
                                           "B*_OF %{customdata[1]:.2f} bits<extra>" + family + "</extra>"))
        if "B_O_prior" in rows:
            fig.add_trace(go.Scatter(x=rows["site"], y=rows["B_O_prior"], mode="markers", name=f"{family}: prior only",
                                     marker={"symbol": "line-ew-open", "size": 18, "color": "black"},
                                     hovertemplate="%{x}<br>prior-only probe: B_O %{y:.2f} bits<extra></extra>"))
    h_o = float(part["H_O"].iloc[0]) if len(part) else float("nan")
    fig.update_layout(barmode="group", template="plotly_white",
                      title=f"Binding information B_O = H(O) - CE_O (H(O) = {h_o:.2f} bits)<br><sup>{model}, "
                            f"n_test={int(part['n_test'].max()) if len(part) else 0}; a bar below zero: no information "
                            f"found (estimator bound below zero); marks: the prior-only probe</sup>",
                      xaxis_title="site", yaxis_title="bits")
    return fig


def same_object_figure(frame: pd.DataFrame, *, model: str) -> Any:
    """IsSameObject test accuracy per site, a line per probe family with its interval (+-1.96 SE of the margin),
    and the baselines as dashed lines."""
    import plotly.graph_objects as go

    fig = go.Figure()
    sites = list(dict.fromkeys(frame["site"]))
    for family in dict.fromkeys(frame["family"]):
        rows = frame[frame["family"] == family].set_index("site").reindex(sites)
        fig.add_trace(go.Scatter(x=sites, y=rows["accuracy"], mode="lines+markers", name=family,
                                 error_y={"type": "data", "array": 1.96 * rows["margin_se"]},
                                 hovertemplate="%{x}<br>accuracy %{y:.3f}<extra>" + family + "</extra>"))
    first = frame[frame["family"] == frame["family"].iloc[0]].set_index("site").reindex(sites)
    names = ["baseline_not_same", "baseline_same_class"] + [c for c in frame.columns
                                                            if c.startswith(("baseline_same_", "reference_"))
                                                            and c != "baseline_same_class"]
    for column in names:
        if column in first:
            fig.add_trace(go.Scatter(x=sites, y=first[column], mode="lines", name=column.split("_", 1)[1],
                                     line={"dash": "dot" if column.startswith("reference_") else "dash"}))
    fig.update_layout(template="plotly_white", xaxis_title="site", yaxis_title="test accuracy",
                      title=f"IsSameObject: is a pair of tokens one object?<br><sup>{model}, "
                            f"{int(frame['n_pairs_test'].max())} test pairs; dashed: class baselines, dotted: "
                            f"class + adjacency reference; bars: 95% interval of the margin</sup>")
    return fig
