"""The causal overview of one model: located heads per condition, how far attribution agrees, where the top heads
look, what ablating them does, and the position-ID edit. ``vlmbind demo`` runs it and puts it in report.html.

Design: every part reuses the toolkit's own analyses (:func:`~vlmbind.analysis.locate`,
:func:`~vlmbind.analysis.ablation_study`, :func:`~vlmbind.analysis.edit_study`) on the model's own training stimuli
(:func:`vlmbind.analysis.evaluation.training_defaults`), so the page shows what a user would get from the commands it
lists. One part is a check on the others: :func:`object_attention` measures where a head looks from the last token, the
missing object or every object alike. A head that changes the answer when patched but spreads its attention over all
objects is more likely counting features than retrieving the missing object's, a simpler strategy that produces the
same mediation scores. Parts that cannot run on a model (attention_swap needs a model that points) are skipped with
the reason, never silently.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..core.errors import InputError
from ..core.io import write_json_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result
from ..engine.activations import capture
from ..probes import ProbeConfig
from ..stimuli import counting, scene_description, scene_pairs
from ..stimuli.core import object_token_positions
from .ablation import AblationResult, ablation_study
from .binding import BindingResult, colorshape_splits, default_sites, default_world, probe_sites
from .edits import EditResult, edit_study
from .evaluation import training_defaults
from .lens import LensResult, lens, lens_dataset
from .mediation import HeadScores, locate
from .relevancy import RelevancyResult, relevancy, relevancy_dataset
from .rsa import RSAResult, rsa, rsa_stimuli
from .traces import point_swap_pairs
from .tracking import TrackResult, track, tracking_dataset

SCENE_CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval")
# random-k draws per ablation study: enough to show the spread between draws, each an evaluation of the data set
ABLATION_SEEDS = (0, 1, 2, 3, 4)


def object_attention(vlm: Any, examples: Any, heads: list[tuple[int, int]]) -> pd.DataFrame:
    """Where each head looks from the last prompt token of scene-description examples.

    Per head, averaged over examples: ``image_mass`` (its attention on image tokens), ``target_share`` (the share of
    that mass on the missing object's tokens), ``described_share`` (the mean share on one described object) and
    ``target_ratio`` = target_share / described_share (about 1: no preference for the missing object).

    Raises:
        InputError: no examples, or examples that are not scene descriptions.
    """
    examples = list(examples)
    if not examples or any("target" not in e.fields or "described" not in e.fields for e in examples):
        raise InputError("object_attention needs scene-description examples (fields 'target' and 'described')")
    layers = sorted({l for l, _ in heads})
    rows: dict[tuple[int, int], list[tuple[float, float, float]]] = {h: [] for h in heads}
    for ex in examples:
        batch = vlm.prepare([ex.image], [ex.prompt])
        index = batch.index[0]
        run = vlm.run(batch, sites=[f"blocks.{l}.attn.hook_pattern" for l in layers], logits_at=[0])
        objects = object_token_positions(index, ex.objects)
        image, last = index.image_positions, index.last_position
        for layer, head in heads:
            a = run.cache[f"blocks.{layer}.attn.hook_pattern"][0, head, last].double()
            mass = float(a[image].sum())
            target = float(a[objects[ex.fields["target"]]].sum()) / max(mass, 1e-12)
            described = float(np.mean([float(a[objects[i]].sum()) for i in ex.fields["described"]])) / max(mass, 1e-12)
            rows[(layer, head)].append((mass, target, described))
    out = []
    for (layer, head), values in rows.items():
        mass, target, described = np.mean(values, axis=0)
        out.append({"layer": layer, "head": head, "image_mass": mass, "target_share": target,
                    "described_share": described, "target_ratio": target / max(described, 1e-12),
                    "n": len(values)})
    return pd.DataFrame(out)


@register_result
@dataclass
class CausalOverview(Result):
    """Everything :func:`causal_overview` measured (see the module docstring)."""

    model: str
    scores: dict[str, Any] = field(default_factory=dict)
    attribution: dict[str, Any] = field(default_factory=dict)
    recall: dict[str, dict[str, float]] = field(default_factory=dict)
    looks: pd.DataFrame | None = None
    ablations: dict[str, Any] = field(default_factory=dict)
    edit: Any = None
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "seconds": self.seconds, "skipped": self.skipped,
                               "commands": self.commands}
        out["located"] = {c: {"top_heads": [f"{l}.{h}" for l, h in s.top(5)],
                              "top_scores": [float(s.scores[l, h]) for l, h in s.top(5)], "n": s.n}
                          for c, s in self.scores.items()}
        out["attribution_recall"] = self.recall
        out["ablation"] = {name: r.summary()["accuracy"] | {"heads_top": r.arms[1]["heads"]}
                           for name, r in self.ablations.items()}
        if self.looks is not None:
            out["object_attention"] = self.looks.to_dict(orient="records")
        if self.edit is not None:
            s = self.edit.summary()
            out["edit"] = {k: s[k] for k in ("heads", "efficacy", "control_efficacy", "clean_accuracy", "n_used")}
        return out

    kind = "causal"
    reproduced_files = ("object_attention.csv",)
    marker_files = ("object_attention.csv",)
    table_name = "object_attention.csv"

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CausalOverview:
        """The overview saved in ``directory``: ``object_attention.csv``, ``summary.json`` and every part folder
        present (``locate/<condition>``, ``ablation/<name>``, ``edit``); the attribution runs are not saved."""
        directory = Path(directory)
        summary = read_json_object(directory / "summary.json") if (directory / "summary.json").is_file() else {}
        looks = read_csv_columns(directory / "object_attention.csv", ())

        def parts(sub: str) -> list[Path]:
            folder = directory / sub
            return sorted(d for d in folder.iterdir() if d.is_dir()) if folder.is_dir() else []

        return cls(
            model=summary.get("model", ""), looks=looks,
            scores={d.name: HeadScores.load(d) for d in parts("locate") if HeadScores.matches(d)},
            ablations={d.name: AblationResult.load(d) for d in parts("ablation") if AblationResult.matches(d)},
            edit=EditResult.load(directory / "edit") if EditResult.matches(directory / "edit") else None,
            recall=summary.get("attribution_recall", {}), skipped=summary.get("skipped", {}),
            seconds=summary.get("seconds", {}), commands=summary.get("commands", {}),
        )

    def to_frame(self) -> pd.DataFrame:
        """Where the top heads look (:func:`object_attention`); empty when that part was skipped."""
        return self.looks if self.looks is not None else pd.DataFrame()

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        return {}, ({} if self.looks is None else {"object_attention.csv": self.looks})

    def save(self, out: str | os.PathLike) -> Path:
        """Write every part under ``out`` (one folder per part) and ``summary.json``; :meth:`files` lists them."""
        out = Path(out)
        for condition, scores in self.scores.items():
            scores.save(out / "locate" / condition)
        for name, result in self.ablations.items():
            result.save(out / "ablation" / name)
        if self.looks is not None:
            write_text_atomic(self.looks.to_csv(index=False), out / "object_attention.csv")
        if self.edit is not None:
            self.edit.save(out / "edit")
        write_json_atomic(self.summary(), out / "summary.json")
        return out

    def files(self) -> list[str]:
        """The files :meth:`save` writes, relative to its folder."""
        written = []
        for condition in self.scores:
            written += [f"locate/{condition}/{f}" for f in ("scores.csv", "heatmap.html", "summary.json")]
        written += [f"ablation/{name}/results.json" for name in self.ablations]
        if self.looks is not None:
            written.append("object_attention.csv")
        if self.edit is not None:
            written += ["edit/results.json", "edit/curve.html"]
        return [*written, "summary.json"]


def causal_overview(vlm: Any, *, n_pairs: int = 16, n_eval: int = 64, n_estimate: int = 256, seed: int = 0,
                    k: int = 5, alphas: tuple[float, ...] = (0, 1, 2, 4, 8), progress: bool = False) -> CausalOverview:
    """Locate (all conditions), attribution recall, where the top heads look, ablations and the position-ID edit.

    Args:
        vlm: a loaded VLM.
        n_pairs: counterfactual pairs per condition.
        n_eval: examples per ablation arm and edit evaluation.
        n_estimate: estimation examples of the position-ID edit.
        seed: stimulus seed.
        k: heads per ablation arm.
        alphas: edit scales.
        progress: progress bars.
    """
    for name, value in (("n_pairs", n_pairs), ("n_eval", n_eval), ("n_estimate", n_estimate), ("k", k)):
        if not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    result = CausalOverview(vlm.name)
    scene_kwargs = training_defaults(vlm, "scene", {"n_objects": 3})
    model_arg = vlm.source if os.path.isdir(str(vlm.source)) else vlm.name
    clock = time.perf_counter()
    for condition in SCENE_CONDITIONS:
        pairs = scene_pairs(n_pairs, condition, seed, **scene_kwargs)
        result.scores[condition] = locate(vlm, pairs, progress=progress)
        result.attribution[condition] = locate(vlm, pairs, method="attribution", verify_top=0)
        result.commands[f"locate {condition}"] = (f"vlmbind locate --model {model_arg} --condition {condition} "
                                                  f"--n-pairs {n_pairs} --seed {seed}")
    try:
        swaps = point_swap_pairs(vlm, n_pairs, seed)
        result.scores["attention_swap"] = locate(vlm, swaps, progress=progress)
        result.attribution["attention_swap"] = locate(vlm, swaps, method="attribution", verify_top=0)
        result.commands["locate attention_swap"] = (f"vlmbind locate --model {model_arg} --condition attention_swap "
                                                    f"--n-pairs {n_pairs} --seed {seed}")
    except InputError as err:
        result.skipped["attention_swap"] = str(err)
    n_heads = vlm.n_layers * vlm.n_heads
    for condition, scores in result.scores.items():
        attribution = result.attribution[condition]
        result.recall[condition] = {f"top{j}": attribution.recall(scores, j) for j in (5, 10) if j <= n_heads}
    result.seconds["locate"] = time.perf_counter() - clock

    clock = time.perf_counter()
    scene_eval = scene_description(n_eval, seed + 1000, **training_defaults(vlm, "scene", {"n_objects": (2, 4)}))
    top = {h for c in ("feature_retrieval", "id_selection") for h in result.scores[c].top(3)}
    if "attention_swap" in result.scores:
        top |= set(result.scores["attention_swap"].top(3))
    result.looks = object_attention(vlm, list(scene_eval)[: min(32, n_eval)], sorted(top))
    result.seconds["object_attention"] = time.perf_counter() - clock

    clock = time.perf_counter()
    k = min(k, n_heads // 2)
    count_kwargs = training_defaults(vlm, "count", {})
    options = (getattr(vlm, "training", None) or {}).get("task_options", {}).get("count", {})
    count_kwargs["objects"] = tuple(options["objects"]) if options.get("objects") else (2, 6)
    count_eval = counting(n_eval, seed + 2000, **count_kwargs)
    studies = {"scene-feature_retrieval": (scene_eval, "feature_retrieval"),
               "scene-id_selection": (scene_eval, "id_selection"),
               "count-" + ("attention_swap" if "attention_swap" in result.scores else "id_selection"):
                   (count_eval, "attention_swap" if "attention_swap" in result.scores else "id_selection")}
    for name, (dataset, condition) in studies.items():
        result.ablations[name] = ablation_study(vlm, dataset, result.scores[condition], k=k, seeds=ABLATION_SEEDS)
    result.seconds["ablation"] = time.perf_counter() - clock

    clock = time.perf_counter()
    heads = result.scores["id_selection"].top(3)
    try:
        result.edit = edit_study(vlm, heads, list(alphas), n_estimate=n_estimate, n_eval=n_eval, seed=seed)
        result.commands["edit"] = (f"vlmbind edit --model {model_arg} --heads {','.join(f'{l}.{h}' for l, h in heads)}"
                                   f" --alpha {','.join(str(a) for a in alphas)} --n-estimate {n_estimate} --n-eval {n_eval}"
                                   f" --seed {seed}")
    except InputError as err:
        result.skipped["edit"] = str(err)
    result.seconds["edit"] = time.perf_counter() - clock
    return result


# ----------------------------------------------------------------------------------------------------------------
# the representational half: RSA by layer, the centroid RMSE curve, the probe table
# ----------------------------------------------------------------------------------------------------------------
@register_result
@dataclass
class RepresentationOverview(Result):
    """RSA on the single-object set, centroid tracking on pointing traces, probes on BalancedColorShape, the logit lens
    over the image grid and relevancy maps scored against random maps."""

    model: str
    rsa: Any = None
    track: Any = None
    probes: Any = None
    lens: Any = None
    relevancy: Any = None
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "skipped": self.skipped, "seconds": self.seconds,
                               "commands": self.commands}
        if self.rsa is not None:
            lm = self.rsa.frame[self.rsa.frame["component"] == "lm"]
            out["rsa_lm"] = {m: [float(v) for v in lm[lm["model_matrix"] == m].sort_values("layer")["r"]]
                             for m in ("compositional", "conjunctive", "position")}
        if self.track is not None:
            out["track"] = {"valley_layer": self.track.valley_layer,
                            "rmse_by_layer": [float(v) for v in self.track.rmse_mean], "n_points": self.track.n_points}
        if self.probes is not None:
            out["probes"] = self.probes.frame.to_dict(orient="records")
        if self.lens is not None:
            out["lens"] = self.lens.decodable[["layer", "feature", "share", "low", "high", "n", "chance",
                                               "background_share"]].to_dict(orient="records")
        if self.relevancy is not None:
            scores = self.relevancy.scores()
            out["relevancy"] = scores[["method", "n", "deletion_auc", "deletion_vs_random", "insertion_auc",
                                       "insertion_vs_random", "knockout_changed"]].to_dict(orient="records")
        return out

    # a folder of parts: the parts are found on their own (by export, load_result); load this one explicitly
    kind = "representations"

    @classmethod
    def load(cls, directory: str | os.PathLike) -> RepresentationOverview:
        """The overview saved in ``directory``: ``summary.json`` and the ``rsa``, ``track`` and ``probe`` parts
        present."""
        directory = Path(directory)
        summary = read_json_object(directory / "summary.json")
        part = lambda kind, name: kind.load(directory / name) if kind.matches(directory / name) else None  # noqa: E731
        return cls(model=summary.get("model", ""), rsa=part(RSAResult, "rsa"), track=part(TrackResult, "track"),
                   probes=part(BindingResult, "probe"), lens=part(LensResult, "lens"),
                   relevancy=part(RelevancyResult, "relevancy"), skipped=summary.get("skipped", {}),
                   seconds=summary.get("seconds", {}), commands=summary.get("commands", {}))

    def to_frame(self) -> pd.DataFrame:
        """The RSA table (empty when RSA was skipped)."""
        return self.rsa.frame if self.rsa is not None else pd.DataFrame()

    def save(self, out: str | os.PathLike) -> Path:
        """Write each part in its folder (``rsa``, ``track``, ``probe``, ``lens``, ``relevancy``) and
        ``summary.json``."""
        out = Path(out)
        if self.rsa is not None:
            self.rsa.save(out / "rsa")
        if self.track is not None:
            self.track.save(out / "track")
        if self.probes is not None:
            self.probes.save(out / "probe")
        if self.lens is not None:
            self.lens.save(out / "lens")
        if self.relevancy is not None:
            self.relevancy.save(out / "relevancy")
        write_json_atomic(self.summary(), out / "summary.json")
        return out


def _optional_part(result: RepresentationOverview, name: str, build: Any, command: str) -> None:
    """Run one part of the overview into ``result.<name>`` with its command and wall time; a part the model cannot
    run (a named input error: no pointing traces, no image tokens in the sequence) is recorded as skipped."""
    clock = time.perf_counter()
    try:
        setattr(result, name, build())
        result.commands[name] = command
    except InputError as err:
        result.skipped[name] = str(err)
    result.seconds[name] = time.perf_counter() - clock


def representation_overview(vlm: Any, *, seed: int = 0, rsa_positions: int = 2, n_track: int = 32,
                            n_train: int = 512, n_val: int = 128, n_test: int = 128, epochs: int = 40,
                            permutations: int = 200, n_lens: int = 8, n_relevancy: int = 8,
                            ) -> RepresentationOverview:
    """RSA by layer, the centroid RMSE curve (visual search traces), linear probes at the default sites, the logit
    lens on scene description and relevancy maps on the query task (a family whose image never enters the sequence
    skips the last two, with the reason)."""
    result = RepresentationOverview(vlm.name)
    model_arg = vlm.source if os.path.isdir(str(vlm.source)) else vlm.name
    clock = time.perf_counter()
    sites = ["vision.blocks.*.hook_resid_post", "projector.hook_out", "blocks.*.hook_resid_post"]
    acts = capture(vlm, rsa_stimuli(vlm, rsa_positions, seed), sites)
    result.rsa = rsa(acts, permutations=permutations, seed=seed)
    result.commands["rsa"] = f"vlmbind rsa --model {model_arg} --positions {rsa_positions} --permutations {permutations}"
    result.seconds["rsa"] = time.perf_counter() - clock

    _optional_part(result, "track", lambda: track(vlm, tracking_dataset(vlm, "search", n_track, seed + 1)),
                   f"vlmbind track --model {model_arg} --task search --n {n_track} --seed {seed + 1}")

    clock = time.perf_counter()
    world = default_world(vlm)  # in domain: the organisms' own palette and canvas
    examples, split = colorshape_splits(n_train, n_val, n_test, seed, world)
    probe_at = default_sites(vlm)
    acts = capture(vlm, examples, probe_at)
    # small training sets underfit with FBP's lr 1e-3 / batch 512 in a few epochs; this recipe converges here
    config = ProbeConfig(epochs=epochs, lr=1e-2, batch_size=128, seed=seed)
    result.probes = probe_sites(acts, split, families=("linear",), config=config, world=world)
    result.commands["probe"] = (f"vlmbind probe --model {model_arg} --world {world.name} --sites {','.join(probe_at)} "
                                f"--family linear "
                                f"--n-train {n_train} --n-val {n_val} --n-test {n_test} --epochs {epochs} --lr 0.01 "
                                f"--batch-size 128")
    result.seconds["probe"] = time.perf_counter() - clock

    _optional_part(result, "lens", lambda: lens(vlm, lens_dataset(vlm, "scene", n_lens, seed + 2)),
                   f"vlmbind lens --model {model_arg} --n {n_lens} --seed {seed + 2}")
    _optional_part(result, "relevancy",
                   lambda: relevancy(vlm, relevancy_dataset(vlm, "query", n_relevancy, seed + 3), fractions=5,
                                     random_maps=2, seed=seed + 3),
                   f"vlmbind relevancy --model {model_arg} --n {n_relevancy} --seed {seed + 3} --fractions 5 "
                   "--random-maps 2")
    return result
