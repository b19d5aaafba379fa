"""The search-head methods against a planted search head: does vlmbind find the heads that choose where to point?

An organism trained with pointing SIIT (:mod:`vlmbind.organisms.siit.pointing`) records the heads that carry the
pointed object's cell at each point's steps (``planted["search"]``). :func:`validate_search` scores, on fresh
counting displays (another seed than training's, the organism's own object counts):

* attention_swap head scores on the model's own traces (PbP's condition, :mod:`vlmbind.analysis.traces`) by every
  mediation method asked for (``exact``; ``attribution`` (AtP), ``atp_star`` and ``integrated_gradients``, its
  estimates; ``naive`` on a sample of heads, which must equal ``exact``): the planted heads' ranks, recall@k, AUROC
  and the planted-vs-rest ratio;
* thresholded attention-centroid tracking (:func:`vlmbind.analysis.tracking.track`): each head's RMSE between its
  centroid and the point the model wrote, whether the lowest RMSE is at a planted head, and per head the share of
  points whose centroid lies within half a cell of the point (Wilson 95% interval);
* ablation of the top-k heads by exact attention_swap score (k = the planted count) on counting, against random-k
  from the other heads, random-k from the top-k's own layers and the bottom-k. A display counts as right when its
  whole trace is (every point and the count): the points are what a search head writes, and a small count can be
  right with every point wrong.

The result is a :class:`~vlmbind.analysis.validate.ValidationResult` (condition ``search``, with a ``tracking``
table), so the scene validation's tables, figure and export read it as they read any other. On a model with nothing
planted (the twin), ``reference`` names the heads to score against: the same numbers then say what the methods report
where the mechanism was not trained in. A planted search head validates the methods; it says nothing about how
pretrained VLMs point.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..core.checks import check_ablation_modes, check_validation_methods
from ..core.choices import ABLATION_MODES, VALIDATION_METHODS
from ..core.errors import InputError
from ..core.sites import parse_heads
from .ablation import wilson_interval
from .traces import point_swap_pairs
from .tracking import track, tracking_dataset
from .validate import ValidationResult, ablate_top_k, naive_sample, planted_heads, score_methods

SEARCH_CONDITION = "search"
# a centroid this close to the point (in canvas cells) lands on the pointed object's cell
HALF_CELL = 0.5


def search_reference(vlm: Any, reference: Mapping[str, Sequence[str]] | None) -> list[tuple[int, int]]:
    """The heads to score against: ``reference["search"]`` or the model's own planted search heads (empty: none).

    Raises:
        InputError: a reference that names another condition, or heads outside the model.
    """
    if reference is not None:
        other = sorted(set(reference) - {SEARCH_CONDITION})
        if other:
            raise InputError(f"search validation scores heads of the condition 'search', not {other}; give "
                             f"--heads search=L.H,...")
        heads = parse_heads(list(reference.get(SEARCH_CONDITION, [])))
    else:
        heads = planted_heads(vlm).get(SEARCH_CONDITION, [])
    outside = [f"{l}.{h}" for l, h in heads if not (0 <= l < vlm.n_layers and 0 <= h < vlm.n_heads)]
    if outside:
        raise InputError(f"reference heads {outside} do not exist in {vlm.name} ({vlm.n_layers} layers x "
                         f"{vlm.n_heads} heads)")
    return heads


def _swap_task(vlm: Any, pair: Any, layers: Sequence[int]) -> Any:
    return pair.task(vlm, layers)


def tracking_rows(result: Any, reference: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per head: RMSE between its centroid and the written point, points scored, and the share of points whose
    centroid lies within half a cell of the point, with its Wilson 95% interval."""
    frame = result.to_frame()
    distance = np.linalg.norm(result.head_centroids - result.points[:, None, None, :], axis=-1)  # N L H
    rows = []
    for r in frame[frame["head"] != "mean"].itertuples():
        l, h = int(r.layer), int(r.head)
        d = distance[:, l, h]
        d = d[np.isfinite(d)]
        within = float(np.mean(d <= HALF_CELL)) if d.size else float("nan")
        low, high = wilson_interval(within, int(d.size)) if d.size else (float("nan"), float("nan"))
        rows.append({"layer": l, "head": h, "rmse": float(r.rmse), "n_points": int(r.n_points),
                     "within_half_cell": within, "within_low": low, "within_high": high,
                     "reference": (l, h) in set(reference)})
    return rows


def validate_search(vlm: Any, *, reference: Mapping[str, Sequence[str]] | None = None,
                    reference_source: str | None = None, n_pairs: int = 16, seed: int = 1000,
                    methods: Sequence[str] = VALIDATION_METHODS, naive_heads: int = 6, ig_steps: int = 8,
                    modes: Sequence[str] = ABLATION_MODES, n_eval: int = 64, ablation_seeds: int = 5,
                    n_track: int = 32, progress: bool = False) -> ValidationResult:
    """The search-head methods against the model's planted search heads (or ``reference["search"]``) on fresh
    counting displays (see the module docstring).

    Args:
        vlm: a Point-to-Answer model (an organism with planted search heads, or any with ``reference``).
        reference: ``{"search": ["l.h", ...]}`` to score against instead of the model's own planted heads.
        reference_source: what to call those heads in the result (e.g. the organism they were planted in).
        n_pairs: attention_swap pairs (from the model's own counting traces).
        seed: stimulus seed (keep it away from training's); the tracking displays use ``seed + 1``, the ablation's
            ``seed + 2``.
        methods: the mediation methods (``naive`` is checked on ``naive_heads`` heads against ``exact``).
        ig_steps: integrated-gradients path points.
        modes: ablation modes.
        n_eval: counting displays the ablation is scored on.
        ablation_seeds: random-k draws.
        n_track: counting displays whose traces are tracked.
        progress: show progress bars.

    Raises:
        InputError: unknown methods or modes, bad counts, reference heads outside the model, or a model that writes
            no usable pointing trace.
    """
    check_validation_methods(methods)
    check_ablation_modes(modes)
    for name, value in (("n_pairs", n_pairs), ("n_eval", n_eval), ("ablation_seeds", ablation_seeds),
                        ("ig_steps", ig_steps), ("n_track", n_track), ("naive_heads", naive_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an int >= 1, got {value!r}")
    if "naive" in methods and "exact" not in methods:
        raise InputError("naive is checked against exact: add exact to the methods")
    heads = search_reference(vlm, reference)
    source = (reference_source or "given") if reference is not None else ("planted" if heads else None)
    names = [f"{l}.{h}" for l, h in heads]
    result = ValidationResult(model=vlm.name, reference=source, heads={SEARCH_CONDITION: names} if heads else {},
                              params={"condition": SEARCH_CONDITION, "task": "count", "n_pairs": n_pairs,
                                      "seed": seed, "methods": list(methods), "ig_steps": ig_steps,
                                      "modes": list(modes), "n_eval": n_eval, "ablation_seeds": ablation_seeds,
                                      "n_track": n_track, "n_objects": None})
    start = time.perf_counter()
    swaps = point_swap_pairs(vlm, n_pairs, seed, task="count")
    result.params.update(n_pairs=len(swaps), skipped_traces=len(swaps.skipped))
    result.seconds["pairs"] = time.perf_counter() - start
    exact = score_methods(vlm, result, SEARCH_CONDITION, swaps, heads, methods, ig_steps, progress)
    if "naive" in methods and exact is not None:
        begin = time.perf_counter()
        sampled, worst = naive_sample(vlm, list(swaps), exact, heads, naive_heads, seed, task=_swap_task)
        result.naive_check[SEARCH_CONDITION] = {"heads": [f"{l}.{h}" for l, h in sampled],
                                                "max_abs_difference": float(worst),
                                                "seconds": time.perf_counter() - begin}
    result.seconds["mediation"] = float(sum(r["seconds"] for r in result.methods))
    begin = time.perf_counter()
    tracked = track(vlm, tracking_dataset(vlm, "count", n_track, seed + 1), progress=progress)
    result.tracking = tracking_rows(tracked, heads)
    result.params["n_points"] = int(tracked.n_points)
    result.seconds["tracking"] = time.perf_counter() - begin
    if exact is not None:
        begin = time.perf_counter()
        dataset = tracking_dataset(vlm, "count", n_eval, seed + 2)
        for example in dataset:  # a search head writes the points: right means the whole trace, points and count
            example.fields["scorer"] = "exact"
        result.params["ablation_scored"] = "whole trace"
        ablate_top_k(vlm, result, {SEARCH_CONDITION: heads}, {SEARCH_CONDITION: exact}, dataset, modes,
                     ablation_seeds)
        result.seconds["ablation"] = time.perf_counter() - begin
    else:
        result.skipped["ablation"] = "the top-k heads are exact's: add exact to the methods"
    result.skipped.update(edit="the position-ID edit is a scene-description method",
                          probes="the probes read scene objects' cells")
    return result

