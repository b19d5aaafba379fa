"""vlmbind: mechanistic interpretability of vision-language models, aimed at the binding problem.

``import vlmbind as vb``; ``vb.load(name)`` gives a :class:`VLM`; see the README for the tour.

The public names below load on first use (PEP 562), so ``import vlmbind`` (and the ``vlmbind`` command's ``--help``)
does not import torch; ``from vlmbind import load`` and ``vb.load`` work as before.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from . import version

__version__ = version.__version__

# public name -> the module that defines it (a name equal to its module's last part is the module itself)
_LAZY: dict[str, str] = {
    "stimuli": "vlmbind.stimuli",
    "probes": "vlmbind.probes",
    "locate": "vlmbind.analysis",
    "HeadScores": "vlmbind.analysis",
    "circuit": "vlmbind.analysis.circuits",
    "Circuit": "vlmbind.analysis.circuits",
    "lens": "vlmbind.analysis.lens",
    "LensResult": "vlmbind.analysis.lens",
    "relevancy": "vlmbind.analysis.relevancy",
    "RelevancyResult": "vlmbind.analysis.relevancy",
    "steer": "vlmbind.analysis.steering",
    "SteerResult": "vlmbind.analysis.steering",
    "ablation_study": "vlmbind.analysis",
    "edit_study": "vlmbind.analysis",
    "capture": "vlmbind.engine.activations",
    "ActivationSet": "vlmbind.engine.activations",
    "evaluate": "vlmbind.analysis.evaluation",
    "EvalResult": "vlmbind.analysis.evaluation",
    "check_alignment": "vlmbind.engine.alignment",
    "AlignedPairs": "vlmbind.engine.alignment",
    "VLM": "vlmbind.engine.vlm",
    "Batch": "vlmbind.engine.batches",
    "RunOutput": "vlmbind.engine.batches",
    "load": "vlmbind.engine.loading",
    "registered_names": "vlmbind.engine.loading",
    "supported_families": "vlmbind.engine.loading",
    "AblateHeads": "vlmbind.engine.interventions",
    "AddToHeads": "vlmbind.engine.interventions",
    "PatchHeads": "vlmbind.engine.interventions",
    "SteerAttention": "vlmbind.engine.interventions",
    "BlockAttention": "vlmbind.engine.interventions",
    "ZeroImageAttention": "vlmbind.engine.interventions",
    "Site": "vlmbind.core.sites",
    "resolve_sites": "vlmbind.core.sites",
    "ImageGrid": "vlmbind.core.tokens",
    "TokenIndex": "vlmbind.core.tokens",
    "VlmbindError": "vlmbind.core.errors",
    "UnsupportedModelError": "vlmbind.core.errors",
    "ModelLoadError": "vlmbind.core.errors",
    "SiteError": "vlmbind.core.errors",
    "InterventionError": "vlmbind.core.errors",
    "InputError": "vlmbind.core.errors",
    "SpanNotFoundError": "vlmbind.core.errors",
}

__all__ = [
    "VLM",
    "AblateHeads",
    "ActivationSet",
    "AddToHeads",
    "AlignedPairs",
    "Batch",
    "BlockAttention",
    "Circuit",
    "EvalResult",
    "HeadScores",
    "ImageGrid",
    "InputError",
    "InterventionError",
    "LensResult",
    "ModelLoadError",
    "PatchHeads",
    "RelevancyResult",
    "RunOutput",
    "Site",
    "SiteError",
    "SpanNotFoundError",
    "SteerAttention",
    "SteerResult",
    "TokenIndex",
    "UnsupportedModelError",
    "VlmbindError",
    "ZeroImageAttention",
    "ablation_study",
    "capture",
    "check_alignment",
    "circuit",
    "edit_study",
    "evaluate",
    "lens",
    "load",
    "locate",
    "probes",
    "registered_names",
    "relevancy",
    "resolve_sites",
    "steer",
    "stimuli",
    "supported_families",
]


# the public names that are modules themselves
_MODULES = frozenset({"stimuli", "probes"})


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        # any other submodule, as an eager import of the package made ``vb.analysis`` and the like reachable
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
