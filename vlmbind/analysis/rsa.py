"""Representational similarity analysis and PCA of object representations (PbP, VSM; docs/methods.md section 2).

Per site: each object's representation is the mean of the image tokens it covers (language-model sites, projectors
that keep the image tokens' order, standalone encoders: :meth:`~vlmbind.engine.activations.ActivationSet.objects`); for
other sites (a VLM's vision tower, whose token order is its own; LLaVA-OneVision's tiled projector rows), the mean over
all of the example's tokens, which on the single-object set (one object on a white background) is a representation
of that object. The empirical similarity matrix (Pearson correlation across objects by default, or
cosine) is compared on its lower triangle with the model matrices:

* conjunctive: 1 if same colour and same shape, else 0;
* compositional: 0.5 [same colour] + 0.5 [same shape];
* position: 1 - distance / max distance between the objects' grid cells;

by Pearson r and Spearman rho, with a permutation p-value for r (Mantel: the objects of the model matrix are
permuted, rows and columns together; p = (1 + #{r_perm >= r}) / (1 + permutations)).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
from sklearn.decomposition import PCA

from ..core.choices import RSA_DEFAULT_SITES as DEFAULT_SITES  # noqa: F401  (public here too)
from ..core.choices import SIMILARITIES
from ..core.errors import InputError
from ..core.io import write_json_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..organisms.data import training_canvas
from ..stimuli import rsa_set
from ..viz import write_html_atomic
from ..viz.rsa import (  # noqa: F401  (MODEL_MATRICES, pca_figure: public here before viz)
    MODEL_MATRICES,
    pca_figure,
    rsa_figure,
)


def model_matrices(objects: pd.DataFrame) -> dict[str, np.ndarray]:
    """The three ``n n`` model matrices for objects with ``colour``, ``shape``, ``row`` and ``col`` columns."""
    colour = objects["colour"].to_numpy()
    shape = objects["shape"].to_numpy()
    same_colour = (colour[:, None] == colour[None]).astype(float)
    same_shape = (shape[:, None] == shape[None]).astype(float)
    cells = objects[["row", "col"]].to_numpy(dtype=float)
    distance = np.sqrt(((cells[:, None] - cells[None]) ** 2).sum(-1))
    top = distance.max()
    return {
        "conjunctive": same_colour * same_shape,
        "compositional": 0.5 * same_colour + 0.5 * same_shape,
        "position": 1.0 - distance / top if top > 0 else np.ones_like(distance),
    }


def similarity_matrix(x: np.ndarray, kind: str = "pearson") -> np.ndarray:
    """``n n`` similarity of the rows of ``x``: Pearson correlation (rows centred and scaled) or cosine."""
    if kind not in SIMILARITIES:
        raise InputError(f"similarity must be one of {SIMILARITIES}, got {kind!r}")
    x = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x).all():
        # a NaN would turn the whole matrix, and every r computed from it, into NaN without a word
        raise InputError(f"the representations hold {int((~np.isfinite(x)).sum())} NaN or inf values; clean them "
                         "(or re-capture in float32) before computing similarities")
    if kind == "pearson":
        x = x - x.mean(1, keepdims=True)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.where(norm > 0, norm, 1.0)
    return x @ x.T


def compare(similarity: np.ndarray, model: np.ndarray, permutations: int = 1000,
            rng: np.random.Generator | None = None) -> dict[str, float]:
    """Pearson r and Spearman rho between two matrices' lower triangles, and the permutation p-value of r."""
    n = similarity.shape[0]
    rows, cols = np.tril_indices(n, -1)
    a, b = similarity[rows, cols], model[rows, cols]
    if np.ptp(b) == 0 or np.ptp(a) == 0:
        return {"r": float("nan"), "spearman": float("nan"), "p": float("nan")}
    r = float(stats.pearsonr(a, b).statistic)
    rho = float(stats.spearmanr(a, b).statistic)
    p = float("nan")
    if permutations > 0:
        rng = rng or np.random.default_rng(0)
        a_z = (a - a.mean()) / a.std()
        exceed = 0
        for _ in range(permutations):
            perm = rng.permutation(n)
            bp = model[perm][:, perm][rows, cols]
            sd = bp.std()
            if sd > 0 and float(np.mean(a_z * (bp - bp.mean()) / sd)) >= r - 1e-12:
                exceed += 1
        p = (1 + exceed) / (1 + permutations)
    return {"r": r, "spearman": rho, "p": p}


def _site_parts(site: str) -> tuple[str, int | None]:
    m = re.match(r"^(vision\.)?blocks\.(\d+)\.", site)
    if m:
        return ("vision" if m.group(1) else "lm"), int(m.group(2))
    return "projector", None


def _objects_of(acts: Any, site: str) -> tuple[pd.DataFrame, np.ndarray]:
    """``(objects frame, n d object vectors)`` of ``site``; non-finite activations are refused (RSA and PCA would
    return NaN silently)."""
    objects, x = _object_vectors(acts, site)
    bad = ~np.isfinite(x).all(1)
    if bad.any():
        examples = sorted({int(e) for e in objects.loc[bad, "example"]})
        raise InputError(f"{site}: the activations of examples {examples[:5]} hold NaN or inf values; re-capture "
                         "them (e.g. in float32) or drop those examples")
    return objects, x


def _object_vectors(acts: Any, site: str) -> tuple[pd.DataFrame, np.ndarray]:
    if acts._token_aligned(site):
        return acts.objects(site)
    rows, vectors = [], []
    for i, (meta, tensor) in enumerate(zip(acts.examples, acts.iter_site(site))):
        objects = meta.get("objects", [])
        if len(objects) != 1:
            raise InputError(f"{site}: its rows do not follow the token table, so RSA pools whole images and every "
                             "example must hold one object "
                             f"(example {i} holds {len(objects)}); use the single-object RSA set")
        o = objects[0]
        rows.append({"example": i, "object": 0, "colour": o["colour"], "shape": o["shape"], "row": o["row"],
                     "col": o["col"]})
        vectors.append(tensor.float().mean(0).numpy())
    return pd.DataFrame(rows), np.stack(vectors)


@register_result
@dataclass
class RSAResult(Result):
    """RSA per site: a tidy frame (site, component, layer, model_matrix, r, spearman, p, n_objects)."""

    kind = "rsa"
    reproduced_files = ("rsa.csv", "rsa.json", "rsa.html")
    marker_files = ("rsa.csv",)
    figure_name = "rsa"
    table_name = "rsa.csv"

    model: str
    similarity: str
    permutations: int
    frame: pd.DataFrame

    def figure(self) -> Any:
        """r by layer, one panel per component (vision tower, projector, language model), one line per model matrix."""
        return rsa_figure(self.frame, similarity=self.similarity, model=self.model)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> RSAResult:
        directory = Path(directory)
        frame = read_csv_columns(directory / "rsa.csv", ("site", "component", "layer", "model_matrix", "r",
                                                         "spearman", "p", "n_objects"))
        meta = read_json_object(directory / "rsa.json")
        require_keys(meta, ("model", "similarity", "permutations"), directory / "rsa.json")
        return cls(meta["model"], meta["similarity"], int(meta["permutations"]), frame)

    def to_frame(self) -> pd.DataFrame:
        return self.frame

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "similarity": self.similarity, "permutations": self.permutations,
                "rows": self.frame.to_dict(orient="records")}

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``rsa.csv``, ``rsa.html`` and ``rsa.json`` atomically."""
        out = Path(out)
        write_text_atomic(self.frame.to_csv(index=False), out / "rsa.csv")
        write_html_atomic(self.figure(), out / "rsa.html")
        write_json_atomic(self.summary(), out / "rsa.json")
        return out


def rsa(acts: Any, sites: list[str] | None = None, *, similarity: str = "pearson", permutations: int = 1000,
        seed: int = 0) -> RSAResult:
    """RSA of every (or the listed) captured site against the three model matrices.

    Raises:
        InputError: an unknown similarity, a negative permutation count, or sites that cannot give object vectors.
    """
    if similarity not in SIMILARITIES:
        raise InputError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    if not isinstance(permutations, int) or permutations < 0:
        raise InputError(f"permutations must be an int >= 0, got {permutations!r}")
    sites = acts.sites if sites is None else list(sites)
    rng = np.random.default_rng(seed)
    rows = []
    for site in sites:
        objects, x = _objects_of(acts, site)
        if len(objects) < 3:
            raise InputError(f"{site}: RSA needs at least 3 objects, got {len(objects)}")
        sim = similarity_matrix(x, similarity)
        component, layer = _site_parts(site)
        for name, matrix in model_matrices(objects).items():
            rows.append({"site": site, "component": component, "layer": layer, "model_matrix": name,
                         **compare(sim, matrix, permutations, rng), "n_objects": len(objects)})
    return RSAResult(acts.manifest.get("model", ""), similarity, permutations, pd.DataFrame(rows))


# ----------------------------------------------------------------------------------------------------------------
# PCA
# ----------------------------------------------------------------------------------------------------------------
def pca(acts: Any, site: str, n_components: int = 2) -> pd.DataFrame:
    """Object representations at ``site`` projected on their first principal components (scikit-learn), with each
    object's colour, shape, cell and the explained variance ratio of each component (``evr1``, ...)."""
    objects, x = _objects_of(acts, site)
    k = min(n_components, x.shape[0], x.shape[1])
    fit = PCA(n_components=k).fit(x)
    projected = fit.transform(x)
    frame = objects.copy()
    for j in range(k):
        frame[f"pc{j + 1}"] = projected[:, j]
        frame[f"evr{j + 1}"] = float(fit.explained_variance_ratio_[j])
    frame["cell"] = [f"({r}, {c})" for r, c in zip(frame["row"], frame["col"])]
    frame["site"] = site
    return frame


def rsa_stimuli(vlm: Any, n_positions: int, seed: int) -> Any:
    """The single-object RSA set on the model's own canvas and pools when it records them (organisms), else PbP's."""
    training = getattr(vlm, "training", None)
    if not training:
        return rsa_set(seed, positions_per_conjunction=n_positions)
    options = training.get("task_options", {}).get("scene", {})
    kwargs: dict[str, Any] = {"canvas": training_canvas(training)}
    if options.get("colours"):
        kwargs["colours"] = tuple(options["colours"])
    if options.get("shapes"):
        kwargs["shapes"] = tuple(options["shapes"])
    return rsa_set(seed, positions_per_conjunction=n_positions, **kwargs)
