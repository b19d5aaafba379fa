"""Point-to-Answer search heads planted by SIIT (PbP's mechanism): at each point's steps, chosen heads attend to the
object being pointed at and carry its cell, and the point written follows them.

The high-level model: a Point-to-Answer trace writes ``(x, y)`` per object; the token that predicts x (`` (``) and
the one that predicts y (``,``) each read one variable, *the cell of the object pointed at now*, and the digits are
that cell's. The variable lives in the search heads' outputs at those two positions. A pair patches it:

* ``trace`` pairs (PbP's attention_swap condition): one counting trace, the heads' outputs at point k's two steps
  taken from point j's steps of the same run: point k must be written as point j;
* ``display`` pairs: two displays of one task and variant with the same prompt, the heads' outputs at point k's
  steps taken from the other display's point k: point k must be written as the source's.

Only the two coordinates of the patched point are scored in the IIT loss (what follows depends on how a trace goes
on, which the variable does not say). The strictness loss patches one unaligned head the same way and asks for the
base's whole answer. The attention loss asks the search heads, at every point's two steps of the source run, to put
their attention on the pointed object's image token at each step that writes one of the point's five tokens (the
token before `` (`` through y: the steps that emit `` (``, x, ``,``, y and ``)``, where tracking reads attention); the
readout loss asks a linear probe (trained beside the organism) to read the pointed cell from their outputs there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ...core.errors import TrainingError
from ...core.sites import parse_heads
from ..data import IGNORE_INDEX, BatchBuilder, TaskMixture, TrainingExample, answer_correct, answer_loss
from ..model import evaluating
from .interchange import HeadInterchange, patched_logits
from .pairs import step_rng
from .readouts import SelectionProbe

PAIR_KINDS = ("trace", "display")
POINT_PARTS = ("iit", "strict")
POINT_LOSSES = ("point_iit", "point_strict", "point_attention", "point_readout")
# random streams of the pointing pairs (the mixture uses 0 and 1, the scene SIIT 2 and 3)
POINT_STREAM, POINT_EVAL_STREAM = 4, 5
_TRIES = 200


@dataclass(frozen=True, kw_only=True)
class PointSIITSpec:
    """Which heads search, and how hard each loss weighs (the behaviour loss weighs 1).

    Attributes:
        heads: the search heads, ``["layer.head", ...]``.
        iit_weight: the interchange loss (the patched point's two coordinates).
        strict_weight: one unaligned head (drawn each step) patched the same way must leave the whole answer alone.
        attention_weight: the search heads' attention at every point's two steps on the pointed object's image token.
        readout_weight: a linear probe must read the pointed cell from the search heads' outputs there.
        pairs: pairs per step.
        trace_share: share of ``trace`` pairs (the rest are ``display`` pairs).
        strict_head_weights: unaligned head -> how often the strictness loss draws it (1 for a head not listed).
        position_layer: when set, the image tokens' residual stream after this decoder layer must give their cell
            through a linear probe (weight ``position_weight``): the heads can only copy a cell the tokens carry.
        position_weight: that loss's weight.
    """

    heads: tuple[str, ...]
    iit_weight: float = 1.0
    strict_weight: float = 1.0
    attention_weight: float = 1.0
    readout_weight: float = 1.0
    pairs: int = 8
    trace_share: float = 0.5
    strict_head_weights: Mapping[str, float] = field(default_factory=dict)
    position_layer: int | None = None
    position_weight: float = 1.0

    def __post_init__(self) -> None:
        heads = (self.heads,) if isinstance(self.heads, str) else tuple(self.heads or ())
        if not heads:
            raise TrainingError("point_siit.heads must name at least one search head, e.g. ['2.3']")
        parse_heads(list(heads))
        object.__setattr__(self, "heads", heads)
        for name in ("iit_weight", "strict_weight", "attention_weight", "readout_weight", "position_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise TrainingError(f"point_siit.{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.pairs, bool) or not isinstance(self.pairs, int) or self.pairs < 1:
            raise TrainingError(f"point_siit.pairs must be an int >= 1, got {self.pairs!r}")
        if isinstance(self.trace_share, bool) or not isinstance(self.trace_share, (int, float)) \
                or not 0 <= self.trace_share <= 1:
            raise TrainingError(f"point_siit.trace_share must be in [0, 1], got {self.trace_share!r}")
        object.__setattr__(self, "strict_head_weights", {str(k): float(v) for k, v in
                                                         dict(self.strict_head_weights).items()})
        if self.position_layer is not None and (isinstance(self.position_layer, bool)
                                                or not isinstance(self.position_layer, int)
                                                or self.position_layer < -1):
            raise TrainingError(f"point_siit.position_layer must be an int >= -1 or None, got {self.position_layer!r}")

    @classmethod
    def from_value(cls, value: Any) -> PointSIITSpec | None:
        if value is None or isinstance(value, PointSIITSpec):
            return value
        if not isinstance(value, Mapping):
            raise TrainingError(f"point_siit must be a mapping of PointSIITSpec fields or None, got {value!r}")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - names)
        if unknown:
            raise TrainingError(f"unknown point_siit field(s) {unknown}; fields: {', '.join(sorted(names))}")
        return cls(**dict(value))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["heads"] = list(self.heads)
        d["strict_head_weights"] = dict(self.strict_head_weights)
        return d

    @property
    def plants(self) -> bool:
        """Whether any loss trains the heads (with every such weight 0 the spec asks for the position code only, as
        a twin's run does)."""
        return max(self.iit_weight, self.strict_weight, self.attention_weight, self.readout_weight) > 0

    def planted(self) -> list[tuple[int, int]]:
        return parse_heads(list(self.heads))

    def check(self, layers: int, heads: int) -> None:
        """Raises TrainingError when a head (planted or weighted) is outside a ``layers x heads`` model."""
        for name in [*self.heads, *self.strict_head_weights]:
            layer, head = parse_heads([name])[0]
            if not (0 <= layer < layers and 0 <= head < heads):
                raise TrainingError(f"point_siit: head {name!r} is outside the model ({layers} layers x {heads} "
                                    f"heads)")
        if self.position_layer is not None and self.position_layer >= layers:
            raise TrainingError(f"point_siit.position_layer {self.position_layer} is outside the model's "
                                f"{layers} layers")

    def unaligned(self, layers: int, heads: int) -> list[tuple[int, int]]:
        planted = set(self.planted())
        return [(l, h) for l in range(layers) for h in range(heads) if (l, h) not in planted]

    def draw_unaligned(self, rng: np.random.Generator, layers: int, heads: int) -> tuple[int, int]:
        sample = self.unaligned(layers, heads)
        w = np.array([self.strict_head_weights.get(f"{l}.{h}", 1.0) for l, h in sample], dtype=np.float64)
        return sample[int(rng.choice(len(sample), p=w / w.sum()))]


# ----------------------------------------------------------------------------------------------------------------
# pairs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class PointPair:
    """A base and a source trace, and which of their points the pair patches.

    Attributes:
        kind: ``trace`` (source = base, another point) or ``display`` (another display, the same point).
        base, source: the examples (their answers are the traces, teacher-forced).
        point: the base's patched point (0-based).
        source_point: the source's point whose steps give the heads' outputs.
    """

    kind: str
    base: TrainingExample
    source: TrainingExample
    point: int
    source_point: int

    @property
    def counterfactual_point(self) -> tuple[int, int]:
        x, y = self.source.example.fields["points"][self.source_point]
        return int(x), int(y)


def _points(example: TrainingExample) -> list[list[int]]:
    return list(example.example.fields.get("points") or [])


def _draw_example(mixture: TaskMixture, rng: np.random.Generator, task: str, variant: str | None,
                  least: int) -> TrainingExample:
    spec = next(s for s in mixture.specs if s.task == task)
    for _ in range(_TRIES):
        v = variant if variant is not None else spec.variants[int(rng.integers(len(spec.variants)))]
        example = spec.generate(int(rng.integers(2**62)), v, mixture.regime, mixture.canvas)
        if len(example.fields.get("points") or []) >= least:
            return TrainingExample(example, task, v, example.answer)
    raise TrainingError(f"point_siit: no {task} display with {least} point(s) in {_TRIES} draws; give the task more "
                        f"objects (or a higher 'present' share)")


def point_tasks(mixture: TaskMixture) -> dict[str, int]:
    """The mixture's pointing tasks and the most points one display can have: ``{"search": n, "count": n}``."""
    if mixture.regime != "p2a":
        raise TrainingError("point_siit plants heads that point: train the Point-to-Answer regime (regime='p2a')")
    return {s.task: int(s.objects[1]) for s in mixture.specs if s.task in ("search", "count")}


def draw_point_pairs(spec: PointSIITSpec, mixture: TaskMixture, *, seed: int, stream: int, step: int,
                     n: int | None = None) -> list[PointPair]:
    """One step's pairs (a pure function of seed, stream and step)."""
    rng = step_rng(seed, stream, step)
    tasks = point_tasks(mixture)
    if not tasks:
        raise TrainingError("point_siit needs a 'search' or 'count' task in the mixture")
    traced = [t for t, most in tasks.items() if t == "count" and most >= 2]
    out = []
    for _ in range(n or spec.pairs):
        if traced and rng.random() < spec.trace_share:
            base = _draw_example(mixture, rng, "count", None, 2)
            k, j = rng.choice(len(_points(base)), size=2, replace=False)
            out.append(PointPair("trace", base, base, int(k), int(j)))
            continue
        task = sorted(tasks)[int(rng.integers(len(tasks)))]
        base = _draw_example(mixture, rng, task, None, 1)
        k = int(rng.integers(len(_points(base))))
        for _ in range(_TRIES):
            source = _draw_example(mixture, rng, task, base.variant, k + 1)
            if source.prompt == base.prompt and _points(source)[k] != _points(base)[k]:
                break
        else:
            raise TrainingError(f"point_siit: no {task} display whose point {k} differs in {_TRIES} draws")
        out.append(PointPair("display", base, source, k, k))
    return out


def evaluation_point_pairs(spec: PointSIITSpec, mixture: TaskMixture, *, seed: int, n: int) -> list[PointPair]:
    """``n`` fixed pairs from the evaluation stream (never a training step's)."""
    pairs: list[PointPair] = []
    step = 0
    while len(pairs) < n:
        pairs += draw_point_pairs(spec, mixture, seed=seed, stream=POINT_EVAL_STREAM, step=step,
                                  n=min(spec.pairs, n - len(pairs)))
        step += 1
    return pairs


# ----------------------------------------------------------------------------------------------------------------
# pairs -> rows
# ----------------------------------------------------------------------------------------------------------------
def point_steps(builder: BatchBuilder, labels: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, per point of its answer: ``(position predicting x, position predicting y)``: the `` (`` and ``,``
    tokens of ``(x, y)`` (labels hold the answer's token ids, -100 elsewhere).

    Raises:
        TrainingError: a point's tokens are not `` (``, x, ``,``, y, ``)`` (a tokenizer that splits points otherwise).
    """
    opening, comma = _point_tokens(builder)
    out = []
    for row in labels.tolist():
        steps = []
        for i, token in enumerate(row):
            if token == opening:
                if i + 4 >= len(row) or row[i + 2] != comma:
                    raise TrainingError("a point's tokens are not ' (', x, ',', y, ')'; point_siit reads x and y at "
                                        "fixed offsets")
                steps.append((i, i + 2))
        out.append(steps)
    return out


def _point_tokens(builder: BatchBuilder) -> tuple[int, int]:
    ids = builder._encode(" (0, 0)")
    if len(ids) != 5:
        raise TrainingError(f"' (0, 0)' is {len(ids)} tokens, not 5 (' (', x, ',', y, ')'); point_siit needs "
                            f"one token per coordinate")
    return int(ids[0]), int(ids[2])


@dataclass
class PointBatch:
    """The rows of a step's pairs.

    Attributes:
        base, source: :class:`~vlmbind.organisms.data.TrainBatch` es (each teacher-forced with its own trace).
        base_steps, source_steps: per row, the patched point's two predicting positions in the base row and the
            source point's in the source row.
        counterfactual: ``B P`` labels of the interchanged base run: the source point's two coordinate tokens at the
            base point's coordinate positions, -100 elsewhere.
        steps: per source row, every point's emitting positions (the five that write its tokens) and the pointed
            cell (raster index).
    """

    base: Any
    source: Any
    base_steps: list[tuple[int, int]]
    source_steps: list[tuple[int, int]]
    counterfactual: torch.Tensor
    steps: list[list[tuple[tuple[int, ...], int]]]

    def where(self) -> torch.Tensor:
        mask = torch.zeros(self.base.labels.shape, dtype=torch.bool)
        for r, (px, py) in enumerate(self.base_steps):
            mask[r, [px, py]] = True
        return mask

    def values(self, stored: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Per layer, the source run's outputs moved to the base rows' patch positions (``B P H*D``, zero
        elsewhere; kept in the graph)."""
        rows = torch.tensor([r for r in range(len(self.base_steps)) for _ in range(2)])
        to = torch.tensor([q for pair in self.base_steps for q in pair])
        frm = torch.tensor([q for pair in self.source_steps for q in pair])
        p = self.base.labels.shape[1]
        out = {}
        for layer, z in stored.items():
            values = z.new_zeros((z.shape[0], p, z.shape[2]))
            out[layer] = values.index_put((rows, to), z[rows, frm])
        return out


def point_batch(builder: BatchBuilder, pairs: Sequence[PointPair], grid: int) -> PointBatch:
    """Rows for ``pairs``."""
    base = builder([p.base for p in pairs])
    source = builder([p.source for p in pairs])
    base_all, source_all = point_steps(builder, base.labels), point_steps(builder, source.labels)
    counterfactual = torch.full_like(base.labels, IGNORE_INDEX)
    base_steps, source_steps, steps = [], [], []
    for r, p in enumerate(pairs):
        if len(base_all[r]) != len(_points(p.base)) or len(source_all[r]) != len(_points(p.source)):
            raise TrainingError(f"row {r}: the answer's point tokens do not match its {len(_points(p.base))} points")
        bx, by = base_all[r][p.point]
        sx, sy = source_all[r][p.source_point]
        base_steps.append((bx, by))
        source_steps.append((sx, sy))
        counterfactual[r, bx + 1] = source.labels[r, sx + 1]
        counterfactual[r, by + 1] = source.labels[r, sy + 1]
        steps.append([(tuple(range(qx - 1, qy + 2)), int(y) * grid + int(x))
                      for (qx, qy), (x, y) in zip(source_all[r], _points(p.source))])
    return PointBatch(base, source, base_steps, source_steps, counterfactual, steps)


def _image_positions(input_ids: torch.Tensor, image_token_id: int) -> list[torch.Tensor]:
    return [torch.nonzero(row == image_token_id).flatten() for row in input_ids]


def pointed_attention(patterns: Mapping[int, torch.Tensor], heads: Sequence[tuple[int, int]], batch: PointBatch,
                      image_token_id: int) -> torch.Tensor:
    """The heads' attention on the pointed object's image token at every point's emitting steps of the source rows
    (one value per head, row, point and step)."""
    images = _image_positions(batch.source.inputs["input_ids"], image_token_id)
    values = []
    for layer, head in heads:
        for r, row_steps in enumerate(batch.steps):
            if not row_steps:
                continue
            queries = [q for emitting, _ in row_steps for q in emitting]
            keys = [int(images[r][cell]) for emitting, cell in row_steps for _ in emitting]
            values.append(patterns[layer][r, head, queries, keys])
    return torch.cat(values)


def _readout_positions(batch: PointBatch) -> tuple[list[list[int]], torch.Tensor]:
    """Per source row, every point's emitting steps, and the pointed cell of each (flattened in the same order)."""
    positions = [[q for emitting, _ in row for q in emitting] for row in batch.steps]
    cells = torch.tensor([cell for row in batch.steps for emitting, cell in row for _ in emitting], dtype=torch.long)
    return positions, cells


class PointProbe(SelectionProbe):
    """A linear readout of the pointed object's cell from the search heads' outputs (every step of every point),
    trained beside the organism (never part of it)."""

    def loss_at(self, stored: Mapping[int, torch.Tensor], batch: PointBatch) -> torch.Tensor:
        positions, cells = _readout_positions(batch)
        logits = self.linear(self.features(stored, positions))
        return torch.nn.functional.cross_entropy(logits, cells.to(logits.device))

    def accuracy_at(self, stored: Mapping[int, torch.Tensor], batch: PointBatch) -> float:
        positions, cells = _readout_positions(batch)
        with torch.no_grad():
            pred = self.linear(self.features(stored, positions)).argmax(-1)
        return float((pred == cells.to(pred.device)).float().mean())


# ----------------------------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------------------------
def point_losses(model: Any, interchange: HeadInterchange, builder: BatchBuilder, spec: PointSIITSpec,
                 mixture: TaskMixture, *, seed: int, step: int, loss_norm: str = "example",
                 parts: Sequence[str] = POINT_PARTS, probe: PointProbe | None = None) -> dict[str, Any]:
    """The step's pointing losses of ``parts`` (``iit``: the interchange, attention and readout losses, computed
    in its source run; ``strict``: one unaligned head), each None where not computed, and ``strict_head``."""
    out: dict[str, Any] = dict.fromkeys(POINT_LOSSES)
    out["strict_head"] = None
    if not spec.plants:  # the position code alone (a twin's): no pair to draw
        return out
    pairs = draw_point_pairs(spec, mixture, seed=seed, stream=POINT_STREAM, step=step)
    batch = point_batch(builder, pairs, mixture.canvas.shape[1])
    a = interchange.adapter
    planted = spec.planted()
    rng = step_rng(seed, POINT_STREAM, 1_000_000 + step)
    strict_head = spec.draw_unaligned(rng, a.n_layers, a.n_heads)
    if "iit" in parts and (spec.iit_weight > 0 or spec.attention_weight > 0 or spec.readout_weight > 0):
        layers = sorted({l for l, _ in planted})
        attend = spec.attention_weight > 0
        with interchange.capture(layers, grad=True, patterns=attend):
            model(**batch.source.inputs, use_cache=False)
        stored = interchange.stored
        if attend:
            on = pointed_attention(interchange.patterns, planted, batch, builder.image_token_id)
            out["point_attention"] = -torch.log(on.clamp_min(1e-9)).mean()
        if probe is not None and spec.readout_weight > 0:
            out["point_readout"] = probe.loss_at(stored, batch)
        if spec.iit_weight > 0:
            logits = patched_logits(model, interchange, batch, planted, batch.where(), batch.values(stored))
            out["point_iit"] = answer_loss(logits, batch.counterfactual, loss_norm)
    if "strict" in parts and spec.strict_weight > 0:
        out["strict_head"] = f"{strict_head[0]}.{strict_head[1]}"
        with torch.no_grad(), interchange.capture([strict_head[0]]):
            model(**batch.source.inputs, use_cache=False)
        logits = patched_logits(model, interchange, batch, [strict_head], batch.where(),
                                batch.values(interchange.stored))
        out["point_strict"] = answer_loss(logits, batch.base.labels, loss_norm)
    return out


# ----------------------------------------------------------------------------------------------------------------
# measures on fixed pairs
# ----------------------------------------------------------------------------------------------------------------
def _chunks(pairs: Sequence[PointPair], size: int) -> list[Sequence[PointPair]]:
    return [pairs[i : i + size] for i in range(0, len(pairs), size)]


def point_interchange(model: Any, interchange: HeadInterchange, builder: BatchBuilder, pairs: Sequence[PointPair],
                      heads: Sequence[tuple[int, int]], grid: int, *, batch_size: int = 32) -> dict[str, Any]:
    """With ``heads`` patched from the source at the base point's two steps: per pair, whether the base wrote the
    source's point (both coordinates, ``moved``) and whether any answer token's argmax differs from the unpatched
    run's (``changed``; both teacher-forced with the base's trace)."""
    moved, changed = [], []
    layers = sorted({l for l, _ in heads})
    with evaluating(model):
        for chunk in _chunks(pairs, batch_size):
            batch = point_batch(builder, chunk, grid)
            with interchange.capture(layers):
                model(**batch.source.inputs, use_cache=False)
            logits = patched_logits(model, interchange, batch, heads, batch.where(), batch.values(interchange.stored))
            clean = model(**batch.base.inputs, use_cache=False).logits
            answer = batch.base.labels[:, 1:] != IGNORE_INDEX
            differs = (logits[:, :-1].argmax(-1) != clean[:, :-1].argmax(-1)) & answer
            moved += answer_correct(logits, batch.counterfactual).tolist()
            changed += differs.any(1).tolist()
    return {"moved": moved, "changed": changed}


def pointed_attention_mean(model: Any, interchange: HeadInterchange, builder: BatchBuilder,
                           pairs: Sequence[PointPair], heads: Sequence[tuple[int, int]], grid: int,
                           probe: PointProbe | None = None, *, batch_size: int = 32) -> dict[str, float]:
    """The heads' mean attention on the pointed object at every point's steps of the pairs' source rows, and the
    readout's accuracy there (where one is trained)."""
    on, accuracy = [], []
    layers = sorted({l for l, _ in heads})
    with evaluating(model):
        for chunk in _chunks(pairs, batch_size):
            batch = point_batch(builder, chunk, grid)
            with interchange.capture(layers, patterns=True):
                model(**batch.source.inputs, use_cache=False)
            on.append(pointed_attention(interchange.patterns, heads, batch, builder.image_token_id))
            if probe is not None:
                accuracy.append(probe.accuracy_at(interchange.stored, batch))
    out = {"attention_on_pointed": float(torch.cat(on).mean())}
    if probe is not None:
        out["readout_accuracy"] = float(np.mean(accuracy))
    return out
