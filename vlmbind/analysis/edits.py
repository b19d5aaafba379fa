"""Position-ID additive edits (VSM) and the entropy-repair experiment: ``edit_study``, ``entropy_repair`` and
``vlmbind edit``.

Design: a position ID ``d_c`` is, per chosen head, the mean output z of that head (the head's slice of the
``o_proj`` input, site ``blocks.{l}.attn.hook_z``) at the last prompt token over estimation examples whose missing
object sits at grid cell ``c`` (:func:`estimate_position_ids`; cells with fewer than ``min_count`` examples get no
estimate, and how many examples that dropped is reported). The edit adds ``alpha * (d_t - d_o)`` to the heads' z at the
prompt's last position only, ``o`` the missing object's cell and ``t`` a described object's cell; efficacy is the share
of held-out examples whose answer becomes the object at ``t``. The control adds ``alpha * (d_c - d_o)`` with ``c`` a
random *empty* cell of the scene (one holding no object), so a reader sees whether switching to ``t`` needs ``t``'s ID
or follows from any perturbation of that size. Answers are decoded greedily by re-running full forwards (no key/value
cache) on the growing sequence, so the edit sits at one absolute position, the prompt's last, in every step; the first
two words are scored like :func:`vlmbind.analysis.evaluation.score`. The edit's vector differs per example, while
:class:`~vlmbind.engine.hooks.AddToHeads` takes one vector for the whole batch, so :class:`AddToHeadRows` (an
``AddToHeads`` whose vector may be ``B h D``, one per row) batches several examples per forward; it is tested against
``AddToHeads`` and against a plain ``o_proj`` pre-hook. Entropy repair (:func:`entropy_repair`) estimates IDs on
high-entropy scenes (distinct features) and on low-entropy scenes (shared features), and adds ``alpha * (d^high_o -
d^low_o)`` on held-out low-entropy scenes: it injects the *correct* cell's ID, an oracle repair as in VSM, not a method
that could run without knowing the answer's cell. Its control injects the high-entropy ID of a random empty cell
instead.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.choices import EDIT_POSITIONS
from ..core.errors import InputError, TooFewEstimatesError
from ..core.io import write_json_atomic
from ..core.results import Result, read_json_object, register_result
from ..core.sites import parse_heads
from ..engine.decoding import greedy_decode
from ..engine.interventions import AddToHeadRows
from ..stimuli import scene_description
from ..viz import write_html_atomic
from ..viz.edits import edit_figure, edit_traces, repair_figure, repair_traces
from .evaluation import score, training_defaults
from .position_ids import (
    Cell,
    check_alphas,
    check_heads,
    check_positive,
    chunks,
    estimate_position_ids,
    estimated_cells,
    object_cell,
    target_cell,
)

EDIT_ARMS = ("edit", "control", "random_direction")
REPAIR_ARMS = ("repair", "control")
RANDOM_DIRECTION_STREAM = 7  # the random-direction control's own random stream


def answer_budget(vlm: Any, examples: Sequence[Any]) -> int:
    """Tokens enough to spell any object name of the scenes, plus one that shows the second word has ended."""
    tok = vlm.adapter.tokenizer
    names = {o.name for e in examples for o in e.objects}
    return max(len(tok(" " + n, add_special_tokens=False)["input_ids"]) for n in names) + 1


def edited_decode(vlm: Any, batch: Any, heads: list[tuple[int, int]], vectors: torch.Tensor, alpha: float,
                  budget: int, positions: str = "last") -> list[str]:
    """Greedy answers with ``alpha * vectors`` added to the heads at the prompt's last position, and with
    ``positions="answer"`` also at every answer position already generated (the forward that picks token ``s`` edits
    the last prompt position and the ``s`` after it: every position that predicts an answer token)."""
    last = torch.as_tensor(batch.last_positions, dtype=torch.long)[:, None]
    if positions == "last":
        return greedy_decode(vlm, batch, edit_interventions(heads, last, vectors, alpha), budget)
    return greedy_decode(vlm, batch, (), budget, step_interventions=lambda step: edit_interventions(
        heads, last + torch.arange(step + 1)[None], vectors, alpha))


def edit_interventions(heads: list[tuple[int, int]], positions: Any, vectors: torch.Tensor,
                       alpha: float) -> list[AddToHeadRows]:
    """One :class:`AddToHeadRows` per layer adding ``alpha * vectors`` (``B H D``, ``H`` in ``heads`` order)."""
    by_layer: dict[int, list[int]] = {}
    for j, (layer, _) in enumerate(heads):
        by_layer.setdefault(layer, []).append(j)
    return [AddToHeadRows(layer=layer, heads=[heads[j][1] for j in js], positions=positions,
                          vector=vectors[:, js], alpha=float(alpha)) for layer, js in sorted(by_layer.items())]


def _outcome(example: Any, output: str, t_name: str | None) -> str:
    """``switch`` (names the object at t), ``original`` (names the missing object) or ``other``."""
    if t_name is not None and score(replace(example, answer=t_name), output)[0]:
        return "switch"
    return "original" if score(example, output)[0] else "other"


def _parsed(output: str) -> str:
    return " ".join(output.split()[:2])


# ------------------------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------------------------
def _stimulus_kwargs(vlm: Any, n_objects: Any, entropy: str, stimulus: dict[str, Any] | None) -> dict[str, Any]:
    return training_defaults(vlm, "scene", {"n_objects": n_objects, "entropy": entropy, **(stimulus or {})})


def alpha_label(alpha: float) -> str:
    return f"{alpha:g}"


@dataclass(kw_only=True)
class PositionEditStudy(Result):
    """What the position-ID edit and the entropy repair have in common: an edit of ``heads`` at several alphas,
    evaluated per arm, saved as ``results.json`` and ``curve.html``.

    Attributes:
        model: the model's name.
        heads: the edited heads.
        alphas: the alphas (0 included).
        rows: per alpha and arm, the shares the study reports (see the subclass).
        records: one dict per (example, alpha, arm); not saved in ``results.json``.
        clean_accuracy: accuracy of the unedited model on the evaluated examples.
        alpha0_identical: alpha 0 gave the unedited outputs on every example and arm.
        n_estimate, n_eval, n_used: estimation examples, evaluation examples drawn, and evaluated.
        skipped: reason -> evaluation examples skipped (a cell without an estimate).
        norms: per head, the mean norms of the added directions over the evaluated examples.
        params, seed, seconds: stimuli, seed and wall time.
    """

    model: str
    heads: list[tuple[int, int]]
    alphas: list[float]
    rows: list[dict[str, Any]]
    records: list[dict[str, Any]]
    clean_accuracy: float
    alpha0_identical: bool
    n_estimate: int
    n_eval: int
    n_used: int
    skipped: dict[str, int]
    norms: dict[str, Any]
    params: dict[str, Any]
    seed: int
    seconds: float = 0.0

    figure_name = "curve"
    table_name = "rows.csv"

    @staticmethod
    def common_fields(data: dict[str, Any]) -> dict[str, Any]:
        """The shared fields from a saved ``results.json`` (per-example records are not saved there)."""
        return dict(model=data["model"], heads=parse_heads(data["heads"]), alphas=[float(a) for a in data["alphas"]],
                    rows=data["rows"], records=[], clean_accuracy=data["clean_accuracy"],
                    alpha0_identical=data["alpha0_identical"], n_estimate=data["n_estimate"], n_eval=data["n_eval"],
                    n_used=data["n_used"], skipped=data["skipped"], norms=data.get("norms", {}),
                    params=data.get("params", {}), seed=data.get("seed", 0), seconds=data.get("seconds", 0.0))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> PositionEditStudy:
        path = Path(directory) / "results.json"
        try:
            return cls.from_dict(read_json_object(path))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{str(path)!r} lacks {exc} or holds a bad value; it is not the file vlmbind edit "
                             f"wrote") from None

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def head_labels(self) -> list[str]:
        return [f"{l}.{h}" for l, h in self.heads]

    def lookup(self, alpha: float, arm: str, column: str) -> float:
        for r in self.rows:
            if r["arm"] == arm and r["alpha"] == float(alpha):
                return float(r[column])
        raise KeyError(f"no row for alpha {alpha} and arm {arm!r}")

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``results.json`` (:meth:`summary`) and ``curve.html`` atomically."""
        out = Path(out)
        write_json_atomic(self.summary(), out / "results.json")
        write_html_atomic(self.figure(), out / "curve.html")
        return out


@register_result
@dataclass(kw_only=True)
class RepairResult(PositionEditStudy):
    """Accuracy on low-entropy scenes with the correct cell's high-entropy ID injected, per alpha.

    Attributes (besides :class:`PositionEditStudy`'s):
        rows: ``{"alpha", "arm": "repair"|"control", "n", "accuracy", "change", "changed"}`` per alpha and arm;
            ``change`` is the accuracy minus the accuracy at alpha 0, ``changed`` the share of outputs that differ
            from the unedited ones.
        clean_accuracy: low-entropy accuracy of the unedited model on the evaluated examples.
        high_accuracy: high-entropy accuracy of the unedited model on as many held-out high-entropy scenes
            (reference: how much there is to repair).
        estimates: the high- and low-entropy :meth:`PositionIDs.summary`.
        norms: per head, the mean ``|d^high_o - d^low_o|`` and the control's ``|d^high_w - d^low_o|``.
    """

    high_accuracy: float
    estimates: dict[str, Any]

    kind = "repair"
    marker_keys = ("rows", "injects")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RepairResult:
        """The result from its ``results.json`` (:meth:`summary`)."""
        return cls(**cls.common_fields(data), high_accuracy=data["high_entropy_accuracy"],
                   estimates=data.get("estimates", {}))

    def accuracy(self, alpha: float, arm: str = "repair") -> float:
        return self.lookup(alpha, arm, "accuracy")

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model, "heads": self.head_labels(), "alphas": self.alphas,
            "injects": "d^high_o - d^low_o at the missing object's (correct) cell o: an oracle repair, as in VSM",
            "control": "d^high_w - d^low_o, w a random empty cell (no object) of the scene with a high-entropy ID",
            "clean_accuracy": self.clean_accuracy, "high_entropy_accuracy": self.high_accuracy,
            "alpha0_identical": self.alpha0_identical, "n_estimate": self.n_estimate, "n_eval": self.n_eval,
            "n_used": self.n_used, "skipped": self.skipped, "rows": self.rows, "estimates": self.estimates,
            "norms": self.norms, "params": self.params, "seed": self.seed, "seconds": self.seconds,
        }

    def traces(self) -> list[Any]:
        return repair_traces(self.rows, self.alphas, self.high_accuracy)

    def figure(self) -> Any:
        return repair_figure(self.rows, self.alphas, self.high_accuracy, model=self.model, heads=self.head_labels(),
                             n_used=self.n_used)

    def panel(self) -> dict[str, Any]:
        """What :func:`vlmbind.viz.edits.edit_figure` draws the repair panel from."""
        return {"rows": self.rows, "alphas": self.alphas, "high_accuracy": self.high_accuracy, "n_used": self.n_used}


@register_result
@dataclass(kw_only=True)
class EditResult(PositionEditStudy):
    """Efficacy of the position-ID edit per alpha, with the empty-cell and random-direction controls.

    Attributes (besides :class:`PositionEditStudy`'s):
        rows: per alpha and arm (``edit``: ``d_t - d_o``; ``control``: ``d_c - d_o``, ``c`` an empty cell;
            ``random_direction``: a random direction per head with the norm of that head's ``d_t - d_o``):
            ``n``, ``efficacy`` (names the object at t), ``original`` (names the missing object), ``other``
            (anything else), ``described`` (names any described object, t included) and ``changed`` (differs from
            the unedited output).
        records: one dict per (example, alpha, arm): ids, cells, output, parsed answer, outcome.
        clean_names_t: share of unedited outputs that already name the object at t.
        estimate: :meth:`PositionIDs.summary` (cells, counts, skipped estimation examples, mean |z| per head).
        norms: per head, the mean ``|d_t - d_o|`` (edit) and ``|d_c - d_o|`` (control) over the evaluated examples.
        repair: an attached :class:`RepairResult` (saved in the same files), or None.
        prompt_format: ``raw`` or ``chat``.
        positions: where the edit was added (:data:`EDIT_POSITIONS`).
    """

    clean_names_t: float
    estimate: dict[str, Any]
    repair: RepairResult | None = None
    prompt_format: str = "raw"
    positions: str = "last"

    kind = "edit"
    reproduced_files = ("results.json", "curve.html")
    marker_keys = ("rows", "efficacy")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EditResult:
        """The result from its ``results.json`` (:meth:`summary`)."""
        return cls(
            **cls.common_fields(data), clean_names_t=data["clean_names_t"], estimate=data.get("estimate", {}),
            repair=RepairResult.from_dict(data["repair"]) if data.get("repair") else None,
            prompt_format=data.get("prompt_format", "raw"), positions=data.get("positions", "last"),
        )

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        figures, tables = super().exports()
        if self.repair is not None:
            tables["repair_rows.csv"] = self.repair.to_frame()
        return figures, tables

    def efficacy(self, alpha: float, arm: str = "edit") -> float:
        return self.lookup(alpha, arm, "efficacy")

    def summary(self) -> dict[str, Any]:
        out = {
            "model": self.model, "heads": self.head_labels(), "alphas": self.alphas,
            "edit": "z_h += alpha * (d_t - d_o) at the last prompt position"
                    + (" and every answer position" if self.positions == "answer" else "")
                    + "; t a described object's cell",
            "positions": self.positions,
            "control": "z_h += alpha * (d_c - d_o), c a random empty cell (no object) of the scene; efficacy still "
                       "counts outputs naming the object at t",
            "random_direction": "z_h += alpha * |d_t - d_o| * u, u a random unit vector per head and example; "
                                "efficacy counts outputs naming the object at t",
            "random_direction_efficacy": {alpha_label(r["alpha"]): r["efficacy"] for r in self.rows
                                          if r["arm"] == "random_direction"},
            "efficacy": {alpha_label(r["alpha"]): r["efficacy"] for r in self.rows if r["arm"] == "edit"},
            "control_efficacy": {alpha_label(r["alpha"]): r["efficacy"] for r in self.rows if r["arm"] == "control"},
            "clean_accuracy": self.clean_accuracy, "clean_names_t": self.clean_names_t,
            "alpha0_identical": self.alpha0_identical, "n_estimate": self.n_estimate, "n_eval": self.n_eval,
            "n_used": self.n_used, "skipped": self.skipped, "rows": self.rows, "estimate": self.estimate,
            "norms": self.norms, "params": self.params, "seed": self.seed, "seconds": self.seconds,
            "prompt_format": self.prompt_format,
        }
        if self.repair is not None:
            out["repair"] = self.repair.summary()
        return out

    def traces(self) -> list[Any]:
        return edit_traces(self.rows)

    def figure(self) -> Any:
        """Efficacy against alpha with the control (plus the repair curve beside it when attached)."""
        return edit_figure(self.rows, model=self.model, heads=self.head_labels(), n_used=self.n_used,
                           repair=None if self.repair is None else self.repair.panel())


def _share(records: list[dict[str, Any]], key: str, value: Any = True) -> float:
    return sum(r[key] == value for r in records) / max(1, len(records))


# ------------------------------------------------------------------------------------------------------------------
# The edit study
# ------------------------------------------------------------------------------------------------------------------
def _estimated_empty(cells: Collection[Cell], example: Any) -> list[Cell]:
    """The cells of ``cells`` (estimated ones) that hold no object of ``example``, in raster order."""
    occupied = {object_cell(o) for o in example.objects}
    return [c for c in sorted(cells) if c not in occupied]


def _edit_choices(example: Any, cells: Collection[Cell]) -> tuple[str | None, list[str], list[Cell]]:
    """For one evaluation example of the edit and the cells with an estimate: why it cannot be edited (its
    ``skipped`` key; None when it can), the described objects whose cell has an estimate (the candidates for ``t``)
    and the estimated empty cells (the candidates for the control's ``c``)."""
    targets = [k for k in example.fields["described"] if object_cell(example.objects[k]) in cells]
    empty = _estimated_empty(cells, example)
    if target_cell(example) not in cells:
        return "missing_object_cell_without_estimate", targets, empty
    if not targets:
        return "no_described_cell_with_estimate", targets, empty
    if not empty:
        return "no_empty_cell_with_estimate", targets, empty
    return None, targets, empty


def _repair_choices(example: Any, high_cells: Collection[Cell], low_cells: Collection[Cell]
                    ) -> tuple[str | None, list[Cell]]:
    """For one low-entropy evaluation example of the repair: why it cannot be repaired (its ``skipped`` key; None
    when it can) and the empty cells with a high-entropy estimate (the candidates for the control's ``w``)."""
    o, empty = target_cell(example), _estimated_empty(high_cells, example)
    if o not in high_cells:
        return "missing_object_cell_without_high_estimate", empty
    if o not in low_cells:
        return "missing_object_cell_without_low_estimate", empty
    if not empty:
        return "no_empty_cell_with_high_estimate", empty
    return None, empty


# the most estimation examples the fix of a too-small n_estimate is looked for up to (scenes are cheap to draw)
MOST_ESTIMATES_TRIED = 1 << 16


def _enough_estimates(n_estimate: int, works: Callable[[int], bool]) -> int | None:
    """The first of ``2 n_estimate``, ``4 n_estimate``, ... (up to :data:`MOST_ESTIMATES_TRIED`) with which
    ``works`` (read from the scenes alone: no model runs); None when none does."""
    n = n_estimate * 2
    while n <= MOST_ESTIMATES_TRIED:
        if works(n):
            return n
        n *= 2
    return None


def _too_few_estimates(reason: str, n_estimate: int, enough: int | None) -> TooFewEstimatesError:
    """The error of a study whose ``n_estimate`` scenes leave no evaluation example usable. It carries ``reason``,
    ``n_estimate`` and ``enough`` (the first doubling of ``n_estimate`` that leaves one, or None), so that a caller
    can name its own option (``vlmbind edit``: ``--n-estimate``)."""
    fix = (f"use n_estimate={enough} (its scenes leave examples to evaluate, at this seed and n_eval)"
           if enough is not None else
           f"more estimation examples (up to {MOST_ESTIMATES_TRIED}) do not help: use more evaluation examples")
    error = TooFewEstimatesError(f"{n_estimate} estimation examples are too few: {reason}; {fix}")
    error.reason, error.n_estimate, error.enough = reason, n_estimate, enough
    return error


def _cells_reason(cells: Collection[Cell], examples: Sequence[Any], min_count: int, which: str = "") -> str:
    """Why the estimation scenes estimate no cell an evaluation example needs, in words."""
    if not cells:
        most = max(Counter(target_cell(e) for e in examples).values())
        return (f"no cell holds the missing object of {min_count} of the {which}estimation scenes (most: {most}), "
                f"so no position ID is estimated")
    return (f"the {len(cells)} cells with {f'a {which}' if which else 'an '}estimate are not those any evaluation "
            f"example needs")


class _EstimateCheck:
    """Whether ``n`` estimation scenes leave an evaluation example to a study (the edit, or the repair), and why not,
    read from the scenes alone."""

    def __init__(self, vlm: Any, study: str, n_eval: int, seed: int, n_objects: Any, entropy: str, min_count: int,
                 stimulus: dict[str, Any] | None) -> None:
        self.study, self.n_eval, self.seed, self.min_count = study, n_eval, seed, min_count
        entropies = ("high", "low") if study == "repair" else (entropy,)
        self.scenes = [_stimulus_kwargs(vlm, n_objects, e, stimulus) for e in entropies]

    def draw(self, n: int) -> list[list[Any]]:
        """The study's scene lists (edit: one; repair: high- and low-entropy) with ``n`` estimation scenes."""
        return [list(scene_description(n + self.n_eval, self.seed, **kw)) for kw in self.scenes]

    def usable(self, n: int) -> bool:
        drawn = self.draw(n)
        cells = [estimated_cells(scenes[:n], self.min_count) for scenes in drawn]
        if self.study == "repair":
            return any(_repair_choices(e, *cells)[0] is None for e in drawn[1][n:])
        return any(_edit_choices(e, cells[0])[0] is None for e in drawn[0][n:])

    def reason(self, n: int) -> str:
        """Why ``n`` estimation scenes leave the study nothing to evaluate."""
        estimation = [scenes[:n] for scenes in self.draw(n)]
        cells = [estimated_cells(scenes, self.min_count) for scenes in estimation]
        kinds = ("high-entropy ", "low-entropy ") if self.study == "repair" else ("",)
        for kind, scenes, found in zip(kinds, estimation, cells):
            if not found:
                return _cells_reason(found, scenes, self.min_count, kind)
        if self.study == "repair":
            return ("the cells with both a high- and a low-entropy estimate are not those any low-entropy evaluation "
                    "example needs")
        return _cells_reason(cells[0], estimation[0], self.min_count)


def check_estimates(vlm: Any, *, n_estimate: int, n_eval: int, seed: int = 0, n_objects: int | tuple[int, int] = 3,
                    entropy: str = "high", min_count: int = 3, stimulus: dict[str, Any] | None = None,
                    studies: Sequence[str] = ("edit",)) -> None:
    """Before any model runs, from the scenes alone: raise when the ``n_estimate`` estimation scenes of
    :func:`edit_study` (``"edit"`` in ``studies``) or :func:`entropy_repair` (``"repair"``), with the same arguments,
    estimate the cells of no evaluation example, naming the first doubling of ``n_estimate`` that serves every study
    asked for.

    Raises:
        TooFewEstimatesError: a study would have no evaluation example; ``enough`` on it is the fix.
    """
    checks = [_EstimateCheck(vlm, study, n_eval, seed, n_objects, entropy, min_count, stimulus) for study in studies]
    failing = [check for check in checks if not check.usable(n_estimate)]
    if failing:
        raise _too_few_estimates(failing[0].reason(n_estimate), n_estimate,
                                 _enough_estimates(n_estimate, lambda n: all(c.usable(n) for c in checks)))


def default_positions(vlm: Any) -> str:
    """Where an edit goes unless told: ``answer`` on a model vlmbind trained (its IDs are planted and read at the
    answer positions too, and ``validate`` edits there), else ``last``, VSM's edit at the prompt's last position."""
    return "answer" if getattr(vlm, "training", None) is not None else "last"


def edit_positions(vlm: Any, positions: str | None) -> str:
    positions = default_positions(vlm) if positions is None else positions
    if positions not in EDIT_POSITIONS:
        raise InputError(f"positions must be one of {', '.join(EDIT_POSITIONS)}, got {positions!r}")
    return positions


def edit_study(vlm: Any, heads: Any, alphas: Any, *, n_estimate: int = 512, n_eval: int = 64, seed: int = 0,
               n_objects: int | tuple[int, int] = 3, entropy: str = "high", min_count: int = 3,
               batch_size: int = 32, stimulus: dict[str, Any] | None = None, progress: bool = False,
               positions: str | None = None) -> EditResult:
    """VSM's position-ID edit: efficacy of ``z_h += alpha * (d_t - d_o)`` per alpha, with two controls.

    The controls ask whether the edit's direction matters or any push of its size would do: the empty-cell control
    adds ``alpha * (d_c - d_o)``, the ID of a cell with no object (a position-like push that points at nothing),
    the random-direction control adds ``alpha * |d_t - d_o| * u`` with ``u`` a random unit vector per head and
    example (a push of the edit's size in no particular direction). Both count outputs that name the object at t.

    Scenes come from ``scene_description(n_estimate + n_eval, seed)`` with the model's own training canvas and
    pools (:func:`vlmbind.analysis.evaluation.training_defaults`): the first ``n_estimate`` estimate the IDs, the rest
    are evaluated. Per evaluated example, ``t`` is a uniformly drawn described object's cell and ``c`` a uniformly drawn
    empty cell, both among cells with an estimate (seeded by ``seed``); examples whose missing object's cell, or all
    of whose candidate cells, lack an estimate are skipped and counted.

    Args:
        vlm: a loaded VLM.
        heads: ``[(layer, head), ...]`` or ``"12.3,14.0"``.
        alphas: the scales to sweep (0 is always added).
        n_estimate: estimation examples.
        n_eval: evaluation examples drawn.
        seed: stimulus and choice seed.
        n_objects: objects per scene (int or inclusive range).
        entropy: ``"high"`` (distinct features) or ``"low"``.
        min_count: the fewest estimation examples a cell needs for an estimate.
        batch_size: examples per forward.
        stimulus: extra ``scene_description`` options (``canvas``, ``colours``, ``shapes``) overriding the model's.
        progress: show progress bars.
        positions: ``last`` (the prompt's last position, VSM's edit) or ``answer`` (also every answer position:
            with a two-word answer the shape is predicted at the colour word, so an ID read there too must be edited
            there too; an organism planted with ``last_positions="answer"`` reads it at both); None:
            :func:`default_positions` (``answer`` on a model vlmbind trained, ``last`` on others).

    Returns:
        :class:`EditResult`.

    Raises:
        InputError: bad heads, alphas or sizes, impossible stimuli, or no evaluation example left.
    """
    return edit_studies(vlm, [heads], alphas, n_estimate=n_estimate, n_eval=n_eval, seed=seed, n_objects=n_objects,
                        entropy=entropy, min_count=min_count, batch_size=batch_size, stimulus=stimulus,
                        progress=progress, positions=positions)[0]


def edit_studies(vlm: Any, head_sets: Sequence[Any], alphas: Any, *, n_estimate: int = 512, n_eval: int = 64,
                 seed: int = 0, n_objects: int | tuple[int, int] = 3, entropy: str = "high", min_count: int = 3,
                 batch_size: int = 32, stimulus: dict[str, Any] | None = None, progress: bool = False,
                 positions: str | None = None) -> list[EditResult]:
    """:func:`edit_study` for several head sets on the same scenes: the position IDs are estimated once for every
    head of every set and the unedited answers decoded once, so each result equals that set's own ``edit_study``
    (a test checks it) at a fraction of the cost. Each result's ``seconds`` is the whole call's.

    Args:
        head_sets: the head sets (each as ``heads`` in :func:`edit_study`); the rest as in :func:`edit_study`.

    Raises:
        InputError: no head set, or as :func:`edit_study`.
    """
    start = time.perf_counter()
    if not head_sets:
        raise InputError("head_sets is empty: pass at least one set of heads to edit")
    sets, alphas = [check_heads(vlm, heads) for heads in head_sets], check_alphas(alphas)
    positions = edit_positions(vlm, positions)
    check_positive(n_estimate=n_estimate, n_eval=n_eval, min_count=min_count, batch_size=batch_size)
    check_estimates(vlm, n_estimate=n_estimate, n_eval=n_eval, seed=seed, n_objects=n_objects, entropy=entropy,
                    min_count=min_count, stimulus=stimulus)
    data = scene_description(n_estimate + n_eval, seed, **_stimulus_kwargs(vlm, n_objects, entropy, stimulus))
    examples = list(data)
    every = list(dict.fromkeys(head for heads in sets for head in heads))
    all_ids = estimate_position_ids(vlm, examples[:n_estimate], every, min_count=min_count, batch_size=batch_size,
                                    progress=progress)
    rng = np.random.default_rng(seed)
    skipped = {"missing_object_cell_without_estimate": 0, "no_described_cell_with_estimate": 0,
               "no_empty_cell_with_estimate": 0}
    plan = []
    cells = set(all_ids.cells)
    for e in examples[n_estimate:]:  # which cells have an estimate does not depend on the head
        reason, targets, empty = _edit_choices(e, cells)
        if reason is not None:
            skipped[reason] += 1
        else:
            k = targets[int(rng.integers(len(targets)))]
            plan.append((e, target_cell(e), k, empty[int(rng.integers(len(empty)))]))
    # check_estimates made sure the plan is not empty

    ids_by_set = [all_ids.subset(heads) for heads in sets]
    records: list[list[dict[str, Any]]] = [[] for _ in sets]
    clean_records: list[dict[str, Any]] = []
    delta_norms = [{arm: torch.zeros(len(heads), dtype=torch.float64) for arm in EDIT_ARMS} for heads in sets]
    offset = 0
    for chunk in tqdm(chunks(plan, batch_size), desc="edit", disable=not progress):
        indices = range(offset, offset + len(chunk))
        offset += len(chunk)
        batch = vlm.prepare([p[0].image for p in chunk], [p[0].prompt for p in chunk])
        budget = answer_budget(vlm, [p[0] for p in chunk])
        clean = greedy_decode(vlm, batch, (), budget)
        for (e, o, k, c), out in zip(chunk, clean):
            t_name = e.objects[k].name
            clean_records.append({"correct": score(e, out)[0], "names_t": _outcome(e, out, t_name) == "switch"})
        for heads, ids, into, norms in zip(sets, ids_by_set, records, delta_norms):
            edit = torch.stack([ids.delta(object_cell(e.objects[k]), o) for e, o, k, _ in chunk])
            vectors = {
                "edit": edit,
                "control": torch.stack([ids.delta(c, o) for e, o, _, c in chunk]),
                "random_direction": edit.norm(dim=-1, keepdim=True) * torch.stack(
                    [random_directions(seed, i, heads, edit.shape[-1]) for i in indices]),
            }
            for arm in EDIT_ARMS:
                norms[arm] += vectors[arm].norm(dim=-1).sum(0)
            for alpha in alphas:
                for arm in EDIT_ARMS:
                    outs = edited_decode(vlm, batch, heads, vectors[arm], alpha, budget, positions)
                    for (e, o, k, c), out, base in zip(chunk, outs, clean):
                        t_name = e.objects[k].name
                        described = {e.objects[j].name for j in e.fields["described"]}
                        into.append({
                            "id": e.id, "alpha": alpha, "arm": arm, "o": list(o), "t": list(object_cell(e.objects[k])),
                            "c": list(c), "answer": e.answer, "t_name": t_name, "output": out,
                            "parsed": _parsed(out), "outcome": _outcome(e, out, t_name),
                            "described": _parsed(out) in described, "changed": out != base,
                        })
    n_used, seconds = len(plan), time.perf_counter() - start
    results = []
    for heads, ids, set_records, set_norms in zip(sets, ids_by_set, records, delta_norms):
        rows = []
        for alpha in alphas:
            for arm in EDIT_ARMS:
                group = [r for r in set_records if r["alpha"] == alpha and r["arm"] == arm]
                rows.append({"alpha": alpha, "arm": arm, "n": len(group),
                             "efficacy": _share(group, "outcome", "switch"),
                             "original": _share(group, "outcome", "original"),
                             "other": _share(group, "outcome", "other"),
                             "described": _share(group, "described"), "changed": _share(group, "changed")})
        norms = {f"{l}.{h}": {"z": float(ids.z_norm[j]), "edit_delta": float(set_norms["edit"][j]) / n_used,
                              "control_delta": float(set_norms["control"][j]) / n_used}
                 for j, (l, h) in enumerate(heads)}
        results.append(EditResult(
            model=vlm.name, heads=heads, alphas=alphas, rows=rows, records=set_records,
            clean_accuracy=_share(clean_records, "correct"), clean_names_t=_share(clean_records, "names_t"),
            alpha0_identical=not any(r["changed"] for r in set_records if r["alpha"] == 0.0),
            n_estimate=n_estimate, n_eval=n_eval, n_used=n_used, skipped=skipped, estimate=ids.summary(),
            norms=norms, params=data.params, seed=seed, seconds=seconds, prompt_format=vlm.active_prompt_format,
            positions=positions,
        ))
    return results


def random_directions(seed: int, index: int, heads: Sequence[tuple[int, int]], d_head: int) -> torch.Tensor:
    """``H D`` unit vectors, uniform on the sphere, one per head for evaluation example ``index``: the random-direction
    control's directions. Each is drawn from its own stream of (seed, example, layer, head), so a head gets the same
    direction whichever heads it is edited with, and the edit's own draws are untouched."""
    return torch.stack([_unit(np.random.default_rng([seed, RANDOM_DIRECTION_STREAM, index, l, h]), d_head)
                        for l, h in heads])


def _unit(rng: np.random.Generator, d: int) -> torch.Tensor:
    v = torch.as_tensor(rng.standard_normal(d), dtype=torch.float64)
    return v / v.norm()


# ------------------------------------------------------------------------------------------------------------------
# Entropy repair
# ------------------------------------------------------------------------------------------------------------------
def entropy_repair(vlm: Any, heads: Any, alphas: Any, *, n_estimate: int = 512, n_eval: int = 64, seed: int = 0,
                   n_objects: int | tuple[int, int] = 3, min_count: int = 3, batch_size: int = 32,
                   stimulus: dict[str, Any] | None = None, progress: bool = False,
                   positions: str | None = None) -> RepairResult:
    """VSM's entropy repair: inject the high-entropy position ID of the missing object's cell into low-entropy
    scenes, ``z_h += alpha * (d^high_o - d^low_o)``, and report accuracy per alpha.

    This is an oracle repair: it uses the correct answer's cell ``o``. The control injects
    ``d^high_w - d^low_o`` with ``w`` a random empty cell of the scene (seeded). ``d^high`` comes from
    ``n_estimate`` high-entropy scenes, ``d^low`` from the first ``n_estimate`` of ``n_estimate + n_eval``
    low-entropy scenes, whose remaining ``n_eval`` are evaluated; ``high_accuracy`` is the unedited accuracy on
    ``n_eval`` held-out high-entropy scenes.

    Args:
        vlm, heads, alphas, n_estimate, n_eval, seed, n_objects, min_count, batch_size, stimulus, progress,
            positions: as in
            :func:`edit_study`.

    Returns:
        :class:`RepairResult`.

    Raises:
        InputError: bad heads, alphas or sizes, impossible stimuli, or no evaluation example left.
    """
    start = time.perf_counter()
    positions = edit_positions(vlm, positions)
    heads, alphas = check_heads(vlm, heads), check_alphas(alphas)
    check_positive(n_estimate=n_estimate, n_eval=n_eval, min_count=min_count, batch_size=batch_size)
    check_estimates(vlm, n_estimate=n_estimate, n_eval=n_eval, seed=seed, n_objects=n_objects, min_count=min_count,
                    stimulus=stimulus, studies=("repair",))
    high = list(scene_description(n_estimate + n_eval, seed, **_stimulus_kwargs(vlm, n_objects, "high", stimulus)))
    low_data = scene_description(n_estimate + n_eval, seed, **_stimulus_kwargs(vlm, n_objects, "low", stimulus))
    low = list(low_data)
    ids_high = estimate_position_ids(vlm, high[:n_estimate], heads, min_count=min_count, batch_size=batch_size,
                                     progress=progress)
    ids_low = estimate_position_ids(vlm, low[:n_estimate], heads, min_count=min_count, batch_size=batch_size,
                                    progress=progress)
    rng = np.random.default_rng(seed)
    skipped = {"missing_object_cell_without_high_estimate": 0, "missing_object_cell_without_low_estimate": 0,
               "no_empty_cell_with_high_estimate": 0}
    plan = []
    high_cells, low_cells = set(ids_high.cells), set(ids_low.cells)
    for e in low[n_estimate:]:
        reason, empty = _repair_choices(e, high_cells, low_cells)
        if reason is not None:
            skipped[reason] += 1
        else:
            plan.append((e, target_cell(e), empty[int(rng.integers(len(empty)))]))
    # check_estimates made sure the plan is not empty

    high_correct = []
    for chunk in chunks(high[n_estimate:], batch_size):
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk])
        outs = greedy_decode(vlm, batch, (), answer_budget(vlm, chunk))
        high_correct += [score(e, out)[0] for e, out in zip(chunk, outs)]

    records: list[dict[str, Any]] = []
    clean_correct: list[bool] = []
    delta_norms = {arm: torch.zeros(len(heads), dtype=torch.float64) for arm in REPAIR_ARMS}
    for chunk in tqdm(chunks(plan, batch_size), desc="repair", disable=not progress):
        batch = vlm.prepare([p[0].image for p in chunk], [p[0].prompt for p in chunk])
        budget = answer_budget(vlm, [p[0] for p in chunk])
        clean = greedy_decode(vlm, batch, (), budget)
        clean_correct += [score(p[0], out)[0] for p, out in zip(chunk, clean)]
        vectors = {
            "repair": torch.stack([ids_high.vector(o) - ids_low.vector(o) for _, o, _ in chunk]),
            "control": torch.stack([ids_high.vector(w) - ids_low.vector(o) for _, o, w in chunk]),
        }
        for arm in REPAIR_ARMS:
            delta_norms[arm] += vectors[arm].norm(dim=-1).sum(0)
        for alpha in alphas:
            for arm in REPAIR_ARMS:
                outs = edited_decode(vlm, batch, heads, vectors[arm], alpha, budget, positions)
                for (e, o, w), out, base in zip(chunk, outs, clean):
                    records.append({"id": e.id, "alpha": alpha, "arm": arm, "o": list(o), "w": list(w),
                                    "answer": e.answer, "output": out, "parsed": _parsed(out),
                                    "correct": bool(score(e, out)[0]), "changed": out != base})
    rows = []
    for arm in REPAIR_ARMS:
        base = _share([r for r in records if r["alpha"] == 0.0 and r["arm"] == arm], "correct")
        for alpha in alphas:
            group = [r for r in records if r["alpha"] == alpha and r["arm"] == arm]
            acc = _share(group, "correct")
            rows.append({"alpha": alpha, "arm": arm, "n": len(group), "accuracy": acc, "change": acc - base,
                         "changed": _share(group, "changed")})
    rows.sort(key=lambda r: (r["alpha"], REPAIR_ARMS.index(r["arm"])))
    n_used = len(plan)
    norms = {f"{l}.{h}": {"z_low": float(ids_low.z_norm[j]), "repair_delta": float(delta_norms["repair"][j]) / n_used,
                          "control_delta": float(delta_norms["control"][j]) / n_used}
             for j, (l, h) in enumerate(heads)}
    return RepairResult(
        model=vlm.name, heads=heads, alphas=alphas, rows=rows, records=records,
        clean_accuracy=sum(clean_correct) / len(clean_correct), high_accuracy=sum(high_correct) / len(high_correct),
        alpha0_identical=not any(r["changed"] for r in records if r["alpha"] == 0.0), n_estimate=n_estimate,
        n_eval=n_eval, n_used=n_used, skipped=skipped,
        estimates={"high": ids_high.summary(), "low": ids_low.summary()}, norms=norms, params=low_data.params,
        seed=seed, seconds=time.perf_counter() - start,
    )
