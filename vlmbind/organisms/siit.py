"""Strict interchange-intervention training (SIIT): plant a known mechanism at chosen heads of an organism.

A planted mechanism is a high-level causal model plus an alignment. For scene description ("name the missing
object") the high-level model is VSM's pipeline and its variables are named as the conditions that should find them:

* ``id_retrieval``: at a described object's prompt tokens, that object's position (its grid cell);
* ``id_selection``: at the last prompt token, the missing object's position;
* ``feature_retrieval``: at the last prompt token, the missing object's colour and shape.

Interchanging a variable means: run a source input, take the variable's value there, and ask what the high-level
model answers on the base input with that value. The counterfactual scene pairs of :func:`vlmbind.stimuli.scene_pairs`
are built exactly so: their ``answer_counterfactual`` is the high-level answer of the interchange at the pair's patch
positions (the span of one described object, or the last token), and the source gives the variable a value that is
meaningful in the base (a cell holding an object of the base scene, or a colour the base's object can take). So the
high-level model needs no code of its own here: the pairs are its interventions.

An alignment maps each variable to heads (``"layer.head"``: the head's slice of the ``o_proj`` input, where vlmbind's
``hook_z`` reads it). Each step adds to the behaviour loss (the task mixture, as :func:`~vlmbind.organisms.train.train`)

* the IIT loss: for one variable sampled per step, pairs of that condition; the aligned heads' outputs at the pair's
  patch positions are taken from the source run and written into the base run (a pre-hook with ``torch.where``, never
  in place), which is teacher-forced with ``answer_counterfactual`` and must give it;
* the strictness loss: one head outside every alignment, sampled per step, gets the source run's outputs (at every
  prompt position by default, as InterpBench interchanges a whole node), and the base answer must not change.

Changes from InterpBench's recipe (the ``iit`` library's ``StrictIITModelPair``, weights behaviour 1, IIT 1,
strict 0.4, used as the defaults): nodes are attention heads at token positions rather than whole hook points; the
sources are CMA pairs rather than random inputs (a random source would usually give the variable a value with no
meaning in the base); one loss, one optimiser step by default (``single_loss=False`` takes InterpBench's step per
loss); the source run carries no gradient unless ``source_grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..adapters.base import adapter_class_for_config
from ..core.errors import TrainingError
from ..core.sites import parse_heads
from ..stimuli.core import Canvas
from ..stimuli.scenes import RECOLOURS, SWAPS, CounterfactualPair, scene_pairs
from .data import IGNORE_INDEX, BatchBuilder, answer_correct, answer_loss, answer_unlikelihood

VARIABLES = ("id_retrieval", "id_selection", "feature_retrieval")
STRICT_POSITIONS = ("all", "aligned")
STRICT_SAMPLING = ("individual", "sample_all", "all")
SIIT_PARTS = ("iit", "strict")
ABLATION_STRICT_MODES = ("zero", "mean", "role_mean")
DEFAULT_ABLATION_MODES = ("zero", "mean")  # what the ablation losses drew before role_mean could be asked for
CHANGE_POSITIONS = ("all", "aligned", "image", "text", "last")
LAST_POSITIONS = ("answer", "prompt")
SPAN_POSITIONS = ("name", "last")
POSITION_READOUTS = ("trained", "fixed")
# random streams of SIIT: training pairs and evaluation pairs never share a seed (the mixture uses 0 and 1)
SIIT_STREAM, SIIT_EVAL_STREAM = 2, 3


@dataclass(frozen=True, kw_only=True)
class SIITSpec:
    """What to plant and how hard.

    Attributes:
        alignments: variable (one of :data:`VARIABLES`) -> the heads that must carry it, ``["layer.head", ...]``.
        iit_weight, strict_weight: the losses' weights (the behaviour loss weighs 1).
        pairs: counterfactual pairs per step (each is a base row and a source row).
        objects: objects per scene, inclusive ``[lo, hi]``.
        entropies: scene entropies the pairs are drawn from (``high``: distinct features; ``low``: shared ones).
        colours, shapes: the pools (None: the scene task's pools of the run, else every colour / shape).
        strict_positions: ``all`` (every prompt position of the sampled unaligned head) or ``aligned`` (the step's
            patch positions).
        strict_head_weights: unaligned head ``"l.h"`` -> how often the strictness loss draws it, relative to an
            unlisted unaligned head (weight 1). Empty: every unaligned head alike. A head that still moves the answer
            when interchanged can be drawn more often than the many that do not (``individual`` sampling only).
        strict_sampling: which unaligned heads the strictness loss interchanges together, named as the ``iit``
            library's ``siit_sampling``: ``individual`` (one head per step), ``sample_all`` (each unaligned head
            with probability 1/2, at least one), ``all`` (every unaligned head). Interchanging several at once
            also penalises a side path that two heads carry redundantly, which a one-head loss cannot see.
        single_loss: True (vlmbind's default): the behaviour, IIT and strictness losses are summed into one
            optimiser step. False: one step per loss in InterpBench's order (IIT with the readout and attention
            losses computed in its graph, then strictness, then behaviour with the position code), each with its
            own backward pass and gradient clip, as the ``iit`` library's trainer does unless ``use_single_loss``.
        source_grad: let gradients flow through the source run too.
        skip_objects: object counts left out of the pairs (held out, so that a validation can test on them).
        swap: which described object the swap pairs exchange with the target (``random`` by default, so the
            counterfactual answer cannot be read off the prompt's order; ``last`` is VSM's pairs).
        recolour: feature-retrieval sources (``any`` new conjunction by default; ``unused`` is VSM's pairs, whose
            counterfactual answer a model can guess from the base scene alone).
        position_layer: when set, the position code: every image token's residual stream after this decoder layer
            (-1: the decoder's input, the image tokens as the vision tower and merger give them) must give the
            token's grid cell through a linear readout (cross-entropy, weight ``position_weight``). A head can
            only copy a position ID that the image tokens carry, and a layer-0 head reads the decoder's input.
        position_weight: that loss's weight.
        position_readout: ``trained`` (a linear probe trained with the model, kept beside its checkpoints: the code
            only has to be linearly readable, as a head's keys and values read it) or ``fixed`` (a fixed random
            readout with cosine logits: the code must dominate the token's residual stream).
        selection_weight: when > 0, the ID-selection readout: a linear probe, trained beside the organism, must read
            the missing object's grid cell from the ``id_selection`` heads' outputs at their patch positions in the
            source run (cross-entropy, this weight; needs ``source_grad``). Interchanging a head can only move the
            answer where the head carries the variable; this asks it to carry it, the IIT loss then asks the later
            layers to use it.
        selection_attention_weight: when > 0, the ``id_selection`` heads' attention at their patch positions in the
            source run must fall on the missing object's image token (cross-entropy of the attention, this weight;
            needs ``source_grad`` and the organism built with eager attention, whose patterns carry gradients). With
            the readout, this says how the head gets the position: by attending to the object and copying its
            position code.
        retrieval_attention_weight: when > 0, the ``id_retrieval`` heads' attention at their patch positions (the
            described object's name) in the source run must fall on that object's image token (cross-entropy, this
            weight; needs ``source_grad`` and eager attention). The head is told where its position comes from.
        interchanged_selection_weight: when > 0, on the ``id_retrieval`` steps the selecting ``id_selection`` heads'
            attention at the last prompt token of the interchanged base run must fall on the image token of the
            object whose name was patched (cross-entropy, this weight; eager attention). That is the high-level
            selection there: the names now claim every cell but that object's own. In a source run a selection by
            the objects' features and one by the retrieved positions pick the same object, so the source-run losses
            cannot tell them apart; the interchanged run can.
        strict_selection_weight: when > 0, in the strictness loss's run (the base scene with unaligned heads
            interchanged) the selecting ``id_selection`` heads' attention at the last prompt token must stay on the
            base's missing object (cross-entropy, this weight; eager attention). The high-level selection does not
            move when an unaligned head does, so neither may the heads that carry it; on the ``id_retrieval`` steps
            it is also the unpatched contrast of ``interchanged_selection_weight`` on the same scenes, so a selection
            that ignores the patched names is no longer free.
        retrieval_readout_weight: when > 0, on the ``id_retrieval`` steps a linear probe, trained beside the
            organism, must read the patched object's grid cell from the ``id_retrieval`` heads' outputs at its name
            in the source run (cross-entropy, this weight; needs ``source_grad``). The attention loss says where the
            head looks; this says that what it writes is the position.
        gather_readout_weight: when > 0, on the ``id_selection`` steps a linear probe must read the set of the
            described objects' cells from the ``aggregation_heads``' outputs at their patch positions in the source
            run (binary cross-entropy summed over the cells, this weight; needs ``source_grad``). A selection by the retrieved
            positions can only read what the gathering head carries, and an attention loss alone let the
            gathering head pass on almost none of it (its output changed by about 2% when a name's position did).
        gather_interchange_weight: when > 0, on the ``id_selection`` steps a second interchanged run patches the
            ``aggregation_heads`` alone (at the variable's positions, from the same source) and must give the
            pair's counterfactual answer (this weight). In a swap pair the source's names claim the base's missing
            cell and leave the swapped object's cell unclaimed, so a selection by the gathered positions names the
            swapped object; a selection that finds the missing object another way does not move. The same
            high-level answer as the ``id_retrieval`` interchange, with the whole gathered set patched instead of
            one name's position.
        gather_selection_weight: when > 0, in that run the selecting heads' attention at the last prompt token must
            fall on the swapped object's image token (cross-entropy, this weight; eager attention).
        selecting_interchange_weight: when > 0, on the ``id_selection`` steps one more interchanged run patches the
            selecting heads alone (the ``id_selection`` heads that are not ``aggregation_heads``; at the variable's
            positions, from the same source run) and must give the pair's counterfactual answer (this weight). The
            IIT loss interchanges every ``id_selection`` head together, which the later layers can satisfy by
            reading the gathering heads and ignoring the selecting ones; this asks that the answer follow the
            selecting heads too.
        ablation_strict_weight: when > 0, strictness under ablation: the strictness loss's base scenes run once more
            with ``ablation_strict_heads`` unaligned heads (a random number from 1 to that many, drawn each step)
            ablated at every position, zeroed or set to their mean over the batch's positions (drawn each step), and
            must still give their own answer (this weight). An interchange pair shares its prompt with its base, so
            the interchange strictness cannot see a head that works on the text alone; an ablation can, and
            ablation is how a user compares planted heads with random ones.
        ablation_strict_heads: the most unaligned heads that loss ablates at once (0: as many as are aligned).
        ablation_strict_modes: the ablations those losses draw from: ``zero``, ``mean`` (each head's mean over the
            batch's non-padding positions), ``role_mean`` (its mean over the batch's positions of the same token
            role, image, text or special, as :mod:`vlmbind.analysis.ablation` takes it).
        ablation_necessity_weight: when > 0, necessity under ablation: the same base scenes run once more with one
            aligned variable's heads (drawn each step) ablated in a drawn mode, and the answer must lose its
            probability: the unlikelihood ``-log(1 - p(answer token))`` per answer token (this weight). Strictness
            under ablation alone teaches the model to survive missing heads, planted ones included; in the
            high-level model a variable that is removed leaves the answer undetermined, and this says so.
        aggregation_heads: ``id_selection`` heads that gather the described objects' positions at the last token
            rather than read the missing object: their attention target (with ``selection_attention_weight``) is the
            described objects' name tokens, where ``id_retrieval`` heads wrote their positions; the other
            ``id_selection`` heads keep the missing object's image token. A head can only read what an earlier
            layer wrote, so a selection that uses the retrieved positions needs a layer that gathers them first.
        last_positions: where a last-token variable (``id_selection``, ``feature_retrieval``) is interchanged:
            ``answer`` (the last prompt token and every answer position that predicts a token; the answer's second
            word, the shape, is predicted at the colour word's position, which is where CMA patches and scores when
            the two answers share their colour) or ``prompt`` (the last prompt token only; the shape must then be
            carried forward by later layers).
        span_positions: where a span variable (``id_retrieval``) is interchanged and its readouts and attention are
            read: ``name`` (every token of the described object's name) or ``last`` (its last token, the shape word:
            at the colour word no causal model can know which of two objects of that colour the name means).
    """

    alignments: Mapping[str, Sequence[str]]
    iit_weight: float = 1.0
    strict_weight: float = 0.4
    pairs: int = 16
    objects: tuple[int, int] = (3, 4)
    entropies: tuple[str, ...] = ("high",)
    colours: tuple[str, ...] | None = None
    shapes: tuple[str, ...] | None = None
    strict_positions: str = "all"
    strict_head_weights: Mapping[str, float] = field(default_factory=dict)
    strict_sampling: str = "individual"
    single_loss: bool = True
    source_grad: bool = False
    skip_objects: tuple[int, ...] = ()
    swap: str = "random"
    recolour: str = "any"
    position_layer: int | None = None
    position_weight: float = 1.0
    position_readout: str = "trained"
    selection_weight: float = 0.0
    selection_attention_weight: float = 0.0
    retrieval_attention_weight: float = 0.0
    interchanged_selection_weight: float = 0.0
    strict_selection_weight: float = 0.0
    retrieval_readout_weight: float = 0.0
    gather_readout_weight: float = 0.0
    gather_interchange_weight: float = 0.0
    gather_selection_weight: float = 0.0
    selecting_interchange_weight: float = 0.0
    ablation_strict_weight: float = 0.0
    ablation_strict_heads: int = 0
    ablation_strict_modes: tuple[str, ...] = DEFAULT_ABLATION_MODES
    ablation_necessity_weight: float = 0.0
    aggregation_heads: tuple[str, ...] = ()
    last_positions: str = "answer"
    span_positions: str = "name"

    def __post_init__(self) -> None:
        if not self.alignments:
            raise TrainingError("siit.alignments is empty: align at least one variable to heads, e.g. "
                                "{'id_selection': ['2.1']}")
        aligned = {}
        for variable, heads in dict(self.alignments).items():
            if variable not in VARIABLES:
                raise TrainingError(f"unknown SIIT variable {variable!r}; variables: {', '.join(VARIABLES)}")
            try:
                parsed = parse_heads(list(heads))
            except Exception as exc:  # noqa: BLE001 - re-raised as a named training error
                raise TrainingError(f"siit.alignments[{variable!r}]: {exc}") from None
            if not parsed:
                raise TrainingError(f"siit.alignments[{variable!r}] lists no heads")
            aligned[variable] = tuple(f"{l}.{h}" for l, h in parsed)
        object.__setattr__(self, "alignments", aligned)
        for name in ("iit_weight", "strict_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise TrainingError(f"siit.{name} must be a number >= 0, got {value!r}")
        if isinstance(self.pairs, bool) or not isinstance(self.pairs, int) or self.pairs < 1:
            raise TrainingError(f"siit.pairs must be an int >= 1, got {self.pairs!r}")
        lo, hi = (int(v) for v in self.objects)
        if not 2 <= lo <= hi:
            raise TrainingError(f"siit.objects must be [lo, hi] with 2 <= lo <= hi, got {list(self.objects)}")
        object.__setattr__(self, "objects", (lo, hi))
        object.__setattr__(self, "entropies", tuple(self.entropies))
        bad = [e for e in self.entropies if e not in ("high", "low")] or ([] if self.entropies else ["(none)"])
        if bad:
            raise TrainingError(f"siit.entropies must be high and/or low, got {list(self.entropies)}")
        for pool in ("colours", "shapes"):
            if getattr(self, pool) is not None:
                object.__setattr__(self, pool, tuple(getattr(self, pool)))
        object.__setattr__(self, "skip_objects", tuple(int(k) for k in self.skip_objects))
        if not self.object_counts:
            raise TrainingError(f"siit.skip_objects {list(self.skip_objects)} leaves no object count in "
                                f"{list(self.objects)}")
        if self.swap not in SWAPS:
            raise TrainingError(f"siit.swap must be one of {SWAPS}, got {self.swap!r}")
        if self.recolour not in RECOLOURS:
            raise TrainingError(f"siit.recolour must be one of {RECOLOURS}, got {self.recolour!r}")
        layer = self.position_layer
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < -1):
            raise TrainingError(f"siit.position_layer must be a layer index >= 0, -1 (the decoder's input) or None, "
                                f"got {self.position_layer!r}")
        if isinstance(self.position_weight, bool) or not isinstance(self.position_weight, (int, float)) \
                or not self.position_weight >= 0:
            raise TrainingError(f"siit.position_weight must be a number >= 0, got {self.position_weight!r}")
        for name in ("selection_weight", "selection_attention_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise TrainingError(f"siit.{name} must be a number >= 0, got {value!r}")
            if value > 0 and "id_selection" not in aligned:
                raise TrainingError(f"siit.{name} > 0 reads the id_selection heads, but id_selection is not aligned; "
                                    f"align it or set {name} to 0")
            if value > 0 and not self.iit_weight > 0:
                raise TrainingError(f"siit.{name} > 0 reads the heads in the IIT loss's source run; set iit_weight "
                                    "above 0")
            if value > 0 and not self.source_grad:
                raise TrainingError(f"siit.{name} > 0 trains the id_selection heads through the source run; set "
                                    "source_grad to true")
        value = self.retrieval_attention_weight
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise TrainingError(f"siit.retrieval_attention_weight must be a number >= 0, got {value!r}")
        if value > 0 and "id_retrieval" not in aligned:
            raise TrainingError("siit.retrieval_attention_weight > 0 trains the id_retrieval heads' attention, but "
                                "id_retrieval is not aligned; align it or set the weight to 0")
        if value > 0 and not (self.iit_weight > 0 and self.source_grad):
            raise TrainingError("siit.retrieval_attention_weight > 0 trains the id_retrieval heads through the IIT "
                                "loss's source run; set iit_weight above 0 and source_grad to true")
        value = self.interchanged_selection_weight
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise TrainingError(f"siit.interchanged_selection_weight must be a number >= 0, got {value!r}")
        if value > 0 and not {"id_retrieval", "id_selection"} <= set(aligned):
            raise TrainingError("siit.interchanged_selection_weight > 0 trains the id_selection heads on the "
                                "id_retrieval steps; align both variables or set the weight to 0")
        if value > 0 and not self.iit_weight > 0:
            raise TrainingError("siit.interchanged_selection_weight > 0 reads the IIT loss's interchanged run; set "
                                "iit_weight above 0")
        value = self.strict_selection_weight
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise TrainingError(f"siit.strict_selection_weight must be a number >= 0, got {value!r}")
        if value > 0 and "id_selection" not in aligned:
            raise TrainingError("siit.strict_selection_weight > 0 trains the id_selection heads in the strictness "
                                "run; align id_selection or set the weight to 0")
        if value > 0 and not self.strict_weight > 0:
            raise TrainingError("siit.strict_selection_weight > 0 reads the strictness loss's run; set strict_weight "
                                "above 0")
        try:
            aggregation = tuple(f"{l}.{h}" for l, h in parse_heads(list(self.aggregation_heads)))
        except Exception as exc:  # noqa: BLE001 - re-raised as a named training error
            raise TrainingError(f"siit.aggregation_heads: {exc}") from None
        stray = [h for h in aggregation if h not in aligned.get("id_selection", ())]
        if stray:
            raise TrainingError(f"siit.aggregation_heads {stray} are not id_selection heads "
                                f"({list(aligned.get('id_selection', ()))}); list id_selection heads only")
        if aggregation and len(aggregation) == len(aligned["id_selection"]):
            raise TrainingError("siit.aggregation_heads lists every id_selection head; at least one must read the "
                                "missing object")
        object.__setattr__(self, "aggregation_heads", aggregation)
        for name, needs in (("retrieval_readout_weight", "id_retrieval"), ("gather_readout_weight", "id_selection")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise TrainingError(f"siit.{name} must be a number >= 0, got {value!r}")
            if value > 0 and needs not in aligned:
                raise TrainingError(f"siit.{name} > 0 reads the {needs} heads, but {needs} is not aligned; align it "
                                    f"or set {name} to 0")
            if value > 0 and not (self.iit_weight > 0 and self.source_grad):
                raise TrainingError(f"siit.{name} > 0 trains heads through the IIT loss's source run; set iit_weight "
                                    "above 0 and source_grad to true")
        for name in ("gather_interchange_weight", "gather_selection_weight", "selecting_interchange_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise TrainingError(f"siit.{name} must be a number >= 0, got {value!r}")
            if value > 0 and not aggregation:
                raise TrainingError(f"siit.{name} > 0 interchanges the aggregation heads or the selecting heads "
                                    "apart from them; list the aggregation heads in siit.aggregation_heads")
            if value > 0 and not self.iit_weight > 0:
                raise TrainingError(f"siit.{name} > 0 reuses the IIT loss's source run; set iit_weight above 0")
        value = self.ablation_strict_weight
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise TrainingError(f"siit.ablation_strict_weight must be a number >= 0, got {value!r}")
        k = self.ablation_strict_heads
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise TrainingError(f"siit.ablation_strict_heads must be an int >= 0 (0: as many as are aligned), "
                                f"got {k!r}")
        modes = self.ablation_strict_modes
        if isinstance(modes, str) or not modes or not all(m in ABLATION_STRICT_MODES for m in modes) or len(set(modes)) != len(modes):
            raise TrainingError(f"siit.ablation_strict_modes must be distinct modes from {ABLATION_STRICT_MODES}, "
                                f"got {list(modes)!r}")
        value = self.ablation_necessity_weight
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise TrainingError(f"siit.ablation_necessity_weight must be a number >= 0, got {value!r}")
        if self.gather_selection_weight > 0 and not self.gather_interchange_weight > 0:
            raise TrainingError("siit.gather_selection_weight > 0 reads the gathering interchange's run; set "
                                "siit.gather_interchange_weight above 0")
        if self.gather_readout_weight > 0 and not aggregation:
            raise TrainingError("siit.gather_readout_weight > 0 reads the aggregation heads; list them in "
                                "siit.aggregation_heads")
        if self.position_readout not in POSITION_READOUTS:
            raise TrainingError(f"siit.position_readout must be one of {POSITION_READOUTS}, got "
                                f"{self.position_readout!r}")
        if self.span_positions not in SPAN_POSITIONS:
            raise TrainingError(f"siit.span_positions must be one of {SPAN_POSITIONS}, got {self.span_positions!r}")
        if self.last_positions not in LAST_POSITIONS:
            raise TrainingError(f"siit.last_positions must be one of {LAST_POSITIONS}, got {self.last_positions!r}")
        if self.strict_positions not in STRICT_POSITIONS:
            raise TrainingError(f"siit.strict_positions must be one of {STRICT_POSITIONS}, got "
                                f"{self.strict_positions!r}")
        if self.strict_sampling not in STRICT_SAMPLING:
            raise TrainingError(f"siit.strict_sampling must be one of {STRICT_SAMPLING}, got "
                                f"{self.strict_sampling!r}")
        if not isinstance(self.single_loss, bool):
            raise TrainingError(f"siit.single_loss must be True or False, got {self.single_loss!r}")
        if self.strict_head_weights and self.strict_sampling != "individual":
            raise TrainingError(f"siit.strict_head_weights applies to strict_sampling 'individual' (one head a "
                                f"step), not {self.strict_sampling!r}; drop the weights or sample individually")
        if not isinstance(self.strict_head_weights, Mapping):
            raise TrainingError(f"siit.strict_head_weights must map 'layer.head' to a weight, got "
                                f"{self.strict_head_weights!r}")
        weights = {}
        for head, weight in dict(self.strict_head_weights).items():
            try:
                (parsed,) = parse_heads([head])
            except Exception as exc:  # noqa: BLE001 - re-raised as a named training error
                raise TrainingError(f"siit.strict_head_weights: {exc}") from None
            name = f"{parsed[0]}.{parsed[1]}"
            if any(name in heads for heads in aligned.values()):
                raise TrainingError(f"siit.strict_head_weights lists {name}, which is aligned; the strictness loss "
                                    "draws unaligned heads only")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise TrainingError(f"siit.strict_head_weights[{name!r}] must be a number > 0, got {weight!r}")
            weights[name] = float(weight)
        object.__setattr__(self, "strict_head_weights", weights)

    @property
    def object_counts(self) -> list[int]:
        """The object counts the pairs are drawn with."""
        return [k for k in range(self.objects[0], self.objects[1] + 1) if k not in self.skip_objects]

    @property
    def planted(self) -> dict[str, list[str]]:
        """variable -> heads, the ``planted`` field of a shipped organism's training record."""
        return {v: list(h) for v, h in self.alignments.items()}

    def heads(self, variable: str) -> list[tuple[int, int]]:
        return parse_heads(list(self.alignments[variable]))

    def selecting_heads(self) -> list[tuple[int, int]]:
        """The ``id_selection`` heads that read the missing object (all but the aggregation heads)."""
        gather = set(parse_heads(list(self.aggregation_heads)))
        return [h for h in self.heads("id_selection") if h not in gather]

    def unaligned(self, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
        """Every head of the model that no variable is aligned to."""
        taken = {h for v in self.alignments for h in self.heads(v)}
        return [(l, h) for l in range(n_layers) for h in range(n_heads) if (l, h) not in taken]

    def check(self, n_layers: int, n_heads: int) -> None:
        """Raise TrainingError when an aligned head does not exist or no head is left unaligned."""
        for variable in self.alignments:
            bad = [f"{l}.{h}" for l, h in self.heads(variable) if not (0 <= l < n_layers and 0 <= h < n_heads)]
            if bad:
                raise TrainingError(f"siit.alignments[{variable!r}]: heads {bad} do not exist; the organism has "
                                    f"layers 0..{n_layers - 1} and heads 0..{n_heads - 1}")
        if self.position_layer is not None and self.position_layer >= n_layers:
            raise TrainingError(f"siit.position_layer {self.position_layer} does not exist; the organism has layers "
                                f"0..{n_layers - 1}")
        if (self.strict_weight > 0 or self.ablation_strict_weight > 0) and not self.unaligned(n_layers, n_heads):
            raise TrainingError("every head is aligned: the strictness loss has no head to interchange")
        weighted = parse_heads(list(self.strict_head_weights))
        bad = [f"{l}.{h}" for l, h in weighted if not (0 <= l < n_layers and 0 <= h < n_heads)]
        if bad:
            raise TrainingError(f"siit.strict_head_weights: heads {bad} do not exist; the organism has layers "
                                f"0..{n_layers - 1} and heads 0..{n_heads - 1}")

    def draw_strict_heads(self, rng: np.random.Generator, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
        """The step's unaligned heads for the strictness loss, as ``strict_sampling`` says."""
        if self.strict_sampling == "individual":
            return [self.draw_strict_head(rng, n_layers, n_heads)]
        free = self.unaligned(n_layers, n_heads)
        if self.strict_sampling == "all":
            return free
        chosen = rng.random(len(free)) < 0.5
        if not chosen.any():  # an empty draw would make the loss the behaviour loss; take one head instead
            chosen[int(rng.integers(len(free)))] = True
        return [head for head, keep in zip(free, chosen) if keep]

    def draw_ablated_heads(self, rng: np.random.Generator, n_layers: int,
                           n_heads: int) -> tuple[list[tuple[int, int]], str]:
        """The step's unaligned heads for the ablation strictness loss and how they are ablated (``zero``/``mean``)."""
        free = self.unaligned(n_layers, n_heads)
        most = min(self.ablation_strict_heads or sum(len(h) for h in self.alignments.values()), len(free))
        k = int(rng.integers(1, most + 1))
        chosen = sorted(int(i) for i in rng.choice(len(free), size=k, replace=False))
        return [free[i] for i in chosen], self.draw_ablation_mode(rng)

    def draw_ablation_mode(self, rng: np.random.Generator) -> str:
        return self.ablation_strict_modes[int(rng.integers(len(self.ablation_strict_modes)))]

    def draw_necessary_heads(self, rng: np.random.Generator) -> tuple[str, list[tuple[int, int]], str]:
        """The step's aligned variable for the necessity loss, its heads and how they are ablated."""
        variables = sorted(self.alignments)
        variable = variables[int(rng.integers(len(variables)))]
        return variable, self.heads(variable), self.draw_ablation_mode(rng)

    def draw_strict_head(self, rng: np.random.Generator, n_layers: int, n_heads: int) -> tuple[int, int]:
        """One unaligned head for the strictness loss (uniform unless ``strict_head_weights`` says else)."""
        free = self.unaligned(n_layers, n_heads)
        if not self.strict_head_weights:
            return free[int(rng.integers(len(free)))]
        weights = np.array([self.strict_head_weights.get(f"{l}.{h}", 1.0) for l, h in free])
        return free[int(rng.choice(len(free), p=weights / weights.sum()))]

    def to_dict(self) -> dict[str, Any]:
        return {"alignments": self.planted, "iit_weight": self.iit_weight, "strict_weight": self.strict_weight,
                "pairs": self.pairs, "objects": list(self.objects), "entropies": list(self.entropies),
                "colours": None if self.colours is None else list(self.colours),
                "shapes": None if self.shapes is None else list(self.shapes),
                "strict_positions": self.strict_positions, "source_grad": self.source_grad,
                **({"strict_head_weights": dict(self.strict_head_weights)} if self.strict_head_weights else {}),
                **({"strict_sampling": self.strict_sampling} if self.strict_sampling != "individual" else {}),
                **({"single_loss": False} if not self.single_loss else {}),
                "skip_objects": list(self.skip_objects), "swap": self.swap, "recolour": self.recolour,
                "position_layer": self.position_layer, "position_weight": self.position_weight,
                "position_readout": self.position_readout, "last_positions": self.last_positions,
                **({"span_positions": self.span_positions} if self.span_positions != "name" else {}),
                **({"selection_weight": self.selection_weight} if self.selection_weight else {}),
                **({"selection_attention_weight": self.selection_attention_weight}
                   if self.selection_attention_weight else {}),
                **({"retrieval_attention_weight": self.retrieval_attention_weight}
                   if self.retrieval_attention_weight else {}),
                **({"interchanged_selection_weight": self.interchanged_selection_weight}
                   if self.interchanged_selection_weight else {}),
                **({"strict_selection_weight": self.strict_selection_weight}
                   if self.strict_selection_weight else {}),
                **({"retrieval_readout_weight": self.retrieval_readout_weight}
                   if self.retrieval_readout_weight else {}),
                **({"gather_readout_weight": self.gather_readout_weight} if self.gather_readout_weight else {}),
                **({"gather_interchange_weight": self.gather_interchange_weight}
                   if self.gather_interchange_weight else {}),
                **({"gather_selection_weight": self.gather_selection_weight}
                   if self.gather_selection_weight else {}),
                **({"selecting_interchange_weight": self.selecting_interchange_weight}
                   if self.selecting_interchange_weight else {}),
                **({"ablation_strict_weight": self.ablation_strict_weight} if self.ablation_strict_weight else {}),
                **({"ablation_strict_heads": self.ablation_strict_heads} if self.ablation_strict_heads else {}),
                **({"ablation_strict_modes": list(self.ablation_strict_modes)}
                   if tuple(self.ablation_strict_modes) != DEFAULT_ABLATION_MODES else {}),
                **({"ablation_necessity_weight": self.ablation_necessity_weight}
                   if self.ablation_necessity_weight else {}),
                **({"aggregation_heads": list(self.aggregation_heads)} if self.aggregation_heads else {})}

    @classmethod
    def from_value(cls, value: SIITSpec | Mapping[str, Any] | None) -> SIITSpec | None:
        if value is None or isinstance(value, SIITSpec):
            return value
        if not isinstance(value, Mapping):
            raise TrainingError(f"siit must be a mapping of SIITSpec fields, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise TrainingError(f"unknown siit fields {unknown}; fields: {', '.join(sorted(known))}")
        data = dict(value)
        for key in ("objects", "skip_objects", "aggregation_heads", "ablation_strict_modes"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


# ----------------------------------------------------------------------------------------------------------------
# pairs -> rows
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class InterchangeBatch:
    """Base and source rows of counterfactual pairs, teacher-forced with one answer per pair.

    Attributes:
        base, source: :class:`~vlmbind.organisms.data.TrainBatch` es with identical token ids outside the image
            (same prompt, same answer text); only the images differ.
        positions: per row, the patch positions (the variable's positions in the high-level model).
        prompt_mask: ``B P`` True on the prompt's tokens (image included), False on the answer and padding.
    """

    base: Any
    source: Any
    positions: list[list[int]]
    prompt_mask: torch.Tensor = field(repr=False)


def patch_positions(builder: BatchBuilder, pair: CounterfactualPair) -> list[int]:
    """The row positions a pair patches in a :class:`BatchBuilder` row: the last prompt token, or the tokens of the
    pair's text span (``patch["text"]`` at ``patch["occurrence"]``, counted from the end when negative).

    Raises:
        TrainingError: the span's text does not occur in the prompt, or no token covers it.
    """
    prompt = pair.clean.prompt
    if pair.patch["kind"] == "last":
        return [len(builder.prefix) + len(builder._encode(prompt)) - 1]
    return _span_tokens(builder, pair.id, prompt, pair.patch["text"], int(pair.patch.get("occurrence", -1)))


def _span_tokens(builder: BatchBuilder, pair_id: str, prompt: str, text: str, occurrence: int) -> list[int]:
    """Row positions of the tokens covering ``text`` at ``occurrence`` (negative: from the end) in ``prompt``."""
    offset = len(builder.prefix)
    starts = [i for i in range(len(prompt)) if prompt.startswith(text, i)]
    if not starts or not -len(starts) <= occurrence < len(starts):
        raise TrainingError(f"pair {pair_id!r}: {text!r} does not occur in the prompt {prompt!r} (occurrence "
                            f"{occurrence})")
    start = starts[occurrence]
    end = start + len(text)
    enc = builder.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(builder._encode(prompt)):
        raise TrainingError(f"pair {pair_id!r}: the tokenizer's offsets belong to another tokenisation")
    covered = [offset + k for k, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    if not covered:
        raise TrainingError(f"pair {pair_id!r}: no token covers {text!r}")
    return covered


def described_name_tokens(builder: BatchBuilder, pairs: Sequence[CounterfactualPair],
                          span_positions: str = "name") -> list[list[int]]:
    """Per pair, the row positions of every described object's name in the prompt (each named once: the
    conjunctions of a scene are distinct), or with ``span_positions="last"`` of each name's last token: where
    ``id_retrieval`` heads write the described objects' positions."""
    out = []
    for p in pairs:
        names = [p.clean.objects[k].name for k in p.clean.fields["described"]]
        spans = [_span_tokens(builder, p.id, p.clean.prompt, name, -1) for name in names]
        out.append(sorted({q for span in spans for q in (span[-1:] if span_positions == "last" else span)}))
    return out


def interchange_batch(builder: BatchBuilder, pairs: Sequence[CounterfactualPair], answer: str,
                      last_positions: str = "prompt", span_positions: str = "name") -> InterchangeBatch:
    """Rows for ``pairs``: base = the clean scene, source = the counterfactual scene, both teacher-forced with
    ``answer`` (``"counterfactual"``: a*, the IIT target; ``"clean"``: a, the strictness target). A last-token pair
    patches the last prompt token, and with ``last_positions="answer"`` also every answer position that predicts a
    token; a span pair patches its span's tokens, or with ``span_positions="last"`` the span's last token (see
    :class:`SIITSpec`)."""
    if answer not in ("counterfactual", "clean"):
        raise TrainingError(f"answer must be 'counterfactual' or 'clean', got {answer!r}")
    if span_positions not in SPAN_POSITIONS:
        raise TrainingError(f"span_positions must be one of {SPAN_POSITIONS}, got {span_positions!r}")
    texts = [p.answer_counterfactual if answer == "counterfactual" else p.answer for p in pairs]
    base = builder([(p.clean.image, p.clean.prompt, t) for p, t in zip(pairs, texts)])
    source = builder([(p.counterfactual.image, p.counterfactual.prompt, t) for p, t in zip(pairs, texts)])
    if not torch.equal(base.inputs["input_ids"], source.inputs["input_ids"]):
        raise TrainingError("base and source rows differ outside the image; interchange pairs need the same prompt")
    first_answer = (base.labels != IGNORE_INDEX).int().argmax(1)  # the first answer token of each row
    prompt_mask = torch.arange(base.labels.shape[1])[None] < first_answer[:, None]
    positions = [patch_positions(builder, p) for p in pairs]
    if span_positions == "last":
        positions = [pos[-1:] if p.patch["kind"] == "span" else pos for p, pos in zip(pairs, positions)]
    if last_positions == "answer":
        for r, p in enumerate(pairs):
            if p.patch["kind"] == "last":
                predicting = (torch.nonzero(base.labels[r] != IGNORE_INDEX).flatten() - 1).tolist()
                positions[r] = sorted(set(positions[r]) | set(predicting))
    return InterchangeBatch(base, source, positions, prompt_mask)


# ----------------------------------------------------------------------------------------------------------------
# the interchange on the model
# ----------------------------------------------------------------------------------------------------------------
class HeadInterchange:
    """Captures heads' ``o_proj`` inputs in one run and writes them into another, at chosen rows and positions.

    ``capture(heads)`` stores the ``o_proj`` input of the heads' layers (kept in the graph when ``grad``);
    ``patch(heads, mask_rows)`` replaces, by ``torch.where`` (never in place), the heads' slices at the positions
    given per row. Hooks are removed when each block ends, also on an error.
    """

    def __init__(self, model: Any, processor: Any):
        self.adapter = adapter_class_for_config(model.config)(model, processor)
        self.d_head = self.adapter.d_head
        self.stored: dict[int, torch.Tensor] = {}
        self.patterns: dict[int, torch.Tensor] = {}
        self.base_patterns: dict[int, torch.Tensor] = {}

    def _modules(self, layers: Sequence[int]) -> dict[int, Any]:
        return {l: self.adapter.o_proj_module(l) for l in sorted(set(layers))}

    @contextlib.contextmanager
    def capture(self, layers: Sequence[int], grad: bool = False, patterns: bool = False) -> Iterator[None]:
        """Store the layers' ``o_proj`` inputs in ``stored`` (and with ``patterns`` their attention probabilities,
        ``B H P P``, in ``patterns``: eager attention only)."""
        self.stored, self.patterns = {}, {}

        def hook(layer: int):
            def pre(_module: Any, args: tuple) -> None:
                self.stored[layer] = args[0] if grad else args[0].detach()
            return pre

        def pattern_hook(layer: int):
            def post(_module: Any, _args: tuple, output: Any) -> None:
                weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                if weights is None:
                    raise TrainingError("the attention returned no pattern: build the organism with "
                                        "attn_implementation='eager' to train on attention patterns")
                self.patterns[layer] = weights if grad else weights.detach()
            return post

        handles = [m.register_forward_pre_hook(hook(l)) for l, m in self._modules(layers).items()]
        if patterns:
            handles += [self.adapter.attention_module(l).register_forward_hook(pattern_hook(l))
                        for l in sorted(set(layers))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def mask(self, heads: Sequence[tuple[int, int]], positions: Sequence[Sequence[int]] | torch.Tensor,
             shape: tuple[int, int, int]) -> dict[int, torch.Tensor]:
        """Per layer, a ``B P H*D`` boolean mask: True at the rows' positions (a list per row, or a ``B P`` boolean
        tensor) and the heads' slices."""
        b, p, width = shape
        if isinstance(positions, torch.Tensor):
            where = positions.to(torch.bool)
        else:
            where = torch.zeros((b, p), dtype=torch.bool)
            for r, pos in enumerate(positions):
                where[r, list(pos)] = True
        out: dict[int, torch.Tensor] = {}
        for layer, head in heads:
            cols = torch.zeros(width, dtype=torch.bool)
            cols[head * self.d_head : (head + 1) * self.d_head] = True
            m = where[:, :, None] & cols[None, None, :]
            out[layer] = out[layer] | m if layer in out else m
        return out

    @contextlib.contextmanager
    def patch(self, masks: Mapping[int, torch.Tensor], values: Mapping[int, torch.Tensor]) -> Iterator[None]:
        def hook(layer: int):
            def pre(_module: Any, args: tuple) -> tuple:
                x = args[0]
                m = masks[layer].to(x.device)
                return (torch.where(m, values[layer].to(x.dtype), x), *args[1:])
            return pre

        handles = [m.register_forward_pre_hook(hook(l)) for l, m in self._modules(list(masks)).items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


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
    stored, source_patterns = interchange.stored, interchange.patterns
    b, p, width = values[layers[0]].shape
    masks = interchange.mask(heads, where, (b, p, width))
    with interchange.patch(masks, {l: values[l] for l in layers}):
        if not base_patterns:
            return model(**batch.base.inputs, use_cache=False).logits
        with interchange.capture(base_patterns, grad=True, patterns=True):
            logits = model(**batch.base.inputs, use_cache=False).logits
    interchange.base_patterns = interchange.patterns
    interchange.stored, interchange.patterns = stored, source_patterns
    return logits


# ----------------------------------------------------------------------------------------------------------------
# the step's pairs and losses
# ----------------------------------------------------------------------------------------------------------------
def _step_rng(seed: int, stream: int, step: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), stream, int(step)])


def draw_pairs(spec: SIITSpec, variable: str, *, seed: int, stream: int, step: int, canvas: Canvas,
               n: int | None = None) -> list[CounterfactualPair]:
    """The pairs of ``variable``'s condition for one step (a pure function of seed, stream and step)."""
    rng = _step_rng(seed, stream, step)
    entropy = spec.entropies[int(rng.integers(len(spec.entropies)))]
    pair_seed = int(rng.integers(2**62))
    counts = spec.object_counts
    objects: int | tuple[int, int] = spec.objects if not spec.skip_objects else counts[int(rng.integers(len(counts)))]
    return list(scene_pairs(n or spec.pairs, variable, pair_seed, n_objects=objects, entropy=entropy,
                            canvas=canvas, colours=spec.colours, shapes=spec.shapes, swap=spec.swap,
                            recolour=spec.recolour))


def evaluation_pairs(spec: SIITSpec, variable: str, *, seed: int, canvas: Canvas, n: int,
                     stream: int = SIIT_EVAL_STREAM) -> list[CounterfactualPair]:
    """``n`` pairs of ``variable``'s condition spread evenly over every object count and entropy the spec trains on
    (a training step draws one setting; an evaluation set drawn like one step covers one setting only)."""
    settings = [(k, e) for k in spec.object_counts for e in spec.entropies]
    out: list[CounterfactualPair] = []
    for i, (objects, entropy) in enumerate(settings):
        share = n // len(settings) + (1 if i < n % len(settings) else 0)
        if share:
            rng = _step_rng(seed, stream, 10_000 * (VARIABLES.index(variable) + 1) + i)
            out += list(scene_pairs(share, variable, int(rng.integers(2**62)), n_objects=objects, entropy=entropy,
                                    canvas=canvas, colours=spec.colours, shapes=spec.shapes, swap=spec.swap,
                                    recolour=spec.recolour))
    return out


POSITION_READOUT_SEED = 7
# cosine logits times this: bounded, so the loss cannot blow the residual stream up (raw residuals of norm ~25
# gave a cross-entropy of 6 and wrecked the behaviour of a trained organism in its first steps)
POSITION_LOGIT_SCALE = 10.0


def position_readout(hidden: int, cells: int) -> torch.Tensor:
    """The fixed ``hidden x cells`` readout of the position code (unit columns, from a fixed seed, never trained)."""
    g = torch.Generator().manual_seed(POSITION_READOUT_SEED)
    w = torch.randn(hidden, cells, generator=g)
    return w / w.norm(dim=0, keepdim=True)


def _image_cells(input_ids: torch.Tensor, image_token_id: int, cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The image tokens' mask and each one's grid cell (image tokens are in raster order, ``cells`` per image)."""
    mask = input_ids == image_token_id
    counts = mask.sum(1)
    if bool((counts % cells).any()):
        raise TrainingError(f"rows hold {counts.tolist()} image tokens, not a multiple of the grid's {cells} cells")
    return mask, torch.cat([torch.arange(int(c)) % cells for c in counts])


def _position_logits(h: torch.Tensor, cells: int) -> torch.Tensor:
    unit = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return POSITION_LOGIT_SCALE * unit @ position_readout(h.shape[-1], cells).to(h.dtype)


def position_code_loss(hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                       cells: int) -> torch.Tensor:
    """Cross-entropy of every image token's grid cell read from ``hidden_states`` (``B P D``, one decoder layer's
    output) through :func:`position_readout` (cosine logits, scaled by :data:`POSITION_LOGIT_SCALE`)."""
    mask, target = _image_cells(input_ids, image_token_id, cells)
    return torch.nn.functional.cross_entropy(_position_logits(hidden_states[mask], cells),
                                             target.to(hidden_states.device))


class PositionProbe(torch.nn.Module):
    """A linear readout of every image token's grid cell, trained beside the organism (never part of it)."""

    def __init__(self, hidden: int, cells: int, seed: int):
        super().__init__()
        self.cells = cells
        self.linear = torch.nn.Linear(hidden, cells)
        g = torch.Generator().manual_seed(POSITION_READOUT_SEED + int(seed))
        with torch.no_grad():
            self.linear.weight.normal_(0.0, hidden ** -0.5, generator=g)
            self.linear.bias.zero_()

    def loss(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
        mask, target = _image_cells(input_ids, image_token_id, self.cells)
        return torch.nn.functional.cross_entropy(self.linear(hidden_states[mask]), target.to(hidden_states.device))

    def accuracy(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int) -> float:
        mask, target = _image_cells(input_ids, image_token_id, self.cells)
        with torch.no_grad():
            pred = self.linear(hidden_states[mask]).argmax(-1).cpu()
        return float((pred == target).float().mean())


def position_code_accuracy(hidden_states: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                           cells: int) -> float:
    """Share of image tokens whose cell the fixed readout gets right."""
    mask, target = _image_cells(input_ids, image_token_id, cells)
    pred = _position_logits(hidden_states[mask], cells).argmax(-1).cpu()
    return float((pred == target).float().mean())


def target_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas, side: str = "counterfactual") -> torch.Tensor:
    """Per pair, the grid cell (raster index) of the missing object in the source (``counterfactual``) or base
    (``clean``) scene: the value of the ``id_selection`` variable there."""
    cells = []
    for p in pairs:
        example = p.counterfactual if side == "counterfactual" else p.clean
        o = example.objects[example.fields["target"]]
        cells.append(o.row * canvas.shape[1] + o.col)
    return torch.tensor(cells, dtype=torch.long)


def patched_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas) -> torch.Tensor:
    """Per ``id_retrieval`` pair, the grid cell of the patched described object (``patch["object"]``) in the source
    scene: the ``id_retrieval`` variable's value at that object's name tokens there."""
    return _patched_object_cells(pairs, canvas, "counterfactual")


def own_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas) -> torch.Tensor:
    """Per ``id_retrieval`` pair, the grid cell of the patched described object in the base scene: the object the
    high-level model selects once that object's name carries the source's position."""
    return _patched_object_cells(pairs, canvas, "clean")


def _patched_object_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas, side: str) -> torch.Tensor:
    cells = []
    for p in pairs:
        if p.patch.get("kind") != "span" or "object" not in p.patch:
            raise TrainingError(f"pair {p.id!r} patches no described object's span; id_retrieval pairs do")
        o = getattr(p, side).objects[int(p.patch["object"])]
        cells.append(o.row * canvas.shape[1] + o.col)
    return torch.tensor(cells, dtype=torch.long)


def last_prompt_index(prompt_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last prompt token (the first index of the largest running count: the last True)."""
    return prompt_mask.long().cumsum(1).argmax(1)


def last_prompt_positions(prompt_mask: torch.Tensor) -> list[list[int]]:
    """Per row, ``[index of the last prompt token]``."""
    return [[int(i)] for i in last_prompt_index(prompt_mask)]


class SelectionProbe(torch.nn.Module):
    """A linear readout of the missing object's grid cell from the ``id_selection`` heads' outputs (their ``o_proj``
    input slices, concatenated), trained beside the organism (never part of it)."""

    def __init__(self, heads: Sequence[tuple[int, int]], d_head: int, cells: int, seed: int):
        super().__init__()
        self.heads, self.d_head, self.cells = list(heads), int(d_head), int(cells)
        self.linear = torch.nn.Linear(len(self.heads) * self.d_head, self.cells)
        g = torch.Generator().manual_seed(POSITION_READOUT_SEED + 1000 + int(seed))
        with torch.no_grad():
            self.linear.weight.normal_(0.0, (len(self.heads) * self.d_head) ** -0.5, generator=g)
            self.linear.bias.zero_()

    def features(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]]) -> torch.Tensor:
        """``N x (heads * d_head)``: the heads' outputs at every row's positions (rows repeated per position)."""
        rows = [r for r, pos in enumerate(positions) for _ in pos]
        cols = [q for pos in positions for q in pos]
        parts = [stored[l][rows, cols, h * self.d_head : (h + 1) * self.d_head] for l, h in self.heads]
        return torch.cat(parts, dim=-1)

    def _targets(self, targets: torch.Tensor, positions: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.cat([targets[r].repeat(len(pos)) for r, pos in enumerate(positions)])

    def loss(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
             targets: torch.Tensor) -> torch.Tensor:
        logits = self.linear(self.features(stored, positions))
        return torch.nn.functional.cross_entropy(logits, self._targets(targets, positions).to(logits.device))

    def accuracy(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
                 targets: torch.Tensor) -> float:
        with torch.no_grad():
            pred = self.linear(self.features(stored, positions)).argmax(-1).cpu()
        return float((pred == self._targets(targets, positions)).float().mean())


class GatherProbe(SelectionProbe):
    """A linear readout of the set of the described objects' cells (one logit per cell, multi-label) from the
    aggregation heads' outputs, trained beside the organism (never part of it)."""

    def loss(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
             targets: torch.Tensor) -> torch.Tensor:
        logits = self.linear(self.features(stored, positions))
        per_cell = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, self._targets(targets, positions).to(logits.device, logits.dtype), reduction="none")
        return per_cell.sum(-1).mean()  # the set's negative log-likelihood, as a cross-entropy is a cell's

    def accuracy(self, stored: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
                 targets: torch.Tensor) -> float:
        """The share of (row, position)s where the cells with a positive logit are exactly the described ones."""
        with torch.no_grad():
            pred = self.linear(self.features(stored, positions)).cpu() > 0
        return float((pred == self._targets(targets, positions).bool()).all(-1).float().mean())

    def _targets(self, targets: torch.Tensor, positions: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.cat([targets[r][None].expand(len(pos), -1) for r, pos in enumerate(positions)])


def described_cells(pairs: Sequence[CounterfactualPair], canvas: Canvas, side: str = "counterfactual") -> torch.Tensor:
    """``pairs x cells``: 1 at the grid cells of the described objects in the source (``counterfactual``) or base
    (``clean``) scene, the positions the ``id_retrieval`` heads write at their names."""
    out = torch.zeros(len(pairs), canvas.shape[0] * canvas.shape[1])
    for r, p in enumerate(pairs):
        example = p.counterfactual if side == "counterfactual" else p.clean
        for k in example.fields["described"]:
            o = example.objects[k]
            out[r, o.row * canvas.shape[1] + o.col] = 1.0
    return out


def target_tokens(input_ids: torch.Tensor, image_token_id: int, cells: torch.Tensor) -> torch.Tensor:
    """Per row, the sequence position of the image token of grid cell ``cells[row]`` (one image per row, its tokens
    in raster order)."""
    out = []
    for r in range(input_ids.shape[0]):
        positions = torch.nonzero(input_ids[r] == image_token_id).flatten()
        if int(cells[r]) >= len(positions):
            raise TrainingError(f"row {r}: cell {int(cells[r])} but only {len(positions)} image tokens")
        out.append(positions[int(cells[r])])
    return torch.stack(out)


def attention_on_targets(patterns: Mapping[int, torch.Tensor], heads: Sequence[tuple[int, int]],
                         positions: Sequence[Sequence[int]],
                         targets: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
    """The heads' attention on each row's target token (``targets``: one position per row) or summed over the row's
    target positions (a list per row), at each of the row's positions (heads, then rows)."""
    if isinstance(targets, torch.Tensor):
        return torch.cat([patterns[layer][r, head, list(pos), int(targets[r])]
                          for layer, head in heads for r, pos in enumerate(positions)])
    return torch.cat([patterns[layer][r, head][list(pos)][:, list(targets[r])].sum(-1)
                      for layer, head in heads for r, pos in enumerate(positions)])


def selection_attention_loss(patterns: Mapping[int, torch.Tensor], heads: Sequence[tuple[int, int]],
                             positions: Sequence[Sequence[int]],
                             targets: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
    """Mean over heads, rows and the rows' positions of ``-log`` the attention on the row's target(s)."""
    return -torch.log(attention_on_targets(patterns, heads, positions, targets).clamp_min(1e-9)).mean()


READOUT_TARGETS = ("missing", "patched", "described")


def selection_readout(model: Any, interchange: HeadInterchange, builder: BatchBuilder,
                      pairs: Sequence[CounterfactualPair], heads: Sequence[tuple[int, int]], canvas: Canvas, *,
                      probe: SelectionProbe | None = None, patterns: bool = False, batch_size: int = 32,
                      last_positions: str = "answer", target: str = "missing",
                      span_positions: str = "name") -> dict[str, float]:
    """On the source runs' patch positions: the share where ``probe`` reads the target cell from its heads
    (``accuracy``), and with ``patterns`` the heads' mean attention on the target (``attention_mass``).

    ``target``: ``missing`` (the missing object's cell and image token: ``id_selection`` pairs), ``patched`` (the
    patched described object's: ``id_retrieval`` pairs) or ``described`` (attention summed over the described
    objects' names: aggregation heads, with a :class:`GatherProbe` reading their cells)."""
    if target not in READOUT_TARGETS:
        raise TrainingError(f"target must be one of {READOUT_TARGETS}, got {target!r}")
    if (target == "described") != isinstance(probe, GatherProbe) and probe is not None:
        raise TrainingError("a GatherProbe reads the described objects' cells (target 'described'), and only it")
    hits, mass, total, attended = 0.0, 0.0, 0, 0
    layers = sorted({l for l, _ in heads} | ({l for l, _ in probe.heads} if probe is not None else set()))
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            batch = interchange_batch(builder, chunk, "counterfactual", last_positions, span_positions)
            with interchange.capture(layers, patterns=patterns):
                model(**batch.source.inputs, use_cache=False)
            n = sum(len(p) for p in batch.positions)
            cells = None if target == "described" else (
                target_cells(chunk, canvas) if target == "missing" else patched_cells(chunk, canvas))
            if probe is not None:
                read = described_cells(chunk, canvas) if cells is None else cells
                hits += probe.accuracy(interchange.stored, batch.positions, read) * n
            if patterns:
                goal = described_name_tokens(builder, chunk, span_positions) if cells is None else \
                    target_tokens(batch.source.inputs["input_ids"], builder.image_token_id, cells)
                mass += float(attention_on_targets(interchange.patterns, heads, batch.positions, goal).sum())
                attended += n * len(heads)
            total += n
    out = {}
    if probe is not None:
        out["accuracy"] = hits / total if total else float("nan")
    if patterns:
        out["attention_mass"] = mass / attended if attended else float("nan")
    return out


def siit_losses(model: Any, interchange: HeadInterchange, builder: BatchBuilder, spec: SIITSpec, *, seed: int,
                step: int, canvas: Canvas, loss_norm: str = "example",
                selection: SelectionProbe | None = None, parts: Sequence[str] = SIIT_PARTS,
                retrieval: SelectionProbe | None = None, gather: GatherProbe | None = None) -> dict[str, Any]:
    """The step's IIT and strictness losses (tensors in the graph) and what they were computed on.

    ``parts`` picks which to compute (``iit`` with its readout and attention losses, ``strict``); a step's variable,
    pairs and strictness heads depend only on ``seed`` and ``step``, so computing them in two calls (one optimiser
    step each, ``single_loss=False``) sees the same draws as one call.

    Returns:
        ``{"iit": loss, "strict": loss, "selection": loss, "selection_attention": loss, "retrieval_attention": loss,
        "interchanged_selection": loss, "strict_selection": loss, "retrieval_readout": loss, "gather_readout": loss,
        "gather_interchange": loss, "gather_selection": loss, "selecting_interchange": loss,
        "ablation_strict": loss, "ablation_necessity": loss, "variable": v, "strict_head": "l.h[,l.h...]",
        "ablated": "mode:l.h[,l.h...]", "necessity_ablated": "mode:l.h[,l.h...]"}``
        (a loss is None when its weight is 0 or its part is not
        asked for; the ID-selection and ID-retrieval ones also on steps of another variable, and ``selection``
        without a ``selection`` probe; the readouts without their ``retrieval`` / ``gather`` probe).
    """
    unknown = sorted(set(parts) - set(SIIT_PARTS))
    if unknown or not parts:
        raise TrainingError(f"siit_losses parts must be a non-empty subset of {SIIT_PARTS}, got {list(parts)!r}")
    rng = _step_rng(seed, SIIT_STREAM, step)
    variables = sorted(spec.alignments)
    variable = variables[int(rng.integers(len(variables)))]
    pairs = draw_pairs(spec, variable, seed=seed, stream=SIIT_STREAM, step=step, canvas=canvas)
    out: dict[str, Any] = {"variable": variable, "iit": None, "strict": None, "strict_head": None, "selection": None,
                           "selection_attention": None, "retrieval_attention": None, "interchanged_selection": None,
                           "strict_selection": None, "retrieval_readout": None, "gather_readout": None,
                           "gather_interchange": None, "gather_selection": None, "selecting_interchange": None,
                           "ablation_strict": None, "ablated": None, "ablation_necessity": None,
                           "necessity_ablated": None}
    if spec.iit_weight > 0 and "iit" in parts:
        batch = interchange_batch(builder, pairs, "counterfactual", spec.last_positions, spec.span_positions)
        attend = (variable == "id_selection" and spec.selection_attention_weight > 0) or \
            (variable == "id_retrieval" and spec.retrieval_attention_weight > 0)
        judge = variable == "id_retrieval" and spec.interchanged_selection_weight > 0
        logits = interchange_logits(model, interchange, batch, spec.heads(variable), batch.positions,
                                    source_grad=spec.source_grad, patterns=attend,
                                    base_patterns=sorted({l for l, _ in spec.selecting_heads()}) if judge else ())
        out["iit"] = answer_loss(logits, batch.base.labels, loss_norm)
        if judge:
            own = target_tokens(batch.base.inputs["input_ids"], builder.image_token_id, own_cells(pairs, canvas))
            out["interchanged_selection"] = selection_attention_loss(
                interchange.base_patterns, spec.selecting_heads(), last_prompt_positions(batch.prompt_mask), own)
        # interchange.stored / patterns still hold the source run's, in the graph (source_grad)
        source_ids = batch.source.inputs["input_ids"]
        if variable == "id_selection" and (selection is not None and spec.selection_weight > 0 or attend):
            cells = target_cells(pairs, canvas)
            if selection is not None and spec.selection_weight > 0:
                out["selection"] = selection.loss(interchange.stored, batch.positions, cells)
            if attend:
                out["selection_attention"] = _selection_attention(spec, interchange.patterns, batch.positions,
                                                                  target_tokens(source_ids, builder.image_token_id,
                                                                                cells),
                                                                  described_name_tokens(builder, pairs,
                                                                                        spec.span_positions))
        if variable == "id_retrieval" and retrieval is not None and spec.retrieval_readout_weight > 0:
            out["retrieval_readout"] = retrieval.loss(interchange.stored, batch.positions,
                                                      patched_cells(pairs, canvas))
        if variable == "id_selection" and gather is not None and spec.gather_readout_weight > 0:
            out["gather_readout"] = gather.loss(interchange.stored, batch.positions, described_cells(pairs, canvas))
        if variable == "id_selection" and spec.gather_interchange_weight > 0:
            # the aggregation heads alone, from the same source run: the selection must follow the gathered cells
            judge_gather = spec.gather_selection_weight > 0
            gathered = patched_logits(model, interchange, batch, parse_heads(list(spec.aggregation_heads)),
                                      batch.positions, interchange.stored,
                                      base_patterns=sorted({l for l, _ in spec.selecting_heads()})
                                      if judge_gather else ())
            out["gather_interchange"] = answer_loss(gathered, batch.base.labels, loss_norm)
            if judge_gather:
                unclaimed = target_tokens(batch.base.inputs["input_ids"], builder.image_token_id,
                                          target_cells(pairs, canvas))
                out["gather_selection"] = selection_attention_loss(
                    interchange.base_patterns, spec.selecting_heads(), last_prompt_positions(batch.prompt_mask),
                    unclaimed)
        if variable == "id_selection" and spec.selecting_interchange_weight > 0:
            # the selecting heads alone, from the same source run: the answer must follow them, not only the gatherers
            selected = patched_logits(model, interchange, batch, spec.selecting_heads(), batch.positions,
                                      interchange.stored)
            out["selecting_interchange"] = answer_loss(selected, batch.base.labels, loss_norm)
        if variable == "id_retrieval" and attend:
            tokens = target_tokens(source_ids, builder.image_token_id, patched_cells(pairs, canvas))
            out["retrieval_attention"] = selection_attention_loss(interchange.patterns, spec.heads(variable),
                                                                  batch.positions, tokens)
    clean_batch = None
    if spec.strict_weight > 0:
        a = interchange.adapter
        heads = spec.draw_strict_heads(rng, a.n_layers, a.n_heads)  # drawn either way: the rng stays in step
        out["strict_head"] = ",".join(f"{l}.{h}" for l, h in heads)
        if "strict" in parts:
            batch = clean_batch = interchange_batch(builder, pairs, "clean", spec.last_positions, spec.span_positions)
            where = batch.prompt_mask if spec.strict_positions == "all" else batch.positions
            hold = spec.strict_selection_weight > 0
            logits = interchange_logits(model, interchange, batch, heads, where, source_grad=spec.source_grad,
                                        base_patterns=sorted({l for l, _ in spec.selecting_heads()}) if hold else ())
            out["strict"] = answer_loss(logits, batch.base.labels, loss_norm)
            if hold:
                missing = target_tokens(batch.base.inputs["input_ids"], builder.image_token_id,
                                        target_cells(pairs, canvas, side="clean"))
                out["strict_selection"] = selection_attention_loss(
                    interchange.base_patterns, spec.selecting_heads(), last_prompt_positions(batch.prompt_mask),
                    missing)
    if spec.ablation_strict_weight > 0:
        a = interchange.adapter
        # drawn after the strictness heads, so that runs without this loss keep their draws
        heads, mode = spec.draw_ablated_heads(rng, a.n_layers, a.n_heads)
        out["ablated"] = f"{mode}:" + ",".join(f"{l}.{h}" for l, h in heads)
        if "strict" in parts:
            if clean_batch is None:
                clean_batch = interchange_batch(builder, pairs, "clean", spec.last_positions, spec.span_positions)
            batch = clean_batch
            logits = ablated_logits(model, interchange, batch.base, heads, mode)
            out["ablation_strict"] = answer_loss(logits, batch.base.labels, loss_norm)
    if spec.ablation_necessity_weight > 0:
        _variable, heads, mode = spec.draw_necessary_heads(rng)  # after every other draw of the step
        out["necessity_ablated"] = f"{mode}:" + ",".join(f"{l}.{h}" for l, h in heads)
        if "strict" in parts:
            if clean_batch is None:
                clean_batch = interchange_batch(builder, pairs, "clean", spec.last_positions, spec.span_positions)
            logits = ablated_logits(model, interchange, clean_batch.base, heads, mode)
            out["ablation_necessity"] = answer_unlikelihood(logits, clean_batch.base.labels, loss_norm)
    return out


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
        stored, patterns = interchange.stored, interchange.patterns
        with torch.no_grad(), interchange.capture(layers):
            model(**rows.inputs, use_cache=False)
        clean = interchange.stored
        interchange.stored, interchange.patterns = stored, patterns
        if mode == "mean":
            groups = [keep]
        else:
            roles = np.stack([interchange.adapter.roles(ids, mask) for ids, mask in
                              zip(rows.inputs["input_ids"].cpu().numpy(), rows.inputs["attention_mask"].cpu().numpy())])
            groups = [torch.as_tensor(roles == role) & keep for role in sorted(set(roles[keep.numpy()].tolist()))]
        values = {}
        for l in layers:
            value = torch.zeros(shape, dtype=clean[l].dtype)
            for group in groups:
                weights = group[:, :, None].to(clean[l].dtype)
                mean = (clean[l] * weights).sum((0, 1)) / weights.sum((0, 1))
                value = torch.where(group[:, :, None], mean[None, None], value)
            values[l] = value
    masks = interchange.mask(heads, keep, shape)
    with interchange.patch(masks, values):
        return model(**rows.inputs, use_cache=False).logits


def _selection_attention(spec: SIITSpec, patterns: Mapping[int, torch.Tensor], positions: Sequence[Sequence[int]],
                         missing: torch.Tensor, described: Sequence[Sequence[int]]) -> torch.Tensor:
    """The ID-selection attention loss: the selecting heads on the missing object's image token, the aggregation
    heads on the described objects' names (one mean over every head, row and position)."""
    gather = parse_heads(list(spec.aggregation_heads))
    parts = [attention_on_targets(patterns, spec.selecting_heads(), positions, missing)]
    if gather:
        parts.append(attention_on_targets(patterns, gather, positions, described))
    return -torch.log(torch.cat(parts).clamp_min(1e-9)).mean()


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[None]:
    """Eval mode and no gradients for the block; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def interchange_accuracy(model: Any, interchange: HeadInterchange, builder: BatchBuilder,
                         pairs: Sequence[CounterfactualPair], heads: Sequence[tuple[int, int]], *,
                         target: str = "counterfactual", positions: str = "aligned", batch_size: int = 32,
                         last_positions: str = "prompt", span_positions: str = "name") -> float:
    """Share of pairs whose base run, with ``heads`` interchanged from the source, gives ``target``'s answer on every
    answer token (``counterfactual``: interchange accuracy; ``clean``: the answer did not move, strictness).

    ``positions``: ``aligned`` (the pairs' patch positions) or ``all`` (every prompt position).
    """
    correct = []
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            batch = interchange_batch(builder, pairs[i : i + batch_size], target, last_positions, span_positions)
            where = batch.positions if positions == "aligned" else batch.prompt_mask
            logits = interchange_logits(model, interchange, batch, heads, where)
            correct += answer_correct(logits, batch.base.labels).tolist()
    return float(np.mean(correct)) if correct else float("nan")


def answer_changes(model: Any, interchange: HeadInterchange, builder: BatchBuilder, pairs: Sequence[CounterfactualPair],
                   heads: Sequence[tuple[int, int]], *, positions: str = "all", batch_size: int = 32) -> float:
    """Share of pairs whose answer changes when ``heads`` are interchanged from the source: any answer token's argmax
    differs from the unpatched run's (both teacher-forced with the clean answer). Strictness asks this to be ~0 for
    every head outside the alignment, whatever the model answers unpatched.

    ``positions``: ``all`` (every prompt position), ``aligned`` (the pairs' patch positions), or, to say where a
    head's effect enters, ``image`` (the image tokens), ``text`` (the prompt's other tokens) or ``last`` (the last
    prompt token).
    """
    return answer_changes_per_set(model, interchange, builder, pairs, [heads], positions=positions,
                                  batch_size=batch_size)[0]


def answer_changes_per_set(model: Any, interchange: HeadInterchange, builder: BatchBuilder,
                           pairs: Sequence[CounterfactualPair], head_sets: Sequence[Sequence[tuple[int, int]]], *,
                           positions: str = "all", batch_size: int = 32) -> list[float]:
    """:func:`answer_changes` of each head set, with one unpatched and one source run per batch for all of them (the
    same numbers as one call per set)."""
    if positions not in CHANGE_POSITIONS:
        raise TrainingError(f"positions must be one of {CHANGE_POSITIONS}, got {positions!r}")
    changed: list[list[bool]] = [[] for _ in head_sets]
    layers = sorted({l for heads in head_sets for l, _ in heads})
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            batch = interchange_batch(builder, pairs[i : i + batch_size], "clean")
            ids, where = batch.base.inputs["input_ids"], batch.prompt_mask
            if positions == "aligned":
                where = batch.positions
            elif positions in ("image", "text"):
                where = where & ((ids == builder.image_token_id) == (positions == "image"))
            elif positions == "last":
                last = last_prompt_index(where)
                where = torch.zeros_like(where)
                where[torch.arange(len(last)), last] = True
            plain = model(**batch.base.inputs, use_cache=False).logits[:, :-1].argmax(-1)
            with interchange.capture(layers):
                model(**batch.source.inputs, use_cache=False)
            values = interchange.stored
            answer = batch.base.labels[:, 1:] != IGNORE_INDEX
            for heads, out in zip(head_sets, changed):
                patched = patched_logits(model, interchange, batch, heads, where, values)
                out += ((plain != patched[:, :-1].argmax(-1)) & answer).any(1).tolist()
    return [float(np.mean(c)) if c else float("nan") for c in changed]


def unpatched_accuracy(model: Any, builder: BatchBuilder, pairs: Sequence[CounterfactualPair], *,
                       target: str = "counterfactual", batch_size: int = 32) -> float:
    """Share of pairs whose base run, unpatched, already gives ``target``'s answer: what an interchange accuracy must
    be read against (when the counterfactual answer can be guessed from the base alone, e.g. the one colour a scene
    does not use, a model can reach it without the source)."""
    correct = []
    with evaluating(model):
        for i in range(0, len(pairs), batch_size):
            batch = interchange_batch(builder, pairs[i : i + batch_size], target)
            correct += answer_correct(model(**batch.base.inputs, use_cache=False).logits, batch.base.labels).tolist()
    return float(np.mean(correct)) if correct else float("nan")
