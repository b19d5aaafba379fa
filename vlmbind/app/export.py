"""``vlmbind export RESULT_DIR --format png|svg|html|csv``: re-render saved results without loading a model.

Design: the directory tree is searched for result folders (symlinked folders are not followed, the output folder is
skipped); each result class says whether a folder holds its files and loads itself from them (the table of kinds in
:mod:`vlmbind.core.results`), and its ``exports()`` name the figures and tables written here. Each figure is rebuilt
from the saved numbers only, through the same builders the writers used (:mod:`vlmbind.viz`), so an exported HTML
carries the same figure data as the original. Everything is rendered in memory first and written only when every figure
and table succeeded; each file is written atomically and, if a write fails, the files of this export are removed again,
so a failed export leaves nothing partial. Every target path is resolved and checked to lie inside the output directory.
PNG, SVG and PDF go through kaleido (one shared Chromium process when several figures are exported); HTML pages load one
``plotly.min.js`` written at the top of the output folder. Without an output folder the export goes next to the results,
unless they are part of a source tree (:func:`default_export_dir`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .. import analysis  # noqa: F401  (importing analysis registers every result kind)
from ..core import results
from ..core.choices import EXPORT_FORMATS as FORMATS  # noqa: F401  (the formats, named here for callers)
from ..core.choices import EXPORT_MANIFEST as MANIFEST
from ..core.choices import check_export_arguments, check_result_dir
from ..core.errors import InputError
from ..core.io import write_bytes_atomic
from ..core.results import RESULTS
from ..viz.figures import PLOTLYJS_FILE, plotlyjs_bundle

# how deep export looks for result folders below RESULT_DIR (a demo nests them three levels down)
MAX_DEPTH = 6


@dataclass
class ResultSet:
    """One recognised result folder: its figures and tidy tables, built from the saved files only.

    Attributes:
        kind: a key of :data:`vlmbind.core.results.RESULTS` (``demo``, ``locate``, ``ablate``, ``edit``, ...).
        rel: the folder relative to the result directory (``"."`` for the directory itself).
        figures: file stem -> a function building the plotly figure.
        tables: CSV file name -> tidy frame.
    """

    kind: str
    rel: str
    figures: dict[str, Callable[[], Any]] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# reading: the result classes know their files (vlmbind.core.results)
# ----------------------------------------------------------------------------------------------------------------
def detect(directory: Path) -> str | None:
    """The kind of result ``directory`` holds (a key of :data:`vlmbind.core.results.RESULTS`), or None when it holds
    none.

    Raises:
        InputError: a marker file (e.g. ``results.json``) is damaged, or the folder holds several results.
    """
    cls = results.detect(directory)
    return None if cls is None else cls.kind


def load(directory: Path, kind: str, rel: str = ".") -> ResultSet:
    """Read one result folder of a known ``kind`` into a :class:`ResultSet` (figures are built lazily).

    Raises:
        InputError: a file is unreadable or lacks the columns / keys its writer always writes.
    """
    if kind not in RESULTS:
        raise InputError(f"unknown result kind {kind!r}")
    figures, tables = RESULTS[kind].load(directory).exports()
    return ResultSet(kind, rel, figures, tables)


def scan(root: Path, skip: Path | None = None) -> list[ResultSet]:
    """Every recognised result folder at or below ``root`` (depth-first, sorted by name).

    Args:
        root: the result directory.
        skip: a folder not to look into (the export's own output folder).

    Raises:
        InputError: ``root`` is not a directory.
    """
    check_result_dir(root)
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


# PNG is a raster: drawn at twice the figure's layout size by default, so it stays sharp on a slide or a page
DEFAULT_PNG_SCALE = 2.0


def _render(fig: Any, fmt: str, name: str, rel: str, *, width: int | None = None, height: int | None = None,
            scale: float | None = None) -> bytes:
    if fmt == "html":
        # the same div id and the same relative plotly.js reference as vlmbind.viz.write_html_atomic under the
        # results' root: the original and the export are comparable byte for byte
        src = Path(os.path.relpath(PLOTLYJS_FILE, Path(rel).parent)).as_posix()
        return fig.to_html(include_plotlyjs=src, full_html=True, div_id=f"vlmbind-{name}").encode("utf-8")
    if scale is None:
        scale = DEFAULT_PNG_SCALE if fmt == "png" else 1.0
    return fig.to_image(format=fmt, width=width, height=height, scale=scale)


def _tracked_by_git(directory: Path) -> Path | None:
    """The top of the git work tree when ``directory`` holds files git tracks (it is part of a source tree), else
    None (also when git is not installed)."""
    try:
        top = subprocess.run(["git", "-C", str(directory), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode != 0:
            return None
        tracked = subprocess.run(["git", "-C", str(directory), "ls-files", "--", "."], capture_output=True,
                                 text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(top.stdout.strip()) if tracked.returncode == 0 and tracked.stdout.strip() else None


def default_export_dir(result_dir: str | os.PathLike) -> Path:
    """Where an export goes without ``--out``: ``RESULT_DIR/export``, next to the results; but when RESULT_DIR is
    part of a source tree (git tracks files in it, e.g. a repository's shipped results), ``runs/export/<its path in
    the repository>`` at the top of that work tree instead, so an export never adds files to the source tree."""
    root = Path(result_dir)
    top = _tracked_by_git(root) if root.is_dir() else None
    if top is None:
        return root / "export"
    return top / "runs" / "export" / root.resolve().relative_to(top.resolve())


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


def export_results(result_dir: str | os.PathLike, fmt: str = "html", out: str | os.PathLike | None = None, *,
                   width: int | None = None, height: int | None = None, scale: float | None = None) -> ExportReport:
    """Re-render every recognised result under ``result_dir`` in ``fmt``, without loading a model.

    Args:
        result_dir: a folder written by ``vlmbind locate / ablate / edit / rsa / track / probe / demo`` (searched
            recursively).
        fmt: ``png``, ``svg``, ``pdf``, ``html`` (one file per figure, ``<name>.<fmt>``; HTML pages load one
            ``plotly.min.js`` written at the top of ``out``) or ``csv`` (the tidy tables; JSON results such as
            ablation arms flattened).
        out: the output folder (default :func:`default_export_dir`: ``result_dir/export``, or ``runs/export/...``
            when ``result_dir`` is part of a source tree); sub-folders mirror ``result_dir``.
        width, height: png / svg / pdf: the page size in CSS pixels (default: each figure's own layout size).
        scale: png / svg / pdf: the size multiplier (default 2 for png, 1 for the vector formats).

    Returns:
        An :class:`ExportReport` with the written files and per-file timings.

    Raises:
        InputError: unknown format, a missing / empty / unrecognised directory, a malformed result file, a path
            outside ``out``, or an unwritable ``out`` (nothing is left written then).
    """
    start = time.perf_counter()
    root = check_export_arguments(result_dir, fmt, width=width, height=height, scale=scale)
    out_dir = Path(out) if out is not None else default_export_dir(root)
    sets = scan(root, skip=out_dir)
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
                rel = prefix + f"{name}.{fmt}"
                jobs.append((rel, lambda b=build, n=name, r=rel: _render(b(), fmt, n, r, width=width, height=height,
                                                                         scale=scale)))
    if not jobs:
        raise InputError(f"{str(root)!r} holds results ({', '.join(sorted({r.kind for r in sets}))}) but no "
                         f"{'tables' if fmt == 'csv' else 'figures'}; try --format csv")
    for rel, _ in jobs:  # refuse an escaping path before anything is rendered or written
        safe_target(out_dir, rel)

    server = fmt in ("png", "svg", "pdf") and len(jobs) > 1
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
    if fmt == "html":  # one copy of plotly.js for every page of the export
        payload.append((PLOTLYJS_FILE, plotlyjs_bundle().encode("utf-8")))
    manifest = {"source": str(root.resolve()), "format": fmt, "files": [rel for rel, _ in payload]}
    _write_all(out_dir, [*payload, (MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))])
    return ExportReport(str(root), str(out_dir), fmt, [{"dir": r.rel, "kind": r.kind} for r in sets],
                        [rel for rel, _ in payload], timings, time.perf_counter() - start)
