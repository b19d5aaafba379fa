"""Pairwise IsSameObject probes (VOB): do two patch tokens of one image belong to the same object?

Design: pairs are drawn within each image among object tokens (object id >= 0; background, id -1, is excluded),
either balanced (as many different-object pairs as same-object pairs, up to ``max_pairs_per_image``) or uniformly
from all pairs (the natural, mostly "different" distribution). Three probe families score a pair ``(x, y)``:
``linear`` ``w.x + w.y + b`` (additive, so it can only learn which tokens tend to be in same-object pairs: VOB's
weak control); ``diag_quadratic`` ``x^T diag(w) y + b`` (a learned weighted dot product); ``quadratic``
``x^T W y + b`` with ``W`` symmetric, low rank ``sum_r s_r u_r u_r^T`` (rank ``ProbeConfig.rank``; ``rank=None`` is a
full symmetric matrix). All are symmetric in (x, y) and trained with the same recipe as the autoregressive probes
(:func:`vlmbind.probes.training.fit`: Adam, step decay, early stopping on the validation images); tokens are
z-scored per dimension with training-token statistics (VOB layer-normalises tokens first; both only rescale).
Test accuracy (a pair is called "same" when its logit is > 0) is reported beside two baselines on the same test pairs:
always "not same", and same-class-only ("same class => same object", from a per-token class such as the colour-shape
conjunction), which a probe must beat to show object binding rather than feature similarity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.nn import functional as nnf

from ..core.errors import InputError, TrainingError, close_matches
from .autoregressive import ArrayLike, as_tensor, prior_log_odds
from .information import split_indices
from .training import LN2, FitInfo, ProbeConfig, feature_stats, fit

PAIRWISE_FAMILIES = ("linear", "diag_quadratic", "quadratic")
PairRule = Callable[[np.ndarray], np.ndarray]  # test pairs [P, 3] (image, i, j) -> [P] bool "same object"


def sample_pairs(object_ids: ArrayLike, *, balance: bool = True, max_pairs_per_image: int | None = 256,
                 seed: int = 0, images: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token pairs within images, labelled same object or not.

    Args:
        object_ids: ``[n, T]`` ints, the object each token belongs to (``-1`` = background, never paired).
        balance: draw equally many same- and different-object pairs per image (``min`` of the two counts, capped at
            ``max_pairs_per_image // 2`` each); otherwise draw uniformly from all pairs.
        max_pairs_per_image: cap per image (``None``: no cap).
        seed: seed of the draws.
        images: which image rows to use (default all).

    Returns:
        ``(pairs [P, 3] int64 (image, token_i, token_j) with i < j, labels [P] bool (same object))``.
    """
    ids = as_tensor(object_ids, "object_ids").numpy()
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"object_ids must be a [n, T] int array (-1 = background), got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    if max_pairs_per_image is not None and max_pairs_per_image < 2:
        raise InputError(f"max_pairs_per_image must be >= 2 or None, got {max_pairs_per_image}")
    rng = np.random.default_rng(seed)
    rows = np.arange(ids.shape[0]) if images is None else np.asarray(images)
    out_pairs, out_labels = [], []
    for n in rows:
        tok = np.flatnonzero(ids[n] >= 0)
        if len(tok) < 2:
            continue
        a, b = np.triu_indices(len(tok), k=1)
        same = ids[n, tok[a]] == ids[n, tok[b]]
        if balance:
            pos, neg = np.flatnonzero(same), np.flatnonzero(~same)
            k = min(len(pos), len(neg))
            if max_pairs_per_image is not None:
                k = min(k, max_pairs_per_image // 2)
            if k == 0:
                continue
            chosen = np.concatenate([rng.choice(pos, k, replace=False), rng.choice(neg, k, replace=False)])
        else:
            k = len(a) if max_pairs_per_image is None else min(len(a), max_pairs_per_image)
            chosen = rng.choice(len(a), k, replace=False)
        chosen.sort()
        out_pairs.append(np.stack([np.full(len(chosen), n), tok[a[chosen]], tok[b[chosen]]], 1))
        out_labels.append(same[chosen])
    if not out_pairs:
        return np.zeros((0, 3), np.int64), np.zeros(0, bool)
    return np.concatenate(out_pairs).astype(np.int64), np.concatenate(out_labels)


class PairProbe(nn.Module):
    """Base class: ``forward(x [P, d], y [P, d]) -> logits [P]`` of "same object"."""

    family: str = ""

    def n_params(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters())


class LinearPair(PairProbe):
    """``w.x + w.y + b``."""

    family = "linear"

    def __init__(self, dim: int, config: ProbeConfig, g: torch.Generator) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, generator=g) / math.sqrt(dim))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) @ self.w + self.b


class DiagQuadraticPair(PairProbe):
    """``x^T diag(w) y + b``."""

    family = "diag_quadratic"

    def __init__(self, dim: int, config: ProbeConfig, g: torch.Generator) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, generator=g) / dim)
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y) @ self.w + self.b


class QuadraticPair(PairProbe):
    """``x^T W y + b``, W symmetric: ``sum_r s_r (u_r.x)(u_r.y)`` (rank R) or ``(A + A^T) / 2`` (full)."""

    family = "quadratic"

    def __init__(self, dim: int, config: ProbeConfig, g: torch.Generator) -> None:
        super().__init__()
        self.rank = config.rank
        if self.rank is None:
            self.a = nn.Parameter(torch.randn(dim, dim, generator=g) / dim)
        else:
            self.u = nn.Parameter(torch.randn(dim, self.rank, generator=g) / math.sqrt(dim))
            self.s = nn.Parameter(torch.randn(self.rank, generator=g) / math.sqrt(self.rank))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            w = (self.a + self.a.T) / 2
            return ((x @ w) * y).sum(-1) + self.b
        return ((x @ self.u) * (y @ self.u) * self.s).sum(-1) + self.b


PAIR_CLASSES: dict[str, type[PairProbe]] = {"linear": LinearPair, "diag_quadratic": DiagQuadraticPair,
                                            "quadratic": QuadraticPair}


@dataclass
class PairwiseResult:
    """IsSameObject probe accuracy on the test images, with its baselines on the same pairs.

    Attributes:
        family: the probe family.
        accuracy: test accuracy (logit > 0 means "same object").
        baseline_not_same: accuracy of always answering "not same" (the fraction of different-object test pairs).
        baseline_same_class: accuracy of "same class => same object" (``nan`` without token classes).
        test_loss_bits: mean test binary cross-entropy per pair (bits).
        positive_rate: fraction of same-object test pairs.
        n_pairs_train, n_pairs_val, n_pairs_test: pairs per split; ``n_train``, ``n_val``, ``n_test``: images.
        balanced: whether pairs were balanced.
        epochs: epochs run; ``seconds``: wall time; ``n_params``: trainable parameters.
        config: the recipe as a dict.
        baselines: accuracy of each named rule passed as ``baselines`` (e.g. same colour => same object) on the
            test pairs; the margin is taken over the strongest of these, "not same" and same-class.
        references: accuracy of rules that are reported but not baselines (e.g. a class-plus-position rule: what a
            representation that knew each token's class and place exactly would allow).
        strongest_baseline: the baseline the margin is taken over.
        margin_se: standard error of the margin, from per-image differences (pairs of one image are not
            independent), over the test images.
    """

    family: str
    accuracy: float
    baseline_not_same: float
    baseline_same_class: float
    test_loss_bits: float
    positive_rate: float
    n_pairs_train: int
    n_pairs_val: int
    n_pairs_test: int
    n_train: int
    n_val: int
    n_test: int
    balanced: bool
    epochs: int
    seconds: float
    n_params: int
    config: dict[str, Any] = field(default_factory=dict)
    baselines: dict[str, float] = field(default_factory=dict)
    references: dict[str, float] = field(default_factory=dict)
    strongest_baseline: str = "not_same"
    margin_se: float = float("nan")

    @property
    def margin(self) -> float:
        """Accuracy above the strongest baseline (what a binding claim needs to be positive)."""
        return self.accuracy - _all_baselines(self)[self.strongest_baseline]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; each baseline and reference also as a flat ``baseline_<name>`` /
        ``reference_<name>`` entry."""
        out = asdict(self)
        out["margin"] = self.margin
        out.update({f"baseline_{k}": v for k, v in self.baselines.items()})
        out.update({f"reference_{k}": v for k, v in self.references.items()})
        return out


def _all_baselines(res: PairwiseResult) -> dict[str, float]:
    out = {"not_same": res.baseline_not_same, **res.baselines}
    if not math.isnan(res.baseline_same_class):
        out["same_class"] = res.baseline_same_class
    return out

    def to_frame(self) -> pd.DataFrame:
        """One tidy row of the scalar fields."""
        return pd.DataFrame([{k: v for k, v in self.to_dict().items() if not isinstance(v, dict)}])


@dataclass
class TrainedPairProbe:
    """A trained pairwise probe with its token standardisation (``mean``, ``std``: ``[d]``)."""

    module: PairProbe
    mean: torch.Tensor
    std: torch.Tensor
    fit_info: FitInfo
    config: ProbeConfig

    @torch.no_grad()
    def logits(self, tokens: ArrayLike, pairs: ArrayLike) -> torch.Tensor:
        """Logits ``[P]`` of "same object" for ``pairs`` ``[P, 3]`` (image, i, j) of ``tokens`` ``[n, T, d]``."""
        toks = _check_tokens(tokens)
        pr = torch.as_tensor(np.asarray(pairs), dtype=torch.long)
        device = self.mean.device
        out = []
        for start in range(0, len(pr), 4096):
            p = pr[start:start + 4096]
            x = (toks[p[:, 0], p[:, 1]].to(device, torch.float32) - self.mean) / self.std
            y = (toks[p[:, 0], p[:, 2]].to(device, torch.float32) - self.mean) / self.std
            out.append(self.module(x, y).cpu())
        return torch.cat(out) if out else torch.zeros(0)


def _check_tokens(tokens: ArrayLike) -> torch.Tensor:
    t = as_tensor(tokens, "tokens")
    if t.dim() != 3:
        raise InputError(f"tokens must be [n, T, d] patch tokens, got shape {tuple(t.shape)}")
    return t if t.is_floating_point() else t.float()


def pairwise_probe(tokens: ArrayLike, object_ids: ArrayLike, split: ArrayLike, *,
                   token_class: ArrayLike | None = None, family: str = "quadratic", balance: bool = True,
                   max_pairs_per_image: int | None = 256, config: ProbeConfig | None = None,
                   baselines: Mapping[str, PairRule] | None = None, references: Mapping[str, PairRule] | None = None,
                   return_probe: bool = False) -> PairwiseResult | tuple[PairwiseResult, TrainedPairProbe]:
    """Train an IsSameObject probe on ``train`` images, early-stop on ``val``, report accuracy on ``test``.

    Args:
        tokens: ``[n, T, d]`` patch tokens (any float dtype).
        object_ids: ``[n, T]`` ints: the object of each token, ``-1`` for background (excluded from pairs).
        split: ``[n]`` labels ``"train"`` / ``"val"`` / ``"test"`` per image.
        token_class: ``[n, T]`` ints, each token's class (e.g. colour-shape conjunction id) for the
            same-class-only baseline; ``None`` leaves that baseline ``nan``.
        family: ``linear``, ``diag_quadratic`` or ``quadratic``.
        balance: balanced pairs (see :func:`sample_pairs`) or uniform pairs.
        max_pairs_per_image: cap on pairs per image.
        config: the training recipe (``rank`` sets the quadratic probe's rank, ``None`` = full).
        baselines: named rules ``pairs [P, 3] -> [P] bool`` ("same object" predictions) the probe must beat.
        references: named rules reported beside the baselines but not counted in the margin.
        return_probe: also return the trained probe.

    Returns:
        A :class:`PairwiseResult` (and the :class:`TrainedPairProbe` when ``return_probe``).

    Raises:
        InputError: malformed arrays or a split without any pair.
        TrainingError: unknown family or bad config.
    """
    t0 = time.perf_counter()
    config = config or ProbeConfig()
    if family not in PAIRWISE_FAMILIES:
        raise TrainingError(f"unknown pairwise probe family {family!r}; use one of {', '.join(PAIRWISE_FAMILIES)}."
                            f"{close_matches(str(family), PAIRWISE_FAMILIES)}")
    toks = _check_tokens(tokens)
    ids = as_tensor(object_ids, "object_ids")
    if tuple(ids.shape) != tuple(toks.shape[:2]):
        raise InputError(f"object_ids must be [n, T] = {tuple(toks.shape[:2])}, got {tuple(ids.shape)}")
    cls = None
    if token_class is not None:
        cls = as_tensor(token_class, "token_class").numpy()
        if cls.shape != tuple(toks.shape[:2]):
            raise InputError(f"token_class must be [n, T] = {tuple(toks.shape[:2])}, got {cls.shape}")
    idx = split_indices(split, toks.shape[0])
    pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for offset, s in enumerate(("train", "val", "test")):
        pairs[s] = sample_pairs(ids, balance=balance, max_pairs_per_image=max_pairs_per_image,
                                seed=config.seed * 3 + offset, images=idx[s])
        if len(pairs[s][0]) == 0:
            raise InputError(f"the {s} split has no token pairs: its images need at least two object tokens "
                             f"(object_ids >= 0){' of the same and of different objects' if balance else ''}")

    device = config.resolved_device()
    dim = toks.shape[-1]
    train_imgs = torch.as_tensor(idx["train"], dtype=torch.long)
    valid = ids >= 0
    if config.standardize:
        mean, std = feature_stats(lambda i: toks[train_imgs[i]], len(train_imgs), dim,
                                  token_mask=lambda i: valid[train_imgs[i]])
        if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
            raise InputError("tokens contain inf or NaN values; clean the representations before probing")
    else:
        mean, std = torch.zeros(dim), torch.ones(dim)
    mean, std = mean.to(device), std.to(device)
    g = torch.Generator().manual_seed(config.seed)
    module = PAIR_CLASSES[family](dim, config, g)
    with torch.no_grad():  # start at the training prior of "same object"
        labels = torch.as_tensor(pairs["train"][1], dtype=torch.float32)
        module.b.copy_(prior_log_odds(labels.mean().reshape(1), len(labels))[0])
    module = module.to(device)

    def side(p: torch.Tensor, col: int) -> torch.Tensor:
        return (toks[p[:, 0], p[:, col]].to(device, torch.float32) - mean) / std

    tensors = {s: (torch.as_tensor(p), torch.as_tensor(lab, dtype=torch.float32)) for s, (p, lab) in pairs.items()}
    p_tr, y_tr = tensors["train"]
    y_tr_d = y_tr.to(device)

    def batch_loss(b: torch.Tensor) -> torch.Tensor:
        p = p_tr[b]
        return nnf.binary_cross_entropy_with_logits(module(side(p, 1), side(p, 2)), y_tr_d[b.to(device)]) / LN2

    def mean_loss(s: str) -> float:
        p, y = tensors[s]
        total = 0.0
        for start in range(0, len(p), 4096):
            pb = p[start:start + 4096]
            total += float(nnf.binary_cross_entropy_with_logits(module(side(pb, 1), side(pb, 2)),
                                                                y[start:start + 4096].to(device), reduction="sum"))
        return total / (len(p) * LN2)

    info = fit(module, batch_loss, lambda: mean_loss("val"), len(p_tr), config,
               torch.Generator().manual_seed(config.seed + 1))
    probe = TrainedPairProbe(module=module, mean=mean, std=std, fit_info=info, config=config)

    p_te, y_te = pairs["test"]
    pred = (probe.logits(toks, p_te) > 0).numpy()
    correct = {"not_same": ~y_te}
    same_class = float("nan")
    if cls is not None:
        correct["same_class"] = (cls[p_te[:, 0], p_te[:, 1]] == cls[p_te[:, 0], p_te[:, 2]]) == y_te
        same_class = float(np.mean(correct["same_class"]))
    rules = {name: _rule_correct(name, rule, p_te, y_te) for name, rule in (baselines or {}).items()}
    correct.update(rules)
    strongest = max(correct, key=lambda k: float(np.mean(correct[k])))
    with torch.no_grad():
        test_loss = mean_loss("test")
    result = PairwiseResult(
        family=family, accuracy=float(np.mean(pred == y_te)), baseline_not_same=float(np.mean(~y_te)),
        baseline_same_class=same_class, test_loss_bits=test_loss, positive_rate=float(np.mean(y_te)),
        n_pairs_train=len(pairs["train"][0]), n_pairs_val=len(pairs["val"][0]), n_pairs_test=len(p_te),
        n_train=len(idx["train"]), n_val=len(idx["val"]), n_test=len(idx["test"]), balanced=balance,
        epochs=info.epochs_run, seconds=time.perf_counter() - t0, n_params=module.n_params(), config=asdict(config),
        baselines={k: float(np.mean(v)) for k, v in rules.items()},
        references={k: float(np.mean(_rule_correct(k, r, p_te, y_te))) for k, r in (references or {}).items()},
        strongest_baseline=strongest,
        margin_se=_clustered_se((pred == y_te).astype(float) - correct[strongest].astype(float), p_te[:, 0]))
    return (result, probe) if return_probe else result


def _rule_correct(name: str, rule: PairRule, pairs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    said = np.asarray(rule(pairs))
    if said.shape != labels.shape or said.dtype != bool:
        raise InputError(f"pair rule {name!r} must return one bool per pair ({labels.shape}), got {said.dtype} "
                         f"{said.shape}")
    return said == labels


def _clustered_se(diff: np.ndarray, cluster: np.ndarray) -> float:
    """Standard error of ``diff.mean()`` with the pairs of one image as one cluster (a ratio estimator)."""
    ids, inverse = np.unique(cluster, return_inverse=True)
    if len(ids) < 2:
        return float("nan")
    sums, sizes = np.bincount(inverse, diff), np.bincount(inverse).astype(float)
    mean = sums.sum() / sizes.sum()
    resid = sums - mean * sizes
    return float(np.sqrt(len(ids) / (len(ids) - 1) * np.sum(resid**2)) / sizes.sum())


__all__ = ["PAIRWISE_FAMILIES", "PairwiseResult", "TrainedPairProbe", "pairwise_probe", "sample_pairs"]
