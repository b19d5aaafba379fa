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
