"""Site names: where in a model an activation is read or written.

Names follow TransformerLens so that users and SAE tools recognise them. A site is parsed against a model's shape
(number of language-model and vision layers) so that a misspelt name or an out-of-range layer is an error with close
matches, never an empty result. ``*`` matches any run of characters, so ``blocks.*.attn.hook_z`` names every layer.
DeepStack families (Qwen3-VL) also add image features between text layers; each such injection is a site of its own.
Cross-attention families (Llama-3.2-Vision) read the image in some decoder layers through cross-attention alone: at
those layers the heads are ``cross_attn.hook_z`` / ``cross_attn.hook_pattern`` (keys: the image features), and
``attn.*`` does not exist there; elsewhere ``cross_attn.*`` does not.

Shapes (``B`` batch, ``P`` positions, ``H`` query heads, ``D`` head dim, ``N`` vision tokens):

============================================  ===========================================================
``blocks.{l}.hook_resid_pre``                 ``B P d_model``: input of decoder layer l
``blocks.{l}.hook_resid_post``                ``B P d_model``: output of decoder layer l
``blocks.{l}.hook_attn_out``                  ``B P d_model``: what attention adds to the residual stream
``blocks.{l}.hook_mlp_out``                   ``B P d_model``: what the MLP adds to the residual stream
``blocks.{l}.attn.hook_z``                    ``B P H D``: per-head attention output, the input of o_proj
``blocks.{l}.attn.hook_pattern``              ``B H P P``: attention probabilities after the softmax
``blocks.{l}.cross_attn.hook_z``              ``B P H D``: per-head cross-attention output, the input of its o_proj
``blocks.{l}.cross_attn.hook_pattern``        ``B H P K``: cross-attention probabilities over the ``K`` image keys
``vision.blocks.{l}.hook_resid_post``         the vision block's output, as the tower lays it out
``projector.hook_out``                        ``N d_model``: image features handed to the language model
``deepstack.{i}.hook_out``                    ``N d_model``: DeepStack merger i's rows, which the text model adds to
                                              the image tokens' residual stream after layer i (projector layout)
============================================  ===========================================================

A hyper-connection family (Qwen4-Exp: ``adapter.n_residual_streams`` > 1) keeps that many ``d_model`` streams side by
side: its four residual and output sites are ``B P (n_residual_streams * d_model)``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InputError, SiteError, close_matches

LM_HOOKS = ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "attn.hook_z", "attn.hook_pattern")
# what a cross-attention layer has in place of the attn.* hooks, in the same order
CROSS_HOOKS = ("cross_attn.hook_z", "cross_attn.hook_pattern")
SELF_HOOKS = ("attn.hook_z", "attn.hook_pattern")
VISION_HOOKS = ("hook_resid_post",)
DEEPSTACK_HOOKS = ("hook_out",)

_LM_RE = re.compile(r"^blocks\.(\d+)\.(" + "|".join(re.escape(h) for h in (*LM_HOOKS, *CROSS_HOOKS)) + r")$")
_VISION_RE = re.compile(r"^vision\.blocks\.(\d+)\.(" + "|".join(re.escape(h) for h in VISION_HOOKS) + r")$")
_DEEPSTACK_RE = re.compile(r"^deepstack\.(\d+)\.(" + "|".join(re.escape(h) for h in DEEPSTACK_HOOKS) + r")$")
# any injection's name: a pattern matching it asks for DeepStack, whatever this model has
_DEEPSTACK_EXAMPLE = f"deepstack.0.{DEEPSTACK_HOOKS[0]}"


@dataclass(frozen=True, order=True)
class Site:
    """One parsed site.

    Attributes:
        component: ``"lm"``, ``"vision"``, ``"projector"`` or ``"deepstack"``.
        layer: the block index (for ``"deepstack"``: the injection index), ``None`` for the projector.
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
        if self.component == "deepstack":
            return f"deepstack.{self.layer}.{self.hook}"
        return f"projector.{self.hook}"

    def __str__(self) -> str:
        return self.name


def layer_hooks(layer: int, cross_layers: Collection[int] = ()) -> tuple[str, ...]:
    """The hooks of decoder layer ``layer``: :data:`LM_HOOKS`, with :data:`CROSS_HOOKS` in place of the ``attn.*``
    ones on a cross-attention layer."""
    if layer not in cross_layers:
        return LM_HOOKS
    swap = dict(zip(SELF_HOOKS, CROSS_HOOKS))
    return tuple(swap.get(h, h) for h in LM_HOOKS)


def all_sites(n_layers: int, n_vision_layers: int = 0, projector: bool = True, n_deepstack: int = 0,
              absent: Mapping[str, SiteError] | None = None, cross_layers: Collection[int] = ()) -> list[Site]:
    """Every site of a model with this many language-model and vision layers and DeepStack injections, less the
    ``absent`` ones (a hybrid model's per-layer gaps: :meth:`~vlmbind.adapters.base.ModelAdapter.absent_sites`);
    ``cross_layers``: the decoder layers that are cross-attention layers."""
    absent = absent or {}
    sites = [Site("lm", layer, hook) for layer in range(n_layers) for hook in layer_hooks(layer, cross_layers)
             if f"blocks.{layer}.{hook}" not in absent]
    sites += [Site("vision", layer, hook) for layer in range(n_vision_layers) for hook in VISION_HOOKS]
    if projector:
        sites.append(Site("projector", None, "hook_out"))
    sites += [Site("deepstack", i, hook) for i in range(n_deepstack) for hook in DEEPSTACK_HOOKS]
    return sites


def _no_deepstack(name: str, valid: list[str]) -> SiteError:
    return SiteError(
        f"site {name!r}: this model's family has no DeepStack injections (image features added to the residual "
        f"stream between text layers, as Qwen3-VL does).{close_matches(name, valid)}"
    )


def _wrong_kind(name: str, layer: int, hook: str, cross_layers: Collection[int]) -> SiteError | None:
    """The error of an ``attn.*`` site on a cross-attention layer or a ``cross_attn.*`` site elsewhere."""
    if hook in SELF_HOOKS and layer in cross_layers:
        twin = CROSS_HOOKS[SELF_HOOKS.index(hook)]
        return SiteError(f"site {name!r}: layer {layer} is a cross-attention layer (text queries, image keys); its "
                         f"heads are 'blocks.{layer}.{twin}'")
    if hook in CROSS_HOOKS and layer not in cross_layers:
        which = (f"this model's cross-attention layers are {sorted(cross_layers)}" if cross_layers
                 else "this model has no cross-attention layers")
        return SiteError(f"site {name!r}: layer {layer} is not a cross-attention layer; {which}")
    return None


def parse_site(
    name: str, n_layers: int, n_vision_layers: int = 0, projector: bool = True, n_deepstack: int = 0,
    absent: Mapping[str, SiteError] | None = None, cross_layers: Collection[int] = (),
) -> Site:
    """Parse one concrete site name (no wildcard) and check it exists on the model.

    Raises:
        SiteError: the name does not parse, its layer is out of range, or it names a DeepStack injection of a model
            without them; the message lists close matches. An ``absent`` site raises its own error (a subclass).
    """
    if not isinstance(name, str):
        raise SiteError(f"site names are strings, got {type(name).__name__} {name!r}")
    valid = [s.name for s in all_sites(n_layers, n_vision_layers, projector, n_deepstack, absent, cross_layers)]
    if m := _LM_RE.match(name):
        layer, hook = int(m.group(1)), m.group(2)
        if layer >= n_layers:
            raise SiteError(f"site {name!r}: layer {layer} is out of range, the model has layers 0..{n_layers - 1}")
        if (error := _wrong_kind(name, layer, hook, cross_layers)) is not None:
            raise error
        if absent and name in absent:
            raise type(absent[name])(f"site {name!r}: {absent[name]}")
        return Site("lm", layer, hook)
    if m := _VISION_RE.match(name):
        layer, hook = int(m.group(1)), m.group(2)
        if layer >= n_vision_layers:
            raise SiteError(
                f"site {name!r}: vision layer {layer} is out of range, the vision tower has layers "
                f"0..{n_vision_layers - 1}"
            )
        return Site("vision", layer, hook)
    if m := _DEEPSTACK_RE.match(name):
        injection, hook = int(m.group(1)), m.group(2)
        if not n_deepstack:
            raise _no_deepstack(name, valid)
        if injection >= n_deepstack:
            raise SiteError(
                f"site {name!r}: DeepStack injection {injection} is out of range, the model has injections "
                f"0..{n_deepstack - 1} (after text layers 0..{n_deepstack - 1})"
            )
        return Site("deepstack", injection, hook)
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
    n_deepstack: int = 0,
    absent: Mapping[str, SiteError] | None = None,
    cross_layers: Collection[int] = (),
) -> list[Site]:
    """Expand names and ``*`` patterns into concrete sites, in model order, without duplicates.

    Raises:
        SiteError: a pattern matches nothing (a DeepStack pattern on a model without injections says so), or a name
            does not exist.
    """
    if isinstance(patterns, (str, Site)):
        patterns = [patterns]
    if not patterns:
        raise SiteError("no sites given: name at least one, e.g. 'blocks.*.attn.hook_z'")
    every = all_sites(n_layers, n_vision_layers, projector, n_deepstack, absent, cross_layers)
    chosen: list[Site] = []
    for pattern in patterns:
        if isinstance(pattern, Site):
            chosen.append(parse_site(pattern.name, n_layers, n_vision_layers, projector, n_deepstack, absent,
                                     cross_layers))
        elif isinstance(pattern, str) and "*" in pattern:
            hits = [s for s in every if fnmatch.fnmatchcase(s.name, pattern)]
            if not hits:
                generic = [re.sub(r"\d+", "*", s.name) for s in every]
                if not n_deepstack and fnmatch.fnmatchcase(_DEEPSTACK_EXAMPLE, pattern):
                    raise _no_deepstack(pattern, sorted(set(generic)))
                raise SiteError(
                    f"site pattern {pattern!r} matches no site of this model."
                    f"{close_matches(pattern, sorted(set(generic)))}"
                )
            chosen.extend(hits)
        else:
            chosen.append(parse_site(pattern, n_layers, n_vision_layers, projector, n_deepstack, absent, cross_layers))
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
