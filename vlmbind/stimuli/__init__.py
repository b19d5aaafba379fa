"""Synthetic stimuli for the binding tasks, with full metadata and counterfactual pairs.

``vb.stimuli.scene_pairs(n=32, condition="id_selection", seed=0)``, ``vb.stimuli.counting(64, objects=range(11, 16))``
and the other generators return data sets whose examples carry every object's colour, shape, cell, centre and size
(see ``core.py`` for the design). ``vlmbind stimuli TASK`` writes them to disk.
"""

from . import answers
from .colorshape import balanced_color_shape, code_arrays, covering_count, entropies, split_codes
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
from .pairs import PairsFileError, load_pairs
from .points import format_points, p2a_text, parse_count, parse_points, parse_yes_no
from .rsa_set import rsa_set
from .scenes import (
    CONDITIONS,
    CounterfactualPair,
    PairSet,
    scene_description,
    scene_pairs,
)
from .query import binding_query
from .search import COUNT_SPLITS, SEARCH_SPLITS, counting, visual_search
from .user import TaskFileError, load_task, user_images
from .registry import (
    Counterfactual,
    PairContext,
    PluginError,
    load_plugin,
    register_condition,
    register_task,
)
from .tasks import make_pairs  # registers the built-in tasks

__all__ = [
    "COLOURS", "LETTERS", "SHAPES", "CONDITIONS", "COUNT_SPLITS", "SEARCH_SPLITS",
    "Canvas", "Dataset", "Example", "SceneObject", "CounterfactualPair", "PairSet",
    "StimulusError", "PairAlignmentError", "PairsFileError", "load_pairs",
    "scene_description", "scene_pairs", "binding_query", "visual_search", "counting", "rsa_set",
    "balanced_color_shape", "code_arrays", "covering_count", "entropies", "split_codes", "user_images",
    "load_task", "TaskFileError", "Counterfactual", "PairContext", "PluginError", "load_plugin",
    "register_condition", "register_task", "make_pairs",
    "answers", "format_points", "p2a_text", "parse_points", "parse_count", "parse_yes_no",
    "object_token_positions", "object_tokens", "render",
]
