"""Binding information in bits (FBP): B_O, B*_OF and their normalised forms from an object probe and a feature probe.

Design: a probe's TEST cross-entropy upper-bounds the conditional entropy (``CE_O >= H(O|Z)``), so
``B_O = H(O) - CE_O`` is a lower-bound estimate of ``I(O;Z)``, and with a feature probe trained the same way,
``B*_OF = H(O|F) - (CE_O - CE_F)`` estimates ``I(O;Z|F) = I(O;Z) - I(F;Z)`` (exact when O determines F, as in
ColorShape); ``beta_O = B_O / H(O)`` and ``beta*_OF = B*_OF / H(O|F)`` (docs/methods.md section 6). The entropies are
the caller's, not estimated here: synthetic stimuli know them exactly (``vlmbind.stimuli.colorshape.entropies(split)``
returns ``H_O``, ``H_F``, ``H_O_given_F``), and they must be those of the distribution the TEST split is drawn from.
:func:`binding_information` takes whole arrays plus one split label per example, trains the probes on ``train``,
early-stops on ``val`` and evaluates on ``test`` only; training loss is never reported. The estimates can be
negative (a probe worse than the prior on held-out data, or test-set noise); they are reported as measured, not
clipped, beside a prior-only baseline (the same recipe on a representation that carries nothing) and the probe's
margin over it with its standard error, and :func:`finding` says in words what the numbers support: a bound below
zero is "no information found (estimator bound below zero)", a statement about the estimator, never a negative
information.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..core.errors import InputError
from .autoregressive import (
    ArrayLike,
    TrainedProbe,
    check_code,
    check_family,
    check_representations,
    fit_autoregressive,
)
from .training import ProbeConfig

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Entropies:
    """Entropies (bits) of the code distribution the test split is drawn from.

    Attributes:
        H_O: H(O).
        H_F: H(F), or ``None`` when no feature code is used.
        H_O_given_F: H(O|F); when ``None`` and ``H_F`` is given it is taken as ``H_O - H_F`` (valid when O determines
            F, so that H(O, F) = H(O)).
    """

    H_O: float
    H_F: float | None = None
    H_O_given_F: float | None = None

    def __post_init__(self) -> None:
        for name in ("H_O", "H_F", "H_O_given_F"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise InputError(f"entropy {name} must be a finite number >= 0 (bits), got {v!r}")
        if self.H_O_given_F is None and self.H_F is not None:
            object.__setattr__(self, "H_O_given_F", float(self.H_O) - float(self.H_F))

    @classmethod
    def of(cls, value: Entropies | Mapping[str, Any]) -> Entropies:
        """From an :class:`Entropies` or a mapping with keys ``H_O`` and optionally ``H_F``, ``H_O_given_F``
        (the dict that ``vlmbind.stimuli.colorshape.entropies(split)`` returns)."""
        if isinstance(value, Entropies):
            return value
        if not isinstance(value, Mapping) or "H_O" not in value:
            raise InputError("entropies must be an Entropies or a mapping with 'H_O' (and 'H_F', 'H_O_given_F'), "
                             "e.g. vlmbind.stimuli.colorshape.entropies('test')")
        get = (lambda k: None if value.get(k) is None else float(value[k]))
        return cls(H_O=float(value["H_O"]), H_F=get("H_F"), H_O_given_F=get("H_O_given_F"))


def information_estimates(ce_o: float, entropies: Entropies | Mapping[str, Any], ce_f: float | None = None
                          ) -> dict[str, float | None]:
    """The FBP estimates from test cross-entropies (bits).

    Args:
        ce_o: test CE of the object probe, an upper bound on H(O|Z).
        entropies: H(O), and H(F), H(O|F) for the conditional estimate.
        ce_f: test CE of the feature probe (``None``: no conditional estimate).

    Returns:
        ``B_O = H(O) - CE_O``, ``beta_O = B_O / H(O)``, ``B_F = H(F) - CE_F``,
        ``B_star_OF = H(O|F) - (CE_O - CE_F)``, ``beta_star_OF = B_star_OF / H(O|F)`` (``None`` where an input is
        missing; a ratio is ``nan`` when its entropy is 0).
    """
    h = Entropies.of(entropies)
    ratio = (lambda a, b: a / b if b > 0 else float("nan"))
    b_o = h.H_O - ce_o
    out: dict[str, float | None] = {"B_O": b_o, "beta_O": ratio(b_o, h.H_O), "B_F": None, "B_star_OF": None,
                                    "beta_star_OF": None}
    if ce_f is not None and h.H_F is not None:
        out["B_F"] = h.H_F - ce_f
    if ce_f is not None and h.H_O_given_F is not None:
        b_star = h.H_O_given_F - (ce_o - ce_f)
        out["B_star_OF"], out["beta_star_OF"] = b_star, ratio(b_star, h.H_O_given_F)
    return out


@dataclass
class ProbeResult:
    """Binding-information estimates of one probe family on one representation.

    Attributes:
        family: the object probe's family; ``feature_family`` the feature probe's.
        CE_O, CE_F: test cross-entropies (bits, summed over the code's bits, mean over test examples).
        B_O, B_F, B_star_OF: information estimates (bits); ``beta_O``, ``beta_star_OF`` their normalised forms.
        H_O, H_F, H_O_given_F: the entropies used.
        n_train, n_val, n_test: examples per split.
        epochs_O, epochs_F: epochs run by each probe (early stopping may end a run before ``config.epochs``).
        steps_O, steps_F: optimiser steps of each probe; val_loss_O, val_loss_F: the kept parameters' validation
            loss (bits); converged_O, converged_F: training stopped because the validation loss stopped improving.
        CE_O_prior, B_O_prior: the prior-only baseline: the same recipe's linear probe on a constant
            representation (it learns q(o_k | o_<k) and nothing of Z); its B_O is what an estimator gets from no
            information at all.
        margin_O, margin_O_se: the object probe's test bits below the prior-only probe's (mean of per-example
            differences) and its standard error over the test split.
        finding: :func:`finding` of the estimate.
        CE_O_train: the object probe's cross-entropy on its own training split (bits); ``CE_O - CE_O_train`` is
            its generalisation gap to the test split's unseen feature codes.
        seconds: wall time of training and evaluation.
        n_params: trainable parameters of the object probe.
        bits_per_output_O: ``[K]`` test CE of each conditional ``q(o_k | o_<k, z)``.
        attention: for the attention family, ``[n_test, K, T]`` attention weights of the object probe on the test
            split (teacher-forced); ``test_index`` maps its rows back to the input rows.
        config: the recipe as a dict.
        start_O, start_val_losses_O: for the attention family, the object probe's start that was kept and the
            validation loss (bits) of every start tried (``ProbeConfig.attention_starts``); ``None`` otherwise.
    """

    family: str
    feature_family: str | None
    CE_O: float
    CE_F: float | None
    B_O: float
    B_F: float | None
    B_star_OF: float | None
    beta_O: float
    beta_star_OF: float | None
    H_O: float
    H_F: float | None
    H_O_given_F: float | None
    n_train: int
    n_val: int
    n_test: int
    epochs_O: int
    epochs_F: int | None
    seconds: float
    n_params: int
    bits_per_output_O: list[float] = field(default_factory=list)
    attention: torch.Tensor | None = None
    test_index: np.ndarray | None = None
    config: dict[str, Any] = field(default_factory=dict)
    steps_O: int = 0
    steps_F: int | None = None
    val_loss_O: float = float("nan")
    val_loss_F: float | None = None
    converged_O: bool = False
    converged_F: bool | None = None
    CE_O_prior: float = float("nan")
    B_O_prior: float = float("nan")
    margin_O: float = float("nan")
    margin_O_se: float = float("nan")
    finding: str = ""
    CE_O_train: float = float("nan")
    start_O: str | None = None
    start_val_losses_O: dict[str, float] | None = None

    def to_dict(self, include_attention: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (the attention tensor, large, only when asked; its shape always)."""
        # Field by field, not asdict(): asdict would deep-copy the (possibly large) attention tensor.
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("attention", "test_index")}
        out["bits_per_output_O"] = [float(b) for b in self.bits_per_output_O]
        out["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.config.items()}
        out["attention_shape"] = None if self.attention is None else list(self.attention.shape)
        if include_attention and self.attention is not None:
            out["attention"] = self.attention.tolist()
            out["test_index"] = None if self.test_index is None else self.test_index.tolist()
        return out

    def to_frame(self) -> pd.DataFrame:
        """One tidy row of the scalar fields."""
        d = self.to_dict()
        return pd.DataFrame([{k: v for k, v in d.items() if not isinstance(v, (list, dict))}])


NO_INFORMATION = "no information found (estimator bound below zero)"


def finding(b_o: float, margin: float, margin_se: float) -> str:
    """What an estimate says, in words: a bound below zero finds nothing (it is a statement about the estimator,
    not a negative information); a margin over the prior-only probe of at least two standard errors is
    information found; anything else is not distinguishable from the prior."""
    if not b_o >= 0:
        return NO_INFORMATION
    if margin_se >= 0 and margin > 2 * margin_se:
        return "information found (margin over the prior-only probe > 2 standard errors)"
    return "not distinguishable from the prior-only probe"


def split_indices(split: ArrayLike, n: int) -> dict[str, np.ndarray]:
    """Row indices of each split from one label per example (``"train"``, ``"val"``, ``"test"``).

    Raises:
        InputError: wrong length, unknown labels, or an empty split.
    """
    labels = np.asarray(split).astype(str)
    if labels.shape != (n,):
        raise InputError(f"split must hold one label per example ({n}), got shape {labels.shape}")
    unknown = sorted(set(labels.tolist()) - set(SPLITS))
    if unknown:
        raise InputError(f"unknown split labels {unknown[:5]}; use {', '.join(SPLITS)}")
    out = {s: np.flatnonzero(labels == s) for s in SPLITS}
    empty = [s for s in SPLITS if len(out[s]) == 0]
    if empty:
        raise InputError(f"split(s) {empty} have no examples; every one of train, val, test needs at least one")
    return out


def _take(x: torch.Tensor | None, idx: np.ndarray) -> torch.Tensor | None:
    return None if x is None else x[torch.as_tensor(idx, dtype=torch.long)]


def binding_information(Z: ArrayLike, O: ArrayLike, F: ArrayLike | None, split: ArrayLike, *,
                        entropies: Entropies | Mapping[str, Any], family: str = "linear",
                        feature_family: str | None = None, mask: ArrayLike | None = None,
                        config: ProbeConfig | None = None,
                        factor_map: tuple[Sequence[int], Sequence[int]] | None = None,
                        return_probes: bool = False) -> ProbeResult | tuple[ProbeResult, dict[str, TrainedProbe]]:
    """Train object (and feature) probes on ``train``, early-stop on ``val``, estimate binding information on ``test``.

    One line for a caller with arrays::

        res = binding_information(Z, O, F, split, entropies=colorshape.entropies("test"), family="quadratic")

    Args:
        Z: ``[n, d]`` pooled representations or ``[n, T, d]`` spatial tokens (``family="attention"``).
        O: ``[n, K]`` 0/1 object codes.
        F: ``[n, K_F]`` 0/1 feature codes, or ``None`` (then only B_O and beta_O are estimated).
        split: ``[n]`` labels ``"train"`` / ``"val"`` / ``"test"`` (ColorShape splits by F code, disjoint).
        entropies: H(O), H(F), H(O|F) in bits of the test split's distribution (a mapping such as
            ``colorshape.entropies("test")`` or an :class:`Entropies`).
        family: the object probe family (``linear``, ``quadratic``, ``dnn``, ``shared_factor``, ``attention``).
        feature_family: the feature probe's family; default the same, except ``shared_factor`` (whose factor map is
            defined on O only), where the feature probe is ``quadratic``.
        mask: ``[n, T]`` bool token mask for spatial tokens (True = valid token).
        config: the training recipe (both probes use it).
        factor_map: ``(colour_of_output, shape_of_output)`` for ``shared_factor``.
        return_probes: also return ``{"O": probe, "F": probe}``.

    Returns:
        A :class:`ProbeResult` (and the trained probes when ``return_probes``).

    Raises:
        InputError: malformed arrays, splits or entropies.
        TrainingError: unknown family or bad config.
    """
    t0 = time.perf_counter()
    config = config or ProbeConfig()
    check_family(family)
    if feature_family is None:
        feature_family = "quadratic" if family == "shared_factor" else family
    check_family(feature_family)
    h = Entropies.of(entropies)
    z, m = check_representations(Z, "Z", mask)
    o = check_code(O, "O", z.shape[0])
    f = None if F is None else check_code(F, "F", z.shape[0])
    idx = split_indices(split, z.shape[0])
    tr, va, te = idx["train"], idx["val"], idx["test"]

    probes: dict[str, TrainedProbe] = {}
    ce: dict[str, float] = {}
    per_output: list[float] = []
    attention = None
    for name, code, fam in (("O", o, family), ("F", f, feature_family)):
        if code is None:
            continue
        probe = fit_autoregressive(fam, _take(z, tr), code[tr], _take(z, va), code[va],
                                   mask_train=_take(m, tr), mask_val=_take(m, va), config=config,
                                   factor_map=factor_map if fam == "shared_factor" else None)
        z_te, c_te, m_te = _take(z, te), code[te], _take(m, te)
        bits = probe.bits_per_output(z_te, c_te, m_te)
        ce[name] = float(bits.sum())
        probes[name] = probe
        if name == "O":
            ce["O_train"] = probe.cross_entropy(_take(z, tr), code[tr], _take(m, tr))
            per_output = bits.tolist()
            if fam == "attention":
                attention = probe.attention(z_te, c_te, m_te)

    # the prior-only baseline: the same recipe on a representation that carries nothing
    constant = torch.zeros(len(tr) + len(va) + len(te), 1)
    index = {name: torch.arange(a, b) for name, a, b in (("tr", 0, len(tr)), ("va", len(tr), len(tr) + len(va)),
                                                         ("te", len(tr) + len(va), len(constant)))}
    prior = fit_autoregressive("linear", constant[index["tr"]], o[tr], constant[index["va"]], o[va],
                               config=replace(config, standardize=False))
    prior_bits = prior.per_example_bits(constant[index["te"]], o[te]).double()
    probe_bits = probes["O"].per_example_bits(_take(z, te), o[te], _take(m, te)).double()
    gain = (prior_bits - probe_bits).numpy()
    margin = float(gain.mean())
    margin_se = float(gain.std(ddof=1) / math.sqrt(len(gain))) if len(gain) > 1 else float("nan")
    est = information_estimates(ce["O"], h, ce.get("F"))
    result = ProbeResult(
        family=family, feature_family=feature_family if f is not None else None,
        CE_O=ce["O"], CE_F=ce.get("F"), B_O=est["B_O"], B_F=est["B_F"], B_star_OF=est["B_star_OF"],
        beta_O=est["beta_O"], beta_star_OF=est["beta_star_OF"], H_O=h.H_O, H_F=h.H_F, H_O_given_F=h.H_O_given_F,
        n_train=len(tr), n_val=len(va), n_test=len(te), epochs_O=probes["O"].fit_info.epochs_run,
        epochs_F=probes["F"].fit_info.epochs_run if "F" in probes else None, seconds=time.perf_counter() - t0,
        n_params=probes["O"].module.n_params(), bits_per_output_O=per_output, attention=attention,
        test_index=te, config=asdict(config), steps_O=probes["O"].fit_info.steps,
        steps_F=probes["F"].fit_info.steps if "F" in probes else None, val_loss_O=probes["O"].fit_info.best_val_loss,
        val_loss_F=probes["F"].fit_info.best_val_loss if "F" in probes else None,
        converged_O=probes["O"].fit_info.converged,
        converged_F=probes["F"].fit_info.converged if "F" in probes else None,
        CE_O_prior=float(prior_bits.mean()), B_O_prior=h.H_O - float(prior_bits.mean()), margin_O=margin,
        margin_O_se=margin_se, finding=finding(est["B_O"], margin, margin_se), CE_O_train=ce["O_train"],
        start_O=probes["O"].fit_info.start, start_val_losses_O=probes["O"].fit_info.start_val_losses)
    return (result, probes) if return_probes else result


__all__ = ["NO_INFORMATION", "Entropies", "ProbeResult", "binding_information", "finding", "information_estimates",
           "split_indices"]
