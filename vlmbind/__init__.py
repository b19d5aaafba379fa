"""vlmbind: mechanistic interpretability of vision-language models, aimed at the binding problem.

``import vlmbind as vb``; ``vb.load(name)`` gives a :class:`VLM`; see the README for the tour.
"""

from . import probes, stimuli, version
from .activations import ActivationSet, capture
from .analysis import HeadScores, ablation_study, edit_study, locate
from .batches import Batch, RunOutput
from .errors import (
    InputError,
    InterventionError,
    ModelLoadError,
    SiteError,
    SpanNotFoundError,
    UnsupportedModelError,
    VlmbindError,
)
from .evaluate import EvalResult, evaluate
from .interventions import AblateHeads, AddToHeads, PatchHeads, ZeroImageAttention
from .loading import load, registered_names, supported_families
from .models import VLM
from .sites import Site, resolve_sites
from .tokens import ImageGrid, TokenIndex

__version__ = version.__version__

__all__ = [
    "stimuli", "probes", "locate", "HeadScores", "ablation_study", "edit_study", "capture", "ActivationSet", "evaluate", "EvalResult", "VLM", "Batch", "RunOutput", "load", "registered_names", "supported_families",
    "AblateHeads", "AddToHeads", "PatchHeads", "ZeroImageAttention",
    "Site", "resolve_sites", "ImageGrid", "TokenIndex",
    "VlmbindError", "UnsupportedModelError", "ModelLoadError", "SiteError", "InterventionError", "InputError",
    "SpanNotFoundError",
]
