"""Binding-information probes on representation arrays (FBP autoregressive probes, VOB pairwise probes).

Design: everything here works on plain arrays (numpy or torch) and needs no model: ``Z`` (``[n, d]`` pooled vectors or
``[n, T, d]`` spatial tokens with an optional ``[n, T]`` mask), binary codes ``O`` and ``F``, and one split label per
example. The activation capture turns a model's activations into such arrays; these functions turn the arrays into
bits (:func:`binding_information` -> :class:`ProbeResult`) and pair accuracies (:func:`pairwise_probe` ->
:class:`PairwiseResult`). Modules: :mod:`.autoregressive` (the five families and teacher-forced training),
:mod:`.information` (the estimates B_O, B*_OF, beta), :mod:`.pairwise` (IsSameObject), :mod:`.training` (the shared
Adam / step-decay / early-stopping recipe, :class:`ProbeConfig`).
"""

from .autoregressive import (
    FAMILIES,
    AutoregressiveProbe,
    TrainedProbe,
    build_probe,
    fit_autoregressive,
)
from .information import (
    NO_INFORMATION,
    Entropies,
    ProbeResult,
    binding_information,
    finding,
    information_estimates,
    split_indices,
)
from .pairwise import PAIRWISE_FAMILIES, PairwiseResult, TrainedPairProbe, pairwise_probe, sample_pairs
from .training import FitInfo, ProbeConfig

__all__ = [
    "FAMILIES", "PAIRWISE_FAMILIES", "AutoregressiveProbe", "TrainedProbe", "build_probe", "fit_autoregressive",
    "NO_INFORMATION", "Entropies", "ProbeResult", "binding_information", "finding", "information_estimates",
    "split_indices",
    "PairwiseResult", "TrainedPairProbe", "pairwise_probe", "sample_pairs", "FitInfo", "ProbeConfig",
]
