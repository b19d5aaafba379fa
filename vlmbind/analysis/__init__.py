"""Analyses over a model and stimuli (causal) or over captured activations (representational).

Importing this package imports every analysis module, which registers every result kind
(:data:`vlmbind.core.results.RESULTS`); a new analysis module is registered by existing, with no line to add here.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from ..engine.interventions import AddToHeadRows
from .ablation import AblationResult, ablation_study
from .attention import AttentionMass, last_token_attention
from .binding import BindingResult, probe_sites
from .edits import EditResult, PositionEditStudy, RepairResult, edit_study, entropy_repair
from .mediation import HeadScores, answer_token_ids, locate
from .overview import CausalOverview, RepresentationOverview, causal_overview, representation_overview
from .position_ids import PositionIDs, estimate_position_ids
from .rsa import RSAResult  # not rsa / pca: vlmbind.analysis.rsa stays the module
from .traces import PointSwapPair, point_swap_pairs
from .tracking import TrackResult, centroid, grid_to_point_frame, track, tracking_dataset

__all__ = [
    "AblationResult", "HeadScores", "ablation_study", "answer_token_ids", "locate", "PointSwapPair",
    "point_swap_pairs", "TrackResult", "centroid", "grid_to_point_frame", "track", "tracking_dataset",
    "AddToHeadRows", "EditResult", "PositionEditStudy", "PositionIDs", "RepairResult", "edit_study",
    "entropy_repair", "estimate_position_ids", "AttentionMass", "last_token_attention", "BindingResult",
    "probe_sites", "CausalOverview", "RepresentationOverview", "causal_overview", "representation_overview",
    "RSAResult",
]

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
