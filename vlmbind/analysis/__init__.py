"""Analyses over a model and stimuli (causal) or over captured activations (representational)."""

from .mediation import HeadScores, answer_token_ids, locate

__all__ = ["HeadScores", "answer_token_ids", "locate"]
