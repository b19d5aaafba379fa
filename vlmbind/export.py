"""``vlmbind export RESULT_DIR --format png|svg|html|csv``: re-render saved results without loading a model.

Design: a result directory is recognised by the files its writer leaves (``scores.csv`` + ``summary.json`` from
``locate``, ``results.json`` from ``ablate`` / ``edit``, ``rsa.csv``, ``rmse.csv`` + ``centroids.json``,
``probe.csv``, ``attention_mass.csv`` from ``demo``), and the directory tree is searched for such folders (symlinked
folders are not followed, the output folder is skipped). Each figure is rebuilt from the saved numbers only, through
the same builders the writers used (:func:`~vlmbind.viz.head_heatmap`, or the result classes reconstructed from their
JSON: :class:`~vlmbind.analysis.edits.EditResult`, :class:`~vlmbind.analysis.rsa.RSAResult`,
:class:`~vlmbind.analysis.tracking.TrackResult`, :class:`~vlmbind.analysis.binding.BindingResult`), so an exported
HTML carries the same figure data as the original. Everything is rendered in memory first and written only when every
figure and table succeeded; each file is written atomically and, if a write fails, the files of this export are
removed again, so a failed export leaves nothing partial. Every target path is resolved and checked to lie inside the
output directory. PNG and SVG go through kaleido (one shared Chromium process when several figures are exported).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .analysis.binding import BindingResult
from .analysis.edits import EditResult, RepairResult
from .analysis.rsa import RSAResult
from .analysis.tracking import TrackResult
from .errors import InputError
from .io import write_bytes_atomic
from .viz import head_heatmap
from .viz.figures import _full_title

FORMATS = ("png", "svg", "html", "csv")
# how deep export looks for result folders below RESULT_DIR (a demo nests them three levels down)
MAX_DEPTH = 6
# written into every output folder; scan() never reads a folder holding it (an export of tables looks like results)
MANIFEST = ".vlmbind-export.json"
# the demo heatmap's title (vlmbind/cli.py cmd_demo)
DEMO_TITLE = "Attention mass from the last token to the image tokens"


@dataclass
class ResultSet:
    """One recognised result folder: its figures and tidy tables, built from the saved files only.

    Attributes:
        kind: ``demo``, ``locate``, ``ablate``, ``edit``, ``repair``, ``rsa``, ``track``, ``probe`` or ``causal``.
        rel: the folder relative to the result directory (``"."`` for the directory itself).
        figures: file stem -> a function building the plotly figure.
        tables: CSV file name -> tidy frame.
    """

    kind: str
    rel: str
    figures: dict[str, Callable[[], Any]] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {str(path)!r} as JSON ({exc}); re-run the command that wrote it") from None
    if not isinstance(value, dict):
        raise InputError(f"{str(path)!r} holds a JSON {type(value).__name__}, not an object; it is not a vlmbind result")
    return value


def _read_csv(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    try:
        # round_trip: the parsed floats are exactly the written ones (the heatmap hover text shows repr())
        frame = pd.read_csv(path, float_precision="round_trip")
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise InputError(f"cannot read {str(path)!r} as CSV ({exc}); re-run the command that wrote it") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(f"{str(path)!r} has no column(s) {missing} (it has {list(frame.columns)}); it is not the "
                         f"file vlmbind wrote")
    return frame


def _require(data: dict[str, Any], keys: tuple[str, ...], path: Path) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise InputError(f"{str(path)!r} has no key(s) {missing}; it is not the file vlmbind wrote")


def detect(directory: Path) -> str | None:
    """The kind of result ``directory`` holds (see :class:`ResultSet`), or None when it holds none.

    Raises:
        InputError: its ``results.json`` is not a JSON object.
    """
    has = lambda name: (directory / name).is_file()  # noqa: E731
    if has("attention_mass.csv") and has("summary.json"):
        return "demo"
    if has("scores.csv") and has("summary.json"):
        return "locate"
    if has("rmse.csv") and has("centroids.json"):
        return "track"
    if has("rsa.csv"):
        return "rsa"
    if has("probe.csv"):
        return "probe"
    if has("object_attention.csv"):
        return "causal"
    if has("results.json"):
        # a results.json that does not parse is a damaged result, not "no result": say so instead of skipping it
        data = _read_json(directory / "results.json")
        if isinstance(data, dict) and "arms" in data:
            return "ablate"
        if isinstance(data, dict) and "rows" in data and "efficacy" in data:
            return "edit"
        if isinstance(data, dict) and "rows" in data and "injects" in data:
            return "repair"
    return None


def _heads(labels: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in str(label).split(".")) for label in labels]  # type: ignore[misc]


def _repair_result(data: dict[str, Any]) -> Any:
    return RepairResult(
        model=data["model"], heads=_heads(data["heads"]), alphas=[float(a) for a in data["alphas"]],
        rows=data["rows"], records=[], clean_accuracy=data["clean_accuracy"],
        high_accuracy=data["high_entropy_accuracy"], alpha0_identical=data["alpha0_identical"],
        n_estimate=data["n_estimate"], n_eval=data["n_eval"], n_used=data["n_used"], skipped=data["skipped"],
        estimates=data.get("estimates", {}), norms=data.get("norms", {}), params=data.get("params", {}),
        seed=data.get("seed", 0), seconds=data.get("seconds", 0.0),
    )


def _edit_result(data: dict[str, Any]) -> Any:
    return EditResult(
        model=data["model"], heads=_heads(data["heads"]), alphas=[float(a) for a in data["alphas"]],
        rows=data["rows"], records=[], clean_accuracy=data["clean_accuracy"], clean_names_t=data["clean_names_t"],
        alpha0_identical=data["alpha0_identical"], n_estimate=data["n_estimate"], n_eval=data["n_eval"],
        n_used=data["n_used"], skipped=data["skipped"], estimate=data.get("estimate", {}),
        norms=data.get("norms", {}), params=data.get("params", {}), seed=data.get("seed", 0),
        seconds=data.get("seconds", 0.0), repair=_repair_result(data["repair"]) if data.get("repair") else None,
    )


def _nan_array(value: Any, shape_tail: tuple[int, ...]) -> np.ndarray:
    """Nested lists with None for NaN (as ``_json_xy`` wrote them) -> a float array (``0 ...`` when empty)."""
    array = np.array(value, dtype=float)  # numpy turns None into NaN for float arrays
    return array.reshape(0, *shape_tail) if array.size == 0 else array


def _track_result(centroids: dict[str, Any], rmse: pd.DataFrame, path: Path) -> Any:
    """A :class:`TrackResult` from ``centroids.json`` (points ``N 2``, centroids ``N L 2`` and ``N L H 2``), checked
    against ``rmse.csv`` so a stale pair of files is not silently re-rendered."""
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
    result = TrackResult(
        model=centroids["model"], task=centroids["task"], threshold=float(centroids["threshold"]),
        query=centroids["query"], grid=centroids["grid"], canvas=centroids["canvas"],
        points=_nan_array(points, (2,)), mean_centroids=_nan_array(means, (n_layers, 2)),
        head_centroids=_nan_array(per_head, (n_layers, n_heads, 2)), point_example=np.array(owner, dtype=int),
        point_tokens=tokens, examples=examples,
    )
    rebuilt = result.to_frame()
    same = (len(rebuilt) == len(rmse)
            and np.allclose(rebuilt["rmse"].to_numpy(float), rmse["rmse"].to_numpy(float), equal_nan=True))
    if not same:
        raise InputError(f"{str(path / 'centroids.json')!r} and rmse.csv disagree (different runs?); re-run "
                         f"vlmbind track to write both")
    return result


def _ablation_table(data: dict[str, Any]) -> pd.DataFrame:
    """One row per arm, with the run's settings repeated: the JSON's arms flattened (heads joined by spaces)."""
    rows = [{"model": data["model"], "task": data["task"], "mode": data["mode"], "k": data["k"],
             "renormalize": data["renormalize"], "arm": a["arm"], "seed": a.get("seed"),
             "heads": " ".join(a.get("heads", [])), "accuracy": a["accuracy"], "n": a["n"]} for a in data["arms"]]
    return pd.DataFrame(rows, columns=["model", "task", "mode", "k", "renormalize", "arm", "seed", "heads",
                                       "accuracy", "n"])


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
    fig.update_layout(title={"text": _full_title(title, data["model"], n)}, xaxis={"title": {"text": "arm"}},
                      yaxis={"title": {"text": "accuracy"}, "range": [0, 1.02]}, template="plotly_white",
                      width=640, height=420)
    return fig


def load(directory: Path, kind: str, rel: str = ".") -> ResultSet:
    """Read one result folder of a known ``kind`` into a :class:`ResultSet` (figures are built lazily).

    Raises:
        InputError: a file is unreadable or lacks the columns / keys its writer always writes.
    """
    out = ResultSet(kind, rel)
    if kind == "demo":
        frame = _read_csv(directory / "attention_mass.csv", ("layer", "head", "mass"))
        summary = _read_json(directory / "summary.json")
        _require(summary, ("model",), directory / "summary.json")
        # the overlay needs the image-token boxes, which the demo does not save: only the heatmap is rebuilt
        out.figures["heatmap"] = lambda: head_heatmap(frame, "mass", title=DEMO_TITLE, model=summary["model"], n=1)
        out.tables["attention_mass.csv"] = frame
    elif kind == "locate":
        frame = _read_csv(directory / "scores.csv", ("layer", "head", "score", "stderr", "n"))
        summary = _read_json(directory / "summary.json")
        _require(summary, ("condition", "method", "model", "n"), directory / "summary.json")
        # HeadScores.figure's call; the per-pair scores it is built from are not saved, the means are
        out.figures["heatmap"] = lambda: head_heatmap(
            frame, value="score", title=f"{summary['condition']} mediation ({summary['method']})",
            model=summary["model"], n=int(summary["n"]), signed=True)
        out.tables["scores.csv"] = frame
    elif kind == "ablate":
        data = _read_json(directory / "results.json")
        _require(data, ("model", "task", "mode", "k", "renormalize", "arms"), directory / "results.json")
        out.figures["ablation"] = lambda: ablation_figure(data)
        out.tables["arms.csv"] = _ablation_table(data)
    elif kind in ("edit", "repair"):
        data = _read_json(directory / "results.json")
        try:
            result = _edit_result(data) if kind == "edit" else _repair_result(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{str(directory / 'results.json')!r} lacks {exc} or holds a bad value; it is not the "
                             f"file vlmbind edit wrote") from None
        out.figures["curve"] = result.figure
        out.tables["rows.csv"] = result.to_frame()
        if kind == "edit" and result.repair is not None:
            out.tables["repair_rows.csv"] = result.repair.to_frame()
    elif kind == "rsa":
        frame = _read_csv(directory / "rsa.csv", ("site", "component", "layer", "model_matrix", "r", "spearman", "p",
                                                  "n_objects"))
        meta = _read_json(directory / "rsa.json")
        _require(meta, ("model", "similarity", "permutations"), directory / "rsa.json")
        out.figures["rsa"] = RSAResult(meta["model"], meta["similarity"], int(meta["permutations"]), frame).figure
        out.tables["rsa.csv"] = frame
    elif kind == "track":
        rmse = _read_csv(directory / "rmse.csv", ("layer", "head", "rmse", "n_points"))
        centroids = _read_json(directory / "centroids.json")
        _require(centroids, ("model", "task", "threshold", "query", "grid", "canvas", "examples"),
                 directory / "centroids.json")
        try:
            result = _track_result(centroids, rmse, directory)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(f"{str(directory / 'centroids.json')!r} lacks {exc} or holds a bad value; re-run "
                             f"vlmbind track") from None
        out.figures["rmse"] = result.figure
        out.tables["rmse.csv"] = rmse
    elif kind == "probe":
        frame = _read_csv(directory / "probe.csv", ("site", "family", "B_O", "beta_O", "B_star_OF", "H_O", "n_test"))
        meta = _read_json(directory / "probe.json") if (directory / "probe.json").is_file() else {}
        if "model" not in meta:
            raise InputError(f"{str(directory)!r} has probe.csv but no probe.json naming the model; re-run vlmbind "
                             f"probe")
        out.figures["probe"] = BindingResult(meta["model"], frame).figure
        out.tables["probe.csv"] = frame
    elif kind == "causal":
        out.tables["object_attention.csv"] = _read_csv(directory / "object_attention.csv", ())
    else:
        raise InputError(f"unknown result kind {kind!r}")
    return out


def scan(root: Path, skip: Path | None = None) -> list[ResultSet]:
    """Every recognised result folder at or below ``root`` (depth-first, sorted by name).

    Args:
        root: the result directory.
        skip: a folder not to look into (the export's own output folder).

    Raises:
        InputError: ``root`` is not a directory.
    """
    if not root.is_dir():
        raise InputError(f"{str(root)!r} is not a directory; pass a folder written by vlmbind (locate, ablate, "
                         f"edit, rsa, track, probe or demo)")
    skip_resolved = skip.resolve() if skip is not None else None
    found: list[ResultSet] = []

    def visit(directory: Path, depth: int) -> None:
        if (directory / MANIFEST).is_file():  # an earlier export, not a result
            return
        kind = detect(directory)
        if kind is not None:
            found.append(load(directory, kind, directory.relative_to(root).as_posix()))
        if depth >= MAX_DEPTH:
            return
        for child in sorted(directory.iterdir()):
            # symlinked folders are not followed: no cycles, and nothing outside RESULT_DIR is read
            if child.is_dir() and not child.is_symlink() and not child.name.startswith(".") \
                    and child.resolve() != skip_resolved:
                visit(child, depth + 1)

    visit(root, 0)
    return found


# ----------------------------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------------------------
def safe_target(out: Path, relative: str) -> Path:
    """``out / relative``, refused unless it resolves to a path inside ``out``.

    Raises:
        InputError: ``relative`` is absolute or climbs out of ``out`` (``..``, or a symlink pointing elsewhere).
    """
    base = out.resolve()
    if Path(relative).is_absolute():
        raise InputError(f"export path {relative!r} is absolute; export paths must stay inside {str(base)!r}")
    target = (base / relative).resolve()
    if target == base or not target.is_relative_to(base):
        raise InputError(f"export path {relative!r} resolves to {str(target)!r}, outside the output directory "
                         f"{str(base)!r}; refusing to write there")
    return target


def _render(fig: Any, fmt: str, name: str) -> bytes:
    if fmt == "html":
        # same div id as vlmbind.viz.write_html_atomic: the original and the export are comparable byte for byte
        return fig.to_html(include_plotlyjs=True, full_html=True, div_id=f"vlmbind-{name}").encode("utf-8")
    return fig.to_image(format=fmt)


@dataclass
class ExportReport:
    """What :func:`export_results` wrote.

    Attributes:
        source: the result directory.
        out: the output directory.
        format: the format.
        results: ``{"dir": rel, "kind": kind}`` per recognised folder.
        files: the written files, relative to ``out``.
        timings: ``{"file": rel, "seconds": s}`` per rendered figure or table.
        seconds: total wall time.
    """

    source: str
    out: str
    format: str
    results: list[dict[str, str]]
    files: list[str]
    timings: list[dict[str, Any]]
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {"command": "export", "source": self.source, "out": self.out, "format": self.format,
                "results": self.results, "files": self.files, "timings": self.timings,
                "seconds": round(self.seconds, 3)}


def _write_all(out: Path, payload: list[tuple[str, bytes]]) -> None:
    """Write every ``(relative path, bytes)`` under ``out`` atomically; on a failure remove what this call wrote
    (files and the folders it created), so nothing partial is left.

    Raises:
        InputError: ``out`` or a file under it cannot be written.
    """
    created: list[Path] = []
    written: list[Path] = []
    try:
        # remember which folders are new, to remove exactly those on failure
        missing = [p for p in [out, *out.parents] if not p.exists()]
        out.mkdir(parents=True, exist_ok=True)
        created += reversed(missing)
        for rel, data in payload:
            target = safe_target(out, rel)
            new_dirs = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
            write_bytes_atomic(data, target)
            created += reversed(new_dirs)
            written.append(target)
    except (OSError, InputError) as exc:
        for path in written:
            path.unlink(missing_ok=True)
        for directory in reversed(created):  # deepest first; rmdir only removes a folder left empty
            try:
                directory.rmdir()
            except OSError:
                pass
        if isinstance(exc, InputError):
            raise
        raise InputError(f"cannot write the export to {str(out)!r} ({exc.strerror or exc}); pass a writable "
                         f"--out folder") from None


def export_results(result_dir: str | os.PathLike, fmt: str = "html", out: str | os.PathLike | None = None) -> ExportReport:
    """Re-render every recognised result under ``result_dir`` in ``fmt``, without loading a model.

    Args:
        result_dir: a folder written by ``vlmbind locate / ablate / edit / rsa / track / probe / demo`` (searched
            recursively).
        fmt: ``png``, ``svg``, ``html`` (one file per figure, ``<name>.<fmt>``) or ``csv`` (the tidy tables;
            JSON results such as ablation arms flattened).
        out: the output folder (default ``result_dir/export``); sub-folders mirror ``result_dir``.

    Returns:
        An :class:`ExportReport` with the written files and per-file timings.

    Raises:
        InputError: unknown format, a missing / empty / unrecognised directory, a malformed result file, a path
            outside ``out``, or an unwritable ``out`` (nothing is left written then).
    """
    start = time.perf_counter()
    if fmt not in FORMATS:
        raise InputError(f"unknown export format {fmt!r}; pass one of {', '.join(FORMATS)}")
    root = Path(result_dir)
    if not root.exists():
        raise InputError(f"result directory {str(root)!r} does not exist; pass a folder written by vlmbind")
    out_dir = Path(out) if out is not None else root / "export"
    sets = scan(root, skip=out_dir)
    if (root / MANIFEST).is_file():
        raise InputError(f"{str(root)!r} is the output of vlmbind export, not a result folder; pass the folder "
                         f"that was exported")
    if not sets:
        raise InputError(f"{str(root)!r} holds no vlmbind results (looked for scores.csv, results.json, rsa.csv, "
                         f"rmse.csv, probe.csv, attention_mass.csv up to {MAX_DEPTH} folders deep)")

    jobs: list[tuple[str, Callable[[], bytes]]] = []
    for rs in sets:
        prefix = "" if rs.rel == "." else rs.rel + "/"
        if fmt == "csv":
            for name, frame in rs.tables.items():
                jobs.append((prefix + name, lambda f=frame: f.to_csv(index=False).encode("utf-8")))
        else:
            for name, build in rs.figures.items():
                jobs.append((prefix + f"{name}.{fmt}", lambda b=build, n=name: _render(b(), fmt, n)))
    if not jobs:
        raise InputError(f"{str(root)!r} holds results ({', '.join(sorted({r.kind for r in sets}))}) but no "
                         f"{'tables' if fmt == 'csv' else 'figures'}; try --format csv")
    for rel, _ in jobs:  # refuse an escaping path before anything is rendered or written
        safe_target(out_dir, rel)

    server = fmt in ("png", "svg") and len(jobs) > 1
    payload, timings = [], []
    if server:
        import kaleido

        # one Chromium for every figure instead of a cold start (~2 s) per figure
        kaleido.start_sync_server(silence_warnings=True)
    try:
        with warnings.catch_warnings():
            # plotly warns that its (default) kaleido options are ignored by a running server: expected here
            warnings.filterwarnings("ignore", message="The kopts argument is ignored")
            for rel, job in jobs:
                t0 = time.perf_counter()
                payload.append((rel, job()))
                timings.append({"file": rel, "seconds": round(time.perf_counter() - t0, 4)})
    finally:
        if server:
            import kaleido

            kaleido.stop_sync_server(silence_warnings=True)
    manifest = {"source": str(root.resolve()), "format": fmt, "files": [rel for rel, _ in payload]}
    _write_all(out_dir, [*payload, (MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))])
    return ExportReport(str(root), str(out_dir), fmt, [{"dir": r.rel, "kind": r.kind} for r in sets],
                        [rel for rel, _ in payload], timings, time.perf_counter() - start)
