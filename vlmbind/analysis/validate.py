"""Every method against a planted mechanism: does vlmbind find heads that are known to do the work?

An organism trained with SIIT (:mod:`vlmbind.organisms.siit`) records in its training record which heads carry which
variable of VSM's pipeline (``planted``: condition -> ``["layer.head", ...]``). :func:`validate` runs each method on
fresh counterfactual pairs (another seed, and by default the object count the planting held out) and scores it
against those heads:

* head-level mediation, ``exact`` over every head, ``naive`` on a sample of heads (it must equal ``exact``),
  ``attribution`` (AtP, first order) and ``integrated_gradients`` (EAP-IG style): the rank of every planted head,
  recall@k (k = the number planted for the condition), AUROC over all heads, and the smallest planted mean score
  over the largest |score| of an unplanted head;
* ablation in each mode: the planted conditions' top-k heads together, against random-k heads drawn from the rest
  (several seeds), random-k heads drawn from the top-k's own layers (one per top-k head) and the bottom-k by
  |score|;
* the position-ID edit at the ID-selection heads: efficacy per alpha beside its empty-cell control;
* linear probes (held-out scenes) and PCA of each reference head's last-token output: the missing object's cell,
  colour and shape.

On a model with nothing planted, pass ``reference`` heads (e.g. the heads planted in a twin trained with the same data
and steps but behaviour loss only): the same table then says what each method reports where the mechanism is absent.
With no reference at all the rank metrics are left empty and the table lists each method's top heads. A planted
mechanism validates the methods; it says nothing about what pretrained VLMs do.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from ..core.checks import (
    check_ablation_modes,
    check_alphas,
    check_head_list,
    check_reference_conditions,
    check_validation_methods,
)
from ..core.choices import DEFAULT_ALPHAS, VALIDATION_METHODS
from ..core.errors import InputError, TooFewEstimatesError
from ..core.io import write_json_atomic, write_text_atomic
from ..core.results import Result, read_json_object, register_result, require_keys
from ..core.shipped import ORGANISM_NAMES, organism_dir
from ..core.sites import parse_heads
from ..engine.patching import METHOD_FUNCTIONS
from ..engine.vlm import TRAINING_FILE
from ..stimuli import scene_description, scene_pairs
from ..viz import write_html_atomic
from ..viz.validation import validation_figure
from .ablation import MODES, ablation_study, layers_short_of_heads
from .circuits import ESTIMATED, Circuit, circuit, declared_edges, edge_rank_metrics
from .edits import EDIT_POSITIONS, edit_studies
from .evaluation import training_defaults
from .mediation import HeadScores, locate, scene_task

SCENE_CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval")
PROBE_TARGETS = ("cell", "colour", "shape")


def planted_heads(vlm: Any) -> dict[str, list[tuple[int, int]]]:
    """The ``planted`` field of the model's training record (condition -> heads); empty when there is none."""
    training = getattr(vlm, "training", None) or {}
    return {c: parse_heads(list(h)) for c, h in (training.get("planted") or {}).items()}


def recorded_planted(model: str) -> dict[str, list[str]]:
    """The ``planted`` field of another model's training record, read without loading its weights: a shipped
    organism's name or a model directory.

    Raises:
        InputError: no training record there, or one without planted heads.
    """
    directory = organism_dir(model) if model in ORGANISM_NAMES else Path(model)
    path = directory / TRAINING_FILE
    if not path.is_file():
        raise InputError(f"{model!r} has no training record ({TRAINING_FILE}); name a shipped organism or a "
                         f"directory written by vlmbind.organisms.ship")
    planted = read_json_object(path).get("planted")
    if not planted:
        raise InputError(f"the training record of {model!r} lists no planted heads; name an organism trained with SIIT "
                         f"(e.g. organism-vsm)")
    return {c: list(h) for c, h in planted.items()}


def _flat_edge_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """An edge-method row for a CSV: the exact row's faithfulness as columns (CPR, CMD, the declared circuit's f,
    each with its interval) instead of a nested record."""
    out = {k: v for k, v in row.items() if k != "faithfulness"}
    f = row.get("faithfulness")
    if f:
        declared = f.get("declared") or {}
        out.update({"cpr": f["cpr"], "cpr_low": f["cpr_ci"][0], "cpr_high": f["cpr_ci"][1], "cmd": f["cmd"],
                    "cmd_low": f["cmd_ci"][0], "cmd_high": f["cmd_ci"][1], "declared_f": declared.get("f"),
                    "faithfulness_defined": f.get("defined")})
    return out


def recorded_edges(model: str) -> list[dict[str, Any]]:
    """The ``planted_edges`` of another model's training record (a shipped organism's name or a model directory);
    empty where it declares none."""
    directory = organism_dir(model) if model in ORGANISM_NAMES else Path(model)
    path = directory / TRAINING_FILE
    return declared_edges(read_json_object(path)) if path.is_file() else []


def held_out_objects(vlm: Any) -> int:
    """The object count the planting left out (its training record's ``siit.skip_objects``), else 3."""
    training = getattr(vlm, "training", None) or {}
    skipped = (training.get("siit") or {}).get("skip_objects") or []
    return int(skipped[0]) if skipped else 3


def rank_metrics(scores: np.ndarray, planted: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """How a layers x heads score map ranks the planted heads: 1-based ranks (highest score first), recall@k
    (k = len(planted)), AUROC of planted vs every other head, and min planted score / max |unplanted score|."""
    flat = np.asarray(scores, dtype=float)
    n_heads = flat.shape[1]
    order = np.argsort(-flat.ravel(), kind="stable")
    rank = np.empty(order.size, dtype=int)
    rank[order] = np.arange(1, order.size + 1)
    index = [l * n_heads + h for l, h in planted]
    if not index:
        return {"planted_ranks": [], "recall_at_k": None, "auroc": None, "planted_min": None,
                "unplanted_max_abs": float(np.abs(flat).max()), "ratio": None}
    labels = np.zeros(order.size, dtype=int)
    labels[index] = 1
    k = len(index)
    unplanted = np.abs(flat.ravel()[labels == 0])
    planted_min = float(flat.ravel()[index].min())
    biggest = float(unplanted.max()) if unplanted.size else 0.0
    return {"planted_ranks": [int(rank[i]) for i in index],
            "recall_at_k": float(np.mean([rank[i] <= k for i in index])),
            "auroc": float(roc_auc_score(labels, flat.ravel())) if 0 < k < order.size else None,
            "planted_min": planted_min, "unplanted_max_abs": biggest,
            "ratio": planted_min / biggest if biggest > 0 else None}


@register_result
@dataclass
class ValidationResult(Result):
    """Each method scored against planted (or reference) heads. Tables:

    Attributes:
        model: the model validated.
        reference: where the reference heads come from (``planted``: the model's own training record, the name of
            another model, ``given``, or None).
        heads: condition -> reference heads ``["l.h", ...]``.
        methods: one row per (condition, method): pairs, k, ranks, recall@k, AUROC, ratio, top heads, seconds.
        scores: one row per (condition, method, head): mean score, standard error, n, whether a reference head.
        naive_check: per condition, the largest |exact - naive| over the sampled heads and pairs, and the heads.
        ablation: one row per (mode, arm, seed): heads, accuracy, n; the arms are ``clean``, ``top``, ``random``
            (from the heads outside the top-k), ``random_same_layers`` (per top-k head another of its layer) and
            ``bottom``.
        edit: one row per (heads, alpha, arm) of the position-ID edit (efficacy, the share of answers naming a
            described object, n), or empty: every reference ID-selection head together, then each alone where there
            are several.
        probes: one row per (head, target): held-out accuracy, chance (the majority class), train / test sizes.
        edges: one row per edge-scoring method against the declared edges of the planted pipeline (the training
            record's ``planted_edges``, or the reference model's): each declared edge's rank among all head-to-head
            edges, recall@k, AUROC, seconds; ``exact`` is path patching (with the faithfulness of its top edges and
            of the declared circuit), ``eap``, ``eap_ig`` and ``atp_star`` its estimates, ``node_product`` the simpler
            strategy of ranking an edge by the product of its two heads' best exact node scores (no channel, no path).
        pca: per reference head, the first two principal components of its last-token output with labels.
        tracking: search heads (:func:`vlmbind.analysis.search_validation.validate_search`): one row per head of
            attention-centroid tracking: RMSE to the written point, points, the share of points its centroid lands
            within half a cell of (with its Wilson interval), whether a reference head.
        params: pairs, seeds, object count, entropy, alphas, ig steps.
        seconds: wall time per part.
        skipped: part -> why it was not run (e.g. the edit, when too few estimation scenes leave no cell with an
            estimate).
    """

    model: str
    reference: str | None
    heads: dict[str, list[str]]
    methods: list[dict[str, Any]] = field(default_factory=list)
    scores: list[dict[str, Any]] = field(default_factory=list)
    naive_check: dict[str, Any] = field(default_factory=dict)
    ablation: list[dict[str, Any]] = field(default_factory=list)
    edit: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    edges: list[dict[str, Any]] = field(default_factory=list)
    pca: list[dict[str, Any]] = field(default_factory=list)
    tracking: list[dict[str, Any]] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    kind = "validate"
    reproduced_files = ("validation.json", "methods.csv", "scores.csv", "ablation.csv",
                        "edit.csv", "probes.csv", "edge_methods.csv", "tracking.csv", "validation.html")
    marker_files = ("validation.json",)
    figure_name = "validation"
    table_name = "methods.csv"

    def to_frame(self) -> pd.DataFrame:
        """The methods table (one row per condition and method)."""
        rows = [{**r, "planted_ranks": " ".join(map(str, r["planted_ranks"])), "top_heads": " ".join(r["top_heads"]),
                 "heads": " ".join(r["heads"])} for r in self.methods]
        return pd.DataFrame(rows)

    def figure(self) -> Any:
        return validation_figure(self.methods, self.scores, self.pca, model=self.model, reference=self.reference)

    def ablation_summary(self) -> dict[str, dict[str, float]]:
        """Per mode: accuracy of the clean, top, random (mean over seeds), lowest random seed and bottom arms, and
        where it was run the random arm drawn from the top-k's own layers (``random_same_layers``, mean and lowest)."""
        out: dict[str, dict[str, float]] = {}
        for mode in sorted({r["mode"] for r in self.ablation}):
            rows = [r for r in self.ablation if r["mode"] == mode]
            random = [r["accuracy"] for r in rows if r["arm"] == "random"]
            out[mode] = {arm: float(np.mean([r["accuracy"] for r in rows if r["arm"] == arm]))
                         for arm in ("clean", "top", "bottom")}
            out[mode]["random"] = float(np.mean(random)) if random else float("nan")
            out[mode]["random_min"] = float(np.min(random)) if random else float("nan")
            out[mode]["random_seeds"] = len(random)
            matched = [r["accuracy"] for r in rows if r["arm"] == "random_same_layers"]
            if matched:
                out[mode]["random_same_layers"] = float(np.mean(matched))
                out[mode]["random_same_layers_min"] = float(np.min(matched))
        return out

    def edit_heads(self) -> list[str]:
        """The head sets the edit was run at (``"2.3 3.1"``): every reference ID-selection head together first, then
        each alone where there are several."""
        together = " ".join(self.heads.get("id_selection", []))
        return list(dict.fromkeys(r.get("heads", together) for r in self.edit))

    def edit_summary(self, heads: str | None = None) -> dict[str, Any] | None:
        """The alpha with the highest edit efficacy, its efficacy and the controls' at that alpha (``control``: the
        empty cell's ID; ``random_control``: a random direction of the edit's size, None in results saved before it),
        for the edit at
        ``heads`` (default: every reference ID-selection head together). Where the rows say how often the control's
        answer named a described object (``control_described``), ``control_chance`` is the control's efficacy if
        those answers fell on each described object alike: the switches an ID that points nowhere gives by chance."""
        sets = self.edit_heads()
        if not sets:
            return None
        heads = sets[0] if heads is None else heads
        rows = [r for r in self.edit if r.get("heads", sets[0]) == heads]
        edits = [r for r in rows if r["arm"] == "edit" and r["alpha"] != 0]
        if not edits:
            return None
        best = max(edits, key=lambda r: r["efficacy"])
        control = [r for r in rows if r["arm"] == "control" and r["alpha"] == best["alpha"]]
        random = [r for r in rows if r["arm"] == "random_direction" and r["alpha"] == best["alpha"]]
        out = {"heads": heads, "alpha": best["alpha"], "efficacy": best["efficacy"], "n": best["n"],
               "control": control[0]["efficacy"] if control else None,
               "random_control": random[0]["efficacy"] if random else None}
        described = control[0].get("described") if control else None
        if described is not None:
            # an empty cell's ID names no object; where the answer falls back on a described object instead, it names
            # the edit's target t by chance once in (objects - 1)
            out["control_described"] = described
            out["control_chance"] = described / (int(self.params["n_objects"]) - 1)
        return out

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "reference": self.reference, "heads": self.heads, "methods": self.methods,
                "naive_check": self.naive_check, "ablation": self.ablation_summary(), "edit": self.edit_summary(),
                "probes": self.probes, "edges": self.edges, "tracking": self.tracking_summary(),
                "params": self.params, "seconds": self.seconds, "skipped": self.skipped}

    def tracking_summary(self) -> dict[str, Any] | None:
        """The head whose centroid tracks the written points best (lowest RMSE), whether it is a reference head,
        and each reference head's RMSE, its rank and its share of points within half a cell (None: not tracked)."""
        finite = [r for r in self.tracking if np.isfinite(r["rmse"])]
        if not finite:
            return None
        ranked = sorted(finite, key=lambda r: r["rmse"])
        best = ranked[0]
        order = {(r["layer"], r["head"]): i + 1 for i, r in enumerate(ranked)}
        return {"best_head": f"{best['layer']}.{best['head']}", "best_rmse": best["rmse"],
                "best_is_reference": bool(best["reference"]),
                "reference": [{"head": f"{r['layer']}.{r['head']}", "rmse": r["rmse"],
                               "rank": order.get((r["layer"], r["head"])), "within_half_cell": r["within_half_cell"],
                               "within_ci": [r["within_low"], r["within_high"]], "n_points": r["n_points"]}
                              for r in self.tracking if r["reference"]]}

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        return {"validation": self.figure}, {"methods.csv": self.to_frame(), "scores.csv": pd.DataFrame(self.scores),
                                             "ablation.csv": pd.DataFrame(self.ablation),
                                             "edit.csv": pd.DataFrame(self.edit),
                                             "probes.csv": pd.DataFrame(self.probes),
                                             "edge_methods.csv": pd.DataFrame([_flat_edge_row(r) for r in self.edges]),
                                             "tracking.csv": pd.DataFrame(self.tracking)}

    def save(self, out: str | os.PathLike, figure: bool = True) -> Path:
        """``validation.json`` (everything), the tables as CSV and (with ``figure``) ``validation.html``, each written
        atomically; ``vlmbind export`` draws the figure from the saved files later."""
        out = Path(out)
        document = {"model": self.model, "reference": self.reference, "heads": self.heads, "methods": self.methods,
                    "scores": self.scores, "naive_check": self.naive_check, "ablation": self.ablation,
                    "edit": self.edit, "probes": self.probes, "edges": self.edges, "pca": self.pca,
                    "tracking": self.tracking, "params": self.params,
                    "seconds": self.seconds, "skipped": self.skipped,
                    "summary": {"ablation": self.ablation_summary(), "edit": self.edit_summary(),
                                "tracking": self.tracking_summary(),
                                "edit_by_heads": [self.edit_summary(h) for h in self.edit_heads()]}}
        write_json_atomic(document, out / "validation.json")
        _, tables = self.exports()
        for name, frame in tables.items():
            write_text_atomic(frame.to_csv(index=False), out / name)
        if figure:
            write_html_atomic(self.figure(), out / "validation.html")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ValidationResult:
        path = Path(directory) / "validation.json"
        data = read_json_object(path)
        require_keys(data, ("model", "reference", "heads", "methods", "scores"), path)
        return cls(**{k: data[k] for k in ("model", "reference", "heads", "methods", "scores")},
                   **{k: data.get(k, d) for k, d in (("naive_check", {}), ("ablation", []), ("edit", []),
                                                      ("probes", []), ("edges", []), ("pca", []), ("tracking", []),
                                                      ("params", {}),
                                                      ("seconds", {}), ("skipped", {}))})


def score_rows(condition: str, method: str, scores: HeadScores, reference: set[tuple[int, int]]) -> list[dict]:
    mean, err = scores.scores, scores.stderr
    return [{"condition": condition, "method": method, "layer": l, "head": h, "score": float(mean[l, h]),
             "stderr": float(err[l, h]), "n": scores.n, "reference": (l, h) in reference}
            for l in range(mean.shape[0]) for h in range(mean.shape[1])]


def score_methods(vlm: Any, result: ValidationResult, condition: str, pairs: Any,
                  planted: Sequence[tuple[int, int]], methods: Sequence[str], ig_steps: int,
                  progress: bool) -> HeadScores | None:
    """Every mediation method but ``naive`` (a check, :func:`naive_sample`) on one condition's pairs: its score rows
    and its row of the methods table added to ``result``; returns ``exact``'s scores (None when not run)."""
    exact = None
    for method in methods:
        if method == "naive":
            continue
        start = time.perf_counter()
        extra = {"steps": ig_steps} if method == "integrated_gradients" else {}
        scores = locate(vlm, pairs, method=method, verify_top=0, progress=progress, **extra)
        seconds = time.perf_counter() - start
        exact = scores if method == "exact" else exact
        result.scores += score_rows(condition, method, scores, set(planted))
        result.methods.append({"condition": condition, "method": method, "n_pairs": scores.n,
                               "k": len(planted), "heads": [f"{l}.{h}" for l, h in planted],
                               **rank_metrics(scores.scores, planted),
                               "top_heads": [f"{l}.{h}" for l, h in scores.top(max(3, len(planted)))],
                               "seconds": seconds})
    return exact


def naive_sample(vlm: Any, pairs: Sequence[Any], exact: HeadScores, reference: Sequence[tuple[int, int]],
                 n_heads: int, seed: int, task: Any = scene_task) -> tuple[list[tuple[int, int]], float]:
    """``naive`` on the reference heads, the best-scored others and random heads: the largest |exact - naive|
    (``task(vlm, pair, layers)`` builds a pair's patching task: scene pairs by default)."""
    everyone = [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads)]
    chosen = list(dict.fromkeys([*reference, *[x for x in exact.top(len(everyone)) if x not in reference][:2]]))
    rest = [x for x in everyone if x not in chosen]
    rng = np.random.default_rng(seed)
    extra = max(0, n_heads - len(chosen))
    chosen += [rest[int(i)] for i in rng.choice(len(rest), size=min(extra, len(rest)), replace=False)]
    worst = 0.0
    layers = sorted({l for l, _ in chosen})
    for i, pair in enumerate(pairs):
        clean, patched = METHOD_FUNCTIONS["naive"](vlm, task(vlm, pair, layers), chosen)
        for (l, h), value in zip(chosen, patched):
            worst = max(worst, abs((value - clean) - exact.per_pair[i, l, h]))
    return chosen, worst


def _last_outputs(vlm: Any, examples: Sequence[Any], heads: Sequence[tuple[int, int]],
                  batch_size: int = 32) -> dict[tuple[int, int], np.ndarray]:
    """Per head, ``N D`` outputs z at the last prompt token."""
    layers = sorted({l for l, _ in heads})
    out: dict[tuple[int, int], list[np.ndarray]] = {h: [] for h in heads}
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk])
        z = vlm.capture(batch, [vlm.adapter.z_site(l) for l in layers])
        last = [row.last_position for row in batch.index]
        for l, h in heads:
            values = z[vlm.adapter.z_site(l)]
            out[(l, h)].append(np.stack([values[r, p, h].float().cpu().numpy() for r, p in enumerate(last)]))
    return {h: np.concatenate(v) for h, v in out.items()}


def _labels(examples: Sequence[Any], grid: int) -> dict[str, np.ndarray]:
    targets = [e.objects[e.fields["target"]] for e in examples]
    return {"cell": np.array([t.row * grid + t.col for t in targets]),
            "colour": np.array([t.colour for t in targets]), "shape": np.array([t.shape for t in targets])}


def probe_heads(vlm: Any, examples: Sequence[Any], heads: Sequence[tuple[int, int]], *, grid: int, seed: int = 0
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Linear probes (standardised logistic regression, 25% held out) for the missing object's cell, colour and
    shape from each head's last-token output, and its first two principal components.

    Returns:
        ``(probe rows, pca rows)``.
    """
    outputs = _last_outputs(vlm, examples, heads)
    labels = _labels(examples, grid)
    probes, points = [], []
    for (l, h), x in outputs.items():
        for target in PROBE_TARGETS:
            y = labels[target]
            values, counts = np.unique(y, return_counts=True)
            x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
            model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=1.0))
            with warnings.catch_warnings():  # few scenes per cell is reported beside the accuracy (n, chance)
                warnings.filterwarnings("ignore", message="The number of unique classes", category=UserWarning)
                model.fit(x_train, y_train)
            probes.append({"head": f"{l}.{h}", "target": target, "accuracy": float(model.score(x_test, y_test)),
                           "chance": float(counts.max() / counts.sum()), "classes": int(values.size),
                           "n_train": int(len(y_train)), "n_test": int(len(y_test))})
        pcs = PCA(n_components=2, random_state=seed).fit(x)
        coords = pcs.transform(x)
        for i in range(min(len(x), 300)):
            points.append({"head": f"{l}.{h}", "pc1": float(coords[i, 0]), "pc2": float(coords[i, 1]),
                           "cell": int(labels["cell"][i]), "colour": str(labels["colour"][i]),
                           "shape": str(labels["shape"][i]),
                           "explained": [float(v) for v in pcs.explained_variance_ratio_]})
    return probes, points


def _reference(vlm: Any, reference: Mapping[str, Any] | None, source: str | None,
               conditions: Sequence[str] = SCENE_CONDITIONS) -> tuple[dict[str, list[tuple[int, int]]], str | None]:
    if reference is not None:
        heads = {c: parse_heads(h) for c, h in reference.items()}
        check_reference_conditions(heads, conditions)
        return heads, source or "given"
    own = planted_heads(vlm)
    if "search" in own:
        raise InputError(f"{vlm.name}'s planted heads are search heads (they point); score them with "
                         f"vlmbind.analysis.search_validation.validate_search (vlmbind validate does so for such a "
                         f"model)")
    return own, ("planted" if own else None)


def validate(vlm: Any, *, reference: Mapping[str, Any] | None = None, reference_source: str | None = None,
             n_pairs: int = 16, seed: int = 1000, n_objects: int | None = None, entropy: str = "high",
             methods: Sequence[str] = VALIDATION_METHODS, naive_heads: int = 6, ig_steps: int = 8,
             modes: Sequence[str] = MODES, n_eval: int = 64, ablation_seeds: int = 5,
             alphas: Sequence[float] = DEFAULT_ALPHAS, n_estimate: int = 2048, n_probe: int = 512,
             edit_positions: str = "answer", progress: bool = False, pairs: Any = None, edge_pairs: int = 8,
             reference_edges: Sequence[Mapping[str, Any]] | None = None) -> ValidationResult:
    """Run every method against the model's planted heads (or ``reference`` heads) on fresh stimuli, or on a
    researcher's own ``pairs``.

    Args:
        vlm: a loaded VLM (an organism with a ``planted`` training record, or any model with ``reference``).
        reference: condition -> heads (``["l.h", ...]``) to score against instead of the model's own planted heads.
        reference_source: what to call those heads in the result (e.g. the twin model they were planted in).
        n_pairs: counterfactual pairs per condition.
        seed: stimulus seed (keep it away from training's).
        n_objects: objects per scene (default: the count the planting held out, else 3).
        entropy: scene entropy.
        methods: the mediation methods (``naive`` runs on ``naive_heads`` heads only, as a check on ``exact``, so
            it needs ``exact`` in the list).
        naive_heads: heads ``naive`` is checked on (reference heads first).
        ig_steps: integrated-gradients path points.
        modes: ablation modes.
        n_eval: scenes the ablation is scored on.
        ablation_seeds: random-k draws.
        alphas: position-ID edit scales.
        n_estimate: scenes the position IDs are estimated from (36 cells: 2,048 scenes give about 57 per cell; 256
            gave noisy IDs and a lower efficacy on organism-vsm).
        edit_positions: where the edit is added (:data:`~vlmbind.analysis.edits.EDIT_POSITIONS`); ``answer`` by
            default, because the organisms' ID is planted and read at the answer positions too (the shape word is
            predicted at the colour word).
        n_probe: scenes the probes and PCA use.
        progress: show progress bars.
        edge_pairs: the first this many ``id_selection`` pairs score every head-to-head edge by exact path patching
            (:func:`vlmbind.analysis.circuits.circuit`, its default position classes) against the declared edges;
            0 skips it. Run only where edges are declared and on vlmbind's scene pairs.
        reference_edges: the declared edges to score against (another model's ``planted_edges``); None: the
            model's own training record's when its planted heads are the reference.
        pairs: a :class:`~vlmbind.stimuli.PairSet` of one condition (e.g. a user's pairs file) to run the mediation
            methods on instead of fresh scene pairs; the ablation is then scored on its clean inputs (their
            answers), and the position-ID edit and the probes, which need vlmbind's scenes, are not run
            (``skipped`` says so). ``reference`` must name heads of its condition.

    Raises:
        InputError: unknown methods or modes, alphas that are not finite numbers, reference heads outside the model,
            bad counts, or pairs whose condition the reference does not name.
    """
    check_validation_methods(methods)
    check_ablation_modes(modes)
    check_alphas(alphas)  # before the mediation, not when the edit runs minutes later
    for name, value in (("n_pairs", n_pairs), ("n_eval", n_eval), ("ablation_seeds", ablation_seeds),
                        ("n_probe", n_probe), ("ig_steps", ig_steps), ("n_estimate", n_estimate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(edge_pairs, bool) or not isinstance(edge_pairs, int) or edge_pairs < 0:
        raise InputError(f"edge_pairs must be an int >= 0, got {edge_pairs!r}")
    if n_probe < 16:
        raise InputError(f"n_probe must be at least 16 (a quarter is held out), got {n_probe}")
    if edit_positions not in EDIT_POSITIONS:
        raise InputError(f"edit_positions must be one of {', '.join(EDIT_POSITIONS)}, got {edit_positions!r}")
    heads, source = _reference(vlm, reference, reference_source,
                               SCENE_CONDITIONS if pairs is None else (pairs.condition,))
    if pairs is not None:
        if pairs.condition not in heads:
            raise InputError(f"the reference heads name {', '.join(sorted(heads)) or 'no condition'}, not the pairs' "
                             f"condition {pairs.condition!r}: give its heads, e.g. --heads {pairs.condition}=1.2")
        heads = {pairs.condition: heads[pairs.condition]}
    for condition, hs in heads.items():
        outside = [f"{l}.{h}" for l, h in hs if not (0 <= l < vlm.n_layers and 0 <= h < vlm.n_heads)]
        if outside:
            raise InputError(f"reference heads {outside} ({condition}) do not exist in {vlm.name} "
                             f"({vlm.n_layers} layers x {vlm.n_heads} heads)")
    objects = held_out_objects(vlm) if n_objects is None else int(n_objects)
    kwargs = training_defaults(vlm, "scene", {"n_objects": objects, "entropy": entropy})
    grid = kwargs["canvas"].shape[1] if "canvas" in kwargs else 3
    result = ValidationResult(model=vlm.name, reference=source,
                              heads={c: [f"{l}.{h}" for l, h in hs] for c, hs in heads.items()},
                              params={"n_pairs": n_pairs, "seed": seed, "n_objects": objects, "entropy": entropy,
                                      "methods": list(methods), "ig_steps": ig_steps, "modes": list(modes),
                                      "n_eval": n_eval, "ablation_seeds": ablation_seeds, "alphas": list(alphas),
                                      "n_estimate": n_estimate, "n_probe": n_probe,
                                      "edit_positions": edit_positions, "edge_pairs": edge_pairs})
    if pairs is not None:
        result.params = {"pairs": pairs.params.get("source", "generated"), "condition": pairs.condition,
                         "n_pairs": len(pairs), "methods": list(methods), "ig_steps": ig_steps, "modes": list(modes),
                         "ablation_seeds": ablation_seeds, "n_objects": None, "seed": None}
        pair_sets = {pairs.condition: list(pairs)}
    else:
        pair_sets = {c: list(scene_pairs(n_pairs, c, seed, **kwargs)) for c in SCENE_CONDITIONS}
    exact_scores: dict[str, HeadScores] = {}
    for condition, pair_list in pair_sets.items():
        planted = heads.get(condition, [])
        exact = score_methods(vlm, result, condition, pair_list, planted, methods, ig_steps, progress)
        if exact is not None:
            exact_scores[condition] = exact
        if "naive" in methods and condition in exact_scores:
            start = time.perf_counter()
            sampled, worst = naive_sample(vlm, pair_list, exact_scores[condition], planted, naive_heads, seed)
            result.naive_check[condition] = {"heads": [f"{l}.{h}" for l, h in sampled],
                                             "max_abs_difference": float(worst), "seconds": time.perf_counter() - start}
    result.seconds["mediation"] = float(sum(r["seconds"] for r in result.methods))
    declared = list(reference_edges) if reference_edges is not None else (
        declared_edges(getattr(vlm, "training", None)) if reference is None else [])
    if declared and pairs is None and edge_pairs:
        _score_edges(vlm, result, declared, pair_sets["id_selection"][:edge_pairs], exact_scores, progress)
    start = time.perf_counter()
    dataset = scene_description(n_eval, seed + 2, **kwargs) if pairs is None else pairs.clean
    ablate_top_k(vlm, result, heads, exact_scores, dataset, modes, ablation_seeds)
    result.seconds["ablation"] = time.perf_counter() - start
    if pairs is not None:
        result.skipped.update(edit="the position-ID edit needs vlmbind's scenes (a position ID per grid cell)",
                              probes="the probes read object cells from vlmbind's scenes")
        return result
    selection = heads.get("id_selection")
    if selection:
        start = time.perf_counter()
        # together, and each alone where several share the role: a set can hold a head that carries the position
        # and one that only feeds it, and the edit's direction is estimated per head
        edited = [selection] + ([[h] for h in selection] if len(selection) > 1 else [])
        try:  # one estimation and one unedited decode for every head set
            studies = edit_studies(vlm, edited, list(alphas), n_estimate=n_estimate, n_eval=n_eval, seed=seed,
                                   n_objects=objects, entropy=entropy, progress=progress, positions=edit_positions)
        except TooFewEstimatesError as exc:
            result.skipped["edit"] = f"{n_estimate} estimation scenes: {exc}"
            studies = []
        for edited_heads, edit in zip(edited, studies):
            names = " ".join(f"{l}.{h}" for l, h in edited_heads)
            result.edit += [{"heads": names, "alpha": r["alpha"], "arm": r["arm"], "efficacy": r["efficacy"],
                             "described": r["described"], "n": r["n"]} for r in edit.rows]
        result.seconds["edit"] = time.perf_counter() - start
    probe_set = list(dict.fromkeys(h for hs in heads.values() for h in hs))
    if probe_set:
        start = time.perf_counter()
        scenes = list(scene_description(n_probe, seed + 1, **kwargs))
        result.probes, result.pca = probe_heads(vlm, scenes, probe_set, grid=grid, seed=seed)
        result.seconds["probes"] = time.perf_counter() - start
    return result


def score_edges(vlm: Any, declared: Sequence[Mapping[str, Any]], pairs: Sequence[Any],
                node_scores: np.ndarray | None = None, progress: bool = False) -> tuple[list[dict[str, Any]], Circuit]:
    """Every head-to-head edge scored on ``pairs`` by exact path patching (:func:`~vlmbind.analysis.circuits.circuit`
    with its default position classes), by its estimates (EAP, EAP-IG, AtP*) and, given ``node_scores`` (``L H``,
    e.g. each head's best exact node score over the conditions), by the product of its two heads' node scores (a
    ranking that knows nodes only: no channel, no path), each against the ``declared`` edges; and the faithfulness
    curve of the exact ranking's top edges with the declared circuit's f
    (:class:`~vlmbind.analysis.circuits.Faithfulness`).

    Returns:
        ``(rows, circuit)``: one row per method (:func:`~vlmbind.analysis.circuits.edge_rank_metrics` with the top
        four edges and seconds; the exact row adds ``faithfulness``: CPR, CMD, the declared circuit's f, seconds),
        and the path-patching result (with its faithfulness curve).
    """
    found = circuit(vlm, pairs, progress=progress, declared=declared)
    seconds = found.seconds
    frame = found.to_frame()
    common = {"condition": found.condition, "n_pairs": found.n, "k": len(declared),
              "declared": [f"{e['sender']} -> {e['receiver']} ({e['channel']})" for e in declared],
              "sender_at": found.sender_at, "receiver_at": found.receiver_at}

    def top(table: pd.DataFrame) -> list[str]:
        ranked = table[table["receiver"] != "logits"].sort_values("score", ascending=False, kind="stable")
        return [f"{r.sender} -> {r.receiver} ({r.channel})" for r in ranked.head(4).itertuples()]

    rows = [{**common, "method": "exact", **edge_rank_metrics(frame, declared), "top_edges": top(frame),
             "seconds": seconds, "faithfulness": found.faithfulness.summary()}]
    for method in ESTIMATED:
        begin = time.perf_counter()
        estimate = circuit(vlm, pairs, method=method, verify_top=0, progress=progress, faithfulness=False).to_frame()
        rows.append({**common, "method": method, **edge_rank_metrics(estimate, declared), "top_edges": top(estimate),
                     "seconds": time.perf_counter() - begin})
    if node_scores is not None:
        product = frame.copy()
        product["score"] = [node_scores[check_head_list(s)[0]] * node_scores[check_head_list(r)[0]]
                            if r != "logits" else np.nan for s, r in zip(frame["sender"], frame["receiver"])]
        rows.append({**common, "method": "node_product", **edge_rank_metrics(product, declared),
                     "top_edges": top(product), "seconds": 0.0})
    return rows, found


def _score_edges(vlm: Any, result: ValidationResult, declared: Sequence[Mapping[str, Any]], pairs: Sequence[Any],
                 exact: dict[str, HeadScores], progress: bool) -> None:
    start = time.perf_counter()
    best = np.max([s.scores for s in exact.values()], axis=0) if exact else None
    rows, _ = score_edges(vlm, declared, pairs, best, progress)
    result.edges += rows
    result.seconds["edges"] = time.perf_counter() - start


def ablate_top_k(vlm: Any, result: ValidationResult, heads: dict[str, list[tuple[int, int]]],
            exact: dict[str, HeadScores], dataset: Any, modes: Sequence[str], seeds: int) -> None:
    """Top-k of the reference conditions together (each condition's k best exact heads; k = its reference count, or
    1 with no reference) against random-k from the other heads, random-k from the top-k's own layers (where each of
    those layers has a head to spare) and the bottom-k by |score|."""
    if not exact:
        return
    top: list[tuple[int, int]] = []
    for condition, scores in exact.items():
        k = len(heads.get(condition, [])) if heads else 1
        top += [h for h in scores.top(k) if h not in top] if k else []
    if not top:
        return
    n = vlm.n_layers * vlm.n_heads
    magnitude = np.max([np.abs(s.scores) / max(np.abs(s.scores).max(), 1e-12) for s in exact.values()], axis=0)
    frame = pd.DataFrame([{"layer": l, "head": h, "score": (2.0 + magnitude[l, h]) if (l, h) in top else
                           float(magnitude[l, h])} for l in range(vlm.n_layers) for h in range(vlm.n_heads)])
    k = min(len(top), n // 2)
    # random heads from the rest, and on the same seeds from the top-k's own layers where each has one to spare
    matched = () if layers_short_of_heads(top[:k], vlm.n_heads) else ("same_layers",)
    for mode in modes:
        study = ablation_study(vlm, dataset, frame, k=k, mode=mode, seeds=tuple(range(seeds)), random_from="rest",
                               bottom_by="abs", also_random_from=matched)
        result.ablation += [{"mode": mode, "arm": a["arm"], "seed": a["seed"], "heads": " ".join(a["heads"]),
                             "accuracy": a["accuracy"], "n": a["n"]} for a in study.arms]
