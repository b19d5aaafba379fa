"""Head ablation study: top-k heads by a score against random-k (several seeds) and bottom-k, by task accuracy.

Ablation modes (``VLM.ablate``): ``image_attention`` zeroes the heads' attention to image tokens after the softmax
(renormalised or not), ``zero`` zeroes their output z, ``mean`` replaces z by its mean over the evaluated data set
(one mean per head over every non-padding position), ``role_mean`` by its mean over the positions of the same token
role (image tokens get the head's mean over image tokens, text tokens its mean over text tokens): a head's output on
image tokens and on text tokens can differ by far more than its information about one input, so the global mean
writes an image-like vector onto text positions and vice versa, and can break a model through a head that carries
nothing the task needs. Random-k draws k distinct heads uniformly with each seed, by
default from the heads outside the top-k (so a random draw never repeats the top arm); the same k and mode are used
for every arm, so the comparison isolates which heads are ablated.

Uncertainty: each arm's accuracy carries a Wilson 95% interval over its n examples; the random arm is reported per
seed and as a mean with a 95% t-interval over the seeds (which heads are drawn is the larger source of variation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from ..core.choices import ABLATION_MODES as MODES
from ..core.choices import ABLATION_RANDOM_POOLS as RANDOM_POOLS
from ..core.errors import InputError
from ..core.io import write_json_atomic
from ..core.results import Result, read_json_object, register_result, require_keys
from ..viz.ablation import ablation_figure
from .evaluation import evaluate


@register_result
@dataclass
class AblationResult(Result):
    """Accuracy with no heads ablated and with each arm's heads ablated.

    Attributes:
        model, task, mode, k: what was run; prompt_format: ``raw`` or ``chat``; random_from: the random arm's pool
            (``rest``: the heads outside the top-k; ``same_layers``: per top-k head another of its layer; ``all``:
            every head, as results saved before the pool was recorded);
            bottom_by: how the bottom arm was chosen (``abs``: the smallest |score|; ``score``: the lowest scores,
            which results saved before it was recorded used).
        canvas: the generated examples' canvas, ``{"image_size", "grid", "image_size_from"}``
            (:func:`vlmbind.analysis.evaluation.stimulus_defaults`), or None (a task file, or not recorded).
        arms: ``[{"arm": "clean"|"top"|"random"|"random_<pool>"|"bottom", "seed": s or None, "heads": ["l.h", ...],
            "accuracy": a, "n": n}, ...]``; ``random_<pool>`` arms (``also_random_from``) draw from another pool on
            the same seeds.
    """

    model: str
    task: str
    mode: str
    k: int
    renormalize: bool
    arms: list[dict[str, Any]] = field(default_factory=list)
    prompt_format: str = "raw"
    random_from: str = "rest"
    bottom_by: str = "abs"
    canvas: dict[str, Any] | None = None

    kind = "ablate"
    reproduced_files = ("results.json",)
    marker_keys = ("arms",)
    figure_name = "ablation"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AblationResult:
        return cls(model=data["model"], task=data["task"], mode=data["mode"], k=data["k"],
                   renormalize=data["renormalize"], arms=data["arms"],
                   prompt_format=data.get("prompt_format", "raw"),
                   random_from=data.get("random_from", "all"), bottom_by=data.get("bottom_by", "score"),
                   canvas=data.get("canvas"))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> AblationResult:
        path = Path(directory) / "results.json"
        data = read_json_object(path)
        require_keys(data, ("model", "task", "mode", "k", "renormalize", "arms"), path)
        return cls.from_dict(data)

    def figure(self) -> Any:
        """Accuracy per arm (random arms per seed) with Wilson 95% intervals, and each random arm's mean."""
        intervals = [wilson_interval(a["accuracy"], a["n"]) for a in self.arms]
        every = self.intervals()
        return ablation_figure({"model": self.model, "task": self.task, "mode": self.mode, "k": self.k,
                                "bottom_by": self.bottom_by,
                                "renormalize": self.renormalize, "arms": self.arms, "intervals": intervals,
                                "random": every["random"],
                                "random_arms": {arm: every[arm] for arm in self.random_arms()}})

    def arms_frame(self) -> pd.DataFrame:
        """One row per arm, with the run's settings repeated (heads joined by spaces)."""
        rows = [{"model": self.model, "task": self.task, "mode": self.mode, "k": self.k,
                 "renormalize": self.renormalize, "arm": a["arm"], "seed": a.get("seed"),
                 "heads": " ".join(a.get("heads", [])), "accuracy": a["accuracy"], "n": a["n"]} for a in self.arms]
        return pd.DataFrame(rows, columns=["model", "task", "mode", "k", "renormalize", "arm", "seed", "heads",
                                           "accuracy", "n"])

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        return {"ablation": self.figure}, {"arms.csv": self.arms_frame()}

    def accuracy(self, arm: str) -> float:
        """Accuracy of an arm (the mean over seeds for a random arm)."""
        values = [a["accuracy"] for a in self.arms if a["arm"] == arm]
        if not values:
            raise KeyError(f"no arm {arm!r}")
        return float(np.mean(values))

    def random_arms(self) -> list[str]:
        """The random arms in the order they ran: ``random`` first, then each ``random_<pool>``."""
        return list(dict.fromkeys(a["arm"] for a in self.arms if a["arm"].startswith("random")))

    def random_pool(self, arm: str) -> str:
        """The pool a random arm drew from (``random``: :attr:`random_from`; ``random_<pool>``: that pool)."""
        return self.random_from if arm == "random" else arm.removeprefix("random_")

    def random_seeds(self, arm: str = "random") -> list[dict[str, Any]]:
        """A random arm per seed: ``{"seed", "heads", "accuracy", "n"}``."""
        return [{k: a.get(k) for k in ("seed", "heads", "accuracy", "n")} for a in self.arms if a["arm"] == arm]

    def intervals(self) -> dict[str, dict[str, Any]]:
        """95% intervals per arm: Wilson over the n examples for clean / top / bottom; for each random arm, the mean
        over seeds with a t-interval over the seeds (``low`` = ``high`` = the mean with one seed) and the spread."""
        out: dict[str, dict[str, Any]] = {}
        for arm in ("clean", "top", "bottom"):
            a = next(x for x in self.arms if x["arm"] == arm)
            low, high = wilson_interval(a["accuracy"], a["n"])
            out[arm] = {"accuracy": float(a["accuracy"]), "low": low, "high": high, "n": int(a["n"])}
        for arm in self.random_arms():
            seeds = self.random_seeds(arm)
            values = np.array([a["accuracy"] for a in seeds], dtype=float)
            mean = float(values.mean())
            if len(values) > 1:
                half = float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values)))
            else:
                half = 0.0
            out[arm] = {"accuracy": mean, "low": max(0.0, mean - half), "high": min(1.0, mean + half),
                        "seeds": int(len(values)), "lowest": float(values.min()), "highest": float(values.max()),
                        "n": int(seeds[0]["n"])}
        return out

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.arms)

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "mode": self.mode, "k": self.k,
                "renormalize": self.renormalize, "prompt_format": self.prompt_format,
                "random_from": self.random_from, "bottom_by": self.bottom_by,
                "accuracy": {arm: self.accuracy(arm) for arm in ("clean", "top", *self.random_arms(), "bottom")},
                "intervals": self.intervals(), "arms": self.arms,
                **({"canvas": self.canvas} if self.canvas is not None else {})}

    def text(self) -> str:
        """One line of every arm with its interval, then one line per random arm with its seeds one by one."""
        iv = self.intervals()
        arms = ", ".join(f"{arm} {iv[arm]['accuracy']:.3f} [{iv[arm]['low']:.2f}, {iv[arm]['high']:.2f}]"
                         for arm in ("clean", "top"))
        randoms = ", ".join(f"{arm} {iv[arm]['accuracy']:.3f} [{iv[arm]['low']:.2f}, {iv[arm]['high']:.2f}] over "
                            f"{iv[arm]['seeds']} seeds" for arm in self.random_arms())
        lines = [f"accuracy (95% interval, n={iv['clean']['n']}): {arms}, {randoms}, bottom ({self.bottom_label}) "
                 f"{iv['bottom']['accuracy']:.3f} [{iv['bottom']['low']:.2f}, {iv['bottom']['high']:.2f}]"]
        for arm in self.random_arms():
            seeds = ", ".join(f"seed {a['seed']} {a['accuracy']:.3f}" for a in self.random_seeds(arm))
            name = "random-k" if arm == "random" else arm
            lines.append(f"{name} ({POOL_LABELS[self.random_pool(arm)]}): {seeds}")
        return "\n".join(lines)

    @property
    def bottom_label(self) -> str:
        return BOTTOM_LABELS[self.bottom_by]

    def save(self, out: str | os.PathLike) -> Path:
        out = Path(out)
        write_json_atomic(self.summary(), out / "results.json")
        return out


def ranked_heads(scores: Any) -> list[tuple[int, int]]:
    """Heads from the highest to the lowest score, from HeadScores or a frame with layer, head, score columns."""
    frame = scores.to_frame() if hasattr(scores, "to_frame") else scores
    missing = {"layer", "head", "score"} - set(frame.columns)
    if missing:
        raise InputError(f"scores need columns layer, head, score; missing {sorted(missing)}")
    frame = frame.sort_values(["score", "layer", "head"], ascending=[False, True, True], kind="stable")
    return [(int(l), int(h)) for l, h in zip(frame["layer"], frame["head"])]


BOTTOM_BY = ("abs", "score")
BOTTOM_LABELS = {"abs": "smallest |score|", "score": "lowest score"}
POOL_LABELS = {"all": "from all heads", "rest": "outside the top-k", "same_layers": "from the top-k's layers"}


def ablation_study(vlm: Any, dataset: Any, scores: Any, *, k: int = 5, mode: str = "image_attention",
                   renormalize: bool = False, seeds: tuple[int, ...] = (0, 1, 2), batch_size: int = 32,
                   random_from: str = "rest", bottom_by: str = "abs",
                   also_random_from: tuple[str, ...] = ()) -> AblationResult:
    """Accuracy on ``dataset`` with the top-k, random-k (per seed) and bottom-k heads of ``scores`` ablated.

    Args:
        random_from: the random arm's pool: the ``rest`` (every head outside the top-k, the default), ``all``
            heads, or ``same_layers`` (for each top-k head another head of its layer outside the top-k: asks
            whether the top heads matter more than their layer's other heads, and keeps a small model's random sets
            from taking most of one layer).
        also_random_from: more random arms on the same seeds, each from another pool, as arms named
            ``random_<pool>`` (e.g. ``random_same_layers``) beside ``random``; the clean, top and bottom arms and
            the means are computed once for all.
        bottom_by: the bottom arm: the k smallest ``abs`` (|score|: the heads the scores call least involved
            either way, the default control), or the k lowest ``score`` s (the most negative heads, which can
            matter as much as the top ones).

    Raises:
        InputError: unknown mode, k out of range, no seeds, an empty data set, scores that do not cover the
            model's heads, or (``same_layers``) a top-k layer with no other head left to draw.
    """
    if mode not in MODES:
        raise InputError(f"ablation mode {mode!r} is not one of {MODES}")
    for pool in (random_from, *also_random_from):
        if pool not in RANDOM_POOLS:
            raise InputError(f"random_from must be one of {RANDOM_POOLS}, got {pool!r}")
    if bottom_by not in BOTTOM_BY:
        raise InputError(f"bottom_by must be one of {BOTTOM_BY}, got {bottom_by!r}")
    if len(dataset) == 0:
        raise InputError("the data set is empty: nothing to evaluate the ablations on")
    if not seeds:
        raise InputError("seeds is empty: pass at least one seed for the random-k arm, e.g. seeds=(0, 1, 2)")
    ranked = ranked_heads(scores)
    n_heads = vlm.n_layers * vlm.n_heads
    if len(set(ranked)) != n_heads or any(not (0 <= l < vlm.n_layers and 0 <= h < vlm.n_heads) for l, h in ranked):
        raise InputError(f"scores must give each of the model's {vlm.n_layers} x {vlm.n_heads} heads once")
    if not 1 <= k <= n_heads // 2:
        raise InputError(f"k = {k} must be between 1 and half the heads ({n_heads // 2}) so top and bottom differ")
    short = layers_short_of_heads(ranked[:k], vlm.n_heads)
    if "same_layers" in (random_from, *also_random_from) and short:  # before any arm is evaluated
        raise InputError(f"layer {short[0]} has no head outside the top-k left to match; use random_from='rest'")
    means = _means(vlm, dataset, by_role=mode == "role_mean") if mode in ("mean", "role_mean") else None
    result = AblationResult(vlm.name, dataset[0].task, mode, k, renormalize,
                            prompt_format=vlm.active_prompt_format, random_from=random_from, bottom_by=bottom_by)

    def run(arm: str, heads: list[tuple[int, int]], seed: int | None = None) -> None:
        if heads:
            layer_means = None
            if means is not None:
                layer_means = {}
                for layer in sorted({l for l, _ in heads}):
                    picked = [h for l, h in heads if l == layer]
                    layer_means[layer] = ({role: m[picked] for role, m in means[layer].items()}
                                          if mode == "role_mean" else means[layer][picked])
            with vlm.ablate(heads, mode=mode, renormalize=renormalize, means=layer_means):
                acc = evaluate(vlm, dataset, batch_size=batch_size)
        else:
            acc = evaluate(vlm, dataset, batch_size=batch_size)
        result.arms.append({"arm": arm, "seed": seed, "heads": [f"{l}.{h}" for l, h in heads],
                            "accuracy": acc.accuracy, "n": acc.n})

    def draw(pool: str, seed: int) -> list[tuple[int, int]]:
        if pool == "all":
            pick = np.random.default_rng(seed).choice(n_heads, size=k, replace=False)
            return [(int(i) // vlm.n_heads, int(i) % vlm.n_heads) for i in pick]
        if pool == "same_layers":
            return same_layer_heads(ranked[:k], vlm.n_heads, seed)
        rest = ranked[k:]
        pick = np.random.default_rng(seed).choice(len(rest), size=k, replace=False)
        return [rest[int(i)] for i in pick]

    run("clean", [])
    run("top", ranked[:k])
    for seed in seeds:
        run("random", draw(random_from, seed), seed)
    for pool in also_random_from:
        for seed in seeds:
            run(f"random_{pool}", draw(pool, seed), seed)
    run("bottom", ranked[-k:] if bottom_by == "score" else least_involved(scores, k))
    return result


def layers_short_of_heads(top: list[tuple[int, int]], n_heads: int) -> list[int]:
    """The layers of ``top`` with fewer heads outside ``top`` than inside it: there :func:`same_layer_heads` cannot
    match each top head with another head of its layer (empty when every layer can)."""
    counts = {layer: sum(1 for l, _ in top if l == layer) for layer, _ in top}
    return sorted(layer for layer, count in counts.items() if n_heads - count < count)


def same_layer_heads(top: list[tuple[int, int]], n_heads: int, seed: int) -> list[tuple[int, int]]:
    """For each head of ``top``, in order, a uniformly drawn head of the same layer outside ``top`` and not drawn
    before (heads of a layer in index order, so a seed draws alike in models whose top heads share layers).

    Raises:
        InputError: a layer of ``top`` has no head left to draw.
    """
    rng, taken, out = np.random.default_rng(seed), set(top), []
    for layer, _ in top:
        free = [(layer, h) for h in range(n_heads) if (layer, h) not in taken]
        if not free:
            raise InputError(f"layer {layer} has no head outside the top-k left to match; use random_from='rest'")
        pick = free[int(rng.integers(len(free)))]
        taken.add(pick)
        out.append(pick)
    return out


def wilson_interval(accuracy: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of an accuracy over ``n`` examples (scipy's ``binomtest``)."""
    successes = int(round(float(accuracy) * n))
    ci = stats.binomtest(successes, int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def least_involved(scores: Any, k: int) -> list[tuple[int, int]]:
    """The ``k`` heads with the smallest |score| (ties by layer, head)."""
    frame = (scores.to_frame() if hasattr(scores, "to_frame") else scores).copy()
    frame["magnitude"] = frame["score"].abs()
    frame = frame.sort_values(["magnitude", "layer", "head"], kind="stable")
    return [(int(l), int(h)) for l, h in zip(frame["layer"][:k], frame["head"][:k])]


def _means(vlm: Any, dataset: Any, by_role: bool = False) -> dict[int, Any]:
    """Per layer, ``H D`` mean z of every head over the data set (capped at 64 examples); ``by_role``: role ->
    ``H D``."""
    examples = list(dataset)[:64]
    batch = vlm.prepare([e.image for e in examples], [e.prompt for e in examples])
    return {layer: vlm.head_means(batch, layer, list(range(vlm.n_heads)), by_role=by_role)
            for layer in range(vlm.n_layers)}
