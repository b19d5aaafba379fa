"""The result contract: what every saved analysis result can do, and the one table of result kinds.

Every result class (``HeadScores``, ``AblationResult``, ``EditResult``, ``RepairResult``, ``RSAResult``,
``TrackResult``, ``BindingResult``, ``EvalResult``, ``AttentionMass``, ``CausalOverview``, ``ValidationResult``,
``RepresentationOverview``) derives from :class:`Result` and is registered with :func:`register_result`:

* ``kind``: its name in this table (``locate``, ``ablate``, ...), the names ``vlmbind export`` reports;
* ``to_frame()``: a tidy table; ``figure()``: its plotly figure (built by :mod:`vlmbind.viz`), or None;
* ``save(dir)``: its files, atomically; ``load(dir)``: the result back from those files (``from_dict`` where the
  result is one JSON document);
* ``matches(dir)``: whether a folder holds a saved result of this kind (by the files ``save`` writes), so
  :func:`detect` needs no guessing outside the classes; folders written by older versions keep matching because the
  file names have not changed;
* ``exports()``: the figures (file stem -> builder) and tables (CSV name -> frame) ``vlmbind export`` writes.

A loaded result holds what its files hold: :class:`~vlmbind.analysis.HeadScores` saves the per-head means, standard
errors and counts (not the per-pair scores), and comes back with exactly those.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from .errors import InputError

# the readers of files a user hands in live in one place; results re-export the ones saved results use
from .userfiles import read_csv_columns, read_json_object, require_keys  # noqa: F401

RESULTS: dict[str, type[Result]] = {}


class Result:
    """Base of the result classes (they are dataclasses; this adds the contract and its defaults)."""

    kind: ClassVar[str]
    # the files save() writes that mark a folder as holding this kind, and the keys its results.json must have
    # (ablate, edit, repair and eval share that file name); neither: the kind is never found by scanning
    marker_files: ClassVar[tuple[str, ...]] = ()
    marker_keys: ClassVar[tuple[str, ...]] = ()
    # the files that save(load(folder)) writes again byte for byte (the others hold what a loaded result does not
    # keep: timings per probe, attribution's verified scores, per-example records); tests/app/test_export.py checks them
    reproduced_files: ClassVar[tuple[str, ...]] = ()
    # what export names the figure and the table of a result that has one of each
    figure_name: ClassVar[str | None] = None
    table_name: ClassVar[str | None] = None

    def to_frame(self) -> pd.DataFrame:
        raise NotImplementedError

    def figure(self) -> Any:
        return None

    def save(self, out: str | Path) -> Path:
        raise NotImplementedError

    @classmethod
    def matches(cls, directory: Path) -> bool:
        """Whether ``directory`` holds this kind's files (:attr:`marker_files`, :attr:`marker_keys`).

        Raises:
            InputError: its ``results.json`` is damaged (reported, never skipped).
        """
        if not cls.marker_files and not cls.marker_keys:
            return False
        if not has_files(directory, *cls.marker_files):
            return False
        return not cls.marker_keys or results_json_has(directory, *cls.marker_keys)

    @classmethod
    def load(cls, directory: str | Path) -> Result:
        raise NotImplementedError

    def exports(self) -> tuple[dict[str, Callable[[], Any]], dict[str, pd.DataFrame]]:
        """``(figures, tables)`` for ``vlmbind export``: file stem -> figure builder, CSV name -> frame."""
        figures = {self.figure_name: self.figure} if self.figure_name else {}
        tables = {self.table_name: self.to_frame()} if self.table_name else {}
        return figures, tables


def register_result(cls: type[Result]) -> type[Result]:
    """Class decorator: add a result class to :data:`RESULTS` under its ``kind``."""
    if cls.kind in RESULTS and RESULTS[cls.kind] is not cls:
        raise ValueError(f"result kind {cls.kind!r} registered twice")
    RESULTS[cls.kind] = cls
    return cls


def detect(directory: Path) -> type[Result] | None:
    """The result class whose saved files ``directory`` holds, or None.

    Raises:
        InputError: two kinds match (a folder holding two results' files), or a marker file is damaged.
    """
    found = [cls for cls in RESULTS.values() if cls.matches(directory)]
    if len(found) > 1:
        raise InputError(f"{str(directory)!r} holds the files of several results ({', '.join(c.kind for c in found)}); "
                         "keep one result per folder")
    return found[0] if found else None


def load_result(directory: str | Path) -> Result:
    """The saved result in ``directory``, whatever its kind.

    Raises:
        InputError: the folder holds no vlmbind result, or its files are damaged.
    """
    directory = Path(directory)
    cls = detect(directory)
    if cls is None:
        raise InputError(f"{str(directory)!r} holds no vlmbind result (kinds: {', '.join(RESULTS)})")
    return cls.load(directory)


# ----------------------------------------------------------------------------------------------------------------
# reading saved files (every error names the file and what is wrong with it)
# ----------------------------------------------------------------------------------------------------------------
def has_files(directory: Path, *names: str) -> bool:
    return all((Path(directory) / name).is_file() for name in names)


def results_json_has(directory: Path, *keys: str) -> bool:
    """Whether ``directory/results.json`` exists and has every key in ``keys`` (the ablate / edit / repair / eval
    results share that file name).

    Raises:
        InputError: it exists but is not a JSON object (a damaged result is reported, never skipped).
    """
    path = Path(directory) / "results.json"
    if not path.is_file():
        return False
    data = read_json_object(path)
    return all(k in data for k in keys)
