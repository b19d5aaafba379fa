"""Relevancy maps over image and prompt tokens, scored by deletion / insertion curves and an attention knockout.

**The target.** Every map explains one logit: the one of the example's expected answer's first token at the last
prompt position (``target="answer"``, the default; the result says whether the model's greedy token is that one),
or of the model's own greedy first token (``target="greedy"``).

**Maps** (one value per position of the prompt, image and text tokens together; positions are counted in the
example's own prompt, padding removed):

* ``gradient_attention``: Chefer et al. 2021 ("Generic Attention-model Explainability"), as LVLM-Interpret uses
  it. ``R = I``; for every softmax-attention layer of the language model in order, ``Abar = mean_heads((dA *
  A)^+)`` with ``A`` the layer's attention pattern (``blocks.{l}.attn.hook_pattern``, captured with its graph) and
  ``dA`` the target logit's gradient with respect to it, then ``R = R + Abar R``; the map is the row of ``R`` at the
  last prompt position. Its entry at that position itself holds the identity's 1.
* ``rollout``: Abnar & Zuidema 2020. The product over layers of ``0.5 mean_heads(A) + 0.5 I`` (rows renormalised),
  later layers on the left; the row of the last position.
* ``input_x_gradient``: at every position, the language model's input embedding (the residual entering layer 0,
  ``blocks.0.hook_resid_pre``: the text embeddings with the projector's image features in place) times the target
  logit's gradient with respect to it, summed over the hidden dimension (signed).

The maps cover the language model only (the vision tower's attention is not rolled in). On a hybrid model (Qwen3.5)
the linear-attention layers have no softmax pattern: the two attention maps skip them (as identities), so they miss
the mixing those layers do; ``input_x_gradient`` sees every layer. A family whose image never enters the sequence
(Llama-3.2-Vision) is refused (:class:`~vlmbind.core.errors.NoImageTokensError`).

**Cells.** A map's image part is read on one image-token grid (the image's first grid, or ``grid``): each cell's
value is the map at that cell's token; the cells' pixel boxes lay it on the image.

**Deletion / insertion** (Petsiuk et al. 2018, RISE). The cells are ordered by a map's value, highest first. For each
fraction ``f`` of a grid from 0 to 1 (``fractions`` steps), deletion paints the pixel boxes of the first
``round(f * cells)`` cells with the image's background (its most common colour: the stimuli's white canvas) and
insertion starts from an image of that colour and paints those cells' original pixels back; the model runs on each
image with the same prompt and the target's probability (softmax over the vocabulary) is recorded, with the logit
difference between the target and the best other token of the vocabulary. The area under each curve is the
trapezoid over ``f``. Lower deletion AUC and higher insertion AUC are better. Every map is compared with random maps
(``random_maps`` seeded random orders per example, drawn from ``default_rng([seed, example, draw])``; their AUCs are
averaged per example): the paired difference map - random per example, averaged, with a 95% percentile bootstrap
interval over examples (2000 resamples, seeded).

**Knockout.** The language model's attention to the image tokens of the map's top ``k`` cells is blocked
(:class:`~vlmbind.engine.interventions.BlockAttention`: those keys' scores set to the lowest value before the
softmax) in every softmax layer and head, from the queries ``knockout_queries`` names: ``"text"`` (default: every
position of the prompt that is not an image token, so the text reads nothing from the region while the image tokens
still attend to each other), ``"last"`` (the last prompt position only) or ``"all"`` (every position). ``k``
defaults to the number of cells the target object covers (cells whose box overlaps the object's box), ``1`` for an
example without a known target object; ``knockout_k`` fixes it. The same knockout of ``k`` random cells (the first
``k`` of each random order) is the baseline. Reported: the drop in the target's probability and the share of
examples whose greedy token changes, each with a bootstrap interval, and their paired differences to random.

**Object shares.** Where the examples name their target object (``query`` and ``scene`` stimuli:
``fields["target"]`` and ``objects``), the share of each map's image mass (absolute values summed over the grid's
cells) on the target object's cells, the mean share on each other object's cells, and the uniform share
(target cells / all cells): a map that only finds "the objects", any of them, puts as much on the others.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image
from tqdm.auto import tqdm

from ..core.choices import RELEVANCY_KNOCKOUT_QUERIES as KNOCKOUT_QUERIES
from ..core.choices import RELEVANCY_METHODS as METHODS
from ..core.choices import RELEVANCY_TARGETS as TARGETS
from ..core.choices import RELEVANCY_TASKS as TASKS
from ..core.errors import InputError, NoImageTokensError, close_matches
from ..core.io import json_default, write_bytes_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..core.userfiles import UserFileError
from ..engine.interventions import BlockAttention
from ..stimuli.tasks import generate
from ..viz import write_html_atomic
from ..viz.relevancy import curves_figure, relevancy_figure
from .evaluation import stimulus_defaults

__all__ = [
    "KNOCKOUT_QUERIES", "METHODS", "RANDOM", "TARGETS", "TASKS", "RelevancyResult", "background_colour",
    "bootstrap_mean", "curve_scores", "deletion_insertion", "paint_cells", "relevancy", "relevancy_dataset", "relevancy_maps",
]

RANDOM = "random"
KINDS = ("deletion", "insertion")
RESAMPLES = 2000
LEVEL = 0.95
N_SHOWN = 4
BETTER = {"deletion_auc": "lower is better", "insertion_auc": "higher is better"}
MAP_COLUMNS = ("example", "method", "position", "role", "row", "col", "token", "value")
CURVE_COLUMNS = ("method", "draw", "example", "kind", "fraction", "cells", "prob", "logit_diff")
KNOCKOUT_COLUMNS = ("method", "draw", "example", "k", "prob", "drop", "changed", "top_id")


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------
def _check_methods(methods: Any) -> tuple[str, ...]:
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = tuple(methods)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        hint = close_matches(str(bad[0]), METHODS) if bad else ""
        raise InputError(f"methods {list(bad) if bad else []} are not relevancy methods (choose from "
                         f"{', '.join(METHODS)}).{hint}")
    if len(set(methods)) != len(methods):
        raise InputError(f"methods {list(methods)} name a method twice")
    return methods


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InputError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise InputError(f"{name} {value!r} is not one of {', '.join(choices)}.{close_matches(str(value), choices)}")
    return str(value)


def _check_image_tokens(vlm: Any) -> None:
    if not vlm.adapter.image_tokens_in_sequence:
        raise NoImageTokensError(
            f"relevancy maps image tokens of the language model's sequence, and this {vlm.adapter.display_name} "
            f"model has none (the image reaches it through the cross-attention layers "
            f"{vlm.adapter.cross_attention_layers()} only)")


def _softmax_layers(adapter: Any) -> list[int]:
    """The language model's self-attention layers with a softmax pattern (hybrid models: not the linear ones)."""
    cross = set(adapter.cross_attention_layers())
    return [layer for layer in adapter.pattern_layers() if layer not in cross]


# ----------------------------------------------------------------------------------------------------------------
# Maps
# ----------------------------------------------------------------------------------------------------------------
def _open_graph(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook on layer 0: its input joins the autograd graph even where no parameter requires a gradient
    (a frozen model), so every pattern downstream has one."""
    if args:
        x = args[0]
        return (x + torch.zeros_like(x, requires_grad=True), *args[1:]), kwargs
    x = kwargs["hidden_states"]
    return args, {**kwargs, "hidden_states": x + torch.zeros_like(x, requires_grad=True)}


def relevancy_maps(vlm: Any, batch: Any, targets: Sequence[int], methods: Sequence[str] = METHODS
                   ) -> list[dict[str, np.ndarray]]:
    """The maps of each row of ``batch`` (see the module docstring).

    Args:
        vlm: the model (its active interventions apply).
        batch: a prepared (left-padded) batch.
        targets: one token id per row, whose logit at the row's last position the maps explain.
        methods: some of :data:`METHODS`.

    Returns:
        Per row, method -> float64 array over the row's non-padding positions, in order.

    Raises:
        InputError: unknown methods or a wrong number of targets.
        NoImageTokensError: a family whose image never enters the sequence.
    """
    methods = _check_methods(methods)
    _check_image_tokens(vlm)
    rows = len(batch)
    if len(targets) != rows:
        raise InputError(f"relevancy_maps: {len(targets)} targets for {rows} rows; pass one token id per row")
    adapter = vlm.adapter
    layers = _softmax_layers(adapter)
    patterns = [f"blocks.{layer}.attn.hook_pattern" for layer in layers]
    resid = "blocks.0.hook_resid_pre"
    want_patterns = "gradient_attention" in methods or "rollout" in methods
    want_grad = "gradient_attention" in methods or "input_x_gradient" in methods
    sites = (patterns if want_patterns else []) + ([resid] if "input_x_gradient" in methods else [])
    grads: dict[str, torch.Tensor] = {}
    if want_grad:
        handle = adapter.layer(0).register_forward_pre_hook(_open_graph, with_kwargs=True)
        try:
            with torch.enable_grad():
                out = vlm.run(batch, sites=sites, grad=True, logits_at=[-1])
                picked = torch.as_tensor(list(targets), dtype=torch.long, device=out.logits.device)
                metric = out.logits[torch.arange(rows, device=out.logits.device), -1, picked].float().sum()
                names = [s for s in sites if s in out.cache]
                found = torch.autograd.grad(metric, [out.cache[s] for s in names], allow_unused=True)
        finally:
            handle.remove()
        grads = {s: (torch.zeros_like(out.cache[s]) if g is None else g).detach() for s, g in zip(names, found)}
        cache = {s: v.detach() for s, v in out.cache.items()}
        del out, metric, found
    else:
        cache = vlm.run(batch, sites=sites, logits_at=[-1]).cache if sites else {}

    maps = []
    for r, ti in enumerate(batch.index):
        keep = np.flatnonzero(ti.roles != "pad")
        n = len(keep)
        last = int(np.flatnonzero(keep == ti.last_position)[0])
        idx = torch.as_tensor(keep, dtype=torch.long)
        eye = torch.eye(n, dtype=torch.float64)
        row: dict[str, np.ndarray] = {}
        if "rollout" in methods:
            relevance = eye.clone()
            for site in patterns:
                a = cache[site][r].index_select(1, idx.to(cache[site].device)).index_select(2, idx.to(
                    cache[site].device))
                mixed = 0.5 * a.float().mean(0).to("cpu", torch.float64) + 0.5 * eye
                mixed = mixed / mixed.sum(-1, keepdim=True)
                relevance = mixed @ relevance
            row["rollout"] = relevance[last].numpy()
        if "gradient_attention" in methods:
            relevance = eye.clone()
            for site in patterns:
                device = cache[site].device
                a = cache[site][r].index_select(1, idx.to(device)).index_select(2, idx.to(device)).float()
                g = grads[site][r].index_select(1, idx.to(device)).index_select(2, idx.to(device)).float()
                cam = (g * a).clamp_min(0).mean(0).to("cpu", torch.float64)
                relevance = relevance + cam @ relevance
            row["gradient_attention"] = relevance[last].numpy()
        if "input_x_gradient" in methods:
            x = cache[resid][r].index_select(0, idx.to(cache[resid].device)).double()
            g = grads[resid][r].index_select(0, idx.to(cache[resid].device)).double()
            row["input_x_gradient"] = (x * g).sum(-1).cpu().numpy()
        maps.append({m: row[m] for m in methods})
    return maps


# ----------------------------------------------------------------------------------------------------------------
# Cells, painting, scoring images
# ----------------------------------------------------------------------------------------------------------------
def _grid(index: Any, name: str | None) -> Any:
    grids = [g for g in index.grids if g.image == 0]
    for g in grids:
        if name is None or g.name == name:
            return g
    if not grids:
        raise NoImageTokensError("the prompt holds no image-token grid of its image; relevancy lays maps on one")
    names = [g.name for g in grids]
    raise InputError(f"no image-token grid {name!r}.{close_matches(str(name), names)} Grids: {names}")


def background_colour(image: Image.Image) -> tuple[int, int, int]:
    """The most common pixel colour of ``image`` (the stimuli's canvas: white)."""
    arr = np.asarray(image.convert("RGB"), dtype=np.int64).reshape(-1, 3)
    code = (arr[:, 0] << 16) | (arr[:, 1] << 8) | arr[:, 2]
    top = int(np.bincount(code).argmax())
    return (top >> 16) & 255, (top >> 8) & 255, top & 255


def _pixel_box(box: Sequence[float], width: int, height: int) -> tuple[int, int, int, int]:
    x0, y0, x1, y1 = (int(np.floor(float(v) + 0.5)) for v in box)
    return max(0, x0), max(0, y0), min(width, x1), min(height, y1)


def paint_cells(image: Image.Image, boxes: np.ndarray, cells: Sequence[int], background: Sequence[int],
                kind: str) -> Image.Image:
    """The image of one point of a curve.

    Args:
        image: the original image.
        boxes: ``n 4`` pixel boxes of the grid's cells (flat, row-major).
        cells: the cells (flat indices) deleted (``kind="deletion"``: painted with ``background`` on the original)
            or inserted (``kind="insertion"``: their original pixels on an image of ``background``).
        background: the RGB colour of the blank.
        kind: ``deletion`` or ``insertion``.
    """
    arr = np.asarray(image.convert("RGB"))
    height, width = arr.shape[:2]
    mask = np.zeros((height, width), dtype=bool)
    for c in cells:
        x0, y0, x1, y1 = _pixel_box(boxes[int(c)], width, height)
        mask[y0:y1, x0:x1] = True
    blank = np.empty_like(arr)
    blank[...] = np.asarray(background, dtype=arr.dtype)
    out = np.where(mask[..., None], blank, arr) if kind == "deletion" else np.where(mask[..., None], arr, blank)
    return Image.fromarray(out)


def _score_rows(vlm: Any, images: list[Image.Image], prompts: list[str], targets: list[int],
                interventions: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One forward: per row the target's probability, its logit minus the best other token's, and the top token.

    ``interventions`` is a function of the prepared batch returning the interventions (knockouts need its
    positions)."""
    batch = vlm.prepare(images, prompts)
    edits = interventions(batch) if interventions is not None else ()
    logits = vlm.run(batch, interventions=edits, logits_at=[-1]).logits[:, -1].float()
    rows = torch.arange(len(targets), device=logits.device)
    picked = torch.as_tensor(targets, dtype=torch.long, device=logits.device)
    probs = torch.softmax(logits, -1)[rows, picked]
    target_logit = logits[rows, picked]
    others = logits.clone()
    others[rows, picked] = float("-inf")
    diff = target_logit - others.max(-1).values
    return (probs.double().cpu().numpy(), diff.double().cpu().numpy(), logits.argmax(-1).cpu().numpy())


def _auc(fractions: np.ndarray, values: np.ndarray) -> float:
    return float(np.trapezoid(values, fractions))


def bootstrap_mean(values: Sequence[float], seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL
                   ) -> tuple[float, float, float, int]:
    """``(mean, low, high, n)``: the mean of the finite ``values`` and its percentile bootstrap interval over them
    (``resamples`` resamples drawn from ``default_rng(seed)``); NaN for no value, the value itself for one."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    mean = float(v.mean())
    if n == 1:
        return mean, mean, mean, 1
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, n, size=(resamples, n))].mean(1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return mean, float(low), float(high), n


def curve_scores(curves: pd.DataFrame) -> pd.DataFrame:
    """Per ``method, draw, example, kind``: the area under the curve (trapezoid over the fractions)."""
    rows = []
    for (method, draw, example, kind), part in curves.groupby(["method", "draw", "example", "kind"], sort=False):
        part = part.sort_values("fraction")
        rows.append({"method": method, "draw": int(draw), "example": int(example), "kind": kind,
                     "auc": _auc(part["fraction"].to_numpy(float), part["prob"].to_numpy(float))})
    return pd.DataFrame(rows, columns=["method", "draw", "example", "kind", "auc"])


def _curves(vlm: Any, examples: Sequence[Any], orders: Sequence[dict[tuple[str, int], np.ndarray]],
            targets: Sequence[int], boxes: Sequence[np.ndarray], backgrounds: Sequence[Sequence[int]],
            grid_fracs: np.ndarray, batch_size: int, progress: bool) -> pd.DataFrame:
    """The curves' table; one forward per distinct image (an example's ``kind`` with a set of cells: the endpoints
    and any prefix two orders share run once)."""
    jobs: dict[tuple[int, str, tuple[int, ...]], int] = {}
    points = []
    for i, own in enumerate(orders):
        n_cells = len(boxes[i])
        for (method, draw), order in own.items():
            for kind in KINDS:
                for f in grid_fracs:
                    k = int(np.floor(f * n_cells + 0.5))
                    key = (i, kind, tuple(sorted(int(c) for c in order[:k])))
                    jobs.setdefault(key, len(jobs))
                    points.append((method, draw, i, kind, float(f), k, jobs[key]))
    keys = list(jobs)
    prob = np.zeros(len(keys))
    diff = np.zeros(len(keys))
    bar = tqdm(total=len(keys), desc="relevancy curves", disable=not progress)
    for lo in range(0, len(keys), batch_size):
        part = keys[lo: lo + batch_size]
        images = [paint_cells(examples[i].image, boxes[i], cells, backgrounds[i], kind) for i, kind, cells in part]
        p, dl, _ = _score_rows(vlm, images, [examples[i].prompt for i, _, _ in part], [targets[i] for i, _, _ in part])
        prob[lo: lo + len(part)], diff[lo: lo + len(part)] = p, dl
        bar.update(len(part))
    bar.close()
    return pd.DataFrame(
        [{"method": m, "draw": d, "example": i, "kind": kind, "fraction": f, "cells": k, "prob": float(prob[j]),
          "logit_diff": float(diff[j])} for m, d, i, kind, f, k, j in points], columns=list(CURVE_COLUMNS))


def deletion_insertion(vlm: Any, examples: Sequence[Any], orders: Sequence[dict[str, Sequence[int]]],
                       targets: Sequence[int], *, fractions: int = 10, grid: str | None = None,
                       batch_size: int = 16) -> pd.DataFrame:
    """Deletion and insertion curves of given cell orders (see the module docstring).

    Args:
        vlm: the model.
        examples: objects with ``image`` and ``prompt``.
        orders: per example, name -> the grid's cells (flat, row-major indices) in the order they are deleted /
            inserted.
        targets: per example, the token id whose probability the curves follow.
        fractions: steps of the grid of fractions from 0 to 1.
        grid: the image-token grid (default: the image's first grid).
        batch_size: rows per forward.

    Returns:
        ``method, draw, example, kind, fraction, cells, prob, logit_diff`` (``method`` is the order's name, ``draw``
        0); :func:`curve_scores` gives the AUCs.
    """
    fractions = _check_int(fractions, "fractions", 1)
    if not len(examples) == len(orders) == len(targets):
        raise InputError(f"{len(examples)} examples, {len(orders)} orders and {len(targets)} targets: pass one of "
                         "each per example")
    boxes = []
    for e in examples:
        g = _grid(vlm.prepare([e.image], [e.prompt]).index[0], grid)
        boxes.append(np.asarray(g.boxes, dtype=float).reshape(-1, 4))
    named = [{(name, 0): np.asarray(order, dtype=int) for name, order in own.items()} for own in orders]
    return _curves(vlm, examples, named, [int(t) for t in targets], boxes,
                   [background_colour(e.image) for e in examples], np.linspace(0.0, 1.0, fractions + 1), batch_size,
                   False)


# ----------------------------------------------------------------------------------------------------------------
# The data set
# ----------------------------------------------------------------------------------------------------------------
def relevancy_dataset(vlm: Any, task: str, n: int, seed: int = 1) -> Any:
    """``query`` or ``scene`` stimuli on the model's canvas (an organism's training canvas and pools, else the task's
    grid at the family's typical image size).

    Raises:
        InputError: an unknown task.
    """
    if task not in TASKS:
        raise InputError(f"relevancy runs on {', '.join(TASKS)} stimuli (they name the object asked about); got "
                         f"task {task!r}.{close_matches(str(task), TASKS)}")
    kwargs, _ = stimulus_defaults(vlm, task, {})
    return generate(task, n, seed, kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------------------------------
def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _read_csv(path: Path, columns: Sequence[str], text: Sequence[str] = ()) -> pd.DataFrame:
    """A CSV this module wrote: floats exactly as written, ``text`` columns kept as written (a token ``nan`` or an
    empty token stays text)."""
    return read_csv_columns(path, columns, "relevancy table", text_columns=text, nullable=())


@register_result
@dataclass
class RelevancyResult(Result):
    """Relevancy maps of one model, their deletion / insertion curves, knockouts and object shares.

    Attributes:
        model: the model's name.
        task: the stimuli's task (``query``, ``scene``, or what a data set handed in says).
        target: ``answer`` or ``greedy`` (see the module docstring).
        methods: the map methods.
        fractions: the curves' fractions of cells, from 0 to 1.
        random_maps: random orders per example.
        seed: the random orders' and the bootstrap's seed.
        grid: the name of the image-token grid the maps were read on.
        knockout_queries: ``text``, ``last`` or ``all``.
        knockout_layers: the softmax layers the knockout blocks.
        examples: per example ``id``, ``prompt``, ``answer``, ``target_id``, ``target_token``, ``answer_token``,
            ``greedy_id``, ``greedy_token``, ``gives_answer``, ``clean_prob``, ``grid_shape``, ``boxes`` (``rows
            cols 4`` pixels, for the shown examples; None for the others), ``background``, ``target_object``
            (index or None), ``target_cells`` and ``object_cells`` (flat cell indices), ``knockout_k``.
        maps: ``example, method, position, role, row, col, token, value`` (row / col -1 off the grid).
        curves: ``method, draw, example, kind, fraction, cells, prob, logit_diff`` (``method`` includes
            ``random``, whose ``draw`` counts its orders).
        knockout: ``method, draw, example, k, prob, drop, changed, top_id``.
        prompt_format: ``raw`` or ``chat``.
        seconds: wall time.
        images: the shown examples' images (the first :data:`N_SHOWN`; saved beside the tables for the figure).
    """

    kind = "relevancy"
    reproduced_files = ("maps.csv", "curves.csv", "knockout.csv", "method_scores.csv", "relevancy.json",
                        "relevancy.html", "curves.html")
    marker_files = ("maps.csv", "curves.csv", "relevancy.json")
    figure_name = "relevancy"
    table_name = "method_scores.csv"

    model: str
    task: str
    target: str
    methods: list[str]
    fractions: list[float]
    random_maps: int
    seed: int
    grid: str
    knockout_queries: str
    knockout_layers: list[int]
    examples: list[dict[str, Any]]
    maps: pd.DataFrame
    curves: pd.DataFrame
    knockout: pd.DataFrame
    prompt_format: str = "raw"
    seconds: float = 0.0
    images: list[Image.Image] = field(default_factory=list, repr=False)

    # -- derived tables --------------------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.examples)

    @property
    def target_rule(self) -> str:
        return ("the expected answer's first token" if self.target == "answer"
                else "the model's greedy first token")

    def aucs(self) -> pd.DataFrame:
        """Per ``method, example, kind``: the AUC, random orders averaged per example."""
        per_draw = curve_scores(self.curves)
        return per_draw.groupby(["method", "example", "kind"], as_index=False, sort=False)["auc"].mean()

    def cell_values(self, example: int, method: str) -> np.ndarray:
        """``rows cols`` the map's values on the grid's cells."""
        rows, cols = self.examples[example]["grid_shape"]
        part = self.maps[(self.maps["example"] == example) & (self.maps["method"] == method)
                         & (self.maps["role"] == "image") & (self.maps["row"] >= 0)]
        grid = np.zeros((rows, cols))
        grid[part["row"].to_numpy(int), part["col"].to_numpy(int)] = part["value"].to_numpy(float)
        return grid

    def object_shares(self) -> pd.DataFrame:
        """Per ``method, example``: the share of the map's absolute image mass on the target object's cells
        (``target_share``), the mean share on each other object's (``other_share``) and the uniform share."""
        rows = []
        for i, ex in enumerate(self.examples):
            if ex.get("target_object") is None or not ex.get("target_cells"):
                continue
            n_cells = int(np.prod(ex["grid_shape"]))
            for method in self.methods:
                mass = np.abs(self.cell_values(i, method)).reshape(-1)
                total = float(mass.sum())
                if total <= 0:
                    continue
                others = [c for k, c in enumerate(ex["object_cells"]) if k != ex["target_object"] and c]
                rows.append({
                    "method": method, "example": i,
                    "target_share": float(mass[ex["target_cells"]].sum()) / total,
                    "other_share": (float(np.mean([mass[c].sum() for c in others])) / total) if others
                    else float("nan"),
                    "uniform_share": len(ex["target_cells"]) / n_cells,
                })
        return pd.DataFrame(rows, columns=["method", "example", "target_share", "other_share", "uniform_share"])

    def scores(self) -> pd.DataFrame:
        """Per method (and ``random``): mean AUCs, paired differences to random with bootstrap intervals, the
        knockout's drop and changed share (and their differences to random), the object shares, ``n``."""
        aucs = self.aucs()
        pivot = aucs.pivot_table(index="example", columns=["method", "kind"], values="auc")
        ko = self.knockout.groupby(["method", "example"], as_index=False, sort=False)[["drop", "changed"]].mean()
        ko_drop = ko.pivot(index="example", columns="method", values="drop")
        ko_changed = ko.pivot(index="example", columns="method", values="changed")
        shares = self.object_shares()
        rows = []
        for method in [*self.methods, RANDOM]:
            row: dict[str, Any] = {"method": method, "n": self.n}
            for kind in KINDS:
                own = pivot[(method, kind)]
                row[f"{kind}_auc"] = float(own.mean())
                diff = own - pivot[(RANDOM, kind)]
                mean, lo, hi, _ = (bootstrap_mean(diff.to_numpy(), self.seed) if method != RANDOM
                                   else (float("nan"),) * 3 + (0,))
                row[f"{kind}_vs_random"], row[f"{kind}_vs_random_lo"], row[f"{kind}_vs_random_hi"] = mean, lo, hi
            for name, table in (("drop", ko_drop), ("changed", ko_changed)):
                mean, lo, hi, _ = bootstrap_mean(table[method].to_numpy(), self.seed)
                row[f"knockout_{name}"], row[f"knockout_{name}_lo"], row[f"knockout_{name}_hi"] = mean, lo, hi
                mean, lo, hi, _ = (bootstrap_mean((table[method] - table[RANDOM]).to_numpy(), self.seed)
                                   if method != RANDOM else (float("nan"),) * 3 + (0,))
                row[f"knockout_{name}_vs_random"] = mean
                row[f"knockout_{name}_vs_random_lo"], row[f"knockout_{name}_vs_random_hi"] = lo, hi
            part = shares[shares["method"] == method]
            row["target_share"] = float(part["target_share"].mean()) if len(part) else float("nan")
            row["other_share"] = float(part["other_share"].mean()) if len(part) else float("nan")
            row["uniform_share"] = float(part["uniform_share"].mean()) if len(part) else float("nan")
            mean, lo, hi, n_obj = (bootstrap_mean((part["target_share"] - part["other_share"]).to_numpy(), self.seed)
                                   if len(part) else (float("nan"),) * 3 + (0,))
            row["target_vs_other"], row["target_vs_other_lo"], row["target_vs_other_hi"] = mean, lo, hi
            row["n_objects"] = n_obj
            rows.append(row)
        return pd.DataFrame(rows)

    def to_frame(self) -> pd.DataFrame:
        """The per-method scores (``method_scores.csv``)."""
        return self.scores()

    def curve_means(self) -> pd.DataFrame:
        """``method, kind, fraction, prob, stderr``: the mean curve over examples (random orders averaged per
        example first)."""
        per_example = self.curves.groupby(["method", "kind", "fraction", "example"], as_index=False,
                                          sort=False)["prob"].mean()
        grouped = per_example.groupby(["method", "kind", "fraction"], sort=False)["prob"]
        out = grouped.agg(["mean", "std", "count"]).reset_index()
        stderr = (out["std"].fillna(0.0) / np.sqrt(out["count"].clip(lower=1))).to_numpy(float)
        return pd.DataFrame({"method": out["method"], "kind": out["kind"], "fraction": out["fraction"],
                             "prob": out["mean"].to_numpy(float), "stderr": stderr})

    # -- figures ---------------------------------------------------------------------------------------------------
    def shown(self) -> list[dict[str, Any]]:
        """What :func:`~vlmbind.viz.relevancy.relevancy_figure` draws for the first examples (those with images)."""
        out = []
        for i, image in enumerate(self.images[:N_SHOWN]):
            ex = self.examples[i]
            text = self.maps[(self.maps["example"] == i) & (self.maps["role"] != "image")]
            tokens = text[text["method"] == self.methods[0]].sort_values("position")["token"].tolist()
            values = {m: text[text["method"] == m].sort_values("position")["value"].to_numpy(float)
                      for m in self.methods}
            answer = "" if ex["gives_answer"] else f", model says {ex['greedy_token']!r}"
            out.append({"id": ex["id"], "image": image, "boxes": np.asarray(ex["boxes"], dtype=float),
                        "label": f"{ex['prompt']} -> {ex['target_token']!r}{answer}",
                        "cells": {m: self.cell_values(i, m) for m in self.methods}, "tokens": tokens,
                        "text_values": values})
        return out

    def figure(self) -> Any:
        """The maps of the first examples: on the image per method, and the prompt tokens coloured."""
        return relevancy_figure(self.shown(), self.methods, model=self.model, n=self.n, target_rule=self.target_rule)

    def curves_figure(self) -> Any:
        """Mean deletion and insertion curves per method against the random maps."""
        scores = self.scores()
        aucs = {r["method"]: {k: r[f"{k}_auc"] for k in KINDS} for r in scores.to_dict("records")}
        return curves_figure(self.curve_means(), aucs, model=self.model, n=self.n, target_rule=self.target_rule)

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        return ({"relevancy": self.figure, "curves": self.curves_figure},
                {"method_scores.csv": self.scores(), "maps.csv": self.maps, "curves.csv": self.curves,
                 "knockout.csv": self.knockout})

    # -- summary, files ----------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        scores = self.scores()
        per_method = {r["method"]: {k: _nan_to_none(v) for k, v in r.items() if k != "method"}
                      for r in scores.to_dict("records")}
        gives = [bool(e["gives_answer"]) for e in self.examples]
        return {
            "model": self.model, "task": self.task, "n_examples": self.n, "target": self.target,
            "target_rule": self.target_rule, "gives_answer": float(np.mean(gives)) if gives else None,
            "methods": list(self.methods), "fractions": list(self.fractions), "random_maps": self.random_maps,
            "seed": self.seed, "grid": self.grid, "knockout_queries": self.knockout_queries,
            "knockout_layers": list(self.knockout_layers), "better": BETTER,
            "interval": f"{int(LEVEL * 100)}% percentile bootstrap over examples, {RESAMPLES} resamples",
            "scores": per_method, "seconds": self.seconds, "prompt_format": self.prompt_format,
        }

    def record(self) -> dict[str, Any]:
        """``relevancy.json``: the run's settings and per-example records."""
        return {"model": self.model, "task": self.task, "target": self.target, "methods": list(self.methods),
                "fractions": list(self.fractions), "random_maps": self.random_maps, "seed": self.seed,
                "grid": self.grid, "knockout_queries": self.knockout_queries,
                "knockout_layers": list(self.knockout_layers), "prompt_format": self.prompt_format,
                "shown": [f"images/example-{i}.png" for i in range(min(len(self.images), N_SHOWN))],
                "examples": self.examples}

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``maps.csv``, ``curves.csv``, ``knockout.csv``, ``method_scores.csv``, ``relevancy.json``,
        ``summary.json``, the shown examples' images (``images/example-<i>.png``), ``relevancy.html`` and
        ``curves.html``, atomically."""
        out = Path(out)
        write_text_atomic(self.maps.to_csv(index=False), out / "maps.csv")
        write_text_atomic(self.curves.to_csv(index=False), out / "curves.csv")
        write_text_atomic(self.knockout.to_csv(index=False), out / "knockout.csv")
        write_text_atomic(self.scores().to_csv(index=False), out / "method_scores.csv")
        write_text_atomic(json.dumps(self.record(), indent=1, default=json_default) + "\n", out / "relevancy.json")
        for i, image in enumerate(self.images[:N_SHOWN]):
            buf = io.BytesIO()
            image.convert("RGB").save(buf, format="PNG")
            write_bytes_atomic(buf.getvalue(), out / "images" / f"example-{i}.png")
        write_html_atomic(self.figure(), out / "relevancy.html")
        write_html_atomic(self.curves_figure(), out / "curves.html")
        write_text_atomic(json.dumps(self.summary(), indent=2, default=json_default) + "\n", out / "summary.json")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> RelevancyResult:
        """The result from its tables, ``relevancy.json`` and the shown images; the scores are recomputed and
        checked against ``method_scores.csv`` (a stale pair of files is refused, never re-rendered).

        Raises:
            InputError: a file is missing, unreadable or lacks what its writer writes, or the files disagree.
        """
        directory = Path(directory)
        record = read_json_object(directory / "relevancy.json")
        require_keys(record, ("model", "task", "target", "methods", "fractions", "random_maps", "seed", "grid",
                              "knockout_queries", "knockout_layers", "examples"), directory / "relevancy.json")
        maps = _read_csv(directory / "maps.csv", MAP_COLUMNS, text=("method", "role", "token"))
        curves = _read_csv(directory / "curves.csv", CURVE_COLUMNS, text=("method", "kind"))
        knockout = _read_csv(directory / "knockout.csv", KNOCKOUT_COLUMNS, text=("method",))
        images = []
        for rel in record.get("shown", []):
            path = directory / rel
            try:
                with Image.open(path) as im:
                    images.append(im.convert("RGB"))
            except OSError:
                raise UserFileError(f"{str(path)!r} is missing or not an image; re-run vlmbind relevancy") from None
        try:
            result = cls(model=record["model"], task=record["task"], target=record["target"],
                         methods=list(record["methods"]), fractions=[float(f) for f in record["fractions"]],
                         random_maps=int(record["random_maps"]), seed=int(record["seed"]), grid=record["grid"],
                         knockout_queries=record["knockout_queries"],
                         knockout_layers=[int(v) for v in record["knockout_layers"]], examples=record["examples"],
                         maps=maps, curves=curves, knockout=knockout,
                         prompt_format=record.get("prompt_format", "raw"), images=images)
            rebuilt = result.scores()
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InputError(f"{str(directory)!r}: the relevancy files lack {exc} or hold a bad value; re-run "
                             "vlmbind relevancy") from None
        saved = _read_csv(directory / "method_scores.csv", ("method", "deletion_auc", "insertion_auc"),
                          text=("method",))
        same = (saved["method"].tolist() == rebuilt["method"].tolist()
                and np.allclose(saved["deletion_auc"].to_numpy(float), rebuilt["deletion_auc"].to_numpy(float),
                                equal_nan=True)
                and np.allclose(saved["insertion_auc"].to_numpy(float), rebuilt["insertion_auc"].to_numpy(float),
                                equal_nan=True))
        if not same:
            raise InputError(f"{str(directory / 'method_scores.csv')!r} and curves.csv disagree (different runs?); "
                             "re-run vlmbind relevancy to write both")
        summary = directory / "summary.json"
        if summary.is_file():
            result.seconds = float(read_json_object(summary).get("seconds", 0.0) or 0.0)
        return result


# ----------------------------------------------------------------------------------------------------------------
# relevancy
# ----------------------------------------------------------------------------------------------------------------
def _cells_of_box(boxes: np.ndarray, box: Sequence[float]) -> list[int]:
    """Flat indices of the cells whose boxes overlap ``box`` by a positive area."""
    x0, y0, x1, y1 = (float(v) for v in box)
    w = np.minimum(boxes[:, 2], x1) - np.maximum(boxes[:, 0], x0)
    h = np.minimum(boxes[:, 3], y1) - np.maximum(boxes[:, 1], y0)
    return [int(c) for c in np.flatnonzero((w > 0) & (h > 0))]


def _query_rows(batch: Any, mode: str) -> Any:
    """The knockout's query positions for ``batch`` (None: every position)."""
    if mode == "all":
        return None
    if mode == "last":
        return [[int(ti.last_position)] for ti in batch.index]
    rows = [np.flatnonzero((ti.roles != "image") & (ti.roles != "pad")) for ti in batch.index]
    width = max(len(r) for r in rows)
    # one equal-length list per row: a row's last position repeats to fill (a position named twice is one)
    return [list(map(int, r)) + [int(r[-1])] * (width - len(r)) for r in rows]


def _knockout_edits(layers: Sequence[int], n_heads: int, cells: list[list[int]], grid: str | None, mode: str
                    ) -> Any:
    def edits(batch: Any) -> list[BlockAttention]:
        keys = [np.asarray(_grid(ti, grid).positions).reshape(-1)[c].tolist() for ti, c in zip(batch.index, cells)]
        queries = _query_rows(batch, mode)
        return [BlockAttention(layer=layer, heads=list(range(n_heads)), keys=keys, query_positions=queries)
                for layer in layers]
    return edits


def relevancy(vlm: Any, dataset: Any, *, methods: Sequence[str] | str = METHODS, target: str = "answer",
              fractions: int = 10, random_maps: int = 5, seed: int = 1, knockout_k: int | None = None,
              knockout_queries: str = "text", grid: str | None = None, batch_size: int = 16,
              progress: bool = False) -> RelevancyResult:
    """Relevancy maps, deletion / insertion curves against random maps, the knockout check and the object shares
    (see the module docstring).

    Args:
        vlm: a loaded VLM (its active interventions apply to every forward).
        dataset: a :class:`~vlmbind.stimuli.Dataset` (e.g. :func:`relevancy_dataset`) or a list of examples, each
            with ``image``, ``prompt`` and ``answer``; ``objects`` with ``fields["target"]`` give the object checks.
        methods: some of :data:`METHODS` (a list or a comma-separated string).
        target: ``answer`` (the expected answer's first token) or ``greedy`` (the model's own first token).
        fractions: steps of the curves' grid of fractions (``fractions + 1`` points from 0 to 1).
        random_maps: random orders per example (at least 1).
        seed: the random orders' and the bootstrap's seed.
        knockout_k: cells knocked out (default: the cells the target object covers, 1 without one).
        knockout_queries: ``text``, ``last`` or ``all``.
        grid: the image-token grid to read maps on (default: the image's first grid).
        batch_size: rows per forward (the gradient pass keeps every layer's pattern and its graph for as many rows).
        progress: show progress bars.

    Raises:
        InputError: bad arguments or examples.
        NoImageTokensError: a family whose image never enters the language model's sequence.
    """
    start = time.perf_counter()
    methods = _check_methods(methods)
    target = _check_choice(target, "target", TARGETS)
    knockout_queries = _check_choice(knockout_queries, "knockout_queries", KNOCKOUT_QUERIES)
    fractions = _check_int(fractions, "fractions", 1)
    random_maps = _check_int(random_maps, "random_maps", 1)
    seed = _check_int(seed, "seed", 0)
    batch_size = _check_int(batch_size, "batch_size", 1)
    if knockout_k is not None:
        knockout_k = _check_int(knockout_k, "knockout_k", 1)
    _check_image_tokens(vlm)
    examples = list(dataset)
    if not examples:
        raise InputError("the data set is empty: nothing to explain")
    for e in examples:
        if not isinstance(getattr(e, "image", None), Image.Image) or not str(getattr(e, "prompt", "")).strip():
            raise InputError(f"example {getattr(e, 'id', '?')!r} lacks an image or a prompt")
        if target == "answer" and not str(getattr(e, "answer", "") or "").strip():
            raise InputError(f"example {e.id!r} has no expected answer; pass target='greedy'")
    tokenizer = vlm.adapter.tokenizer
    chat = vlm.active_prompt_format == "chat"
    layers = _softmax_layers(vlm.adapter)
    grid_fracs = np.linspace(0.0, 1.0, fractions + 1)

    # ---- clean runs and maps ------------------------------------------------------------------------------
    records: list[dict[str, Any]] = []
    map_rows: list[dict[str, Any]] = []
    values: list[dict[str, np.ndarray]] = []  # per example: method -> flat cell values
    boxes_all: list[np.ndarray] = []
    grid_name = None
    bar = tqdm(total=len(examples), desc="relevancy maps", disable=not progress)
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo: lo + batch_size]
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk])
        logits = vlm.logits(batch, at=[-1])[:, -1].float()
        greedy = logits.argmax(-1).tolist()
        answer_ids = [vlm.answer_ids(e.answer, chat)[0] if str(getattr(e, "answer", "") or "").strip() else None
                      for e in chunk]
        targets = [int(a) if target == "answer" else int(g) for a, g in zip(answer_ids, greedy)]
        probs = torch.softmax(logits, -1)[torch.arange(len(chunk)), torch.as_tensor(targets)].tolist()
        row_maps = relevancy_maps(vlm, batch, targets, methods)
        for r, (e, maps) in enumerate(zip(chunk, row_maps)):
            i = lo + r
            ti = batch.index[r]
            g = _grid(ti, grid)
            grid_name = g.name
            keep = np.flatnonzero(ti.roles != "pad")
            where = {int(p): k for k, p in enumerate(keep)}
            cell_pos = np.asarray(g.positions).reshape(-1)
            cell_of = {int(p): divmod(c, g.shape[1]) for c, p in enumerate(cell_pos)}
            boxes = np.asarray(g.boxes, dtype=float).reshape(-1, 4)
            boxes_all.append(boxes)
            values.append({m: np.array([maps[m][where[int(p)]] for p in cell_pos]) for m in methods})
            ids = ti.input_ids[keep]
            tokens = [tokenizer.decode([int(t)]) for t in ids]
            for m in methods:
                for k, p in enumerate(keep):
                    rc = cell_of.get(int(p), (-1, -1))
                    map_rows.append({"example": i, "method": m, "position": k, "role": str(ti.roles[p]),
                                     "row": int(rc[0]), "col": int(rc[1]), "token": tokens[k],
                                     "value": float(maps[m][k])})
            objects = list(getattr(e, "objects", []) or [])
            fields = getattr(e, "fields", {}) or {}
            target_object = fields.get("target") if objects else None
            object_cells = [_cells_of_box(boxes, o.box) for o in objects]
            target_cells = object_cells[target_object] if target_object is not None else []
            records.append({
                "id": str(e.id), "prompt": e.prompt, "answer": str(getattr(e, "answer", "") or ""),
                "target_id": targets[r], "target_token": tokenizer.decode([targets[r]]),
                "answer_token": None if answer_ids[r] is None else tokenizer.decode([answer_ids[r]]),
                "greedy_id": int(greedy[r]), "greedy_token": tokenizer.decode([int(greedy[r])]),
                "gives_answer": answer_ids[r] is not None and int(greedy[r]) == int(answer_ids[r]),
                "clean_prob": float(probs[r]), "grid_shape": [int(v) for v in g.shape], "boxes": g.boxes,
                "background": list(background_colour(e.image)),
                "target_object": None if target_object is None else int(target_object),
                "target_cells": target_cells, "object_cells": object_cells,
                "knockout_k": int(knockout_k or max(1, len(target_cells))),
            })
        bar.update(len(chunk))
    bar.close()

    # ---- orders -----------------------------------------------------------------------------------------------
    orders: list[dict[tuple[str, int], np.ndarray]] = []
    for i, vals in enumerate(values):
        n_cells = len(boxes_all[i])
        own = {(m, 0): np.argsort(-vals[m], kind="stable") for m in methods}
        for d in range(random_maps):
            own[(RANDOM, d)] = np.random.default_rng([seed, i, d]).permutation(n_cells)
        orders.append(own)

    # ---- curves ---------------------------------------------------------------------------------------------
    curves = _curves(vlm, examples, orders, [r["target_id"] for r in records], boxes_all,
                     [r["background"] for r in records], grid_fracs, batch_size, progress)

    # ---- knockout --------------------------------------------------------------------------------------------
    arms = [(i, method, draw, order[: records[i]["knockout_k"]].tolist())
            for i, own in enumerate(orders) for (method, draw), order in own.items()]
    ko_rows = []
    n_heads = vlm.adapter.n_heads
    bar = tqdm(total=len(arms), desc="relevancy knockout", disable=not progress)
    for lo in range(0, len(arms), batch_size):
        part = arms[lo: lo + batch_size]
        edits = _knockout_edits(layers, n_heads, [c for *_, c in part], grid, knockout_queries)
        p, _, top = _score_rows(vlm, [examples[i].image for i, *_ in part], [examples[i].prompt for i, *_ in part],
                                [records[i]["target_id"] for i, *_ in part], edits)
        for (i, method, draw, cells), pk, t in zip(part, p, top):
            ko_rows.append({"method": method, "draw": draw, "example": i, "k": len(cells), "prob": float(pk),
                            "drop": records[i]["clean_prob"] - float(pk),
                            "changed": int(int(t) != records[i]["greedy_id"]), "top_id": int(t)})
        bar.update(len(part))
    bar.close()

    for i, rec in enumerate(records):  # the pixel boxes of the shown examples' cells, for the figure
        rec["boxes"] = np.asarray(rec["boxes"], dtype=float).tolist() if i < N_SHOWN else None
    task = getattr(dataset, "task", None) or getattr(examples[0], "task", "") or ""
    return RelevancyResult(
        model=vlm.name, task=str(task), target=target, methods=list(methods),
        fractions=[float(f) for f in grid_fracs], random_maps=random_maps, seed=seed, grid=str(grid_name),
        knockout_queries=knockout_queries, knockout_layers=list(layers), examples=records,
        maps=pd.DataFrame(map_rows, columns=list(MAP_COLUMNS)), curves=curves,
        knockout=pd.DataFrame(ko_rows, columns=list(KNOCKOUT_COLUMNS)), prompt_format=vlm.active_prompt_format,
        seconds=time.perf_counter() - start, images=[e.image.convert("RGB") for e in examples[:N_SHOWN]],
    )
