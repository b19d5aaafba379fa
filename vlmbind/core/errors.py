"""Named exceptions. Every error vlmbind raises on bad input derives from :class:`VlmbindError`.

Messages name the bad value, list the valid choices (close matches where it helps) and say how to fix it, so the CLI
can print them as a one-line reason and exit 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class VlmbindError(Exception):
    """Base class of every error vlmbind raises on bad input or an impossible request."""


class UnsupportedModelError(VlmbindError):
    """A model name, directory or config that no registered family adapter handles."""


class ModelLoadError(VlmbindError):
    """A supported model that could not be loaded (missing or corrupt files)."""


class SiteError(VlmbindError, KeyError):
    """A hook site name that does not parse or does not exist on the model."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InterventionError(VlmbindError, ValueError):
    """An intervention whose heads, layers, positions or values do not fit the model or the batch."""


class NoAttentionPatternError(SiteError, InterventionError):
    """A softmax attention pattern (``attn.hook_pattern``, the ``image_attention`` ablation) asked of a layer whose
    token mixer has none (a linear-attention layer of a hybrid model); the message lists the layers that have one."""


class HeadLayoutError(SiteError, InterventionError):
    """Per-head outputs (``attn.hook_z``, head interventions) asked of a layer whose heads are not the model's
    ``n_heads x d_head`` (a linear-attention layer with its own head count); the message lists the layers that have
    them."""


class InputError(VlmbindError, ValueError):
    """Images or prompts that cannot be turned into a model batch."""


class NoImageTokensError(InterventionError, InputError):
    """Image tokens of the language model's sequence (the ``image_attention`` ablation, an image-token capture of
    language-model sites) asked of a model that has none (Llama-3.2-Vision reads the image through cross-attention
    layers only)."""


class TooFewEstimatesError(InputError):
    """Too few estimation scenes for a position-ID estimate (no cell, or no evaluation example, has one)."""


class SpanNotFoundError(VlmbindError, LookupError):
    """A text span that does not occur in the prompt."""


class TrainingError(VlmbindError, ValueError):
    """An invalid training configuration, or a checkpoint that cannot be resumed from or initialised from."""


def close_matches(value: str, choices: Iterable[str], n: int = 3) -> str:
    """A short ``did you mean ...?`` clause, or an empty string when nothing is close."""
    matches = difflib.get_close_matches(value, list(choices), n=n, cutoff=0.5)
    return f" Did you mean {', '.join(repr(m) for m in matches)}?" if matches else ""
