"""vlmbind: mechanistic interpretability of vision-language models, aimed at the binding problem.

``import vlmbind as vb``; ``vb.load(name)`` gives a :class:`VLM`; see the README for the tour.

The public names below load on first use (PEP 562), so ``import vlmbind`` (and the ``vlmbind`` command's ``--help``)
does not import torch; ``from vlmbind import load`` and ``vb.load`` work as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from . import version

__version__ = version.__version__

# public name -> the module that defines it (a name equal to its module's last part is the module itself)
_LAZY: dict[str, str] = {
    "stimuli": "vlmbind.stimuli",
    "probes": "vlmbind.probes",
    "locate": "vlmbind.analysis",
    "HeadScores": "vlmbind.analysis",
    "ablation_study": "vlmbind.analysis",
    "edit_study": "vlmbind.analysis",
    "capture": "vlmbind.activations",
    "ActivationSet": "vlmbind.activations",
    "evaluate": "vlmbind.evaluate",
    "EvalResult": "vlmbind.evaluate",
    "VLM": "vlmbind.models",
    "Batch": "vlmbind.batches",
    "RunOutput": "vlmbind.batches",
    "load": "vlmbind.loading",
    "registered_names": "vlmbind.loading",
    "supported_families": "vlmbind.loading",
    "AblateHeads": "vlmbind.interventions",
    "AddToHeads": "vlmbind.interventions",
    "PatchHeads": "vlmbind.interventions",
    "ZeroImageAttention": "vlmbind.interventions",
    "Site": "vlmbind.sites",
    "resolve_sites": "vlmbind.sites",
    "ImageGrid": "vlmbind.tokens",
    "TokenIndex": "vlmbind.tokens",
    "VlmbindError": "vlmbind.errors",
    "UnsupportedModelError": "vlmbind.errors",
    "ModelLoadError": "vlmbind.errors",
    "SiteError": "vlmbind.errors",
    "InterventionError": "vlmbind.errors",
    "InputError": "vlmbind.errors",
    "SpanNotFoundError": "vlmbind.errors",
}

__all__ = [
    "stimuli", "probes", "locate", "HeadScores", "ablation_study", "edit_study", "capture", "ActivationSet", "evaluate", "EvalResult", "VLM", "Batch", "RunOutput", "load", "registered_names", "supported_families",
    "AblateHeads", "AddToHeads", "PatchHeads", "ZeroImageAttention",
    "Site", "resolve_sites", "ImageGrid", "TokenIndex",
    "VlmbindError", "UnsupportedModelError", "ModelLoadError", "SiteError", "InterventionError", "InputError",
    "SpanNotFoundError",
]


# the public names that are modules themselves
_MODULES = frozenset({"stimuli", "probes"})
# public names that share their name with a submodule but are not it: ``vb.evaluate`` is the function in
# ``vlmbind.evaluate``
_SHADOWED = frozenset(n for n, m in _LAZY.items() if m == f"{__name__}.{n}" and n not in _MODULES)


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


class _Package(types.ModuleType):
    """The package's module type: importing a submodule binds it on the package, which must not replace a public name
    of the same name that is not the module (``vlmbind.evaluate`` stays the function, as with an eager import)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
