"""Figures of the position-ID edit and of entropy repair, from their rows (``EditResult.rows`` / ``RepairResult.rows``:
one dict per alpha and arm)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def repair_traces(rows: Sequence[Mapping[str, Any]], alphas: Sequence[float], high_accuracy: float) -> list[Any]:
    """Low-entropy accuracy per alpha with the correct ID and the wrong-cell control, and the unedited high-entropy
    accuracy as a reference line."""
    import plotly.graph_objects as go

    out = []
    for arm, dash in (("repair", "solid"), ("control", "dash")):
        frame = [r for r in rows if r["arm"] == arm]
        out.append(go.Scatter(
            x=[r["alpha"] for r in frame], y=[r["accuracy"] for r in frame], mode="lines+markers",
            name="low-entropy accuracy, correct ID" if arm == "repair" else "low-entropy accuracy, wrong-cell ID",
            line={"dash": dash}, text=[repr(r["accuracy"]) for r in frame],
            hovertemplate="alpha %{x}<br>accuracy %{text}<extra></extra>",
        ))
    out.append(go.Scatter(x=[min(alphas), max(alphas)], y=[high_accuracy] * 2, mode="lines",
                          name="high-entropy accuracy (unedited)", line={"dash": "dot", "color": "gray"}))
    return out


def repair_figure(rows: Sequence[Mapping[str, Any]], alphas: Sequence[float], high_accuracy: float, *, model: str,
                  heads: Sequence[str], n_used: int) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure(repair_traces(rows, alphas, high_accuracy))
    fig.update_layout(title=f"Entropy repair (oracle: correct cell's ID), heads {', '.join(heads)}<br><sup>{model}, "
                            f"n={n_used}</sup>", xaxis_title="alpha", yaxis_title="accuracy",
                      yaxis_range=[-0.02, 1.02], template="plotly_white")
    return fig


def edit_traces(rows: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Efficacy per alpha, the empty-cell and random-direction controls, and the share that still names the missing
    object."""
    import plotly.graph_objects as go

    out = []
    for arm, column, name, dash in (("edit", "efficacy", "efficacy (switch to t)", "solid"),
                                    ("control", "efficacy", "control: empty-cell ID, names t", "dash"),
                                    ("random_direction", "efficacy", "control: random direction, names t", "dashdot"),
                                    ("edit", "original", "edit: still names the missing object", "dot")):
        frame = [r for r in rows if r["arm"] == arm]
        if not frame:  # results saved before the random-direction control
            continue
        out.append(go.Scatter(
            x=[r["alpha"] for r in frame], y=[r[column] for r in frame], mode="lines+markers", name=name,
            line={"dash": dash}, text=[repr(r[column]) for r in frame],
            hovertemplate="alpha %{x}<br>share %{text}<extra></extra>",
        ))
    return out


def edit_figure(rows: Sequence[Mapping[str, Any]], *, model: str, heads: Sequence[str], n_used: int,
                repair: Mapping[str, Any] | None = None) -> Any:
    """Efficacy against alpha with the control; with ``repair`` (``rows``, ``alphas``, ``high_accuracy``,
    ``n_used``) the repair curve in a second panel."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    title = f"Position-ID edit at heads {', '.join(heads)}<br><sup>{model}, n={n_used}</sup>"
    if repair is None:
        fig = go.Figure(edit_traces(rows))
        fig.update_xaxes(title_text="alpha")
        fig.update_yaxes(title_text="share of examples", range=[-0.02, 1.02])
    else:
        fig = make_subplots(rows=1, cols=2, subplot_titles=(
            "edit: switch to t", f"entropy repair (oracle), n={repair['n_used']}"))
        for trace in edit_traces(rows):
            fig.add_trace(trace, row=1, col=1)
        for trace in repair_traces(repair["rows"], repair["alphas"], repair["high_accuracy"]):
            fig.add_trace(trace, row=1, col=2)
        fig.update_xaxes(title_text="alpha")
        fig.update_yaxes(title_text="share of examples", range=[-0.02, 1.02], row=1, col=1)
        fig.update_yaxes(title_text="accuracy", range=[-0.02, 1.02], row=1, col=2)
    fig.update_layout(title=title, template="plotly_white")
    return fig
