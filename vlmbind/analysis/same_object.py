"""IsSameObject per site: pairwise probes on scenes whose objects cover several tokens and repeat classes
(VOB's question, in a model's own world).

Design: :func:`~vlmbind.stimuli.same_object.same_object_scenes` is captured once at every site; a vision-block site
is read one row per image token (the mean of the patches merged into it, ``ActivationSet.per_token``), so every
site has the same token table and pairs. Per site and family, :func:`~vlmbind.probes.pairwise_probe` trains on the
train images and reports test accuracy beside the class baselines: always "not same", same class (colour and shape),
same colour, same shape. Each scene holds two identical objects, so no class rule is perfect and a probe above the
strongest of them separates objects that its class cannot. The reference ``same_class_adjacent`` (same class and
neighbouring tokens) is what exact knowledge of each token's class and place would allow; it is reported, not
counted as a baseline. Beside them, a linear readout of each token's row and column (``row_readout``,
``col_readout``, with chance) says whether the site carries the place that separating identical objects needs, and
the twin probe (the same family trained and tested on pairs of the duplicated class's tokens only, ``twin_accuracy``)
says whether the site tells the two identical objects apart when class cannot help. Its margin is over the stronger
of "not same" (0.5 on balanced pairs) and :func:`different_part_rule` (a token pair covering the same part of two
objects is never one object: 0.625 with no place at all). A probe can fail the full task with the twins separable,
if it does not combine class and place.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..core.errors import InputError
from ..core.io import write_json_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result
from ..engine.activations import capture
from ..probes import PAIRWISE_FAMILIES, pairwise_probe
from ..stimuli.colorshape import SPLITS, world_named
from ..stimuli.same_object import same_object_scenes
from ..viz import write_html_atomic
from ..viz.probes import same_object_figure
from .binding import _load_checkpoint, _plain


def token_tables(acts: Any) -> dict[str, np.ndarray]:
    """``[n, T]`` arrays per token: ``object`` (-1: background), ``colour`` and ``shape`` ids (-1: background),
    ``row`` and ``col`` in the token grid."""
    rows = [acts.token_table(i) for i in range(len(acts))]
    if len({len(r["object"]) for r in rows}) != 1:
        raise InputError("the captured examples have different numbers of image tokens; use same-size images")
    out = {k: np.stack([r[k] for r in rows]).astype(np.int64) for k in ("object", "row", "col")}
    colour_ids, shape_ids = {}, {}
    out["colour"], out["shape"] = np.full_like(out["object"], -1), np.full_like(out["object"], -1)
    for i, m in enumerate(acts.examples):
        for t, k in enumerate(out["object"][i]):
            if k >= 0:
                o = m["objects"][k]
                out["colour"][i, t] = colour_ids.setdefault(o["colour"], len(colour_ids))
                out["shape"][i, t] = shape_ids.setdefault(o["shape"], len(shape_ids))
    return out


def class_rules(table: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(baselines, references)``: pair rules on ``(image, i, j)`` rows (see the module docstring)."""

    def same(key: str):
        return lambda p: table[key][p[:, 0], p[:, 1]] == table[key][p[:, 0], p[:, 2]]

    def same_class_adjacent(p):
        near = ((np.abs(table["row"][p[:, 0], p[:, 1]] - table["row"][p[:, 0], p[:, 2]]) <= 1)
                & (np.abs(table["col"][p[:, 0], p[:, 1]] - table["col"][p[:, 0], p[:, 2]]) <= 1))
        return same("colour")(p) & same("shape")(p) & near

    return {"same_colour": same("colour"), "same_shape": same("shape")}, {"same_class_adjacent": same_class_adjacent}


def twin_objects(table: dict[str, np.ndarray], token_class: np.ndarray) -> np.ndarray:
    """``[n, T]`` object ids kept only on the tokens of each image's most repeated class (its duplicated pair, the
    twins), ``-1`` elsewhere: pairs among them differ in place only."""
    keep = np.full_like(table["object"], -1)
    for i, classes in enumerate(token_class):
        objects = {int(k): int(c) for k, c in zip(table["object"][i], classes) if k >= 0}  # object -> its class
        values, counts = np.unique(list(objects.values()), return_counts=True)
        twin = values[counts.argmax()]
        keep[i] = np.where(classes == twin, table["object"][i], -1)
    return keep


def object_parts(table: dict[str, np.ndarray]) -> np.ndarray:
    """``[n, T]`` each token's place within its own object (raster index of its cell in the object's bounding box of
    tokens), ``-1`` for background: two tokens of one object never share it."""
    parts = np.full_like(table["object"], -1)
    for i, objects in enumerate(table["object"]):
        for k in np.unique(objects[objects >= 0]):
            own = objects == k
            rows, cols = table["row"][i][own], table["col"][i][own]
            width = int(cols.max() - cols.min() + 1)
            parts[i][own] = (rows - rows.min()) * width + (cols - cols.min())
    return parts


def different_part_rule(table: dict[str, np.ndarray]) -> Any:
    """The twins' rule that needs no place in the image: "same object unless both tokens cover the same part of
    their objects" (a pair of one object never does). On balanced pairs of two 2 x 2 twins it is right on every
    same-object pair and on a quarter of the others: 0.625."""
    parts = object_parts(table)
    return lambda p: parts[p[:, 0], p[:, 1]] != parts[p[:, 0], p[:, 2]]


def position_readout(tokens: np.ndarray, table: dict[str, np.ndarray], split: np.ndarray, seed: int = 0
                     ) -> dict[str, float]:
    """Test accuracy of a linear (multinomial logistic) readout of each token's row and column in the token grid
    from its representation, and chance (the most frequent value): two identical objects can be told apart only
    through where their tokens are, so a site that does not carry place cannot beat the same-class rule."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x = np.asarray(tokens, dtype=np.float32)
    out = {}
    train, test = split == "train", split == "test"
    for axis in ("row", "col"):
        y = table[axis]
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000, random_state=seed))
        model.fit(x[train].reshape(-1, x.shape[-1]), y[train].ravel())
        out[f"{axis}_readout"] = float(model.score(x[test].reshape(-1, x.shape[-1]), y[test].ravel()))
        out[f"{axis}_chance"] = float(np.bincount(y[test].ravel()).max() / y[test].size)
    return out


@register_result
@dataclass
class SameObjectResult(Result):
    """IsSameObject probe accuracy per (site, family), with the baselines on the same test pairs."""

    model: str
    frame: pd.DataFrame

    kind = "same_object"
    marker_files = ("same_object.csv",)
    figure_name = "same_object"
    table_name = "same_object.csv"

    @classmethod
    def load(cls, directory: str | os.PathLike) -> SameObjectResult:
        directory = Path(directory)
        frame = read_csv_columns(directory / "same_object.csv", ("site", "family", "accuracy", "margin",
                                                                 "strongest_baseline"))
        return cls(read_json_object(directory / "same_object.json").get("model", ""), frame)

    def to_frame(self) -> pd.DataFrame:
        return self.frame

    def figure(self) -> Any:
        return same_object_figure(self.frame, model=self.model)

    def peak(self) -> dict[str, Any]:
        """The (site, family) with the largest margin over the strongest baseline."""
        return self.frame.loc[self.frame["margin"].idxmax()].to_dict()

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``same_object.csv``, ``same_object.html`` and ``same_object.json`` atomically."""
        out = Path(out)
        write_text_atomic(self.frame.to_csv(index=False), out / "same_object.csv")
        write_html_atomic(self.figure(), out / "same_object.html")
        write_json_atomic({"model": self.model, "rows": self.frame.to_dict(orient="records"), "peak": self.peak()},
                          out / "same_object.json")
        return out


def same_object_probes(vlm: Any, sites: list[str], *, n_train: int = 512, n_val: int = 128, n_test: int = 256,
                       seed: int = 0, families: tuple[str, ...] = PAIRWISE_FAMILIES, config: Any = None,
                       world: Any = "organism", token_span: int = 2, n_objects: int = 4,
                       checkpoint: str | os.PathLike | None = None) -> SameObjectResult:
    """Capture :func:`same_object_scenes` at ``sites`` and fit every pairwise family at each.

    Raises:
        InputError: an unknown family, a site that cannot be read per token, or another run's checkpoint.
    """
    bad = [f for f in families if f not in PAIRWISE_FAMILIES]
    if bad:
        raise InputError(f"unknown pairwise families {bad}; families: {', '.join(PAIRWISE_FAMILIES)}")
    world = world_named(world)
    examples, split = [], []
    for name, n in zip(SPLITS, (n_train, n_val, n_test)):
        part = list(same_object_scenes(n, seed, split=name, world=world, token_span=token_span, n_objects=n_objects))
        examples += part
        split += [name] * len(part)
    split = np.array(split)
    acts = capture(vlm, examples, sites)
    table = token_tables(acts)
    klass = np.where(table["object"] >= 0, table["colour"] * 1000 + table["shape"], -1)
    baselines, references = class_rules(table)
    twins, twin_rule = twin_objects(table, klass), different_part_rule(table)
    run = {"model": vlm.name, "sites": list(sites), "families": list(families), "n": [n_train, n_val, n_test],
           "seed": seed, "world": world.name, "token_span": token_span, "n_objects": n_objects, "twin_probes": True,
           "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config)}
    path = Path(checkpoint) if checkpoint is not None else None
    done = {(r["site"], r["family"]): r for r in _load_checkpoint(path, run)} if path is not None else {}
    rows = []
    for site in sites:
        tokens, where = None, None
        for family in families:
            if (site, family) in done:
                rows.append(done[(site, family)])
                continue
            tokens = acts.stacked_per_token(site) if tokens is None else tokens
            where = position_readout(tokens, table, split, seed) if where is None else where
            res = pairwise_probe(tokens, table["object"], split, token_class=klass, family=family, config=config,
                                 baselines=baselines, references=references)
            twin = pairwise_probe(tokens, twins, split, family=family, config=config,
                                  baselines={"different_part": twin_rule})
            d = {k: _plain(v) for k, v in res.to_dict().items() if not isinstance(v, dict)}
            d.pop("seconds", None)
            rows.append({"site": site, "family": family, **{k: v for k, v in d.items() if k != "family"}, **where,
                         "twin_accuracy": twin.accuracy, "twin_not_same": twin.baseline_not_same,
                         "twin_different_part": twin.baselines["different_part"], "twin_margin": twin.margin,
                         "twin_margin_se": twin.margin_se, "twin_pairs_test": twin.n_pairs_test})
            if path is not None:
                write_json_atomic({"run": run, "rows": rows}, path)
    return SameObjectResult(vlm.name, pd.DataFrame(rows))


__all__ = ["SameObjectResult", "class_rules", "different_part_rule", "object_parts", "same_object_probes",
           "token_tables", "twin_objects"]
