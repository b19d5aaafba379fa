"""The circuit figure: layers as rows, heads as nodes, the strongest edges drawn by score."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .figures import full_title

CHANNEL_COLOURS = {"q": "#1f77b4", "k": "#ff7f0e", "v": "#2ca02c", "logits": "#7f7f7f"}
SHOWN_EDGES = 20


def _head(label: str) -> tuple[int, int]:
    layer, head = label.split(".")
    return int(layer), int(head)


def circuit_figure(frame: pd.DataFrame, *, model: str | None = None, n: int | None = None,
                   title: str = "Circuit", shown: int = SHOWN_EDGES) -> Any:
    """Heads as nodes (x: head, y: layer, the logits above the last layer), the ``shown`` edges of largest
    ``|score|`` as lines whose width follows the score and whose colour names the channel (q, k, v, or the direct
    path into the logits); a dashed line is a negative score. Hovering a line gives its score and interval.

    Args:
        frame: :meth:`vlmbind.analysis.circuits.Circuit.to_frame`'s table.
        model, n: shown on the title's second line.
        title: the figure title.
        shown: how many edges to draw.
    """
    import plotly.graph_objects as go

    heads = [_head(s) for s in frame["sender"]] + [_head(r) for r in frame["receiver"] if r != "logits"]
    n_layers = max(l for l, _ in heads) + 1
    n_heads = max(h for _, h in heads) + 1
    top = frame.reindex(frame["score"].abs().sort_values(ascending=False, kind="stable").index).head(shown)
    biggest = float(top["score"].abs().max()) if len(top) else 0.0
    fig = go.Figure()
    logits_y = n_layers
    for row in top.itertuples():
        sl, sh = _head(row.sender)
        rl, rh = (logits_y, (n_heads - 1) / 2) if row.receiver == "logits" else _head(row.receiver)
        width = 1 + 7 * abs(row.score) / biggest if biggest > 0 else 1
        interval = "" if np.isnan(row.ci_low) else f"<br>95% CI [{row.ci_low:+.3f}, {row.ci_high:+.3f}]"
        target = "logits" if row.receiver == "logits" else f"{row.receiver} ({row.channel})"
        fig.add_trace(go.Scatter(
            x=[sh, rh], y=[sl, rl], mode="lines", showlegend=False,
            line={"width": width, "color": CHANNEL_COLOURS.get(row.channel, "#000"),
                  "dash": "solid" if row.score >= 0 else "dash"},
            hovertext=f"{row.sender} -> {target}: {row.score:+.4f}{interval}", hoverinfo="text"))
    xs, ys = zip(*[(h, l) for l in range(n_layers) for h in range(n_heads)])
    fig.add_trace(go.Scatter(x=list(xs) + [(n_heads - 1) / 2], y=list(ys) + [logits_y], mode="markers+text",
                             text=[f"{l}.{h}" for h, l in zip(xs, ys)] + ["logits"], textposition="middle right",
                             marker={"size": 10, "color": "#444"}, showlegend=False, hoverinfo="text"))
    for channel, colour in CHANNEL_COLOURS.items():
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"color": colour, "width": 3},
                                 name=channel if channel == "logits" else f"into {channel}"))
    fig.update_layout(title=full_title(title, model, n), xaxis_title="head", yaxis_title="layer",
                      yaxis={"tickvals": list(range(n_layers + 1)), "ticktext": [*map(str, range(n_layers)), "logits"]},
                      xaxis={"dtick": 1}, height=160 + 70 * (n_layers + 1), width=760)
    return fig


def faithfulness_figure(frame: pd.DataFrame, summary: dict[str, Any], *, title: str = "Faithfulness",
                        model: str | None = None) -> Any:
    """The faithfulness curve: f of the top-k edges against the fraction of scored edges kept (log scale), with its
    95% interval as a band, f = 1 (the full model) and f = 0 (every scored edge ablated) as dotted lines, and the
    declared circuit, when measured, as a diamond with its interval. CPR and CMD are in the legend.

    Args:
        frame: :meth:`vlmbind.analysis.circuits.Faithfulness.to_frame`'s table.
        summary: :meth:`vlmbind.analysis.circuits.Faithfulness.summary`.
        title: the figure title.
        model: shown on the title's second line.
    """
    import plotly.graph_objects as go

    top = frame[frame["circuit"] == "top"]
    n = int(frame["n"].max()) if len(frame) else None
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(top["fraction"]) + list(top["fraction"])[::-1],
                             y=list(top["ci_high"]) + list(top["ci_low"])[::-1], fill="toself",
                             fillcolor="rgba(31,119,180,0.18)", line={"width": 0}, hoverinfo="skip",
                             name="95% CI"))
    fig.add_trace(go.Scatter(
        x=top["fraction"], y=top["f"], mode="lines+markers", line={"color": "#1f77b4"},
        customdata=np.column_stack([top["edges"], top["ci_low"], top["ci_high"]]),
        hovertemplate="%{customdata[0]} edges (%{x:.3%})<br>f = %{y:.3f} [%{customdata[1]:.3f}, "
                      "%{customdata[2]:.3f}]<extra></extra>",
        name=f"top edges: CPR {summary['cpr']:.3f}, CMD {summary['cmd']:.3f}"))
    declared = frame[frame["circuit"] == "declared"]
    for row in declared.itertuples():
        fig.add_trace(go.Scatter(
            x=[row.fraction], y=[row.f], mode="markers", marker={"symbol": "diamond", "size": 12, "color": "#d62728"},
            error_y={"type": "data", "symmetric": False, "array": [row.ci_high - row.f],
                     "arrayminus": [row.f - row.ci_low]},
            hovertemplate=f"declared circuit, {row.edges} edges<br>f = {row.f:.3f}<extra></extra>",
            name=f"declared circuit: f = {row.f:.3f}"))
    for level in (0.0, 1.0):
        fig.add_hline(y=level, line={"dash": "dot", "color": "#888"})
    fig.update_layout(title=full_title(title, model, n),
                      xaxis={"type": "log", "title": "fraction of scored edges kept"},
                      yaxis={"title": "faithfulness f"}, template="plotly_white", width=720, height=440,
                      legend={"orientation": "h", "y": -0.25})
    return fig
