"""Synthetic stimuli for the binding tasks, with full metadata and counterfactual pairs (see core.py's design note)."""

from .core import (
    COLOURS,
    LETTERS,
    SHAPES,
    Canvas,
    Dataset,
    Example,
    PairAlignmentError,
    SceneObject,
    StimulusError,
    object_token_positions,
    object_tokens,
    render,
)

__all__ = [
    "COLOURS", "LETTERS", "SHAPES", "Canvas", "Dataset", "Example", "PairAlignmentError", "SceneObject",
    "StimulusError", "object_token_positions", "object_tokens", "render",
]
