"""The interchanged and ablated runs of SIIT, through the engine's hook session.

:class:`HeadInterchange` builds the engine's calls and registers no hook itself: a run's per-head outputs (the
``o_proj`` input, ``hook_z``) and attention patterns are :class:`~vlmbind.engine.hooks.HookSession` captures (kept in
the graph when a loss trains through them), and an interchange writes them into another run with one
:class:`~vlmbind.engine.interventions.PatchHeadsWhere` per layer (a ``torch.where``, never in place, so the gradient
reaches both runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...adapters.base import adapter_class_for_config
from ...core.errors import TrainingError
from ...core.sites import resolve_sites
from ...engine.hooks import HookSession
from ...engine.interventions import Intervention, PatchHeadsWhere
from .pairs import InterchangeBatch
from .spec import ABLATION_STRICT_MODES


class HeadInterchange:
    """Takes heads' outputs from one run and writes them into another, at chosen rows and positions.

    ``capture(layers)`` keeps the layers' per-head outputs of the run inside the block in ``stored`` (per layer
    ``B P H*D``, the ``o_proj`` input; in the graph when ``grad``) and with ``patterns`` their attention probabilities
    (``B H P P``) in ``patterns``; ``patch(heads, where, values)`` replaces the heads' outputs at ``where`` by
    ``values`` for the run inside the block. The engine's hooks are removed when each block ends, also on an error.
    """

    def __init__(self, model: Any, processor: Any):
        self.adapter = adapter_class_for_config(model.config)(model, processor)
        self.d_head = self.adapter.d_head
        self.stored: dict[int, torch.Tensor] = {}
        self.patterns: dict[int, torch.Tensor] = {}
        self.base_patterns: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def session(self, z_layers: Sequence[int] = (), pattern_layers: Sequence[int] = (), grad: bool = False,
                 edits: Sequence[Intervention] = ()) -> Iterator[dict[str, dict[int, torch.Tensor]]]:
        """One engine hook session for the run inside the block: ``edits`` applied, the per-head outputs of
        ``z_layers`` and the attention of ``pattern_layers`` captured (in the graph when ``grad``). Yields
        ``{"z": {layer: B P H*D}, "pattern": {layer: B H P P}}``, filled when the block ends."""
        a = self.adapter
        if pattern_layers and a.text_config._attn_implementation != "eager":
            raise TrainingError("the attention losses read attention patterns: build the organism with "
                                "attn_implementation='eager' (with sdpa, the runs that read patterns would compute "
                                "attention another way than every other run)")
        z_sites = {a.z_site(l): l for l in sorted(set(z_layers))}
        pattern_sites = {a.pattern_site(l): l for l in sorted(set(pattern_layers))}
        names = [*z_sites, *pattern_sites]
        sites = resolve_sites(names, a.n_layers, a.n_vision_layers, n_deepstack=a.n_deepstack,
                              absent=a.absent_sites(), cross_layers=a.cross_attention_layers()) if names else []
        found: dict[str, dict[int, torch.Tensor]] = {"z": {}, "pattern": {}}
        session = HookSession(a, sites, edits, detach=not grad)
        with session:
            yield found
        for name, layer in z_sites.items():
            if name in session.captured:
                found["z"][layer] = session.captured[name][-1].flatten(2)
        for name, layer in pattern_sites.items():
            if name in session.captured:
                found["pattern"][layer] = session.captured[name][-1]

    @contextlib.contextmanager
    def capture(self, layers: Sequence[int], grad: bool = False, patterns: bool = False) -> Iterator[None]:
        """Store the layers' ``o_proj`` inputs in ``stored`` (and with ``patterns`` their attention probabilities,
        ``B H P P``, in ``patterns``: eager attention only)."""
        self.stored, self.patterns = {}, {}
        with self.session(layers, layers if patterns else (), grad) as found:
            yield
        self.stored, self.patterns = found["z"], found["pattern"]

    def patches(self, heads: Sequence[tuple[int, int]], where: Sequence[Sequence[int]] | torch.Tensor,
                values: Mapping[int, torch.Tensor]) -> list[PatchHeadsWhere]:
        """The engine's edits writing ``heads``' outputs at ``where`` (a list of positions per row, or a ``B P``
        boolean tensor) from ``values`` (per layer ``B P H*D``, as :attr:`stored` holds them)."""
        by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            by_layer.setdefault(layer, []).append(head)
        b, p, _ = values[min(by_layer)].shape
        if isinstance(where, torch.Tensor):
            mask = where.to(torch.bool)
        else:
            mask = torch.zeros((b, p), dtype=torch.bool)
            for r, positions in enumerate(where):
                mask[r, list(positions)] = True
        shape = (b, p, self.adapter.n_heads, self.d_head)
        return [PatchHeadsWhere(layer=layer, heads=listed, where=mask, values=values[layer].view(shape))
                for layer, listed in sorted(by_layer.items())]

    @contextlib.contextmanager
    def patch(self, heads: Sequence[tuple[int, int]], where: Sequence[Sequence[int]] | torch.Tensor,
              values: Mapping[int, torch.Tensor]) -> Iterator[None]:
        """``heads``' outputs at ``where`` taken from ``values`` in the run inside the block (see :meth:`patches`)."""
        with self.session(edits=self.patches(heads, where, values)):
            yield


def interchange_logits(model: Any, interchange: HeadInterchange, batch: InterchangeBatch,
                       heads: Sequence[tuple[int, int]], where: Sequence[Sequence[int]] | torch.Tensor, *,
                       source_grad: bool = False, patterns: bool = False,
                       base_patterns: Sequence[int] = ()) -> torch.Tensor:
    """Logits of the base rows with ``heads``' outputs at ``where`` taken from the source rows (the source run's
    outputs, and with ``patterns`` its attention, stay in ``interchange.stored`` / ``patterns``; the attention of
    the interchanged base run at layers ``base_patterns``, in the graph, in ``interchange.base_patterns``)."""
    layers = sorted({l for l, _ in heads})
    with contextlib.ExitStack() as stack:
        if not source_grad:
            stack.enter_context(torch.no_grad())
        with interchange.capture(layers, grad=source_grad, patterns=patterns):
            model(**batch.source.inputs, use_cache=False)
    return patched_logits(model, interchange, batch, heads, where, interchange.stored, base_patterns=base_patterns)


def patched_logits(model: Any, interchange: HeadInterchange, batch: InterchangeBatch,
                   heads: Sequence[tuple[int, int]], where: Sequence[Sequence[int]] | torch.Tensor,
                   values: Mapping[int, torch.Tensor], *, base_patterns: Sequence[int] = ()) -> torch.Tensor:
    """Logits of the base rows with ``heads``' outputs at ``where`` taken from ``values`` (a source run's stored
    ``o_proj`` inputs, per layer: a second interchange from one source run needs no second source run);
    ``interchange.stored`` and ``patterns`` are left as they were, and the base run's attention at
    ``base_patterns`` goes to ``interchange.base_patterns``."""
    layers = sorted({l for l, _ in heads})
    missing = [l for l in layers if l not in values]
    if missing:
        raise TrainingError(f"no stored source values for layers {missing}; capture them in the source run")
    edits = interchange.patches(heads, where, values)
    with interchange.session(pattern_layers=base_patterns, grad=True, edits=edits) as found:
        logits = model(**batch.base.inputs, use_cache=False).logits
    if base_patterns:
        interchange.base_patterns = found["pattern"]
    return logits


def ablated_logits(model: Any, interchange: HeadInterchange, rows: Any, heads: Sequence[tuple[int, int]],
                   mode: str) -> torch.Tensor:
    """Logits of ``rows`` (a :class:`~vlmbind.organisms.data.TrainBatch`) with ``heads``' outputs at every
    non-padding position zeroed (``zero``) or replaced by each head's mean over those positions in an unablated run
    of the same rows (``mean``, as :func:`vlmbind.analysis.ablation` means over a dataset's positions), or by its
    mean over those positions of the same token role (``role_mean``: image, text, special)."""
    if mode not in ABLATION_STRICT_MODES:
        raise TrainingError(f"ablation mode must be one of {ABLATION_STRICT_MODES}, got {mode!r}")
    layers = sorted({l for l, _ in heads})
    keep = rows.inputs["attention_mask"].to(torch.bool)
    shape = (*keep.shape, interchange.adapter.n_heads * interchange.d_head)
    if mode == "zero":
        values = {l: torch.zeros(shape) for l in layers}
    else:  # one unablated run of the same rows for the means
        with torch.no_grad(), interchange.session(layers) as found:  # stored and patterns stay as they are
            model(**rows.inputs, use_cache=False)
        clean = found["z"]
        if mode == "mean":
            groups = [keep]
        else:
            roles = np.stack([interchange.adapter.roles(ids, mask) for ids, mask in
                              zip(rows.inputs["input_ids"].cpu().numpy(), rows.inputs["attention_mask"].cpu().numpy())])
            groups = [torch.as_tensor(roles == role, device=keep.device) & keep
                      for role in sorted(set(roles[keep.cpu().numpy()].tolist()))]
        values = {}
        for l in layers:
            value = torch.zeros(shape, dtype=clean[l].dtype)
            for group in groups:
                weights = group[:, :, None].to(clean[l].dtype)
                mean = (clean[l] * weights).sum((0, 1)) / weights.sum((0, 1))
                value = torch.where(group[:, :, None], mean[None, None], value)
            values[l] = value
    with interchange.patch(heads, keep, values):
        return model(**rows.inputs, use_cache=False).logits
