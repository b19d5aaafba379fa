"""Attention steering: redirect chosen heads' attention to an object, a grid cell or a pixel box of the image and see
whether the answer follows (``vb.steer``, ``vlmbind steer``), beside the same push on random heads, and each head's
gaze.

Design: steering is :class:`~vlmbind.engine.interventions.SteerAttention` on every chosen head (the scores of every
key outside the target's image tokens set to the lowest value before the softmax, so the head's attention is
renormalised over the target), at the prompt's last position (``positions="last"``) or also at every answer position
(``"answer"``, the default on a model vlmbind trained, whose planted heads act there too). Answers are decoded
greedily by full forwards (:func:`~vlmbind.engine.decoding.greedy_decode`), so the steered positions are absolute in
every step. The unsteered arm runs the same forwards with the heads steered to every key (the identity, exactly:
:attr:`SteerResult.identity_exact` checks it against a forward with no edit), so every arm uses one attention kernel.

``efficacy`` is the share of scenes whose answer names the object steered to (colour and shape, scored like the scene
task), over the scenes whose target is an object other than the one the answer should name (steering towards the
answer itself proves nothing; those scenes are counted in ``n_target_is_answer``). ``random_heads_efficacy`` is the
same push on ``n_random`` draws of as many heads, drawn uniformly from the other heads with softmax attention, pooled
over the draws (its Wilson interval treats the draws' scenes as independent, which they are not quite: the same
scenes recur in every draw). The gaze of a head is the share of its image attention, at the last prompt token of the
unsteered forward, on the image tokens of the object the answer names, beside chance (that object's share of the
image tokens).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.checks import check_head_list, check_steer_target
from ..core.choices import STEER_TASKS
from ..core.errors import InputError
from ..core.io import write_json_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..engine.decoding import greedy_decode
from ..engine.hooks import LastQuerySession
from ..engine.interventions import SteerAttention
from ..stimuli import scene_description
from ..stimuli.points import parse_points, point_spans
from ..stimuli.scenes import DEFAULT_CANVAS
from ..viz import write_html_atomic
from ..viz.steering import gaze_figure, steering_figure
from .ablation import wilson_interval
from .edits import answer_budget, edit_positions
from .evaluation import score, training_defaults
from .position_ids import chunks
from .tracking import tracking_dataset

TARGET_STREAM = 13  # the described object drawn per scene
RANDOM_HEADS_STREAM = 14  # the random-heads control's own draws
ARMS = ("steered", "random_heads", "clean")
POINT_TASKS = tuple(t for t in STEER_TASKS if t != "scene")


# ------------------------------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SteeringTarget:
    """Where one scene's heads are sent: the object there (None: no object) and the box whose image tokens they
    attend to."""

    obj: int | None
    box: tuple[float, float, float, float]


def scene_targets(examples: list[Any], to: Any, canvas: Any, seed: int) -> list[SteeringTarget | None]:
    """Per scene, the target of ``to`` (None where the scene has none: no object K, no distractor).

    ``described`` draws uniformly among the objects the prompt names, ``distractor`` among the objects other than
    the one the answer names or points at first (seeded by ``seed``); ``cell`` and ``box`` take the object whose
    centre lies inside the region (the one nearest the region's centre when several do).
    """
    kind, arg = check_steer_target(to)
    rng = np.random.default_rng([seed, TARGET_STREAM])
    out: list[SteeringTarget | None] = []
    for example in examples:
        objects = example.objects
        if kind in ("described", "distractor"):
            answer = answer_object(example)
            pool = ([i for i, o in enumerate(objects) if o.name in example.prompt] if kind == "described"
                    else [i for i in range(len(objects)) if i != answer])
            if not pool and kind == "distractor":  # a scene holding the answer's object alone has none
                out.append(None)
                continue
            if not pool:
                raise InputError(f"scene {example.id!r}: its prompt names no object; steer to object:K, cell:R,C or "
                                 "box:X0,Y0,X1,Y1 instead")
            k = pool[int(rng.integers(len(pool)))]
            out.append(SteeringTarget(k, tuple(float(v) for v in objects[k].box)))
        elif kind == "object":
            out.append(SteeringTarget(arg, tuple(float(v) for v in objects[arg].box)) if arg < len(objects) else None)
        else:
            if kind == "cell":
                rows, cols = canvas.shape
                if not (arg[0] < rows and arg[1] < cols):
                    raise InputError(f"cell {arg[0]},{arg[1]} is outside the stimulus grid of {rows} x {cols} cells "
                                     f"(0-based)")
                box = tuple(float(v) for v in canvas.cell_box(*arg))
            else:
                box = tuple(float(v) for v in arg)
            out.append(SteeringTarget(_object_in(objects, box), box))
    return out


def _object_in(objects: list[Any], box: tuple[float, float, float, float]) -> int | None:
    x0, y0, x1, y1 = box
    inside = [i for i, o in enumerate(objects) if x0 <= o.x < x1 and y0 <= o.y < y1]
    if not inside:
        return None
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    return min(inside, key=lambda i: (objects[i].x - cx) ** 2 + (objects[i].y - cy) ** 2)


def first_point(text: str) -> tuple[int, int] | None:
    """The first ``(x, y)`` grid point written in ``text`` (None: none)."""
    points = parse_points(text)
    return (round(points[0][0]), round(points[0][1])) if points else None


def answer_object(example: Any) -> int | None:
    """The object the expected answer is about: the scene's missing object or the queried one
    (``fields["target"]``), or on a Point-to-Answer task the object at the first point (x = column, y = row)."""
    if example.fields.get("target") is not None:
        return int(example.fields["target"])
    point = first_point(example.answer)
    if point is None:
        return None
    return next((i for i, o in enumerate(example.objects) if (o.col, o.row) == point), None)


def target_keys(vlm: Any, index: Any, box: tuple[float, float, float, float]) -> np.ndarray:
    """The keys a head attends to when steered to ``box``: the image tokens covering it (the cross-attention image
    keys on a family whose image never enters the sequence)."""
    if vlm.adapter.image_tokens_in_sequence:
        return index.positions_covering(box)
    return index.keys_covering(box)


def _steerable_heads(vlm: Any) -> list[tuple[int, int]]:
    a = vlm.adapter
    layers = a.cross_attention_layers() if not a.image_tokens_in_sequence else a.pattern_layers()
    return [(layer, h) for layer in layers for h in range(vlm.n_heads)]


def random_head_sets(vlm: Any, heads: list[tuple[int, int]], n_random: int, seed: int) -> list[list[tuple[int, int]]]:
    """``n_random`` sets of ``len(heads)`` heads drawn uniformly, without replacement, from the steerable heads
    outside ``heads``."""
    pool = [h for h in _steerable_heads(vlm) if h not in set(heads)]
    if len(pool) < len(heads):
        raise InputError(f"the model has {len(pool)} other heads to steer, fewer than the {len(heads)} chosen; "
                         "use --random-draws 0")
    rng = np.random.default_rng([seed, RANDOM_HEADS_STREAM])
    return [sorted(pool[int(i)] for i in rng.choice(len(pool), size=len(heads), replace=False))
            for _ in range(n_random)]


def steer_interventions(heads: list[tuple[int, int]], keys: list[np.ndarray], queries: Any) -> list[SteerAttention]:
    """One :class:`SteerAttention` per layer of ``heads``, every row steered to its ``keys`` at ``queries``."""
    by_layer: dict[int, list[int]] = {}
    for layer, h in heads:
        by_layer.setdefault(layer, []).append(h)
    return [SteerAttention(layer=layer, heads=hs, keys=keys, query_positions=queries)
            for layer, hs in sorted(by_layer.items())]


# ------------------------------------------------------------------------------------------------------------------
# The result
# ------------------------------------------------------------------------------------------------------------------
@register_result
@dataclass(kw_only=True)
class SteerResult(Result):
    """Attention steering of ``heads`` towards ``to``, with the random-heads control and every head's gaze.

    Attributes:
        model: the model's name.
        heads: the steered heads (``"layer.head"``).
        to: the target as given (``described``, ``object:K``, ``cell:R,C``, ``box:...``).
        positions: ``last`` or ``answer``: where the heads were steered.
        task: ``scene`` (outcomes by the object the answer names) or ``search`` / ``count`` (by its first point).
        seed: stimulus, target and random-heads seed.
        records: one row per scene and arm (``arm``, ``draw``, ``heads``, ``example``, ``target``, ``target_name``,
            ``answer_name``, ``output``, ``outcome``: ``target`` / ``original`` / ``other``, ``counted``).
        gaze: per head (``layer``, ``head``, ``gaze``, ``chance``, ``n``).
        identity_exact: steering every head to every key gave the unedited logits bit for bit.
        random_heads: the random head sets, one per draw.
        seconds: wall time.
    """

    kind = "steer"
    marker_files = ("steering.csv", "gaze.csv")
    reproduced_files = ("steering.csv", "gaze.csv", "arms.csv", "summary.json")
    figure_name = "steering"

    model: str
    heads: list[str]
    to: str
    positions: str
    seed: int
    records: pd.DataFrame
    gaze: pd.DataFrame
    identity_exact: bool
    task: str = "scene"
    random_heads: list[list[str]] = field(default_factory=list)
    seconds: float = 0.0

    def arms_frame(self) -> pd.DataFrame:
        """Per arm: ``n`` counted scenes, ``efficacy`` (names the object steered to) and ``original`` (names the
        original answer) with 95% Wilson intervals."""
        rows = []
        for arm in ARMS:
            part = self.records[(self.records["arm"] == arm) & self.records["counted"].astype(bool)]
            if not len(part) and arm == "random_heads":
                continue
            n = len(part)
            row: dict[str, Any] = {"arm": arm, "n": n}
            for column, outcome in (("efficacy", "target"), ("original", "original")):
                share = float((part["outcome"] == outcome).mean()) if n else float("nan")
                low, high = wilson_interval(share, n) if n else (float("nan"), float("nan"))
                row.update({column: share, f"{column}_low": low, f"{column}_high": high})
            rows.append(row)
        return pd.DataFrame(rows)

    def efficacy(self, arm: str = "steered") -> float:
        arms = self.arms_frame().set_index("arm")
        return float(arms.loc[arm, "efficacy"]) if arm in arms.index else float("nan")

    def summary(self) -> dict[str, Any]:
        arms = self.arms_frame().set_index("arm")
        scenes = self.records[self.records["arm"] == "steered"]

        def arm(name: str) -> dict[str, Any]:
            if name not in arms.index:
                return {}
            r = arms.loc[name]
            return {"n": int(r["n"]), "efficacy": float(r["efficacy"]),
                    "efficacy_interval": [float(r["efficacy_low"]), float(r["efficacy_high"])],
                    "original": float(r["original"])}

        steered, random_heads, clean = arm("steered"), arm("random_heads"), arm("clean")
        return {
            "kind": self.kind, "model": self.model, "task": self.task, "heads": self.heads, "to": self.to,
            "positions": self.positions,
            "seed": self.seed, "n_scenes": len(scenes), "n_counted": steered.get("n", 0),
            "n_without_target": int(scenes["target"].isna().sum()),
            "n_target_is_answer": int((scenes["target_name"] == scenes["answer_name"]).sum()),
            "efficacy": steered.get("efficacy"), "efficacy_interval": steered.get("efficacy_interval"),
            "steered_original": steered.get("original"),
            "random_heads_efficacy": random_heads.get("efficacy"),
            "random_heads_efficacy_interval": random_heads.get("efficacy_interval"),
            "random_heads_n": random_heads.get("n", 0), "random_heads": self.random_heads,
            "clean_efficacy": clean.get("efficacy"), "clean_accuracy": clean.get("original"),
            "identity_exact": bool(self.identity_exact), "seconds": round(float(self.seconds), 3),
        }

    def to_frame(self) -> pd.DataFrame:
        return self.arms_frame()

    def figure(self) -> Any:
        return steering_figure(self.arms_frame(), model=self.model, heads=self.heads, to=self.to,
                               positions=self.positions)

    def gaze_figure(self) -> Any:
        n = int(self.gaze["n"].max()) if len(self.gaze) else 0
        return gaze_figure(self.gaze, model=self.model, n=n)

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        return ({"steering": self.figure, "gaze": self.gaze_figure},
                {"arms.csv": self.arms_frame(), "steering.csv": self.records, "gaze.csv": self.gaze})

    def save(self, out: str | os.PathLike, figure: bool = True) -> Path:
        """The tables, ``summary.json`` and (``figure``) the two pages; ``vlmbind export`` draws them later."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        figures, tables = self.exports()
        for name, frame in tables.items():
            write_text_atomic(frame.to_csv(index=False), out / name)
        write_json_atomic({**self.summary(), "seconds": float(self.seconds)}, out / "summary.json")
        for stem, build in figures.items() if figure else ():
            write_html_atomic(build(), out / f"{stem}.html")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> SteerResult:
        directory = Path(directory)
        summary = read_json_object(directory / "summary.json")
        require_keys(summary, ("model", "heads", "to", "positions", "seed", "identity_exact"),
                     directory / "summary.json")
        records = read_csv_columns(directory / "steering.csv", RECORD_COLUMNS)
        gaze = read_csv_columns(directory / "gaze.csv", ("layer", "head", "gaze", "chance", "n"))
        return cls(model=summary["model"], heads=list(summary["heads"]), to=summary["to"],
                   positions=summary["positions"], seed=int(summary["seed"]), records=records, gaze=gaze,
                   identity_exact=bool(summary["identity_exact"]), task=summary.get("task", "scene"),
                   random_heads=summary.get("random_heads", []),
                   seconds=float(summary.get("seconds", 0.0)))


RECORD_COLUMNS = ("arm", "draw", "heads", "example", "target", "target_name", "answer_name", "output", "outcome",
                  "counted")


# ------------------------------------------------------------------------------------------------------------------
# The experiment
# ------------------------------------------------------------------------------------------------------------------
def steer(vlm: Any, heads: Any, to: str | None = None, *, task: str = "scene", n: int = 64, seed: int = 1000,
          n_objects: Any = None, positions: str | None = None, n_random: int = 5, batch_size: int = 32,
          examples: list[Any] | None = None, progress: bool = False) -> SteerResult:
    """Steer ``heads`` to a target in every scene and count the answers that name it (or point at it first), beside
    random heads.

    Scenes are VSM's scene description (``task="scene"``: ``in this image there is a red square , a blue circle and
    a`` -> the missing object) or a Point-to-Answer task (``search``, ``count``: the answer points at objects before
    it answers, ``(2, 5) yes``; the outcome is the first point written), drawn with the model's own training canvas
    and pools, or ``examples`` (examples of your own of that task, with their objects).

    Args:
        vlm: a loaded VLM.
        heads: ``[(layer, head), ...]`` or ``"3.1,5.2"``; heads with softmax attention (cross-attention heads on a
            family whose image never enters the sequence).
        to: ``described`` (a uniformly drawn object the prompt names; the default on ``scene``), ``distractor`` (one
            the answer is not about, or does not point at first; the default on the Point-to-Answer tasks),
            ``object:K``, ``cell:ROW,COL`` or ``box:X0,Y0,X1,Y1`` (pixels).
        task: ``scene``, ``search`` or ``count``.
        n: scenes drawn (ignored with ``examples``).
        seed: stimulus, target and random-heads seed.
        n_objects: objects per scene (int or inclusive range; None: the model's training range, else 3).
        positions: ``last`` (the prompt's last position) or ``answer`` (also every answer position); None:
            ``answer`` on a model vlmbind trained, else ``last``.
        n_random: draws of random heads for the control (0: none).
        batch_size: scenes per forward.
        examples: scene-description examples to use instead of drawing them.
        progress: show a progress bar.

    Returns:
        :class:`SteerResult`.

    Raises:
        InputError: bad heads, target, positions or sizes, or scenes the target cannot be laid on.
    """
    start = time.perf_counter()
    if task not in STEER_TASKS:
        raise InputError(f"task must be one of {', '.join(STEER_TASKS)} (answers that name or point at an object), "
                         f"got {task!r}")
    points = task in POINT_TASKS
    to = to or ("distractor" if points else "described")
    head_list = check_head_list(heads, n_layers=vlm.n_layers, n_heads=vlm.n_heads)
    kind, _ = check_steer_target(to)
    if points and kind == "described":
        raise InputError(f"a {task} prompt names no object to steer to: use distractor, object:K, cell:R,C or box:...")
    positions = edit_positions(vlm, positions)
    if n_random < 0 or batch_size < 1 or n < 1:
        raise InputError(f"n ({n}) and batch_size ({batch_size}) must be positive and n_random ({n_random}) >= 0")
    steerable = set(_steerable_heads(vlm))
    outside = [f"{l}.{h}" for l, h in head_list if (l, h) not in steerable]
    if outside:
        where = ("cross-attention layers" if not vlm.adapter.image_tokens_in_sequence
                 else "layers with softmax attention")
        raise InputError(f"heads {', '.join(outside)} cannot be steered to the image: steer heads of the {where}")
    if points:
        kwargs = training_defaults(vlm, task, {})
        if examples is None:
            examples = list(tracking_dataset(vlm, task, n, seed, objects=n_objects).examples)
    else:
        kwargs = training_defaults(vlm, "scene", {} if n_objects is None else {"n_objects": n_objects})
        kwargs.setdefault("n_objects", 3)
        if examples is None:
            examples = list(scene_description(n, seed, **kwargs).examples)
    canvas = kwargs.get("canvas", DEFAULT_CANVAS)  # the canvas the stimuli are drawn on
    targets = scene_targets(examples, to, canvas, seed)
    sets = random_head_sets(vlm, head_list, n_random, seed)
    labels = [f"{l}.{h}" for l, h in head_list]
    rows: list[dict[str, Any]] = []
    gaze_sum = np.zeros((vlm.n_layers, vlm.n_heads))
    chance_sum, n_gaze = 0.0, 0
    identity_exact = True
    bar = tqdm(total=len(examples), desc="steer", disable=not progress)
    for chunk_i, chunk in enumerate(chunks(list(range(len(examples))), batch_size)):
        chunk_examples = [examples[i] for i in chunk]
        batch = vlm.prepare([e.image for e in chunk_examples], [e.prompt for e in chunk_examples])
        budget = point_budget(vlm, chunk_examples) if points else answer_budget(vlm, chunk_examples)
        keys = []
        for i, ti in zip(chunk, batch.index):
            target = targets[i]
            k = target_keys(vlm, ti, target.box) if target is not None else np.zeros(0, dtype=int)
            if target is not None and not len(k):
                raise InputError(f"scene {examples[i].id!r}: no image token covers the target box {target.box}")
            keys.append(k)
        usable = [j for j, k in enumerate(keys) if len(k)]
        every = np.arange(batch.seq_len)
        last = torch.as_tensor(batch.last_positions, dtype=torch.long)[:, None]
        decode = partial(steered_decode, vlm, batch, budget, last=last, positions=positions)  # (heads, keys)
        identity = [every] * len(batch)
        if chunk_i == 0:
            identity_exact = _identity_is_exact(vlm, batch, head_list, identity, last)
        arms: list[tuple[str, int, list[tuple[int, int]], list[str]]] = [("clean", -1, head_list,
                                                                          decode(head_list, identity))]
        steered_keys = [k if len(k) else every for k in keys]  # scenes without a target run unsteered
        arms.append(("steered", -1, head_list, decode(head_list, steered_keys)))
        for d, head_set in enumerate(sets):
            arms.append(("random_heads", d, head_set, decode(head_set, steered_keys)))
        for arm, draw, head_set, outputs in arms:
            for j, i in enumerate(chunk):
                rows.append(_record(examples[i], targets[i], outputs[j], arm, draw, head_set, j in usable, points))
        g, chance, m = _gaze(vlm, batch, chunk_examples)
        gaze_sum += g
        chance_sum += chance
        n_gaze += m
        bar.update(len(chunk))
    bar.close()
    layers = sorted({layer for layer, _ in _steerable_heads(vlm)})
    gaze = pd.DataFrame([{"layer": layer, "head": h, "gaze": gaze_sum[layer, h] / max(n_gaze, 1),
                          "chance": chance_sum / max(n_gaze, 1), "n": n_gaze}
                         for layer in layers for h in range(vlm.n_heads)])
    return SteerResult(model=vlm.name, task=task, heads=labels, to=str(to), positions=positions, seed=seed,
                       records=pd.DataFrame(rows, columns=list(RECORD_COLUMNS)), gaze=gaze,
                       identity_exact=identity_exact,
                       random_heads=[[f"{l}.{h}" for l, h in s] for s in sets],
                       seconds=time.perf_counter() - start)


def steered_decode(vlm: Any, batch: Any, budget: int, heads: list[tuple[int, int]], keys: list[np.ndarray],
                   last: torch.Tensor, positions: str) -> list[str]:
    """Greedy answers with ``heads`` steered to each row's ``keys`` at the prompt's last position (``last``, ``B 1``)
    and, with ``positions="answer"``, at every answer position already generated."""
    def queries(step: int) -> torch.Tensor:
        return last if positions == "last" else last + torch.arange(step + 1)[None]

    return greedy_decode(vlm, batch, (), budget,
                         step_interventions=lambda step: steer_interventions(heads, keys, queries(step)))


def point_budget(vlm: Any, examples: list[Any]) -> int:
    """Tokens enough to write the longest first point of the expected answers, plus one."""
    tok = vlm.adapter.tokenizer
    spans = [point_spans(e.answer) for e in examples]
    texts = [e.answer[: s[0][1]] for e, s in zip(examples, spans) if s] or ["(0, 0)"]
    return max(len(tok(" " + t, add_special_tokens=False)["input_ids"]) for t in texts) + 1


def _record(example: Any, target: SteeringTarget | None, output: str, arm: str, draw: int,
            head_set: list[tuple[int, int]], has_keys: bool, points: bool) -> dict[str, Any]:
    """One scene's outcome: ``target`` (the answer names, or first points at, the object steered to), ``original``
    (it gives the expected answer, or first point) or ``other``. On a Point-to-Answer task the names are points."""
    obj = None if target is None else target.obj
    if points:
        target_name = None if obj is None else f"({example.objects[obj].col}, {example.objects[obj].row})"
        expected, written = first_point(example.answer), first_point(output)
        answer_name = None if expected is None else f"({expected[0]}, {expected[1]})"
        hit = written is not None and f"({written[0]}, {written[1]})" == target_name
        outcome = "target" if hit else "original" if written is not None and written == expected else "other"
    else:
        target_name = None if obj is None else example.objects[obj].name
        answer = answer_object(example)
        answer_name = example.objects[answer].name if answer is not None else example.answer
        if target_name is not None and score(replace(example, answer=target_name), output)[0]:
            outcome = "target"
        else:
            outcome = "original" if score(example, output)[0] else "other"
    counted = has_keys and target_name is not None and target_name != answer_name
    return {"arm": arm, "draw": draw, "heads": ",".join(f"{l}.{h}" for l, h in head_set), "example": example.id,
            "target": obj, "target_name": target_name, "answer_name": answer_name, "output": output,
            "outcome": outcome, "counted": bool(counted)}


def _identity_is_exact(vlm: Any, batch: Any, heads: list[tuple[int, int]], every: list[np.ndarray],
                       last: torch.Tensor) -> bool:
    """Steering every head to every key gives the logits of a forward with no edit, bit for bit (both under
    vlmbind's eager attention: a pattern capture switches it on)."""
    layer = heads[0][0]
    reference = vlm.run(batch, sites=vlm.adapter.pattern_site(layer), logits_at=[batch.seq_len - 1]).logits
    steered = vlm.run(batch, interventions=steer_interventions(heads, every, last),
                      logits_at=[batch.seq_len - 1]).logits
    return bool(torch.equal(reference, steered))


def _gaze(vlm: Any, batch: Any, examples: list[Any]) -> tuple[np.ndarray, float, int]:
    """Summed over the scenes: per head, the share of its image attention at the last prompt token on the answer's
    object; that object's share of the image tokens; how many scenes counted."""
    a = vlm.adapter
    layers = sorted({layer for layer, _ in _steerable_heads(vlm)})
    sites = [s for layer in layers for s in vlm.sites(a.pattern_site(layer))]
    session = LastQuerySession(a, sites, [*vlm.active], index=batch.index)
    with torch.no_grad(), session:
        vlm.model(**vlm.model_inputs(batch), use_cache=False, logits_to_keep=1)
    total = np.zeros((vlm.n_layers, vlm.n_heads))
    chance, n = 0.0, 0
    for row, (example, ti) in enumerate(zip(examples, batch.index)):
        answer = answer_object(example)
        if answer is None:
            continue
        image = ti.image_positions if a.image_tokens_in_sequence else np.arange(
            len(ti.key_grids[0].positions.reshape(-1))) if ti.key_grids else np.zeros(0, dtype=int)
        obj = target_keys(vlm, ti, tuple(float(v) for v in example.objects[answer].box))
        if not len(image) or not len(obj):
            continue
        for site in sites:
            weights = session.captured[site.name][0][row].numpy()  # H K
            total[site.layer] += weights[:, obj].sum(-1) / np.clip(weights[:, image].sum(-1), 1e-12, None)
        chance += len(obj) / len(image)
        n += 1
    return total, chance, n
