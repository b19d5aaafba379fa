"""Binding information of a model's sites: BalancedColorShape captured once, then FBP's autoregressive probes (bits)
and VOB's pairwise IsSameObject probes per site (``vlmbind probe``).

Design: the stimuli are BalancedColorShape's three disjoint splits (by F code), captured with
:func:`~vlmbind.engine.activations.capture` into one :class:`~vlmbind.engine.activations.ActivationSet`; per site, the
probes read ``Z`` from it: the mean over the site's stored tokens (image tokens of a language-model or projector site,
every token of a vision-tower site; a VLM has no [CLS] vector, so the mean is the pooled representation) or, for the
attention probe and the pairwise probes, the tokens themselves. The entropies are the stimuli's exact ones for the test
split (:func:`vlmbind.stimuli.colorshape.entropies`), so B_O, B*_OF and the betas are in bits of that distribution.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..core.choices import DEFAULT_SITE_CHOICE, PROBE_FAMILIES  # noqa: F401  (DEFAULT_SITE_CHOICE: public here too)
from ..core.choices import PROBE_CHECKPOINT as CHECKPOINT  # noqa: F401  (public here too)
from ..core.errors import InputError
from ..core.io import json_default, write_json_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result
from ..probes import binding_information, pairwise_probe
from ..stimuli.colorshape import FBP, ORGANISM, ColorShapeSplits, ColorShapeWorld, entropies, world_named
from ..stimuli.core import object_token_positions
from ..viz import write_html_atomic
from ..viz.probes import binding_figure


def default_world(vlm: Any) -> ColorShapeWorld:
    """The ColorShape world a model knows: the organisms' (their palette and canvas) for a model vlmbind trained on
    that world, FBP's otherwise."""
    training = getattr(vlm, "training", None) or {}
    pools = training.get("task_options", {}).get("scene", {})
    knows = (training.get("image_size") == ORGANISM.image_size and set(pools.get("colours", ())) == set(ORGANISM.colours)
             and set(pools.get("shapes", ())) == set(ORGANISM.shapes))
    return ORGANISM if knows else FBP


def colorshape_splits(n_train: int, n_val: int, n_test: int, seed: int = 0,
                      world: ColorShapeWorld | str = "fbp", lazy: bool = False) -> tuple[Any, np.ndarray]:
    """BalancedColorShape examples of the three splits of ``world``, in order, and one split label per example.

    ``lazy``: a :class:`~vlmbind.stimuli.colorshape.ColorShapeSplits` that draws each image when it is read (the
    same examples; for FBP-sized sets, whose images would not fit in memory), else a list."""
    for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        if not isinstance(n, int) or n < 1:
            raise InputError(f"the {split} split needs at least one image, got {n!r}")
    examples = ColorShapeSplits((n_train, n_val, n_test), seed, world)
    return (examples if lazy else examples[:]), examples.labels()


def default_sites(vlm: Any) -> list[str]:
    """The last vision block, the projector and the middle language-model layer (encoders: first, middle, last)."""
    if vlm.n_layers == 0:
        n = vlm.n_vision_layers
        return [f"vision.blocks.{l}.hook_resid_post" for l in sorted({0, n // 2, n - 1})]
    return [f"vision.blocks.{vlm.adapter.n_vision_layers - 1}.hook_resid_post", "projector.hook_out",
            f"blocks.{vlm.n_layers // 2}.hook_resid_post"]


def codes(acts: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(O [n, |colours| x |shapes|], F [n, |colours| + |shapes|])`` 0/1 codes of a BalancedColorShape capture."""
    try:
        o = np.array([[int(b) for b in m["o_code"]] for m in acts.examples], dtype=np.float32)
        f = np.array([[int(b) for b in m["f_code"]] for m in acts.examples], dtype=np.float32)
    except KeyError:
        raise InputError("the captured examples carry no o_code / f_code: capture BalancedColorShape images") from None
    return o, f


PAIRWISE_NEEDS = ("IsSameObject needs objects over several tokens: use vlmbind.analysis.same_object.same_object_probes "
                  "(its scenes draw objects over 2 x 2 token cells), or drop pairwise from the families")


def check_pairwise_world(vlm: Any, examples: Any, world: ColorShapeWorld, n: int = 16) -> None:
    """Before a long capture: raise when no object of the first ``n`` examples covers two or more of ``vlm``'s image
    tokens, so the pairwise (IsSameObject) probe would find no same-object token pair.

    Raises:
        InputError: every object covers at most one token, with what to use instead.
    """
    for i in range(min(n, len(examples))):
        example = examples[i]
        index = vlm.prepare(example.image, example.prompt).index[0]
        if any(len(covered) > 1 for covered in object_token_positions(index, example.objects)):
            return
    raise InputError(f"pairwise: in world {world.name!r} on {vlm.name} every object of the first {min(n, len(examples))} "
                     f"images covers at most one image token, so there is no same-object token pair. {PAIRWISE_NEEDS}")


def _token_classes(acts: Any, world: ColorShapeWorld) -> tuple[np.ndarray, np.ndarray]:
    """``[n, T]`` object id and colour-shape class of every stored token (-1: background), zero-padded."""
    cls = {(c, s): i for i, (c, s) in enumerate((c, s) for c in world.colours for s in world.shapes)}
    rows = [acts.token_objects(i) for i in range(len(acts))]
    longest = max(len(r) for r in rows)
    owner = np.full((len(rows), longest), -1)
    klass = np.full((len(rows), longest), -1)
    for i, (r, m) in enumerate(zip(rows, acts.examples)):
        owner[i, : len(r)] = r
        for t, k in enumerate(r):
            if k >= 0:
                o = m["objects"][k]
                klass[i, t] = cls.get((o["colour"], o["shape"]), -1)
    return owner, klass


@register_result
@dataclass
class BindingResult(Result):
    """Probe results per (site, family): a tidy frame plus the raw results."""

    model: str
    frame: pd.DataFrame
    results: dict[tuple[str, str], Any] = field(default_factory=dict)

    kind = "probe"
    reproduced_files = ("probe.csv", "probe.html")
    marker_files = ("probe.csv",)
    figure_name = "probe"
    table_name = "probe.csv"

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BindingResult:
        """The probe table and model from ``probe.csv`` and ``probe.json`` (the fitted probes are not saved)."""
        directory = Path(directory)
        frame = read_csv_columns(directory / "probe.csv", ("site", "family", "B_O", "beta_O", "B_star_OF", "H_O",
                                                           "n_test"))
        meta = read_json_object(directory / "probe.json") if (directory / "probe.json").is_file() else {}
        if "model" not in meta:
            raise InputError(f"{str(directory)!r} has probe.csv but no probe.json naming the model; re-run vlmbind "
                             f"probe")
        return cls(meta["model"], frame)

    def to_frame(self) -> pd.DataFrame:
        return self.frame

    def figure(self) -> Any:
        return binding_figure(self.frame, model=self.model)

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``probe.csv``, ``probe.html`` and ``probe.json`` atomically."""
        out = Path(out)
        write_text_atomic(self.frame.to_csv(index=False), out / "probe.csv")
        write_html_atomic(self.figure(), out / "probe.html")
        seconds = {f"{site} | {family}": res.seconds for (site, family), res in self.results.items()}
        write_json_atomic({"model": self.model, "rows": self.frame.to_dict(orient="records"), "seconds": seconds},
                          out / "probe.json")
        return out


def _plain(value: Any) -> Any:
    """A row value as a JSON-exact Python scalar (numpy scalars become int / float)."""
    return value.item() if isinstance(value, np.generic) else value


def _load_checkpoint(path: Path, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of finished cells from ``path`` (none when it does not exist); refuses another run's checkpoint."""
    if not path.is_file():
        return []
    try:
        saved = json.loads(path.read_text())
        saved_run, rows = saved["run"], saved["rows"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path} is not a probe checkpoint ({exc}); delete it to start the probes again") from None
    run = json.loads(json.dumps(run, default=json_default))  # compared as it reads back from disk
    if not isinstance(saved_run, dict) or saved_run != run:
        saved_run = saved_run if isinstance(saved_run, dict) else {}
        differ = sorted(k for k in set(run) | set(saved_run) if saved_run.get(k) != run.get(k))
        raise InputError(f"{path} holds another run's probes ({', '.join(differ)} differ); use another output "
                         "directory or delete the checkpoint")
    return rows


def probe_sites(acts: Any, split: np.ndarray, *, sites: list[str] | None = None,
                families: tuple[str, ...] = ("linear",), config: Any = None,
                checkpoint: str | os.PathLike | None = None, world: ColorShapeWorld | str = "fbp") -> BindingResult:
    """Every listed family on every captured (or listed) site.

    Args:
        world: the ColorShape world the captured images were drawn from (its test split's entropies are used).
        checkpoint: a JSON file rewritten atomically after every finished (site, family) cell; cells it already
            holds (for the same activations, sites, families and config) are not trained again, so a killed run
            resumes where it stopped and ends with the same table. Resumed cells have no entry in ``results``.

    Raises:
        InputError: an unknown family, a set that is not a BalancedColorShape capture, or a checkpoint of another
            run.
    """
    bad = [f for f in families if f not in PROBE_FAMILIES]
    if bad:
        raise InputError(f"unknown probe families {bad}; families: {', '.join(PROBE_FAMILIES)}")
    split = np.asarray(split)
    if len(split) != len(acts):
        raise InputError(f"{len(split)} split labels for {len(acts)} captured examples")
    o, f = codes(acts)
    world = world_named(world)
    h = entropies("test", world)
    if o.shape[1] != len(world.colours) * len(world.shapes):
        raise InputError(f"the captured codes have {o.shape[1]} object bits but world {world.name!r} has "
                         f"{len(world.colours) * len(world.shapes)}; pass the world the images were drawn from")
    rows, raw = [], {}
    path = Path(checkpoint) if checkpoint is not None else None
    run = {"model": acts.manifest.get("model", ""), "examples": len(acts), "sites": list(sites or acts.sites),
           "families": list(families), "split": split.tolist(), "world": world.name,
           "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config)}
    done = {(r["site"], r["family"]): r for r in _load_checkpoint(path, run)} if path is not None else {}
    for site in sites or acts.sites:
        pooled = None
        for family in families:
            if (site, family) in done:
                rows.append(done[(site, family)])
                continue
            if family == "pairwise":
                tokens, _ = acts.stacked(site)
                owner, klass = _token_classes(acts, world)
                if tokens.shape[1] != owner.shape[1]:
                    raise InputError(f"{site}: its rows do not line up with the token table; pairwise probes need an "
                                     "LM site, an in-order projector or a standalone encoder")
                try:
                    res = pairwise_probe(tokens, owner, split, token_class=klass, config=config)
                except InputError as exc:
                    if "no token pairs" not in str(exc):
                        raise
                    raise InputError(f"{site}: {exc}. In world {world.name!r} an object may cover a single token; "
                                     f"{PAIRWISE_NEEDS}") from None
                row = _pairwise_row(res)
            elif family == "attention":
                z, mask = acts.stacked(site)
                res = binding_information(z, o, f, split, entropies=h, family=family, mask=mask, config=config)
                row = _information_row(res)
            else:
                pooled = acts.pooled(site) if pooled is None else pooled
                res = binding_information(pooled, o, f, split, entropies=h, family=family, config=config)
                row = _information_row(res)
            raw[(site, family)] = res
            rows.append({"site": site, "family": family, "world": world.name,
                         **{k: _plain(v) for k, v in row.items()}})
            if path is not None:
                write_json_atomic({"run": run, "rows": rows}, path)
    return BindingResult(acts.manifest.get("model", ""), pd.DataFrame(rows), raw)


def _information_row(res: Any) -> dict[str, Any]:
    return {"CE_O": res.CE_O, "CE_F": res.CE_F, "B_O": res.B_O, "B_star_OF": res.B_star_OF, "beta_O": res.beta_O,
            "beta_star_OF": res.beta_star_OF, "H_O": res.H_O, "H_F": res.H_F, "B_O_prior": res.B_O_prior,
            "margin_O": res.margin_O, "margin_O_se": res.margin_O_se, "finding": res.finding,
            "n_train": res.n_train, "n_val": res.n_val, "n_test": res.n_test, "epochs": res.epochs_O,
            "steps": res.steps_O, "converged": res.converged_O, "val_loss_O": res.val_loss_O,
            "CE_O_train": res.CE_O_train, "start": res.start_O}


def _pairwise_row(res: Any) -> dict[str, Any]:
    d = res.to_dict() if hasattr(res, "to_dict") else dict(vars(res))
    keep = {k: v for k, v in d.items() if isinstance(v, (int, float, str)) or v is None}
    keep["pair_family"] = keep.pop("family", None)  # the row's family stays "pairwise"
    keep.pop("seconds", None)  # wall time is in each result, not in the table, so tables of equal runs are equal
    keep.setdefault("n_test", keep.get("n_test_pairs"))
    return keep
