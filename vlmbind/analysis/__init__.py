"""Analyses over a model and stimuli (causal) or over captured activations (representational)."""

from .ablation import AblationResult, ablation_study
from .mediation import HeadScores, answer_token_ids, locate

__all__ = ["AblationResult", "HeadScores", "ablation_study", "answer_token_ids", "locate"]
