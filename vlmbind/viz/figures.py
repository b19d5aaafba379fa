"""Plotly figure builders shared by the CLI, the result classes and the notebooks, plus atomic file writing.

Design: every builder takes plain data (a tidy pandas frame, numpy arrays, a PIL image) and returns a
``plotly.graph_objects.Figure``; none of them knows about models, so a result class, the CLI and a notebook draw the
same figure from the same table. Hover text always shows the exact stored value (``repr`` of the float), because
reading a number off a colour bar is not good enough to compare heads. Colour scales are chosen from the data: a
diverging scale centred at zero for signed values (effects, differences), a sequential one for non-negative values
(attention mass, probabilities). plotly is imported by the builders when they run, so importing vlmbind does not
load it. Images travel inside the figure as PNG data URIs, and plotly.js (about 4.8 MB) is written once per results
folder as ``plotly.min.js`` and referenced by a relative path, so every HTML file written here is readable offline
and a folder of ten figures holds one copy of the library (see :func:`shared_plotlyjs`). Writers go through a temporary file in the target directory and ``os.replace``, so a reader
never sees a half-written file and an interrupted run leaves the previous file intact.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from PIL import Image

from ..core.errors import InputError
from ..core.io import write_bytes_atomic, write_text_atomic  # noqa: F401  (re-exported by vlmbind.viz)

if TYPE_CHECKING:
    import plotly.graph_objects as go

SEQUENTIAL_SCALE = "Viridis"
DIVERGING_SCALE = "RdBu_r"


PLOTLYJS_FILE = "plotly.min.js"
_PLOTLYJS_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("vlmbind_plotlyjs_root", default=None)


@contextlib.contextmanager
def shared_plotlyjs(root: str | os.PathLike) -> Iterator[Path]:
    """While active, every page written below ``root`` references one ``root/plotly.min.js`` (a run that writes
    figures into several sub-folders, such as the demo, keeps one copy of plotly.js instead of one per folder)."""
    resolved = Path(root).resolve()
    token = _PLOTLYJS_ROOT.set(resolved)
    try:
        yield resolved
    finally:
        _PLOTLYJS_ROOT.reset(token)


def plotlyjs_bundle() -> str:
    """plotly.js as shipped with the installed plotly (the file :func:`plotlyjs_src` writes)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def plotlyjs_src(page: str | os.PathLike, *, write: bool = True) -> str:
    """The relative ``src`` by which the HTML page at ``page`` loads plotly.js: ``plotly.min.js`` in the active
    :func:`shared_plotlyjs` root when the page lies below it, else beside the page. With ``write``, the bundle is
    written there unless an identical one is already present."""
    page = Path(page).resolve()
    root = _PLOTLYJS_ROOT.get()
    folder = root if root is not None and page.parent.is_relative_to(root) else page.parent
    bundle = folder / PLOTLYJS_FILE
    if write:
        text = plotlyjs_bundle()
        if not bundle.is_file() or bundle.stat().st_size != len(text.encode("utf-8")) or \
                bundle.read_text(encoding="utf-8") != text:
            write_text_atomic(text, bundle)
    return Path(os.path.relpath(bundle, page.parent)).as_posix()


def write_html_atomic(
    fig: go.Figure, path: str | os.PathLike, *, include_plotlyjs: bool | str = "shared", div_id: str | None = None
) -> Path:
    """Write ``fig`` as an HTML page, atomically.

    Args:
        fig: the figure.
        path: the destination ``.html`` file.
        include_plotlyjs: ``"shared"`` (default) loads ``plotly.min.js`` from the results folder, written there
            once (:func:`plotlyjs_src`; readable offline as long as the folder stays together); ``True`` embeds
            plotly.js in the page (about 4.8 MB per page); ``"cdn"`` links it online.
        div_id: the plot's ``<div>`` id; defaults to one derived from the file name, so the same figure gives the
            same bytes (plotly would otherwise draw a random id).

    Returns:
        The destination as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    if include_plotlyjs == "shared":
        path.parent.mkdir(parents=True, exist_ok=True)
        include_plotlyjs = plotlyjs_src(path)
    html = fig.to_html(include_plotlyjs=include_plotlyjs, full_html=True, div_id=div_id or f"vlmbind-{path.stem}")
    return write_text_atomic(html, path)


# ------------------------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------------------------
def full_title(title: str, model: str | None, n: int | None) -> str:
    extras = [part for part in (model, None if n is None else f"n={n}") if part]
    # model and n go on a smaller second line so long titles are not clipped by narrow figures
    return f"{title}<br><sup>{', '.join(extras)}</sup>" if extras else title


def head_heatmap(
    frame: pd.DataFrame,
    value: str = "mass",
    *,
    title: str = "Per-head value",
    model: str | None = None,
    n: int | None = None,
    signed: bool | None = None,
    mark: str | None = None,
) -> go.Figure:
    """A layers x heads heatmap of one value per attention head.

    Args:
        frame: tidy table with integer columns ``layer`` and ``head`` and the column ``value``; one row per
            (layer, head). Heads missing from the table are drawn blank.
        value: the column to draw.
        title: the figure title; ``model`` and ``n`` are added on a second line as ``model, n=...``.
        model: the model name shown in the title.
        n: the number of examples the values summarise, shown in the title.
        signed: the value is signed by nature (mediation scores): a diverging scale centred at zero even when every
            value happens to be positive. None: diverging when any value is negative, sequential otherwise.
        mark: a boolean column; its true cells get a ring (mediation scores: heads significant after correction),
            and the title says what the ring means.

    Returns:
        The figure: x axis ``head``, y axis ``layer`` (layer 0 at the bottom), hover text with the exact values.

    Raises:
        InputError: a column is missing, the table is empty, or a (layer, head) occurs twice.
    """
    import plotly.graph_objects as go

    missing = [c for c in ("layer", "head", value) if c not in frame.columns]
    if missing:
        raise InputError(
            f"head_heatmap: the frame has no column(s) {missing}; it has {list(frame.columns)}. "
            f"Pass a tidy table with columns layer, head, {value}."
        )
    if frame.empty:
        raise InputError("head_heatmap: the frame is empty; pass at least one (layer, head) row")
    dup = frame.duplicated(["layer", "head"])
    if dup.any():
        first = frame.loc[dup, ["layer", "head"]].iloc[0].tolist()
        raise InputError(
            f"head_heatmap: (layer, head) {tuple(int(v) for v in first)} occurs more than once; aggregate the frame "
            f"first, e.g. frame.groupby(['layer', 'head'], as_index=False)[{value!r}].mean()"
        )
    n_layers = int(frame["layer"].max()) + 1
    n_heads = int(frame["head"].max()) + 1
    z = np.full((n_layers, n_heads), np.nan)
    z[frame["layer"].to_numpy(int), frame["head"].to_numpy(int)] = frame[value].to_numpy(float)
    # repr gives the shortest string that round-trips to the same float: the exact stored value
    text = [["" if np.isnan(v) else repr(float(v)) for v in row] for row in z]
    if signed is None:
        signed = bool(np.nanmin(z) < 0)
    heatmap = go.Heatmap(
        z=z,
        x=list(range(n_heads)),
        y=list(range(n_layers)),
        text=text,
        hovertemplate="layer %{y}<br>head %{x}<br>" + value + " = %{text}<extra></extra>",
        colorscale=DIVERGING_SCALE if signed else SEQUENTIAL_SCALE,
        zmid=0.0 if signed else None,
        colorbar={"title": {"text": value}},
        xgap=1,
        ygap=1,
    )
    fig = go.Figure(heatmap)
    if mark is not None:
        marked = frame[frame[mark].astype(bool)]
        fig.add_trace(go.Scatter(x=marked["head"].to_numpy(int), y=marked["layer"].to_numpy(int), mode="markers",
                                 marker={"symbol": "circle-open", "size": 14, "color": "black", "line": {"width": 2}},
                                 name=f"{mark} ({len(marked)})", hoverinfo="skip", showlegend=True))
        fig.update_layout(legend={"orientation": "h", "y": -0.25})
        title = f"{title}; rings: {mark} ({len(marked)} of {len(frame)} heads)"
    fig.update_layout(
        title={"text": full_title(title, model, n)},
        xaxis={"title": {"text": "head"}, "dtick": 1 if n_heads <= 32 else None},
        yaxis={"title": {"text": "layer"}, "dtick": 1 if n_layers <= 48 else None},
        template="plotly_white",
        width=max(560, 40 * n_heads + 220),
        height=max(360, 28 * n_layers + 160),
    )
    return fig


def image_data_uri(image: Image.Image) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URI (lossless, embeddable in offline HTML)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def attention_overlay(
    image: Image.Image,
    grid_positions: np.ndarray,
    boxes: np.ndarray,
    weights: np.ndarray,
    title: str,
    *,
    max_line: float = 5.0,
    value_name: str = "attention",
) -> go.Figure:
    """Image-token cells outlined by a weight, drawn over the image they cover; the image itself is never tinted,
    so the objects keep their true colours (this is a tool about colour binding).

    Args:
        image: the original image (pixel coordinates of ``boxes`` refer to it).
        grid_positions: ``rows cols`` sequence positions of the grid's tokens (shown on hover); any shape ``S``.
        boxes: ``rows cols 4`` pixel boxes ``(x0, y0, x1, y1)`` of the tokens in the original image (``S 4``).
        weights: ``rows cols`` one weight per token, e.g. one head's attention from the last token (``S``).
        title: the figure title.
        max_line: outline width in pixels of the cell with the largest weight; a cell's width is proportional to
            its weight (at least a hairline), and its colour comes from a sequential scale.
        value_name: what the weights are, for the colour bar and hover text.

    Returns:
        The figure: the image as background in pixel coordinates (y down), one unfilled rectangle per token whose
        outline colour (sequential scale from 0 to the largest weight) and width grow with the weight, heavier
        cells drawn last so they stay on top, and an invisible marker at each cell centre carrying the hover text
        (row, col, position, exact weight) and the colour bar.

    Raises:
        InputError: the shapes of positions, boxes and weights do not agree, or a weight is not finite.
    """
    import plotly.graph_objects as go
    from plotly.colors import sample_colorscale

    positions = np.asarray(grid_positions)
    boxes = np.asarray(boxes, dtype=float)
    weights = np.asarray(weights, dtype=float)
    if positions.ndim == 0 or boxes.shape != (*positions.shape, 4) or weights.shape != positions.shape:
        raise InputError(
            f"attention_overlay: grid_positions {positions.shape}, boxes {boxes.shape} and weights {weights.shape} "
            f"do not agree; pass positions and weights of one shape S and boxes of shape S + (4,)"
        )
    if not np.isfinite(weights).all():
        raise InputError("attention_overlay: weights contain NaN or inf; pass finite weights")
    width, height = image.size
    flat_pos = positions.reshape(-1)
    flat_box = boxes.reshape(-1, 4)
    flat_w = weights.reshape(-1)
    cells = np.argwhere(np.ones(positions.shape, dtype=bool))  # row-major, like the reshape(-1) above
    top = float(flat_w.max()) if flat_w.size and flat_w.max() > 0 else 1.0
    scaled = np.clip(flat_w / top, 0.0, 1.0)
    colours = sample_colorscale(SEQUENTIAL_SCALE, list(scaled))

    fig = go.Figure()
    # each outline is inset a little from its cell's edge so neighbouring outlines stay apart
    inset = (0.06 * np.minimum(flat_box[:, 2] - flat_box[:, 0], flat_box[:, 3] - flat_box[:, 1])).tolist()
    shapes = [
        {
            "type": "rect", "xref": "x", "yref": "y", "x0": b[0] + d, "y0": b[1] + d, "x1": b[2] - d, "y1": b[3] - d,
            "fillcolor": "rgba(0,0,0,0)", "layer": "above",
            "line": {"width": max(0.5, max_line * a), "color": c if a > 0.05 else "rgba(90,90,90,0.35)"},
        }
        for b, c, a, d in zip(flat_box.tolist(), colours, scaled.tolist(), inset)
    ]
    order = np.argsort(scaled, kind="stable")
    shapes = [shapes[i] for i in order]
    cell_labels = [", ".join(str(int(i)) for i in cell) for cell in cells]
    fig.add_trace(
        go.Scatter(
            x=((flat_box[:, 0] + flat_box[:, 2]) / 2).tolist(),
            y=((flat_box[:, 1] + flat_box[:, 3]) / 2).tolist(),
            mode="markers",
            marker={
                "size": 1, "opacity": 0, "color": flat_w.tolist(), "colorscale": SEQUENTIAL_SCALE,
                "cmin": 0.0, "cmax": top, "showscale": True, "colorbar": {"title": {"text": value_name}},
            },
            customdata=[[lbl, int(p), repr(float(w))] for lbl, p, w in zip(cell_labels, flat_pos, flat_w)],
            hovertemplate="cell (%{customdata[0]})<br>position %{customdata[1]}<br>"
            + value_name + " = %{customdata[2]}<extra></extra>",
            showlegend=False,
        )
    )
    fig.update_layout(
        title={"text": title},
        images=[{
            "source": image_data_uri(image), "xref": "x", "yref": "y", "x": 0, "y": 0, "sizex": width,
            "sizey": height, "sizing": "stretch", "layer": "below",
        }],
        shapes=shapes,
        xaxis={"range": [0, width], "showgrid": False, "zeroline": False, "title": {"text": "x (pixels)"}},
        # y grows downwards, as in the image and in the TokenIndex boxes
        yaxis={"range": [height, 0], "showgrid": False, "zeroline": False, "scaleanchor": "x",
               "title": {"text": "y (pixels)"}},
        template="plotly_white",
        width=640,
        height=600,
    )
    return fig


def share_colour_scale(figures: list[go.Figure]) -> float:
    """Give the heatmaps of ``figures`` one symmetric colour scale, ``+-`` the largest |value| among them, and say
    so in each title: heads of conditions side by side are then compared by colour honestly (a condition whose
    scores are a thousand times smaller looks pale instead of as vivid as the others). Hover keeps exact values.

    Returns:
        The shared bound.
    """
    bound = 0.0
    for fig in figures:
        for trace in fig.data:
            if trace.type == "heatmap" and trace.z is not None:
                z = np.asarray(trace.z, dtype=float)
                if np.isfinite(z).any():
                    bound = max(bound, float(np.nanmax(np.abs(z))))
    bound = bound or 1.0
    for fig in figures:
        for trace in fig.data:
            if trace.type == "heatmap":
                trace.update(zmin=-bound, zmax=bound, zmid=0.0)
        title = fig.layout.title.text or ""
        fig.update_layout(title={"text": f"{title}<br><sup>colour scale shared by the figures beside it: "
                                         f"+-{bound:.3g}</sup>"})
    return bound


def frame_to_html_table(frame: pd.DataFrame, *, float_format: str = "{:.4f}", index: bool = True) -> str:
    """A small HTML table for reports (values escaped; floats formatted with ``float_format``)."""
    return frame.to_html(
        index=index, escape=True, border=0, classes="vb-table", float_format=float_format.format, na_rep=""
    )


__all__ = [
    "attention_overlay",
    "frame_to_html_table",
    "head_heatmap",
    "image_data_uri",
    "write_bytes_atomic",
    "write_html_atomic",
    "shared_plotlyjs",
    "share_colour_scale",
    "plotlyjs_src",
    "PLOTLYJS_FILE",
    "write_text_atomic",
]
