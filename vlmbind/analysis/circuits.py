"""Circuits: edges between heads scored by path patching on counterfactual pairs, with their uncertainty.

An edge ``sender -> receiver (channel)`` is scored, per pair, as the change of ``logit[a*] - logit[a]`` when the
counterfactual flows from the sender's output (at the sender positions) into the receiver's query, key or value
input (at the receiver positions) and nowhere else (:mod:`vlmbind.engine.paths`); ``sender -> logits`` is the
sender's direct effect. Positions are named by class (:func:`vlmbind.core.checks.check_position_class`), so one run
scores the edges from, say, the image tokens into the last token.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import roc_auc_score
from tqdm.auto import tqdm

from ..core.checks import check_head_list, check_position_class
from ..core.choices import CIRCUIT_ABLATIONS, FAITHFULNESS_FRACTIONS, IG_STEPS
from ..core.errors import InputError
from ..core.io import write_json_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..engine.circuit_ablation import circuit_diffs
from ..engine.paths import (
    CHANNELS,
    LOGITS,
    Edge,
    PathTask,
    all_edges,
    atp_star_path_diffs,
    attribution_path_diffs,
    exact_path_diffs,
    naive_path_diffs,
)
from ..viz.circuits import circuit_figure, faithfulness_figure
from ..viz.figures import write_html_atomic
from .mediation import (
    N_BOOTSTRAP,
    UNCERTAINTY_COLUMNS,
    UNCERTAINTY_METHOD,
    aligned_scene_pair,
    head_uncertainty,
    pairs_digest,
    resume_checkpoint,
    save_checkpoint,
)

CIRCUIT_FUNCTIONS: dict[str, Callable[..., tuple[float, np.ndarray]]] = {
    "exact": exact_path_diffs, "naive": naive_path_diffs, "eap": attribution_path_diffs,
    "eap_ig": partial(attribution_path_diffs, steps=IG_STEPS), "atp_star": atp_star_path_diffs}
# the estimates, verified by exact path patching on their top edges
ESTIMATED = ("eap", "eap_ig", "atp_star")
EDGE_COLUMNS = ("sender", "receiver", "channel", "sender_at", "receiver_at", "score", "stderr", "n")


def class_positions(index: Any, position_class: str, patch: np.ndarray) -> np.ndarray:
    """The sorted positions of ``position_class`` in one prepared clean row (``index``, its TokenIndex);
    ``patch`` is the pair's own patch positions (class ``patch``).

    Raises:
        InputError: a class that names no position of this prompt (no image tokens, a span not in the prompt, a
            box covering no image token).
    """
    kind, argument = check_position_class(position_class)
    real = np.flatnonzero(index.roles != "pad")
    if kind == "all":
        found = real
    elif kind == "image":
        found = np.flatnonzero(index.roles == "image")
    elif kind == "text":
        found = real[index.roles[real] != "image"]
    elif kind == "last":
        found = np.array([index.last_position])
    elif kind == "patch":
        found = np.asarray(patch)
    elif kind == "span":
        found = index.span(argument)
    else:
        found = index.positions_covering(argument)
    if not len(found):
        raise InputError(f"position class {position_class!r} names no position of this prompt on this model")
    return np.unique(np.asarray(found, dtype=np.int64))


def edge_frame_labels(edges: Sequence[Edge]) -> tuple[list[str], list[str], list[str]]:
    """The ``sender``, ``receiver`` and ``channel`` columns of ``edges`` (receiver ``logits`` for a direct edge)."""
    return ([f"{e.sender[0]}.{e.sender[1]}" for e in edges],
            [LOGITS if e.receiver is None else f"{e.receiver[0]}.{e.receiver[1]}" for e in edges],
            [e.channel for e in edges])


def parse_edge(sender: str, receiver: str, channel: str) -> Edge:
    """An :class:`~vlmbind.engine.paths.Edge` from its table columns."""
    (s,) = check_head_list(sender)
    r = None if receiver == LOGITS else check_head_list(receiver)[0]
    return Edge(s, r, channel)


FAITHFULNESS_COLUMNS = ("circuit", "fraction", "edges", "f", "ci_low", "ci_high", "n")


@dataclass
class Faithfulness:
    """How much of the model's behaviour a circuit keeps, MIB's way: the circuit of the top-k edges (by the circuit's
    signed score, the table's rank) for each fraction of the scored edges, every other scored edge ablated
    (:mod:`vlmbind.engine.circuit_ablation`).

    Per pair, ``m`` is ``logit[a*] - logit[a]`` of the clean prompt with the edges outside the circuit ablated; the
    faithfulness of a circuit is ``f = (mean m(circuit) - mean m(empty)) / (mean m(full) - mean m(empty))`` (full:
    nothing ablated, f = 1; empty: every scored edge ablated, f = 0). CPR is the area under f and CMD the area under
    ``|1 - f|``, over the fractions on a log scale mapped to [0, 1] (trapezoids); intervals are percentile
    bootstraps over pairs. Where ``m(full) - m(empty)`` is not distinguishable from 0 (its interval covers 0), the
    scored edges do not carry the behaviour and f is undefined: the summary says so (``defined``).

    Attributes:
        fractions: the fractions of the scored edges kept.
        counts: the edges each fraction keeps (``int(fraction * edges)``).
        circuits: ``N K`` per pair, ``m`` of each top-k circuit.
        empty, full: ``N`` per pair, ``m`` with every scored edge ablated and with none.
        ablation: ``patch`` (the counterfactual sender values) or ``mean`` (their mean over the pairs).
        declared: ``N`` per pair, ``m`` of the declared circuit, or None.
        declared_edges: the declared circuit's edges (labels), empty when none.
        n_edges: how many edges are scored.
        seconds: wall time of the curve.
        table: the curve's table (loaded results).
        stats: the summary's numbers (loaded results).
    """

    fractions: list[float]
    counts: list[int]
    circuits: np.ndarray | None
    empty: np.ndarray | None
    full: np.ndarray | None
    ablation: str = "patch"
    declared: np.ndarray | None = None
    declared_edges: list[str] = field(default_factory=list)
    n_edges: int = 0
    seconds: float = 0.0
    table: pd.DataFrame | None = field(default=None, repr=False)
    stats: dict[str, Any] | None = None

    def to_frame(self) -> pd.DataFrame:
        """One row per circuit: ``top`` for each fraction, and ``declared``; f with its 95% interval."""
        if self.circuits is None:
            return self.table.copy()
        n = len(self.full)
        columns = self.circuits if self.declared is None else np.column_stack([self.circuits, self.declared])
        f, low, high = _faithfulness_with_interval(columns, self.empty, self.full)
        rows = [{"circuit": "top", "fraction": fr, "edges": k} for fr, k in zip(self.fractions, self.counts)]
        if self.declared is not None:
            k = len(self.declared_edges)
            rows.append({"circuit": "declared", "fraction": k / self.n_edges, "edges": k})
        frame = pd.DataFrame(rows)
        frame["f"], frame["ci_low"], frame["ci_high"], frame["n"] = f, low, high, n
        return frame[list(FAITHFULNESS_COLUMNS)]

    def summary(self) -> dict[str, Any]:
        """CPR and CMD with their intervals, the mean ``m`` of the full model and of the empty circuit, and the
        declared circuit's f."""
        if self.circuits is None:
            return dict(self.stats or {})
        cpr, cmd = _areas(self.circuits, self.empty, self.full, self.fractions)
        gap = self.full - self.empty
        gap_ci = [np.nan, np.nan]
        if len(gap) >= 2:
            means = gap[_resamples(len(gap))].mean(1)
            gap_ci = [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
        frame = self.to_frame()
        declared = frame[frame["circuit"] == "declared"]
        return {"ablation": self.ablation, "ranking": "signed score", "fractions": list(self.fractions),
                "cpr": cpr[0], "cpr_ci": [cpr[1], cpr[2]], "cmd": cmd[0], "cmd_ci": [cmd[1], cmd[2]],
                "m_full": float(self.full.mean()), "m_empty": float(self.empty.mean()),
                "full_minus_empty": float(gap.mean()), "full_minus_empty_ci": gap_ci,
                "defined": bool(not gap_ci[0] <= 0 <= gap_ci[1]), "n": len(self.full),
                "edges": self.n_edges, "seconds": self.seconds,
                "area": "trapezoids over log10(fraction) mapped to [0, 1]",
                "interval": f"95% percentile bootstrap over pairs ({N_BOOTSTRAP} resamples, seed 0)",
                **({"declared": {"edges": self.declared_edges, "f": float(declared["f"].iloc[0]),
                                 "ci": [float(declared["ci_low"].iloc[0]), float(declared["ci_high"].iloc[0])]}}
                   if len(declared) else {})}

    def figure(self, title: str = "Faithfulness", model: str | None = None) -> Any:
        return faithfulness_figure(self.to_frame(), self.summary(), title=title, model=model)


def _faithfulness(columns: np.ndarray, empty: np.ndarray, full: np.ndarray) -> np.ndarray:
    """``... K`` f of each column from ``... N K`` / ``... N`` per-pair values (NaN where full = empty)."""
    low, high = empty.mean(-1), full.mean(-1)
    span = (high - low)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(span != 0, (columns.mean(-2) - low[..., None]) / span, np.nan)


def _resamples(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, n, size=(N_BOOTSTRAP, n))


def _faithfulness_with_interval(columns: np.ndarray, empty: np.ndarray, full: np.ndarray
                                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    f = _faithfulness(columns, empty, full)
    if len(full) < 2:
        return f, np.full_like(f, np.nan), np.full_like(f, np.nan)
    draws = _resamples(len(full))
    boot = _faithfulness(columns[draws], empty[draws], full[draws])
    with np.errstate(all="ignore"):
        return f, np.nanpercentile(boot, 2.5, axis=0), np.nanpercentile(boot, 97.5, axis=0)


def _areas(circuits: np.ndarray, empty: np.ndarray, full: np.ndarray, fractions: Sequence[float]
           ) -> tuple[list[float], list[float]]:
    """``([CPR, low, high], [CMD, low, high])``: the areas under f and under ``|1 - f|`` over ``log10(fraction)``
    mapped to [0, 1]."""
    x = np.log10(np.asarray(fractions, dtype=float))
    x = (x - x[0]) / (x[-1] - x[0])

    def areas(f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.trapezoid(f, x, axis=-1), np.trapezoid(np.abs(1 - f), x, axis=-1)

    cpr, cmd = areas(_faithfulness(circuits, empty, full))
    out = [[float(cpr), np.nan, np.nan], [float(cmd), np.nan, np.nan]]
    if len(full) >= 2:
        draws = _resamples(len(full))
        for row, boot in zip(out, areas(_faithfulness(circuits[draws], empty[draws], full[draws]))):
            with np.errstate(all="ignore"):
                row[1], row[2] = float(np.nanpercentile(boot, 2.5)), float(np.nanpercentile(boot, 97.5))
    return out[0], out[1]


def faithfulness_curve(vlm: Any, tasks: Iterable[PathTask], edges: Sequence[Edge], scores: np.ndarray, *,
                       fractions: Sequence[float] = FAITHFULNESS_FRACTIONS, ablation: str = "patch",
                       declared: Sequence[Edge] = (), progress: bool = False) -> Faithfulness:
    """The faithfulness curve of the top edges by ``scores`` (see :class:`Faithfulness`) on ``tasks``, and of the
    ``declared`` circuit (those of its edges that are scored) when given.

    Raises:
        InputError: an unknown ablation, fractions not increasing in (0, 1] or fewer than two, a ``scores`` of the
            wrong length, or ``mean`` ablation over pairs whose sender positions differ.
    """
    if ablation not in CIRCUIT_ABLATIONS:
        raise InputError(f"unknown ablation {ablation!r}; ablations: {', '.join(CIRCUIT_ABLATIONS)}")
    fractions = [float(f) for f in fractions]
    if len(fractions) < 2 or any(not 0 < f <= 1 for f in fractions) or np.any(np.diff(fractions) <= 0):
        raise InputError(f"faithfulness fractions must be at least two increasing numbers in (0, 1], got {fractions}")
    scores = np.asarray(scores, dtype=float)
    if scores.shape != (len(edges),):
        raise InputError(f"faithfulness needs one score per edge ({len(edges)}), got shape {scores.shape}")
    order = np.argsort(-scores, kind="stable")
    counts = [int(f * len(edges)) for f in fractions]
    masks = []
    for k in counts:
        mask = np.zeros(len(edges), dtype=bool)
        mask[order[:k]] = True
        masks.append(mask)
    masks.append(np.zeros(len(edges), dtype=bool))  # the empty circuit
    index = {e: i for i, e in enumerate(edges)}
    declared_mask = np.zeros(len(edges), dtype=bool)
    declared_mask[[index[e] for e in declared if e in index]] = True
    if len(declared):
        masks.append(declared_mask)
    if ablation == "mean":
        tasks = _mean_ablated(list(tasks))  # else one pair's task at a time: a large model's sender values are big
    start = time.perf_counter()
    rows = [circuit_diffs(vlm, task, edges, masks)
            for task in tqdm(tasks, desc="faithfulness", disable=not progress)]
    full = np.array([r[0] for r in rows])
    m = np.array([r[1] for r in rows])
    k = len(counts)
    return Faithfulness(fractions=fractions, counts=counts, circuits=m[:, :k], empty=m[:, k], full=full,
                        ablation=ablation, declared=m[:, k + 1] if len(declared) else None,
                        declared_edges=[e.label for e in edges if declared_mask[index[e]]], n_edges=len(edges),
                        seconds=time.perf_counter() - start)


def _mean_ablated(tasks: list[PathTask]) -> list[PathTask]:
    """The tasks with every sender value replaced by its mean over the tasks, position by position."""
    first = tasks[0].sender_positions
    if any(not np.array_equal(t.sender_positions, first) for t in tasks):
        raise InputError("mean ablation averages the sender outputs over the pairs position by position, but these "
                         "pairs' sender positions differ (prompts of other lengths); use ablation 'patch', or pairs "
                         "whose prompts line up")
    means = {l: torch.stack([t.values[l] for t in tasks]).mean(0) for l in tasks[0].values}
    return [PathTask(t.batch, t.sender_positions, t.receiver_positions, means, t.score_position, t.a, t.a_star)
            for t in tasks]


@register_result
@dataclass
class Circuit(Result):
    """Path-patching scores of head-to-head and head-to-logit edges.

    Attributes:
        condition: the pairs' condition.
        method: ``exact`` or ``naive`` (same numbers; exact is fast).
        model: the model's name.
        edges: the scored edges, in the order of ``per_pair``'s columns.
        per_pair: ``N E`` score of every pair for every edge (None once loaded from files: the table holds the
            means, intervals and counts).
        sender_at: the class of positions senders are patched at.
        receiver_at: the class of positions receivers are patched at.
        seconds: wall time of the scoring (the faithfulness curve's is its own).
        pair_ids: the pairs, in order.
        prompt_format: how the scene pairs were prompted.
        verified: an estimate's (``eap``, ``eap_ig``, ``atp_star``) top edges scored again by exact path patching on
            every pair: ``N E`` with NaN at the edges not verified.
        faithfulness: the faithfulness curve of the top edges (and of a declared circuit), or None.
        table: a result loaded from its files.
    """

    kind = "circuit"
    reproduced_files = ("edges.csv", "circuit.html")
    marker_files = ("edges.csv", "summary.json")
    figure_name = "circuit"
    table_name = "edges.csv"

    condition: str
    method: str
    model: str
    edges: list[Edge]
    per_pair: np.ndarray | None
    sender_at: str = "all"
    receiver_at: str = "all"
    seconds: float = 0.0
    pair_ids: list[str] = field(default_factory=list)
    prompt_format: str = "raw"
    verified: np.ndarray | None = None
    faithfulness: Faithfulness | None = None
    table: pd.DataFrame | None = field(default=None, repr=False, compare=False)

    @property
    def n(self) -> int:
        return int(self.table["n"].max()) if self.per_pair is None else int(self.per_pair.shape[0])

    @property
    def scores(self) -> np.ndarray:
        """The mean score of every edge, in :attr:`edges` order."""
        if self.per_pair is None:
            return self.table["score"].to_numpy(float)
        return self.per_pair.mean(0)

    def to_frame(self) -> pd.DataFrame:
        """One row per edge, highest score first: sender, receiver (``logits`` for a direct edge), channel, the
        position classes, the mean score over pairs with its standard error, bootstrap interval, t-test p, BH q and
        significance, and its rank."""
        if self.per_pair is None:
            return self.table.copy()
        senders, receivers, channels = edge_frame_labels(self.edges)
        n = self.n
        u = head_uncertainty(self.per_pair[:, :, None])
        frame = pd.DataFrame({
            "sender": senders, "receiver": receivers, "channel": channels, "sender_at": self.sender_at,
            "receiver_at": self.receiver_at, "score": self.scores,
            "stderr": self.per_pair.std(0, ddof=1) / np.sqrt(n) if n > 1 else np.nan, "n": n,
            **{c: u[c][:, 0] for c in UNCERTAINTY_COLUMNS}})
        if self.verified is not None:
            checked = ~np.isnan(self.verified).any(0)
            exact = np.full(len(self.edges), np.nan)
            low, high = exact.copy(), exact.copy()
            exact[checked] = self.verified[:, checked].mean(0)
            if checked.any():
                v = head_uncertainty(self.verified[:, checked][:, :, None])
                low[checked], high[checked] = v["ci_low"][:, 0], v["ci_high"][:, 0]
            frame["exact_score"], frame["exact_ci_low"], frame["exact_ci_high"] = exact, low, high
        frame = frame.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)
        frame["rank"] = np.arange(1, len(frame) + 1)
        return frame

    def top(self, k: int = 10) -> list[Edge]:
        """The ``k`` edges of largest mean score."""
        order = np.argsort(-self.scores, kind="stable")[:k]
        return [self.edges[i] for i in order]

    def figure(self) -> Any:
        return circuit_figure(self.to_frame(), model=self.model, n=self.n,
                              title=f"{self.condition} circuit ({self.method}; {self.sender_at} -> {self.receiver_at})")

    def faithfulness_figure(self) -> Any:
        if self.faithfulness is None:
            raise InputError("this circuit was scored without its faithfulness curve (faithfulness=False)")
        return self.faithfulness.figure(title=f"{self.condition} circuit faithfulness ({self.method} ranking, "
                                              f"{self.faithfulness.ablation} ablation)", model=self.model)

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        figures, tables = super().exports()
        if self.faithfulness is not None:
            figures["faithfulness"] = self.faithfulness_figure
            tables["faithfulness.csv"] = self.faithfulness.to_frame()
        return figures, tables

    def faithfulness_text(self) -> str:
        """CPR, CMD and the declared circuit's f, with their intervals (empty without a faithfulness curve)."""
        if self.faithfulness is None:
            return ""
        s = self.faithfulness.summary()

        def ci(pair: Sequence[float]) -> str:
            return "" if np.isnan(pair[0]) else f" [{pair[0]:.3f}, {pair[1]:.3f}]"

        text = (f"  faithfulness of the top edges ({s['ablation']} ablation, n = {s['n']}): CPR {s['cpr']:.3f}"
                f"{ci(s['cpr_ci'])} (1 best), CMD {s['cmd']:.3f}{ci(s['cmd_ci'])} (0 best)")
        if not s.get("defined", True):
            text += (f"\n  (every scored edge ablated moves the logit difference by {s['full_minus_empty']:+.3f}"
                     f"{ci(s['full_minus_empty_ci'])}, not distinguishable from 0: f, CPR and CMD are ratios of noise "
                     "here; the behaviour is not carried by these edges)")
        if "declared" in s:
            d = s["declared"]
            text += f"\n  declared circuit ({len(d['edges'])} edges): f = {d['f']:.3f}{ci(d['ci'])}"
        return text + "\n"

    def ranking_text(self, k: int = 5) -> str:
        """The top ``k`` edges with their mean score and 95% interval, one per line."""
        frame = self.to_frame().head(k)
        lines = []
        for row in frame.itertuples():
            target = "logits" if row.receiver == LOGITS else f"{row.receiver} ({row.channel})"
            interval = "" if np.isnan(row.ci_low) else f" [{row.ci_low:+.3f}, {row.ci_high:+.3f}]"
            exact = getattr(row, "exact_score", np.nan)
            beside = "" if np.isnan(exact) else (
                f" (exact {exact:+.3f}" + ("" if np.isnan(row.exact_ci_low) else
                                           f" [{row.exact_ci_low:+.3f}, {row.exact_ci_high:+.3f}]") + ")")
            lines.append(f"  {row.rank}. {row.sender} -> {target}  {row.score:+.3f}{interval}{beside}")
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        frame = self.to_frame()
        significant = frame[frame["significant"].astype(bool)]
        return {"condition": self.condition, "method": self.method, "model": self.model, "n": self.n,
                "seconds": self.seconds, "sender_at": self.sender_at, "receiver_at": self.receiver_at,
                "edges": len(frame), "pair_ids": self.pair_ids, "prompt_format": self.prompt_format,
                "top_edges": [_edge_label(r) for r in frame.head(10).itertuples()],
                "significant_edges": [_edge_label(r) for r in significant.itertuples()],
                "uncertainty": UNCERTAINTY_METHOD.replace("per head", "per edge").replace("all heads", "all edges"),
                **({"verified": [{"edge": _edge_label(r), self.method: r.score, "exact": r.exact_score,
                                  "exact_ci": [r.exact_ci_low, r.exact_ci_high]}
                                 for r in frame[frame["exact_score"].notna()].itertuples()]}
                   if "exact_score" in frame.columns else {}),
                **({"faithfulness": self.faithfulness.summary()} if self.faithfulness is not None else {})}

    def save(self, out: str | os.PathLike, figure: bool = True) -> Path:
        """Write ``edges.csv``, ``summary.json``, ``faithfulness.csv`` (when measured) and, with ``figure``,
        ``circuit.html`` and ``faithfulness.html`` atomically; ``vlmbind export`` draws the figures from the saved
        tables later."""
        out = Path(out)
        write_text_atomic(self.to_frame().to_csv(index=False), out / "edges.csv")
        if self.faithfulness is not None:
            write_text_atomic(self.faithfulness.to_frame().to_csv(index=False), out / "faithfulness.csv")
        if figure:
            write_html_atomic(self.figure(), out / "circuit.html")
            if self.faithfulness is not None:
                write_html_atomic(self.faithfulness_figure(), out / "faithfulness.html")
        write_json_atomic(self.summary(), out / "summary.json")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Circuit:
        """The edges saved in ``directory``: their means, intervals and counts (the per-pair scores are not
        saved)."""
        directory = Path(directory)
        frame = read_csv_columns(directory / "edges.csv", EDGE_COLUMNS, text_columns=("sender", "receiver"))
        summary = read_json_object(directory / "summary.json")
        require_keys(summary, ("condition", "method", "model", "n"), directory / "summary.json")
        edges = [parse_edge(s, r, c) for s, r, c in zip(frame["sender"], frame["receiver"], frame["channel"])]
        faithfulness = None
        if (directory / "faithfulness.csv").is_file() and "faithfulness" in summary:
            curve = read_csv_columns(directory / "faithfulness.csv", FAITHFULNESS_COLUMNS, text_columns=("circuit",))
            stats = summary["faithfulness"]
            top = curve[curve["circuit"] == "top"]
            faithfulness = Faithfulness(fractions=top["fraction"].tolist(), counts=top["edges"].astype(int).tolist(),
                                        circuits=None, empty=None, full=None, ablation=stats.get("ablation", "patch"),
                                        declared_edges=stats.get("declared", {}).get("edges", []),
                                        n_edges=int(stats.get("edges", len(edges))), table=curve, stats=stats)
        return cls(condition=summary["condition"], method=summary["method"], model=summary["model"], edges=edges,
                   per_pair=None, sender_at=summary.get("sender_at", "all"),
                   receiver_at=summary.get("receiver_at", "all"), seconds=summary.get("seconds", 0.0),
                   pair_ids=summary.get("pair_ids", []), prompt_format=summary.get("prompt_format", "raw"),
                   faithfulness=faithfulness, table=frame)


def _edge_label(row: Any) -> str:
    return f"{row.sender} -> {row.receiver}" + ("" if row.receiver == LOGITS else f" ({row.channel})")


def circuit(vlm: Any, pairs: Any, *, method: str = "exact", heads: Any = None, layers: Sequence[int] | None = None,
            channels: Sequence[str] = CHANNELS, logits: bool = True, sender_at: str = "all",
            receiver_at: str = "all", progress: bool = False, checkpoint: str | os.PathLike | None = None,
            prompt_format: str | None = None, verify_top: int = 10, faithfulness: bool = True,
            ablation: str = "patch", declared: Sequence[Any] | None = None, **method_kwargs: Any) -> Circuit:
    """Score every edge between heads (or those among ``heads`` / in ``layers``) by path patching on ``pairs``.

    Args:
        vlm: a loaded VLM.
        pairs: counterfactual pairs of one condition (a :class:`~vlmbind.stimuli.PairSet` or a list).
        method: ``exact`` (fast), ``naive`` (the four-forward reference, same numbers), ``eap`` (first-order
            estimates of every edge from one forward and backward per pair), ``eap_ig`` (the gradient averaged over
            8 points between the clean and the counterfactual sender outputs) or ``atp_star`` (each receiver's change
            exact, what follows it first-order, GradDrop magnitudes: :func:`~vlmbind.engine.paths.atp_star_path_diffs`).
        heads: restrict senders and receivers to these heads (``"1.0,2.3"`` or pairs).
        layers: restrict senders and receivers to these layers.
        channels: the receiver inputs to score (``q``, ``k``, ``v``).
        logits: also score each sender's direct edge into the logits.
        sender_at, receiver_at: position classes (:func:`vlmbind.core.checks.check_position_class`).
        progress: show a progress bar.
        checkpoint: a file the per-pair scores are written to after every pair; one from the same run is continued
            from (another run's is refused), and it is removed when the run completes.
        prompt_format: ``raw`` or ``chat`` (None: the model's).
        verify_top: the estimates (``eap``, ``eap_ig``, ``atp_star``): also score this many top edges (by mean
            estimate) by exact path patching on every pair, reported beside the estimate; 0 skips it.
        faithfulness: also measure the faithfulness curve of the top edges by this method's scores, CPR and CMD
            (:class:`Faithfulness`; one forward per fraction and pair).
        ablation: how the faithfulness curve ablates the edges outside a circuit: ``patch`` (each pair's
            counterfactual sender values) or ``mean`` (their mean over the pairs).
        declared: a circuit to measure beside the curve (edges, or ``{"sender", "receiver", "channel"}`` rows as a
            training record's ``planted_edges``): its edges, and the direct edges into the logits of the heads its
            edges end at.
        method_kwargs: passed to the engine (``exact``: ``max_tokens``, ``layout``, ...).

    Raises:
        InputError: unknown method or position class, no pairs, pairs of several conditions, heads or layers
            outside the model, or a selection that leaves no edge.
    """
    if method not in CIRCUIT_FUNCTIONS:
        raise InputError(f"unknown circuit method {method!r}; methods: {', '.join(CIRCUIT_FUNCTIONS)}")
    if ablation not in CIRCUIT_ABLATIONS:
        raise InputError(f"unknown ablation {ablation!r}; ablations: {', '.join(CIRCUIT_ABLATIONS)}")
    declared_circuit = _declared_circuit(declared or ())
    check_position_class(sender_at)
    check_position_class(receiver_at)
    pairs = list(pairs)
    if not pairs:
        raise InputError("a circuit needs at least one counterfactual pair")
    conditions = {getattr(p, "condition", None) for p in pairs}
    if len(conditions) != 1:
        raise InputError(f"pairs mix conditions {sorted(map(str, conditions))}; score one condition at a time")
    chosen = [(l, h) for l in vlm.adapter.head_layers() for h in range(vlm.n_heads)]
    if heads is not None:
        wanted = check_head_list(heads, n_layers=vlm.n_layers, n_heads=vlm.n_heads)
        chosen = [lh for lh in chosen if lh in set(wanted)]
    if layers is not None:
        bad = [l for l in layers if not 0 <= int(l) < vlm.n_layers]
        if bad:
            raise InputError(f"layers {bad} are out of range; the model has layers 0..{vlm.n_layers - 1}")
        chosen = [lh for lh in chosen if lh[0] in {int(l) for l in layers}]
    edges = all_edges(vlm, chosen, chosen, channels, logits)
    if not edges:
        raise InputError("the chosen heads and layers leave no edge: a receiver must sit in a later layer than its "
                         "sender (or pass logits=True for the direct edges)")
    fmt = vlm.prompt_format(prompt_format)
    sender_layers = sorted({e.sender[0] for e in edges})
    per_pair = np.zeros((len(pairs), len(edges)))
    run_key = {"model": vlm.name, "method": method, "condition": str(next(iter(conditions))),
               "edges": [e.label for e in edges], "sender_at": sender_at, "receiver_at": receiver_at,
               "pairs": [p.id for p in pairs], "content": pairs_digest(pairs), "prompt_format": fmt}
    done = resume_checkpoint(checkpoint, run_key, per_pair)
    start = time.perf_counter()
    compute = CIRCUIT_FUNCTIONS[method]
    tasks: dict[int, PathTask] = {}
    for i, pair in enumerate(tqdm(pairs, desc=f"circuit ({method})", disable=not progress)):
        if i < done:
            continue
        task = _task(vlm, pair, fmt, sender_at, receiver_at, sender_layers)
        base, patched = compute(vlm, task, edges, **method_kwargs)
        per_pair[i] = patched - base
        if method in ESTIMATED and verify_top > 0:
            tasks[i] = task
        if checkpoint is not None:
            save_checkpoint(checkpoint, run_key, per_pair[: i + 1])
    verified = None
    if method in ESTIMATED and verify_top > 0:
        top = np.argsort(-per_pair.mean(0), kind="stable")[:verify_top]
        verified = np.full(per_pair.shape, np.nan)
        for i, pair in enumerate(pairs):
            task = tasks.get(i) or _task(vlm, pair, fmt, sender_at, receiver_at, sender_layers)
            base, patched = exact_path_diffs(vlm, task, [edges[j] for j in top])
            verified[i, top] = patched - base
    seconds = time.perf_counter() - start
    curve = None
    if faithfulness:
        tasks_in_order = (tasks.get(i) or _task(vlm, pair, fmt, sender_at, receiver_at, sender_layers)
                          for i, pair in enumerate(pairs))
        curve = faithfulness_curve(vlm, tasks_in_order, edges, per_pair.mean(0), ablation=ablation,
                                   declared=declared_circuit, progress=progress)
    if checkpoint is not None:
        Path(checkpoint).unlink(missing_ok=True)
    return Circuit(condition=next(iter(conditions)), method=method, model=vlm.name, edges=edges, per_pair=per_pair,
                   sender_at=sender_at, receiver_at=receiver_at, seconds=seconds,
                   pair_ids=[p.id for p in pairs], prompt_format=fmt, verified=verified, faithfulness=curve)


def _declared_circuit(declared: Sequence[Any]) -> list[Edge]:
    """Declared edges (Edge or table rows) and the direct edges into the logits of the heads they end at (a head
    no declared edge leaves)."""
    edges = [e if isinstance(e, Edge) else parse_edge(str(e["sender"]), str(e["receiver"]), str(e["channel"]))
             for e in declared]
    senders = {e.sender for e in edges}
    sinks = sorted({e.receiver for e in edges if e.receiver is not None and e.receiver not in senders})
    return edges + [Edge(r, None, LOGITS) for r in sinks if Edge(r, None, LOGITS) not in edges]


def _task(vlm: Any, pair: Any, fmt: str, sender_at: str, receiver_at: str, sender_layers: Sequence[int]) -> PathTask:
    """The :class:`~vlmbind.engine.paths.PathTask` of one scene pair at the two position classes."""
    clean, counterfactual, patch, a, a_star = aligned_scene_pair(vlm, pair, fmt)
    index = clean.index[0]
    return PathTask.from_counterfactual(vlm, clean, counterfactual, class_positions(index, sender_at, patch),
                                        class_positions(index, receiver_at, patch), sender_layers, a, a_star)


# ----------------------------------------------------------------------------------------------------------------
# scoring a circuit against declared edges
# ----------------------------------------------------------------------------------------------------------------
def declared_edges(record: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The ``planted_edges`` of a training record: ``[{"sender", "receiver", "channel", ...}]`` (empty when it
    declares none)."""
    return [dict(e) for e in ((record or {}).get("planted_edges") or [])]


def edge_rank_metrics(frame: pd.DataFrame, declared: Sequence[Mapping[str, Any]],
                      score: str = "score") -> dict[str, Any]:
    """How an edge table ranks the declared edges among all head-to-head edges (direct edges into the logits are
    left out): each declared edge's 1-based rank (highest ``score`` first), recall@k (k = how many are declared)
    and the AUROC of declared vs every other head-to-head edge."""
    heads = frame[frame["receiver"] != LOGITS].reset_index(drop=True)
    values = heads[score].to_numpy(float)
    order = np.argsort(-values, kind="stable")
    rank = np.empty(len(values), dtype=int)
    rank[order] = np.arange(1, len(values) + 1)
    keys = list(zip(heads["sender"].astype(str), heads["receiver"].astype(str), heads["channel"].astype(str)))
    labels = np.zeros(len(values), dtype=int)
    ranks = []
    for edge in declared:
        key = (str(edge["sender"]), str(edge["receiver"]), str(edge["channel"]))
        if key not in keys:
            ranks.append(None)
            continue
        i = keys.index(key)
        labels[i] = 1
        ranks.append(int(rank[i]))
    k = len(declared)
    found = [r for r in ranks if r is not None]
    return {"edges": len(values), "declared_ranks": ranks,
            "recall_at_k": float(np.mean([r is not None and r <= k for r in ranks])) if k else None,
            "auroc": float(roc_auc_score(labels, values)) if 0 < labels.sum() < len(values) else None,
            "declared_scored": len(found)}
