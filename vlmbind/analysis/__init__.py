"""Analyses over a model and stimuli (causal) or over captured activations (representational)."""

from .ablation import AblationResult, ablation_study
from .edits import (
    AddToHeadRows,
    EditResult,
    PositionIDs,
    RepairResult,
    edit_study,
    entropy_repair,
    estimate_position_ids,
)
from .mediation import HeadScores, answer_token_ids, locate
from .traces import PointSwapPair, point_swap_pairs
from .tracking import TrackResult, centroid, grid_to_point_frame, track, tracking_dataset

__all__ = [
    "AblationResult", "HeadScores", "ablation_study", "answer_token_ids", "locate", "PointSwapPair",
    "point_swap_pairs",
    "TrackResult", "centroid", "grid_to_point_frame", "track", "tracking_dataset",
    "AddToHeadRows", "EditResult", "PositionIDs", "RepairResult", "edit_study", "entropy_repair", "estimate_position_ids",
]
