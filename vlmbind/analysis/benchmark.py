"""One table of every method on every planted organism and its twin: which method finds a mechanism that is known
to be there, and what it reports where it is not.

:func:`benchmark` validates each planted organism against its own planted heads and its twin (the same recipe
without the SIIT losses) against the planted organism's heads: scene heads by
:func:`~vlmbind.analysis.validate.validate`, search heads by
:func:`~vlmbind.analysis.search_validation.validate_search`. :func:`benchmark_rows` turns each validation into rows
of one table, one row per method a validation ran:

* node methods (one row per condition and mediation method, and ``tracking`` for search heads): AUROC of the
  planted heads against every other head, recall@k, the smallest planted score over the largest |unplanted| one
  (``ratio``; tracking ranks heads by -RMSE and has no ratio);
* ``ablation:<mode>``: accuracy with the top-k heads ablated against random-k (``separation`` = mean random-k minus
  top-k, with a 95% interval from the random draws' spread and the top arm's Wilson interval);
* ``edit:position_id``: the position-ID edit's efficacy (the control beside it);
* ``edges:<method>``: AUROC and recall@k of the declared planted edges among every head-to-head edge.

The rows are read from what the validations ran, never listed here: a method added to the validations (a mediation
method registered with the engine, an edge estimate, an ablation mode) appears in the table without a change to this
module. On a twin every figure is measured against heads that were planted elsewhere: high values there mean the
method (or the recipe) finds those heads without the planting, a warning against reading the planted organism's
number as the method's success.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from ..core.errors import InputError
from ..core.io import write_json_atomic, write_text_atomic
from ..core.results import Result, read_json_object, register_result, require_keys
from ..engine.loading import load
from ..viz import shared_plotlyjs
from .ablation import wilson_interval
from .validate import ValidationResult, rank_metrics, recorded_planted

COLUMNS = ("organism", "role", "condition", "method", "family", "auroc", "recall_at_k", "ratio", "separation",
           "separation_low", "separation_high", "efficacy", "control", "n", "seconds")
ROLES = ("planted", "twin")
FAMILIES = ("node", "tracking", "ablation", "edit", "edges")


def _row(result: ValidationResult, role: str, **values: Any) -> dict[str, Any]:
    row = dict.fromkeys(COLUMNS)
    row.update(organism=result.model, role=role, **values)
    return row


def separation(arms: Sequence[Mapping[str, Any]]) -> tuple[float, float, float] | None:
    """Mean random-k accuracy minus top-k accuracy, with a 95% interval: the random draws' t-interval and the top
    arm's Wilson interval, combined (None without both arms)."""
    top = [a for a in arms if a["arm"] == "top"]
    random = [float(a["accuracy"]) for a in arms if a["arm"] == "random"]
    if not top or not random:
        return None
    top_acc, n = float(top[0]["accuracy"]), int(top[0]["n"])
    mean = float(np.mean(random))
    half_random = (stats.t.ppf(0.975, len(random) - 1) * np.std(random, ddof=1) / np.sqrt(len(random))
                   if len(random) > 1 else 0.0)
    low_top, high_top = wilson_interval(top_acc, n)
    half_top = max(top_acc - low_top, high_top - top_acc)
    half = float(np.hypot(half_random, half_top))
    return mean - top_acc, mean - top_acc - half, mean - top_acc + half


def benchmark_rows(result: ValidationResult, role: str) -> list[dict[str, Any]]:
    """The table's rows of one validation (``role``: ``planted`` against its own heads, ``twin`` against another
    organism's)."""
    if role not in ROLES:
        raise InputError(f"role must be one of {ROLES}, got {role!r}")
    rows = []
    for r in result.methods:
        rows.append(_row(result, role, condition=r["condition"], method=r["method"], family="node",
                         auroc=r["auroc"], recall_at_k=r["recall_at_k"], ratio=r["ratio"], n=r["n_pairs"],
                         seconds=r["seconds"]))
    if result.tracking:
        frame = pd.DataFrame(result.tracking)
        frame = frame[np.isfinite(frame["rmse"])]
        if len(frame):
            layers, heads = int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1
            scores = np.full((layers, heads), -np.inf)
            scores[frame["layer"], frame["head"]] = -frame["rmse"]
            planted = [(int(r.layer), int(r.head)) for r in frame.itertuples() if r.reference]
            metrics = rank_metrics(scores, planted)
            rows.append(_row(result, role, condition=result.params.get("condition", "search"), method="tracking",
                             family="tracking", auroc=metrics["auroc"], recall_at_k=metrics["recall_at_k"],
                             n=result.params.get("n_points"), seconds=result.seconds.get("tracking")))
    condition = ",".join(sorted(result.heads)) or None
    for mode in sorted({a["mode"] for a in result.ablation}):
        arms = [a for a in result.ablation if a["mode"] == mode]
        found = separation(arms)
        top = next(a for a in arms if a["arm"] == "top")
        values = dict(zip(("separation", "separation_low", "separation_high"), found)) if found else {}
        rows.append(_row(result, role, condition=condition, method=f"ablation:{mode}", family="ablation",
                         n=top["n"], seconds=result.seconds.get("ablation"), **values))
    edit = result.edit_summary()
    if edit is not None:
        rows.append(_row(result, role, condition="id_selection", method="edit:position_id", family="edit",
                         efficacy=edit["efficacy"], control=edit["control"], n=edit["n"],
                         seconds=result.seconds.get("edit")))
    for r in result.edges:
        rows.append(_row(result, role, condition=r["condition"], method=f"edges:{r['method']}", family="edges",
                         auroc=r["auroc"], recall_at_k=r["recall_at_k"], n=r["n_pairs"], seconds=r["seconds"]))
    return rows


@register_result
@dataclass
class BenchmarkResult(Result):
    """Every method on every planted organism and its twin (see the module docstring).

    Attributes:
        rows: one per (organism, method): the :data:`COLUMNS`.
        organisms: planted organism -> its twin (None where no twin is shipped).
        params: the validations' sizes and seed.
        seconds: wall time per organism.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    organisms: dict[str, str | None] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    kind = "benchmark"
    reproduced_files = ("benchmark.json", "benchmark.csv")
    marker_files = ("benchmark.json",)
    table_name = "benchmark.csv"

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=list(COLUMNS))

    def summary(self) -> dict[str, Any]:
        return {"organisms": self.organisms, "rows": self.rows, "params": self.params, "seconds": self.seconds}

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        return {}, {"benchmark.csv": self.to_frame()}

    def save(self, out: str | os.PathLike) -> Path:
        out = Path(out)
        write_json_atomic({"rows": self.rows, "organisms": self.organisms, "params": self.params,
                           "seconds": self.seconds}, out / "benchmark.json")
        write_text_atomic(self.to_frame().to_csv(index=False), out / "benchmark.csv")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BenchmarkResult:
        path = Path(directory) / "benchmark.json"
        data = read_json_object(path)
        require_keys(data, ("rows", "organisms"), path)
        return cls(rows=data["rows"], organisms=data["organisms"], params=data.get("params", {}),
                   seconds=data.get("seconds", {}))

    def markdown(self) -> str:
        """The table as markdown, one row per (method, organism role), figures as saved (the docs' table)."""
        lines = ["| organism | role | method | condition | AUROC | recall@k | ratio | ablation separation | "
                 "edit efficacy (control) | n | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            sep = "-" if r["separation"] is None else (f"{r['separation']:+.2f} [{r['separation_low']:+.2f}, "
                                                       f"{r['separation_high']:+.2f}]")
            edit = "-" if r["efficacy"] is None else (f"{r['efficacy']:.2f} ({_number(r['control'])})")
            lines.append(f"| {r['organism']} | {r['role']} | {r['method']} | {r['condition'] or '-'} | "
                         f"{_number(r['auroc'])} | {_number(r['recall_at_k'])} | {_number(r['ratio'], '.1f')} | "
                         f"{sep} | {edit} | {r['n'] if r['n'] is not None else '-'} | {_number(r['seconds'], '.1f')} |")
        return "\n".join(lines)


    def compact_markdown(self) -> str:
        """One row per method and one column per organism: the node methods', tracking's and edges' AUROC of the
        planted heads or edges (the mean over conditions), ablation's separation (random-k minus top-k accuracy) and
        the edit's efficacy (the README's table; the full one says n, intervals and seconds)."""
        frame = self.to_frame()
        if frame.empty:
            return ""
        columns = list(dict.fromkeys(frame["organism"]))
        value = {"node": "auroc", "tracking": "auroc", "edges": "auroc", "ablation": "separation", "edit": "efficacy"}
        lines = ["| method (" + "; ".join(f"{f}: {v}" for f, v in (("nodes, tracking, edges", "AUROC"),
                                                                   ("ablation", "random-k minus top-k"),
                                                                   ("edit", "efficacy"))) + ") | "
                 + " | ".join(f"{c} ({frame.loc[frame['organism'] == c, 'role'].iloc[0]})" for c in columns) + " |",
                 "|---|" + "---|" * len(columns)]
        for method in dict.fromkeys(frame["method"]):
            rows = frame[frame["method"] == method]
            field_name = value[rows["family"].iloc[0]]
            cells = []
            for c in columns:
                values = pd.to_numeric(rows.loc[rows["organism"] == c, field_name], errors="coerce").dropna()
                cells.append(_number(float(values.mean()), "+.2f" if field_name == "separation" else ".2f")
                             if len(values) else "-")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _number(value: Any, fmt: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    return format(value, fmt)


def benchmark(organisms: Mapping[str, str | None], validations: Mapping[str, Any], *,
              out: str | os.PathLike | None = None, figures: bool = True) -> BenchmarkResult:
    """Validate every planted organism and its twin and gather one table.

    Args:
        organisms: planted organism -> its twin (None: no twin), e.g.
            :func:`~vlmbind.core.shipped.planted_organisms`.
        validations: per planted organism, a function ``(vlm, reference, reference_source) -> ValidationResult``
            (the scene or the search validation with its sizes bound).
        out: where each validation is saved (``out/<organism>``, its figure loading one ``out/plotly.min.js``),
            beside the table.
        figures: write each validation's figure (False: its tables only; ``vlmbind export`` draws it later).

    Raises:
        InputError: an organism without a validation function.
    """
    missing = sorted(set(organisms) - set(validations))
    if missing:
        raise InputError(f"no validation given for {missing}")
    result = BenchmarkResult(organisms=dict(organisms))
    for planted, twin in organisms.items():
        for name, role in ((planted, "planted"), (twin, "twin")):
            if name is None:
                continue
            start = time.perf_counter()
            vlm = load(name)
            reference = None if role == "planted" else recorded_planted(planted)
            validation = validations[planted](vlm, reference, None if role == "planted" else planted)
            if out is not None:
                with shared_plotlyjs(out):
                    validation.save(Path(out) / name, figure=figures)
            result.rows += benchmark_rows(validation, role)
            result.seconds[name] = time.perf_counter() - start
    return result

