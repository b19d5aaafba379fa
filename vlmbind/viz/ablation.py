"""The ablation study's figure: accuracy per arm, from ``vlmbind ablate``'s ``results.json``."""

from __future__ import annotations

from typing import Any

from .figures import full_title


def ablation_figure(data: dict[str, Any]) -> Any:
    """Accuracy per ablation arm (``vlmbind ablate`` writes no figure; this is its publication figure).

    Args:
        data: the ``results.json`` of ``vlmbind ablate`` (:meth:`AblationResult.summary`).

    Returns:
        A bar chart: one bar per arm (random arms per seed), exact accuracy and heads on hover.
    """
    import plotly.graph_objects as go

    arms = data["arms"]
    labels = [a["arm"] if a.get("seed") is None else f"{a['arm']} (seed {a['seed']})" for a in arms]
    colours = {"clean": "#7f7f7f", "top": "#d62728", "random": "#1f77b4", "bottom": "#2ca02c"}
    fig = go.Figure(go.Bar(
        x=labels, y=[a["accuracy"] for a in arms], marker={"color": [colours.get(a["arm"], "#9467bd") for a in arms]},
        customdata=[[repr(float(a["accuracy"])), ", ".join(a.get("heads", [])) or "none", a["n"]] for a in arms],
        hovertemplate="%{x}<br>accuracy = %{customdata[0]}<br>heads %{customdata[1]}<br>n = %{customdata[2]}"
                      "<extra></extra>",
    ))
    n = max((int(a["n"]) for a in arms), default=0)
    title = (f"Ablating {data['k']} heads ({data['mode']}{', renormalised' if data['renormalize'] else ''}), "
             f"task {data['task']}")
    fig.update_layout(title={"text": full_title(title, data["model"], n)}, xaxis={"title": {"text": "arm"}},
                      yaxis={"title": {"text": "accuracy"}, "range": [0, 1.02]}, template="plotly_white",
                      width=640, height=420)
    return fig
