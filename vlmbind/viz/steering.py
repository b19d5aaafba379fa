"""Figures of attention steering, from its tables: efficacy of the steered heads beside the same push on random heads
(``SteerResult.arms_frame()``), and each head's gaze (``SteerResult.gaze``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from .figures import head_heatmap

ARM_NAMES = {"steered": "steered heads", "random_heads": "random heads (same push)", "clean": "no steering"}


def steering_figure(arms: pd.DataFrame, *, model: str, heads: Sequence[str], to: str, positions: str) -> Any:
    """Per arm, the share of scenes whose answer names the object steered to, with its 95% interval, and the share
    that still names the original answer."""
    import plotly.graph_objects as go

    names = [ARM_NAMES.get(a, a) for a in arms["arm"]]
    fig = go.Figure()
    for column, low, high, label in (("efficacy", "efficacy_low", "efficacy_high", "names the object steered to"),
                                     ("original", "original_low", "original_high", "names the original answer")):
        fig.add_trace(go.Bar(
            x=names, y=arms[column], name=label,
            error_y={"type": "data", "symmetric": False, "array": arms[high] - arms[column],
                     "arrayminus": arms[column] - arms[low]},
            text=[f"{v:.3f} (n={n})" for v, n in zip(arms[column], arms["n"])],
            hovertemplate="%{x}<br>%{text}<extra></extra>",
        ))
    fig.update_layout(title=f"Attention steering of {', '.join(heads)} to {to} (at {positions})<br><sup>{model}; "
                            "bars: share of scenes, whiskers: 95% Wilson intervals</sup>",
                      yaxis_title="share of scenes", yaxis_range=[0, 1.05], barmode="group", template="plotly_white")
    return fig


def gaze_figure(gaze: pd.DataFrame, *, model: str, n: int) -> Any:
    """Layers x heads: the share of each head's image attention, at the last prompt token, on the object the answer
    names, above chance (that object's share of the image tokens)."""
    frame = gaze.assign(excess=gaze["gaze"] - gaze["chance"])
    return head_heatmap(frame, "excess", title="Gaze: share of image attention on the answer's object, minus chance",
                        model=model, n=n, signed=True)
