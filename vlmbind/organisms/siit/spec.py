"""What SIIT plants and how hard: :class:`SIITSpec`, and the table of what each loss weight needs of the rest of the
spec (:data:`LOSS_NEEDS`), checked by one loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...core.errors import TrainingError
from ...core.sites import parse_heads
from ...stimuli.scenes import RECOLOURS, SWAPS

VARIABLES = ("id_retrieval", "id_selection", "feature_retrieval")
STRICT_POSITIONS = ("all", "aligned")
STRICT_SAMPLING = ("individual", "sample_all", "all")
SIIT_PARTS = ("iit", "strict")
ABLATION_STRICT_MODES = ("zero", "mean", "role_mean")
DEFAULT_ABLATION_MODES = ("zero", "mean")  # what the ablation losses drew before role_mean could be asked for
LAST_POSITIONS = ("answer", "prompt")
SPAN_POSITIONS = ("name", "last")
POSITION_READOUTS = ("trained", "fixed")
# random streams of SIIT: training pairs and evaluation pairs never share a seed (the mixture uses 0 and 1)
SIIT_STREAM, SIIT_EVAL_STREAM = 2, 3


@dataclass(frozen=True)
class LossNeeds:
    """What a loss needs of the rest of the spec when its weight is above 0.

    Attributes:
        reads: what the loss reads or does, as the error messages say it.
        variables: the aligned variables whose heads it reads.
        aggregation: it reads the aggregation heads (``aggregation_heads`` must list some).
        iit: it is computed in the IIT loss's runs (``iit_weight`` must be above 0).
        source_grad: it trains heads through the IIT loss's source run (``source_grad`` must be true).
        strict: it is computed in the strictness loss's run (``strict_weight`` must be above 0).
        after: another weight that must be above 0 (the loss reads that loss's run).
    """

    reads: str = ""
    variables: tuple[str, ...] = ()
    aggregation: bool = False
    iit: bool = False
    source_grad: bool = False
    strict: bool = False
    after: str | None = None


# loss -> what its weight (``{loss}_weight``) needs; a step adds the SIIT losses in this order (position last: it is
# computed in the behaviour run)
LOSS_NEEDS: dict[str, LossNeeds] = {
    "iit": LossNeeds(),
    "strict": LossNeeds(),
    "selection": LossNeeds("reads the id_selection heads in the IIT loss's source run", ("id_selection",),
                           iit=True, source_grad=True),
    "selection_attention": LossNeeds("trains the id_selection heads' attention in the IIT loss's source run",
                                     ("id_selection",), iit=True, source_grad=True),
    "retrieval_attention": LossNeeds("trains the id_retrieval heads' attention in the IIT loss's source run",
                                     ("id_retrieval",), iit=True, source_grad=True),
    "interchanged_selection": LossNeeds("trains the id_selection heads on the id_retrieval steps, in the IIT loss's "
                                        "interchanged run", ("id_retrieval", "id_selection"), iit=True),
    "strict_selection": LossNeeds("trains the id_selection heads in the strictness loss's run", ("id_selection",),
                                  strict=True),
    "retrieval_readout": LossNeeds("reads the id_retrieval heads in the IIT loss's source run", ("id_retrieval",),
                                   iit=True, source_grad=True),
    "gather_readout": LossNeeds("reads the aggregation heads in the IIT loss's source run", ("id_selection",),
                                aggregation=True, iit=True, source_grad=True),
    "gather_interchange": LossNeeds("interchanges the aggregation heads alone and reuses the IIT loss's source run",
                                    aggregation=True, iit=True),
    "gather_selection": LossNeeds("reads the selecting heads' attention in the gathering interchange's run",
                                  aggregation=True, iit=True, after="gather_interchange_weight"),
    "selecting_interchange": LossNeeds("interchanges the selecting heads apart from the aggregation heads and reuses "
                                       "the IIT loss's source run", aggregation=True, iit=True),
    "ablation_strict": LossNeeds(),
    "ablation_necessity": LossNeeds(),
    "position": LossNeeds(),
}
# the losses siit_losses computes, in the order a step adds them
SIIT_LOSSES = tuple(loss for loss in LOSS_NEEDS if loss != "position")


def _is_weight(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0


def _parse_heads(heads: Any, where: str) -> list[tuple[int, int]]:
    try:
        return parse_heads(list(heads))
    except Exception as exc:  # noqa: BLE001 - re-raised as a named training error
        raise TrainingError(f"siit.{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class SIITSpec:
    """What to plant and how hard (what each loss weight needs of the other fields: :data:`LOSS_NEEDS`).

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
            run (binary cross-entropy summed over the cells, this weight; needs ``source_grad``). A selection by the
            retrieved positions can only read what the gathering head carries, and an attention loss alone let the
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
            parsed = _parse_heads(heads, f"alignments[{variable!r}]")
            if not parsed:
                raise TrainingError(f"siit.alignments[{variable!r}] lists no heads")
            aligned[variable] = tuple(f"{l}.{h}" for l, h in parsed)
        object.__setattr__(self, "alignments", aligned)
        self._check_scenes()
        layer = self.position_layer
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < -1):
            raise TrainingError(f"siit.position_layer must be a layer index >= 0, -1 (the decoder's input) or None, "
                                f"got {self.position_layer!r}")
        aggregation = tuple(f"{l}.{h}" for l, h in _parse_heads(self.aggregation_heads, "aggregation_heads"))
        stray = [h for h in aggregation if h not in aligned.get("id_selection", ())]
        if stray:
            raise TrainingError(f"siit.aggregation_heads {stray} are not id_selection heads "
                                f"({list(aligned.get('id_selection', ()))}); list id_selection heads only")
        if aggregation and len(aggregation) == len(aligned["id_selection"]):
            raise TrainingError("siit.aggregation_heads lists every id_selection head; at least one must read the "
                                "missing object")
        object.__setattr__(self, "aggregation_heads", aggregation)
        for loss, needs in LOSS_NEEDS.items():
            self._check_weight(f"{loss}_weight", needs)
        k = self.ablation_strict_heads
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise TrainingError(f"siit.ablation_strict_heads must be an int >= 0 (0: as many as are aligned), "
                                f"got {k!r}")
        modes = self.ablation_strict_modes
        if isinstance(modes, str) or not modes or not all(m in ABLATION_STRICT_MODES for m in modes) \
                or len(set(modes)) != len(modes):
            raise TrainingError(f"siit.ablation_strict_modes must be distinct modes from {ABLATION_STRICT_MODES}, "
                                f"got {list(modes)!r}")
        for name, allowed in (("position_readout", POSITION_READOUTS), ("span_positions", SPAN_POSITIONS),
                              ("last_positions", LAST_POSITIONS), ("strict_positions", STRICT_POSITIONS),
                              ("strict_sampling", STRICT_SAMPLING)):
            if getattr(self, name) not in allowed:
                raise TrainingError(f"siit.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.single_loss, bool):
            raise TrainingError(f"siit.single_loss must be True or False, got {self.single_loss!r}")
        self._check_strict_head_weights()

    def _check_scenes(self) -> None:
        """The pairs' settings: how many per step, object counts, entropies, pools, swaps and recolourings."""
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

    def _check_weight(self, name: str, needs: LossNeeds) -> None:
        """A loss weight is a number >= 0; above 0, what its loss reads must be there (:data:`LOSS_NEEDS`)."""
        value = getattr(self, name)
        if not _is_weight(value):
            raise TrainingError(f"siit.{name} must be a number >= 0, got {value!r}")
        if not value > 0:
            return
        missing = [v for v in needs.variables if v not in self.alignments]
        if missing:
            align = "both variables" if len(needs.variables) > 1 else needs.variables[0]
            raise TrainingError(f"siit.{name} > 0 {needs.reads}, but {' and '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} not aligned; align {align} or set {name} "
                                "to 0")
        if needs.aggregation and not self.aggregation_heads:
            raise TrainingError(f"siit.{name} > 0 {needs.reads}; list the aggregation heads in "
                                "siit.aggregation_heads")
        if needs.iit and not self.iit_weight > 0:
            raise TrainingError(f"siit.{name} > 0 {needs.reads}; set iit_weight above 0")
        if needs.source_grad and not self.source_grad:
            raise TrainingError(f"siit.{name} > 0 {needs.reads}; set source_grad to true (its gradient flows "
                                "through the source run)")
        if needs.strict and not self.strict_weight > 0:
            raise TrainingError(f"siit.{name} > 0 {needs.reads}; set strict_weight above 0")
        if needs.after is not None and not getattr(self, needs.after) > 0:
            raise TrainingError(f"siit.{name} > 0 {needs.reads}; set siit.{needs.after} above 0")

    def _check_strict_head_weights(self) -> None:
        if self.strict_head_weights and self.strict_sampling != "individual":
            raise TrainingError(f"siit.strict_head_weights applies to strict_sampling 'individual' (one head a "
                                f"step), not {self.strict_sampling!r}; drop the weights or sample individually")
        if not isinstance(self.strict_head_weights, Mapping):
            raise TrainingError(f"siit.strict_head_weights must map 'layer.head' to a weight, got "
                                f"{self.strict_head_weights!r}")
        weights = {}
        for head, weight in dict(self.strict_head_weights).items():
            ((layer, index),) = _parse_heads([head], "strict_head_weights")
            name = f"{layer}.{index}"
            if any(name in heads for heads in self.alignments.values()):
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

    def weight(self, loss: str) -> float:
        """The weight of one of :data:`LOSS_NEEDS`' losses."""
        return getattr(self, f"{loss}_weight")

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

    # ---- a step's draws ---------------------------------------------------------------------------------------
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

    # ---- serialisation ----------------------------------------------------------------------------------------
    def _nonzero(self, *names: str) -> dict[str, Any]:
        """The named fields that are set (a config that does not use a field does not write it)."""
        return {name: getattr(self, name) for name in names if getattr(self, name)}

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
                **self._nonzero("selection_weight", "selection_attention_weight", "retrieval_attention_weight",
                                "interchanged_selection_weight", "strict_selection_weight",
                                "retrieval_readout_weight", "gather_readout_weight", "gather_interchange_weight",
                                "gather_selection_weight", "selecting_interchange_weight", "ablation_strict_weight",
                                "ablation_strict_heads"),
                **({"ablation_strict_modes": list(self.ablation_strict_modes)}
                   if tuple(self.ablation_strict_modes) != DEFAULT_ABLATION_MODES else {}),
                **self._nonzero("ablation_necessity_weight"),
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


def implied_edges(siit: Mapping[str, Any]) -> list[dict[str, str]]:
    """The head-to-head edges a planted VSM pipeline implies, from a SIIT config's ``alignments`` and
    ``aggregation_heads``, with the channel each is read through and the positions it joins:

    - ID retrieval -> gathering, through the value: the gathering heads are trained to attend from the last prompt
      token to the described names and to carry the cells the retrieval heads wrote there, so what they copy is the
      names' values;
    - gathering -> selecting, through the query: the selecting heads attend from the last token to the missing
      object's image token, and which object is missing depends on the gathered cells, so they must enter the query;
    - selecting -> feature retrieval, through the query: the feature heads attend to the image token at the selected
      cell, so the selected cell must enter their query.

    Empty unless all three stages are planted with at least one gathering head.
    """
    alignments = siit.get("alignments") or {}
    gather = list(siit.get("aggregation_heads") or [])
    retrieval, selection, features = (list(alignments.get(v) or []) for v in VARIABLES)
    selecting = [h for h in selection if h not in gather]
    if not (retrieval and gather and selecting and features):
        return []
    edges = [{"sender": r, "receiver": g, "channel": "v", "sender_at": "text", "receiver_at": "last"}
             for r in retrieval for g in gather]
    edges += [{"sender": g, "receiver": s, "channel": "q", "sender_at": "last", "receiver_at": "last"}
              for g in gather for s in selecting]
    edges += [{"sender": s, "receiver": f, "channel": "q", "sender_at": "last", "receiver_at": "last"}
              for s in selecting for f in features]
    return edges
