"""The ablation study's figure: accuracy per arm, from ``vlmbind ablate``'s ``results.json``."""

from __future__ import annotations

from typing import Any

from .figures import full_title


def ablation_figure(data: dict[str, Any]) -> Any:
    """Accuracy per ablation arm (``vlmbind ablate`` writes no figure; this is its publication figure).

    Args:
        data: the ``results.json`` of ``vlmbind ablate`` (:meth:`AblationResult.summary`).

    Returns:
        A bar chart: one bar per arm (random arms per seed), exact accuracy and heads on hover; with
        ``data["intervals"]`` (``[(low, high)]`` per arm) error bars, and with ``data["random_arms"]`` (each random
        arm's mean and interval over seeds; results without it: ``data["random"]``, the ``random`` arm's) a dashed
        line across that arm's bars.
    """
    import plotly.graph_objects as go

    arms = data["arms"]
    bottom = {"abs": "bottom (smallest |score|)", "score": "bottom (lowest score)"}.get(data.get("bottom_by", "score"))
    labels = [(bottom if a["arm"] == "bottom" else a["arm"]) if a.get("seed") is None
              else f"{a['arm']} (seed {a['seed']})" for a in arms]
    colours = {"clean": "#7f7f7f", "top": "#d62728", "random": "#1f77b4", "random_same_layers": "#17becf",
               "random_all": "#9467bd", "bottom": "#2ca02c"}
    intervals = data.get("intervals")
    error_y = None
    if intervals:
        error_y = {"type": "data", "symmetric": False, "color": "#444", "thickness": 1.2,
                   "array": [hi - a["accuracy"] for a, (_, hi) in zip(arms, intervals)],
                   "arrayminus": [a["accuracy"] - lo for a, (lo, _) in zip(arms, intervals)]}
    fig = go.Figure(go.Bar(
        x=labels, y=[a["accuracy"] for a in arms], marker={"color": [colours.get(a["arm"], "#9467bd") for a in arms]},
        error_y=error_y,
        customdata=[[repr(float(a["accuracy"])), ", ".join(a.get("heads", [])) or "none", a["n"]] for a in arms],
        hovertemplate="%{x}<br>accuracy = %{customdata[0]}<br>heads %{customdata[1]}<br>n = %{customdata[2]}"
                      "<extra></extra>",
    ))
    means = data.get("random_arms") or ({"random": data["random"]} if data.get("random") else {})
    for arm, mean in means.items():
        if mean.get("seeds", 0) < 2:
            continue
        # the arm's mean over seeds with its t-interval, as a line across its bars
        xs = [lab for lab, a in zip(labels, arms) if a["arm"] == arm]
        fig.add_trace(go.Scatter(
            x=xs, y=[mean["accuracy"]] * len(xs), mode="lines",
            line={"color": colours.get(arm, "#9467bd"), "dash": "dash"},
            name=f"{arm} mean {mean['accuracy']:.3f} [{mean['low']:.2f}, {mean['high']:.2f}]", hoverinfo="name"))
        fig.update_layout(legend={"orientation": "h", "y": -0.25})
    n = max((int(a["n"]) for a in arms), default=0)
    title = (f"Ablating {data['k']} heads ({data['mode']}{', renormalised' if data['renormalize'] else ''}), "
             f"task {data['task']}")
    fig.update_layout(title={"text": full_title(title, data["model"], n)}, xaxis={"title": {"text": "arm"}},
                      yaxis={"title": {"text": "accuracy"}, "range": [0, 1.02]}, template="plotly_white",
                      width=640, height=420)
    return fig
