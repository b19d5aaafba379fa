"""Thresholded attention-centroid tracking (PbP, docs/methods.md section 3): where each layer looks while a point is written.

For every Point-to-Answer example the model generates its trace greedily; at each generation step the attention of
every layer and head from the query position to the image tokens is captured through vlmbind's hook layer
(``blocks.*.attn.hook_pattern``) and laid on the image-token grid as a map A (``rows x cols``). A map is thresholded
(keep A where A > 0.9 max A, else 0) and reduced to its centroid ``(sum x A / sum A, sum y A / sum A)`` with x the
column and y the row index of a cell's centre. The centroids of the tokens that make up one generated point are
averaged, mapped to the point's coordinate frame and compared with the point: RMSE per layer, for head-averaged maps
(maps averaged over heads first, then thresholded) and per head.

Design: generation keeps the key/value cache and a thin :class:`~vlmbind.engine.hooks.HookSession` subclass stores only
the newest query row of every attention pattern (the prefill's last position, then each cached step's single row), so
memory grows with the trace, not with its square; tests check these rows against HF ``output_attentions`` of one full
forward on the same sequence. Which query belongs to a token is a choice (``query``): ``"emit"`` (default) takes the
step that produces the token (the query is the previous position: the model is deciding what to write), ``"self"``
the step where the token is the query. Which tokens belong to a point: every generated token whose decoded characters
overlap the point's span from ``point_spans`` (for ``(3, 1)`` that is ``' ('``, ``'3'``, ``','``, ``' 1'``, ``')'``
with the usual byte-level BPE: the whole point from ``(`` to ``)``, the leading space riding along). Tokens are
located by decoding the generated ids prefix by prefix, never by re-tokenising text. Grid coordinates go to the point
frame through pixels: a token cell's centre in original-image pixels (linear between cell centres, exact for the
regular grids every adapter builds), then the stimulus canvas' cells, ``x = px / cell_width - 0.5``. RMSE is the root
of the mean squared Euclidean distance between centroid and generated point, in canvas cells. All-zero maps (an
ablated head, say) give NaN centroids that are counted and left out, never a crash.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch
from PIL import Image
from tqdm.auto import tqdm

from ..core.choices import TRACK_QUERIES as QUERIES
from ..core.choices import TRACK_TASKS as TASKS
from ..core.errors import InputError, close_matches
from ..core.io import json_default, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..core.tokens import decode_generated, decoded_spans, hidden_ids
from ..engine.decoding import generate_ids
from ..engine.hooks import LastQuerySession
from ..stimuli import counting, visual_search
from ..stimuli.answers import UnknownFrameError, canvas_geometry, pixels_to_cells, to_canvas
from ..stimuli.points import PointSpan, pointing_spans
from ..viz import write_html_atomic
from ..viz.tracking import points_figure, rmse_figure
from .evaluation import max_new_tokens_for, training_defaults

__all__ = [
    "CentroidResult", "TrackResult", "centroid", "grid_to_pixels", "pixels_to_canvas", "grid_to_point_frame",
    "point_token_steps", "track", "tracking_dataset", "QUERIES", "TOKEN_RULE",
]

PATTERN_SITES = "blocks.*.attn.hook_pattern"
# a cross-attention family (Llama-3.2-Vision): the image is only the cross-attention layers' keys
CROSS_PATTERN_SITES = "blocks.*.cross_attn.hook_pattern"
TOKEN_RULE = ("every generated token whose decoded characters overlap the point's span, i.e. the tokens from the one "
              "holding '(' to the one holding ')' (a leading space in the '(' token rides along); in a Molmo2 tag "
              "with several points, the tokens of each point's 'idx x y' triple")
POINT_FRAME = "stimulus canvas cells: x = column, y = row, 0-based, cell centres at integers"


# ----------------------------------------------------------------------------------------------------------------
# Centroids and coordinate frames (pure functions)
# ----------------------------------------------------------------------------------------------------------------
class CentroidResult(NamedTuple):
    """Centroids of a stack of maps.

    Attributes:
        xy: ``... 2`` centroid ``(x, y)`` of each map in grid units (x = column, y = row, cell centres at integers);
            NaN for maps with nothing left after thresholding (all-zero maps).
        n_empty: how many maps were empty.
    """

    xy: np.ndarray
    n_empty: int


def centroid(weights: Any, threshold: float = 0.9) -> CentroidResult:
    """Thresholded centroid of each ``rows x cols`` map: keep A where A > ``threshold`` * max A, else 0.

    Args:
        weights: ``... rows cols`` non-negative maps (any leading dims, e.g. ``layers heads``); numpy or torch.
        threshold: fraction of each map's maximum a cell must exceed to be kept, in ``[0, 1)``.

    Returns:
        :class:`CentroidResult` with ``xy`` ``... 2`` and the count of empty maps.

    Raises:
        InputError: fewer than two dims, an empty grid, a threshold outside [0, 1), non-finite or negative weights.
    """
    if isinstance(weights, torch.Tensor):
        weights = weights.detach().to("cpu", torch.float64).numpy()
    a = np.asarray(weights, dtype=np.float64)
    if a.ndim < 2 or a.shape[-1] == 0 or a.shape[-2] == 0:
        raise InputError(f"centroid needs maps of shape (..., rows, cols) with rows, cols >= 1, got {a.shape}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 1.0:
        raise InputError(f"threshold must be a fraction in [0, 1) of each map's maximum, got {threshold!r}")
    if not np.isfinite(a).all():
        raise InputError("centroid: the maps contain NaN or inf; pass finite attention weights")
    if (a < 0).any():
        raise InputError("centroid: the maps contain negative values; attention weights are non-negative")
    rows, cols = a.shape[-2:]
    top = a.max(axis=(-2, -1), keepdims=True)
    # strict '>' so that an all-zero map keeps nothing (and becomes NaN) instead of dividing 0 by 0 silently
    kept = np.where(a > threshold * top, a, 0.0)
    total = kept.sum(axis=(-2, -1))
    empty = total <= 0
    safe = np.where(empty, 1.0, total)
    x = (kept.sum(-2) * np.arange(cols)).sum(-1) / safe
    y = (kept.sum(-1) * np.arange(rows)).sum(-1) / safe
    xy = np.stack([np.where(empty, np.nan, x), np.where(empty, np.nan, y)], -1)
    return CentroidResult(xy, int(np.count_nonzero(empty)))


def grid_to_pixels(xy: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Grid coordinates -> pixel coordinates in the original image.

    Args:
        xy: ``... 2`` grid coordinates (x = column, y = row, cell centres at integers; fractions allowed, NaN passes).
        boxes: ``rows cols 4`` the grid's token boxes ``(x0, y0, x1, y1)`` in original-image pixels.

    Returns:
        ``... 2`` pixels: linear between the centres of neighbouring cells (exact for a regular grid).
    """
    xy = np.asarray(xy, dtype=np.float64)
    boxes = np.asarray(boxes, dtype=np.float64)
    rows, cols = boxes.shape[:2]
    centre_x = (boxes[0, :, 0] + boxes[0, :, 2]) / 2  # one per column
    centre_y = (boxes[:, 0, 1] + boxes[:, 0, 3]) / 2  # one per row
    return np.stack([_interp(xy[..., 0], centre_x), _interp(xy[..., 1], centre_y)], -1)


def _interp(t: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Piecewise-linear map from index coordinates to ``centres`` (extrapolated linearly outside)."""
    n = len(centres)
    if n == 1:
        return np.where(np.isnan(t), np.nan, centres[0])
    idx = np.clip(np.floor(np.nan_to_num(t, nan=0.0)), 0, n - 2).astype(int)
    frac = t - idx
    return centres[idx] + frac * (centres[idx + 1] - centres[idx])


def pixels_to_canvas(pxy: np.ndarray, canvas: Any) -> np.ndarray:
    """Original-image pixels -> canvas cell coordinates (x = column, y = row, cell centres at integers).

    Args:
        pxy: ``... 2`` pixel coordinates.
        canvas: a :class:`~vlmbind.stimuli.Canvas` or its ``to_dict()`` (``image_size``, ``grid``).
    """
    pxy = np.asarray(pxy, dtype=np.float64)
    return np.stack(pixels_to_cells(pxy[..., 0], pxy[..., 1], canvas), -1)


def grid_to_point_frame(xy: np.ndarray, boxes: np.ndarray, canvas: Any) -> np.ndarray:
    """Grid coordinates -> the stimulus points' frame (canvas cells), through pixel centres."""
    return pixels_to_canvas(grid_to_pixels(xy, boxes), canvas)


def _canvas_geometry(canvas: Any) -> tuple[float, tuple[int, int]]:
    """``(image_size, (rows, cols))`` of a Canvas or its dict form."""
    size, rows, cols = canvas_geometry(canvas)
    return size, (rows, cols)


def point_token_steps(tokenizer: Any, ids: Sequence[int]) -> tuple[list[tuple[list[int], PointSpan]], int]:
    """The generated points and the token steps that make up each (see ``TOKEN_RULE``).

    Args:
        tokenizer: the model's tokenizer.
        ids: the generated token ids.

    Returns:
        ``[(steps, span), ...]`` in order of appearance (each span holds one point, in its format's own frame), and
        the number of point-bearing spans that were skipped (tags holding no point or several points, whose tokens
        cannot be attributed to one point).
    """
    ids = [int(i) for i in ids]
    hidden = hidden_ids(tokenizer)
    shown = [k for k, t in enumerate(ids) if t not in hidden]  # Qwen's box markers stay: the box is their span
    spans, text = decoded_spans(tokenizer, [ids[k] for k in shown])
    out, skipped = [], 0
    for span in pointing_spans(text):
        if len(span.points) == 1:
            pieces = [(span.start, span.end, span)]
        elif span.parts is not None:  # Molmo2: one tag, each point's triple its own characters
            pieces = [(a, b, span._replace(start=a, end=b, points=[p], parts=None))
                      for (a, b), p in zip(span.parts, span.points)]
        else:
            skipped += 1
            continue
        for start, end, piece in pieces:
            steps = [shown[j] for j, (a, b) in enumerate(spans) if b > a and a < end and b > start]
            if steps:
                out.append((steps, piece))
            else:
                skipped += 1
    return out, skipped


# ----------------------------------------------------------------------------------------------------------------
# Capture
# ----------------------------------------------------------------------------------------------------------------
def _trace(vlm: Any, batch: Any, max_new_tokens: int, query: str) -> list[tuple[list[int], np.ndarray]]:
    """Greedy generation with every layer's attention captured, one map per generated token.

    Args:
        vlm: the model.
        batch: a prepared (left-padded) batch.
        max_new_tokens: tokens to generate at most.
        query: ``"emit"`` (the step producing the token) or ``"self"`` (the step where the token is the query).

    Returns:
        Per row: the generated ids up to (not including) the first end-of-sequence token, and ``T L H P`` float32
        attention from each token's query to the ``P`` prompt positions (image tokens all lie in the prompt); on a
        cross-attention family ``T L H K`` to the ``K`` image keys of the cross-attention layers (zero on the other
        layers).
    """
    cross = vlm.adapter.cross_attention_layers()
    sites = vlm.sites(CROSS_PATTERN_SITES if cross else PATTERN_SITES)
    extra = 1 if query == "self" else 0  # a token's own query runs one step after it is produced
    session = LastQuerySession(vlm.adapter, sites, [*vlm.active], index=batch.index)
    out = generate_ids(vlm, batch, max_new_tokens + extra, session)
    p = batch.seq_len
    new = out[:, p:].cpu()
    steps = len(session.captured[sites[0].name])
    if cross:
        # L x [steps x (B H K)] over the image keys, the same every step; a self-attention layer attends to no
        # image key: its maps are zero (empty, NaN centroids)
        captured = {site.layer: torch.stack(session.captured[site.name], 1) for site in sites}
        blank = torch.zeros_like(next(iter(captured.values())))
        per_layer = [captured.get(layer, blank) for layer in range(vlm.n_layers)]
    else:
        # L x [steps x (B H K_s)] -> B steps L H P: keys beyond the prompt are generated text, never image tokens
        per_layer = [torch.stack([s[:, :, :p] for s in session.captured[site.name]], 1) for site in sites]
    maps = torch.stack(per_layer, 2).numpy()
    eos = vlm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    rows = []
    for r in range(len(batch)):
        ids = new[r].tolist()[:max_new_tokens]
        cut = next((k for k, t in enumerate(ids) if t in eos), len(ids))
        offset = 1 if query == "self" else 0
        cut = min(cut, steps - offset)
        rows.append((ids[:cut], maps[r, offset : offset + cut]))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------------------------------
def _nanmean(a: np.ndarray, axis: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=RuntimeWarning)  # all-NaN slices stay NaN on purpose
        return np.nanmean(a, axis=axis)


def _rmse(centroids: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``N ... 2`` centroids against ``N 2`` points -> (RMSE ``...``, points used ``...``), NaN centroids left out."""
    d2 = ((centroids - points.reshape(points.shape[0], *([1] * (centroids.ndim - 2)), 2)) ** 2).sum(-1)
    ok = np.isfinite(d2)
    n = ok.sum(0)
    total = np.where(ok, d2, 0.0).sum(0)
    return np.where(n > 0, np.sqrt(total / np.maximum(n, 1)), np.nan), n


def _nan_array(value: Any, shape_tail: tuple[int, ...]) -> np.ndarray:
    """Nested lists with None for NaN (as :func:`_json_xy` wrote them) -> a float array (``0 ...`` when empty)."""
    array = np.array(value, dtype=float)  # numpy turns None into NaN for float arrays
    return array.reshape(0, *shape_tail) if array.size == 0 else array


def _json_xy(a: np.ndarray) -> Any:
    """Nested lists with NaN as None (JSON has no NaN)."""
    if a.ndim == 1:
        return [None if not math.isfinite(v) else float(v) for v in a.tolist()]
    return [_json_xy(x) for x in a]


@register_result
@dataclass
class TrackResult(Result):
    """Attention-centroid tracking of one model on Point-to-Answer examples.

    Attributes:
        model: the model's name.
        task: ``count`` or ``search``.
        threshold: the centroid threshold (fraction of a map's maximum).
        query: ``emit`` or ``self`` (see the module docstring).
        grid: the name of the image-token grid the maps were laid on.
        canvas: the stimulus canvas (``image_size``, ``grid``): the point frame.
        points: ``N 2`` every generated point (point frame).
        mean_centroids: ``N L 2`` centroid of head-averaged maps, averaged over the point's tokens (point frame).
        head_centroids: ``N L H 2`` per-head centroids, averaged over the point's tokens (point frame).
        point_example: ``N`` index into ``examples`` of each point.
        point_tokens: per point, the generated-token steps used.
        examples: per example: ``id``, ``output`` (generated text), ``target_points`` (the stimulus' points),
            ``token_text`` (each generated token decoded).
        n_empty_maps: token-level maps with nothing left after thresholding (left out).
        skipped: ids of examples whose traces held no usable point.
        skipped_spans: point-bearing spans that could not be attributed to one point.
        seconds: wall time.
        images: the examples' images (for :meth:`example_figure`; not saved).
        saved_rmse: a result loaded from its files (:meth:`load`): ``rmse.csv`` as saved.
        prompt_format: ``raw`` or ``chat``.
        point_frames: the coordinate frame each point format was read in (None: unknown, refused).
    """

    kind = "track"
    reproduced_files = ("rmse.csv", "centroids.json", "rmse.html")
    marker_files = ("rmse.csv", "centroids.json")
    figure_name = "rmse"

    model: str
    task: str
    threshold: float
    query: str
    grid: str
    canvas: dict[str, Any]
    points: np.ndarray
    mean_centroids: np.ndarray
    head_centroids: np.ndarray
    point_example: np.ndarray
    point_tokens: list[list[int]]
    examples: list[dict[str, Any]]
    n_empty_maps: int = 0
    skipped: list[str] = field(default_factory=list)
    skipped_spans: int = 0
    seconds: float = 0.0
    images: list[Image.Image] = field(default_factory=list, repr=False)
    saved_rmse: pd.DataFrame | None = field(default=None, repr=False, compare=False)
    prompt_format: str = "raw"
    point_frames: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TrackResult:
        """The result from ``centroids.json`` (points ``N 2``, centroids ``N L 2`` and ``N L H 2``), checked against
        ``rmse.csv`` so a stale pair of files is not silently re-rendered; images are not saved.

        Raises:
            InputError: a file is unreadable or lacks what its writer writes, or the two files disagree.
        """
        directory = Path(directory)
        rmse = read_csv_columns(directory / "rmse.csv", ("layer", "head", "rmse", "n_points"))
        centroids = read_json_object(directory / "centroids.json")
        require_keys(centroids, ("model", "task", "threshold", "query", "grid", "canvas", "examples"),
                     directory / "centroids.json")
        try:
            result = cls._from_saved(centroids, rmse)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{str(directory / 'centroids.json')!r} lacks {exc} or holds a bad value; re-run "
                             f"vlmbind track") from None
        rebuilt = result.to_frame()
        same = (len(rebuilt) == len(rmse)
                and np.allclose(rebuilt["rmse"].to_numpy(float), rmse["rmse"].to_numpy(float), equal_nan=True))
        if not same:
            raise InputError(f"{str(directory / 'centroids.json')!r} and rmse.csv disagree (different runs?); re-run "
                             f"vlmbind track to write both")
        return result

    @classmethod
    def _from_saved(cls, centroids: dict[str, Any], rmse: pd.DataFrame) -> TrackResult:
        heads = rmse[rmse["head"].astype(str) != "mean"]
        n_layers = int(rmse["layer"].max()) + 1 if len(rmse) else 0
        n_heads = int(heads["head"].astype(int).max()) + 1 if len(heads) else 0
        points, means, per_head, owner, tokens, examples = [], [], [], [], [], []
        for i, ex in enumerate(centroids["examples"]):
            examples.append({k: v for k, v in ex.items() if k != "points"})
            for p in ex.get("points", []):
                points.append(p["point"])
                means.append(p["centroid_mean"])
                per_head.append(p["centroid_heads"])
                owner.append(i)
                tokens.append(p["tokens"])
        return cls(
            model=centroids["model"], task=centroids["task"], threshold=float(centroids["threshold"]),
            query=centroids["query"], grid=centroids["grid"], canvas=centroids["canvas"],
            points=_nan_array(points, (2,)), mean_centroids=_nan_array(means, (n_layers, 2)),
            head_centroids=_nan_array(per_head, (n_layers, n_heads, 2)), point_example=np.array(owner, dtype=int),
            point_tokens=tokens, examples=examples, saved_rmse=rmse,
            prompt_format=centroids.get("prompt_format", "raw"), point_frames=centroids.get("point_frames", {}),
        )

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        table = self.saved_rmse if self.saved_rmse is not None else self.to_frame()
        return {"rmse": self.figure}, {"rmse.csv": table}

    @property
    def n_points(self) -> int:
        return int(self.points.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.head_centroids.shape[1])

    @property
    def n_heads(self) -> int:
        return int(self.head_centroids.shape[2])

    @property
    def rmse_mean(self) -> np.ndarray:
        """``L`` RMSE of the head-averaged maps' centroids."""
        return _rmse(self.mean_centroids, self.points)[0]

    @property
    def rmse_heads(self) -> np.ndarray:
        """``L H`` RMSE of each head's centroids."""
        return _rmse(self.head_centroids, self.points)[0]

    @property
    def valley_layer(self) -> int | None:
        """The layer with the lowest head-averaged RMSE (None when no layer has a finite RMSE)."""
        r = self.rmse_mean
        return int(np.nanargmin(r)) if np.isfinite(r).any() else None

    def best_heads(self) -> list[tuple[int, int, float]]:
        """Per layer, ``(layer, head, rmse)`` of the head with the lowest RMSE."""
        out = []
        for layer, row in enumerate(self.rmse_heads):
            if np.isfinite(row).any():
                h = int(np.nanargmin(row))
                out.append((layer, h, float(row[h])))
        return out

    def to_frame(self) -> pd.DataFrame:
        """Tidy table: ``layer, head, rmse, n_points``; ``head`` is ``"mean"`` for head-averaged maps, else an int."""
        mean, n_mean = _rmse(self.mean_centroids, self.points)
        heads, n_heads = _rmse(self.head_centroids, self.points)
        rows = []
        for layer in range(self.n_layers):
            rows.append({"layer": layer, "head": "mean", "rmse": float(mean[layer]), "n_points": int(n_mean[layer])})
            rows += [{"layer": layer, "head": h, "rmse": float(heads[layer, h]), "n_points": int(n_heads[layer, h])}
                     for h in range(self.n_heads)]
        return pd.DataFrame(rows, columns=["layer", "head", "rmse", "n_points"])

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model, "task": self.task, "n_examples": len(self.examples), "n_points": self.n_points,
            "threshold": self.threshold, "query": self.query, "token_rule": TOKEN_RULE, "point_frame": POINT_FRAME,
            "grid": self.grid, "canvas": self.canvas, "valley_layer": self.valley_layer,
            "rmse_mean": _json_xy(self.rmse_mean),
            "best_heads": [{"layer": l, "head": h, "rmse": r} for l, h, r in self.best_heads()],
            "n_empty_maps": self.n_empty_maps, "skipped_examples": self.skipped, "skipped_spans": self.skipped_spans,
            "seconds": self.seconds, "prompt_format": self.prompt_format, "point_frames": self.point_frames,
        }

    def centroids_json(self) -> dict[str, Any]:
        """Per-example points and centroids (JSON-serialisable; NaN as null)."""
        examples = []
        for i, ex in enumerate(self.examples):
            pts = np.flatnonzero(self.point_example == i)
            examples.append({
                **ex,
                "points": [{
                    "point": [float(v) for v in self.points[j]],
                    "tokens": self.point_tokens[j],
                    "centroid_mean": _json_xy(self.mean_centroids[j]),
                    "centroid_heads": _json_xy(self.head_centroids[j]),
                } for j in pts],
            })
        return {"model": self.model, "task": self.task, "threshold": self.threshold, "query": self.query,
                "token_rule": TOKEN_RULE, "point_frame": POINT_FRAME, "grid": self.grid, "canvas": self.canvas,
                "layout": {"centroid_mean": "layer -> [x, y]", "centroid_heads": "layer -> head -> [x, y]"},
                "prompt_format": self.prompt_format, "point_frames": self.point_frames, "examples": examples}

    def figure(self) -> Any:
        """Plotly figure: RMSE by layer for head-averaged maps, every head's RMSE, and the best head per layer."""
        return rmse_figure(self.rmse_heads, self.rmse_mean, self.best_heads(), task=self.task,
                           threshold=self.threshold, query=self.query, valley_layer=self.valley_layer,
                           model=self.model, n_points=self.n_points)

    def example_figure(self, i: int, layer: int | None = None) -> Any:
        """One example's generated points and its head-averaged centroids at ``layer`` (default: the valley layer),
        drawn over the image, each centroid joined to its point.

        Raises:
            InputError: ``i`` or ``layer`` out of range, or the result holds no images (e.g. rebuilt from JSON).
        """
        if not 0 <= i < len(self.examples):
            raise InputError(f"example {i} is out of range; this result has examples 0..{len(self.examples) - 1}")
        if not self.images:
            raise InputError("this result holds no images; example_figure needs the result track() returned")
        layer = self.valley_layer if layer is None else layer
        if layer is None or not 0 <= layer < self.n_layers:
            raise InputError(f"layer {layer} is out of range; the model has layers 0..{self.n_layers - 1}")
        size, (rows, cols) = _canvas_geometry(self.canvas)
        sel = np.flatnonzero(self.point_example == i)
        ex = self.examples[i]
        return points_figure(self.images[i], self.points[sel], self.mean_centroids[sel, layer], size=size, rows=rows,
                             cols=cols, layer=layer, example_id=ex["id"], output=ex["output"], model=self.model)

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``rmse.csv``, ``rmse.html``, ``centroids.json`` and ``summary.json`` atomically."""
        out = Path(out)
        write_text_atomic(self.to_frame().to_csv(index=False), out / "rmse.csv")
        write_html_atomic(self.figure(), out / "rmse.html")
        write_text_atomic(json.dumps(self.centroids_json(), indent=1, default=json_default) + "\n",
                          out / "centroids.json")
        write_text_atomic(json.dumps(self.summary(), indent=2, default=json_default) + "\n", out / "summary.json")
        return out


# ----------------------------------------------------------------------------------------------------------------
# track
# ----------------------------------------------------------------------------------------------------------------
def _pick_grid(index: Any, grid: str | None) -> Any:
    """The grid the maps are laid on: an image-token grid, or on a family whose image is only cross-attention keys
    (``index.key_grids``), a key grid."""
    grids = [g for g in (index.grids or index.key_grids) if g.image == 0]
    for g in grids:
        if grid is None or g.name == grid:
            return g
    names = [g.name for g in grids]
    raise InputError(f"no image-token grid {grid!r}.{close_matches(str(grid), names)} Grids: {names}")


def track(vlm: Any, dataset: Any, *, threshold: float = 0.9, query: str = "emit", grid: str | None = None,
          canvas: Any = None, batch_size: int = 8, max_new_tokens: int | None = None,
          point_frame: str | None = None, progress: bool = False) -> TrackResult:
    """Attention-centroid tracking on Point-to-Answer examples (see the module docstring).

    Args:
        vlm: a loaded VLM (its active interventions apply to the generation).
        dataset: a :class:`~vlmbind.stimuli.Dataset` of ``count`` or ``search`` examples made with
            ``regime="p2a"`` (e.g. from :func:`tracking_dataset`), or a list of such examples with ``canvas``.
        threshold: the centroid threshold, a fraction of each map's maximum in [0, 1).
        query: ``"emit"`` (the step producing each token) or ``"self"`` (the step where it is the query).
        grid: the image-token grid to lay maps on (default: the image's first grid).
        canvas: the stimulus canvas (default: the data set's ``params["canvas"]``).
        batch_size: examples generated together (left-padded).
        max_new_tokens: trace length limit (default: each batch's longest expected answer plus 4 tokens).
        point_frame: the coordinate frame of points whose format does not say it and the model does not declare
            (a key of :data:`vlmbind.stimuli.answers.FRAMES`; see :meth:`vlmbind.engine.vlm.VLM.point_frames`).
        progress: show a progress bar.

    Returns:
        A :class:`TrackResult`.

    Raises:
        InputError: bad arguments, examples that are not Point-to-Answer count / search, images that do not match
            the canvas, or no example whose trace holds a point.
        UnknownFrameError: a trace wrote points in a format whose coordinate frame is unknown for this model (a
            number compared with canvas cells would mean nothing); pass ``point_frame``.
    """
    start = time.perf_counter()
    if query not in QUERIES:
        raise InputError(f"query {query!r} is not one of {QUERIES}.{close_matches(str(query), QUERIES)}")
    centroid(np.zeros((1, 1)), threshold)  # validates the threshold before any generation
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
        raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    examples = list(dataset)
    if not examples:
        raise InputError("the data set is empty: nothing to track")
    bad = [e for e in examples if e.task not in TASKS or e.fields.get("regime") != "p2a"]
    if bad:
        e = bad[0]
        raise InputError(f"example {e.id!r} is task {e.task!r}, regime {e.fields.get('regime')!r}; tracking needs "
                         f"Point-to-Answer count or search examples (counting(..., regime='p2a'))")
    if canvas is None:
        canvas = getattr(dataset, "params", {}).get("canvas")
        if canvas is None:
            raise InputError("pass canvas=... (the stimuli's Canvas): a plain list of examples does not carry it")
    canvas = canvas.to_dict() if hasattr(canvas, "to_dict") else dict(canvas)
    size, _ = _canvas_geometry(canvas)
    wrong = [e for e in examples if e.image.size != (int(size), int(size))]
    if wrong:
        raise InputError(f"example {wrong[0].id!r} has a {wrong[0].image.size} image but the canvas is "
                         f"{int(size)} px; pass the canvas the stimuli were drawn on")

    frames = vlm.point_frames(point_frame)
    tokenizer = vlm.adapter.tokenizer
    points, means, heads, owner, tokens, records, images = [], [], [], [], [], [], []
    skipped, skipped_spans, n_empty, grid_name = [], 0, 0, None
    bar = tqdm(total=len(examples), desc=f"track {examples[0].task}", disable=not progress)
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo : lo + batch_size]
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk])
        budget = max_new_tokens or max(max_new_tokens_for(e, tokenizer) for e in chunk)
        for r, (e, (ids, maps)) in enumerate(zip(chunk, _trace(vlm, batch, budget, query))):
            g = _pick_grid(batch.index[r], grid)
            grid_name = g.name
            found, n_skip = point_token_steps(tokenizer, ids)
            skipped_spans += n_skip
            i = len(records)
            records.append({"id": e.id, "output": decode_generated(tokenizer, ids),
                            "target_points": e.fields.get("points", []),
                            "token_text": [tokenizer.decode([t]) for t in ids]})
            images.append(e.image)
            if not found:
                skipped.append(e.id)
            on_grid = maps[..., g.positions]  # T L H rows cols
            resized = vlm.adapter.resized_size(batch.inputs, r)
            try:
                found = [(steps, to_canvas([span], frames, canvas, image_size=e.image.size, resized_size=resized)[0])
                         for steps, span in found]
            except UnknownFrameError as err:
                raise UnknownFrameError(f"example {e.id!r}: {err} (output {records[-1]['output']!r})") from None
            for steps, point in found:
                m = on_grid[steps].astype(np.float64)  # k L H rows cols
                mean_c = centroid(m.mean(2), threshold)  # heads averaged first, then thresholded
                head_c = centroid(m, threshold)
                n_empty += mean_c.n_empty + head_c.n_empty
                means.append(grid_to_point_frame(_nanmean(mean_c.xy, 0), g.boxes, canvas))  # L 2
                heads.append(grid_to_point_frame(_nanmean(head_c.xy, 0), g.boxes, canvas))  # L H 2
                points.append(point)
                owner.append(i)
                tokens.append([int(s) for s in steps])
        bar.update(len(chunk))
    bar.close()
    if not points:
        raise InputError(f"none of the {len(examples)} traces held a point (first output: "
                         f"{records[0]['output']!r}); is {vlm.name} a Point-to-Answer model?")
    return TrackResult(
        model=vlm.name, task=examples[0].task, threshold=float(threshold), query=query, grid=str(grid_name),
        canvas=canvas, points=np.asarray(points, dtype=np.float64), mean_centroids=np.stack(means),
        head_centroids=np.stack(heads), point_example=np.asarray(owner), point_tokens=tokens, examples=records,
        n_empty_maps=n_empty, skipped=skipped, skipped_spans=skipped_spans, seconds=time.perf_counter() - start,
        images=images, prompt_format=vlm.active_prompt_format, point_frames=frames,
    )


def tracking_dataset(vlm: Any, task: str, n: int, seed: int = 1, *, objects: Any = None, **kwargs: Any) -> Any:
    """Point-to-Answer ``count`` or ``search`` stimuli on the model's training canvas and pools.

    Object counts default to the model's training range for the task (organisms record it); search displays
    default to ``present=1.0`` (an absent target gives ``none no``: nothing to track).

    Raises:
        InputError: unknown task or impossible stimulus parameters.
    """
    if task not in TASKS:
        raise InputError(f"track needs Point-to-Answer traces: task must be one of {TASKS}, got {task!r}."
                         f"{close_matches(str(task), TASKS)}")
    kwargs = training_defaults(vlm, task, kwargs)
    kwargs["regime"] = "p2a"
    if objects is None:
        options = (getattr(vlm, "training", None) or {}).get("task_options", {}).get(task, {})
        objects = tuple(options["objects"]) if options.get("objects") else None
    if task == "count":
        if objects is not None:
            kwargs["objects"] = objects
        return counting(n, seed, **kwargs)
    kwargs.pop("colours", None), kwargs.pop("shapes", None)
    kwargs.setdefault("present", 1.0)
    if objects is not None:
        kwargs["n_objects"] = objects
    return visual_search(n, seed, **kwargs)
