"""Site names: where in a model an activation is read or written.

Names follow TransformerLens so that users and SAE tools recognise them. A site is parsed against a model's shape
(number of language-model and vision layers) so that a misspelt name or an out-of-range layer is an error with close
matches, never an empty result. ``*`` matches any run of characters, so ``blocks.*.attn.hook_z`` names every layer.

Shapes (``B`` batch, ``P`` positions, ``H`` query heads, ``D`` head dim, ``N`` vision tokens):

============================================  ===========================================================
``blocks.{l}.hook_resid_pre``                 ``B P d_model``: input of decoder layer l
``blocks.{l}.hook_resid_post``                ``B P d_model``: output of decoder layer l
``blocks.{l}.hook_attn_out``                  ``B P d_model``: what attention adds to the residual stream
``blocks.{l}.hook_mlp_out``                   ``B P d_model``: what the MLP adds to the residual stream
``blocks.{l}.attn.hook_z``                    ``B P H D``: per-head attention output, the input of o_proj
``blocks.{l}.attn.hook_pattern``              ``B H P P``: attention probabilities after the softmax
``vision.blocks.{l}.hook_resid_post``         the vision block's output, as the tower lays it out
``projector.hook_out``                        ``N d_model``: image features handed to the language model
============================================  ===========================================================
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from .errors import InputError, SiteError, close_matches

LM_HOOKS = ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "attn.hook_z", "attn.hook_pattern")
VISION_HOOKS = ("hook_resid_post",)

_LM_RE = re.compile(r"^blocks\.(\d+)\.(" + "|".join(re.escape(h) for h in LM_HOOKS) + r")$")
_VISION_RE = re.compile(r"^vision\.blocks\.(\d+)\.(" + "|".join(re.escape(h) for h in VISION_HOOKS) + r")$")


@dataclass(frozen=True, order=True)
class Site:
    """One parsed site.

    Attributes:
        component: ``"lm"``, ``"vision"`` or ``"projector"``.
        layer: the block index, ``None`` for the projector.
        hook: the hook name within the block, e.g. ``"attn.hook_z"``.
    """

    component: str
    layer: int | None
    hook: str

    @property
    def name(self) -> str:
        if self.component == "lm":
            return f"blocks.{self.layer}.{self.hook}"
        if self.component == "vision":
            return f"vision.blocks.{self.layer}.{self.hook}"
        return f"projector.{self.hook}"

    def __str__(self) -> str:
        return self.name


def all_sites(n_layers: int, n_vision_layers: int = 0, projector: bool = True) -> list[Site]:
    """Every site of a model with this many language-model and vision layers."""
    sites = [Site("lm", layer, hook) for layer in range(n_layers) for hook in LM_HOOKS]
    sites += [Site("vision", layer, hook) for layer in range(n_vision_layers) for hook in VISION_HOOKS]
    if projector:
        sites.append(Site("projector", None, "hook_out"))
    return sites


def parse_site(name: str, n_layers: int, n_vision_layers: int = 0, projector: bool = True) -> Site:
    """Parse one concrete site name (no wildcard) and check it exists on the model.

    Raises:
        SiteError: the name does not parse, or its layer is out of range; the message lists close matches.
    """
    if not isinstance(name, str):
        raise SiteError(f"site names are strings, got {type(name).__name__} {name!r}")
    valid = [s.name for s in all_sites(n_layers, n_vision_layers, projector)]
    if m := _LM_RE.match(name):
        layer, hook = int(m.group(1)), m.group(2)
        if layer >= n_layers:
            raise SiteError(f"site {name!r}: layer {layer} is out of range, the model has layers 0..{n_layers - 1}")
        return Site("lm", layer, hook)
    if m := _VISION_RE.match(name):
        layer, hook = int(m.group(1)), m.group(2)
        if layer >= n_vision_layers:
            raise SiteError(
                f"site {name!r}: vision layer {layer} is out of range, the vision tower has layers "
                f"0..{n_vision_layers - 1}"
            )
        return Site("vision", layer, hook)
    if name == "projector.hook_out" and projector:
        return Site("projector", None, "hook_out")
    raise SiteError(
        f"unknown site {name!r}.{close_matches(name, valid)} Sites look like 'blocks.3.attn.hook_z', "
        f"'blocks.*.hook_resid_post', 'vision.blocks.0.hook_resid_post' or 'projector.hook_out'."
    )


def resolve_sites(
    patterns: str | Site | list[str | Site] | tuple[str | Site, ...],
    n_layers: int,
    n_vision_layers: int = 0,
    projector: bool = True,
) -> list[Site]:
    """Expand names and ``*`` patterns into concrete sites, in model order, without duplicates.

    Raises:
        SiteError: a pattern matches nothing, or a name does not exist.
    """
    if isinstance(patterns, (str, Site)):
        patterns = [patterns]
    if not patterns:
        raise SiteError("no sites given: name at least one, e.g. 'blocks.*.attn.hook_z'")
    every = all_sites(n_layers, n_vision_layers, projector)
    chosen: list[Site] = []
    for pattern in patterns:
        if isinstance(pattern, Site):
            chosen.append(parse_site(pattern.name, n_layers, n_vision_layers, projector))
        elif isinstance(pattern, str) and "*" in pattern:
            hits = [s for s in every if fnmatch.fnmatchcase(s.name, pattern)]
            if not hits:
                generic = [re.sub(r"\d+", "*", s.name) for s in every]
                raise SiteError(
                    f"site pattern {pattern!r} matches no site of this model."
                    f"{close_matches(pattern, sorted(set(generic)))}"
                )
            chosen.extend(hits)
        else:
            chosen.append(parse_site(pattern, n_layers, n_vision_layers, projector))
    order = {s: i for i, s in enumerate(every)}
    return sorted(set(chosen), key=lambda s: order[s])


def parse_heads(heads: Any) -> list[tuple[int, int]]:
    """``[(layer, head), ...]`` from pairs, ``"12.3"`` strings or a comma-separated string."""
    if isinstance(heads, str):
        heads = [h for h in heads.split(",") if h.strip()]
    out = []
    for h in heads:
        if isinstance(h, str):
            try:
                layer, head = (int(p) for p in h.strip().split("."))
            except ValueError:
                raise InputError(f"head {h!r} is not LAYER.HEAD, e.g. '12.3'") from None
        else:
            try:
                layer, head = (int(p) for p in h)
            except (TypeError, ValueError):
                raise InputError(f"head {h!r} is not a (layer, head) pair") from None
        out.append((layer, head))
    return out
