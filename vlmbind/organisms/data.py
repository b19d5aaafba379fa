"""Training data for the organisms: a seeded task mixture over the stimuli generators and a fast batch builder.

Design: training never stores a data set. Row ``r`` of the batch at step ``t`` is drawn from its own random stream
``default_rng([seed, stream, t, r])``, which picks the task (by the mixture's weights), the task's variant (entropy,
query kind, search kind, counting diversity) and the seed handed to the stimuli generator; so any step's batch can be
rebuilt on its own, and a resumed run sees exactly the batches an uninterrupted run sees. Evaluation sets come from a
separate stream and never overlap the training stream's seeds by construction. The stimuli canvas is aligned with the
organism's merged-token grid (one 28 px cell per image token), and the answer text follows the regime: Direct
(``yes``, ``7``) or Point-to-Answer (``(2, 5) yes``, points then the count); scene description and the binding query
have the same answer in both regimes.

The batch builder replaces the HF processor (0.1-0.17 s a batch) on the training path with numpy/torch code that gives
the same tensors: ``pixel_values`` by the processor's own fused rescale-normalise and patch ordering (images are
already at the processor's fixed size, so its resize is the identity), ``input_ids`` from the tokenizer (image
placeholder expanded, prompt, `` answer``, eos), ``labels`` (-100 except on the answer tokens and eos),
``attention_mask``, ``image_grid_thw`` and ``mm_token_type_ids`` (without them Qwen2.5-VL silently falls back to 1-D
positions). Tests check every tensor against the processor's output and the logits of both batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..core.errors import InputError, TrainingError, close_matches
from ..stimuli.core import Canvas, Example, StimulusError
from ..stimuli.query import binding_query
from ..stimuli.scenes import scene_description
from ..stimuli.search import COUNT_SPLITS, SEARCH_SPLITS, counting, visual_search
from .model import CELL_PX, grid_side

__all__ = [
    "REGIMES", "TASKS", "IGNORE_INDEX", "TaskSpec", "TaskMixture", "TrainingExample", "TrainBatch", "BatchBuilder",
    "answer_loss", "answer_correct", "canvas_for", "training_canvas",
]

REGIMES = ("direct", "p2a")
TASKS = ("scene", "query", "search", "count")
IGNORE_INDEX = -100
# random streams of the mixture: training batches and evaluation sets never share a seed
TRAIN_STREAM, EVAL_STREAM = 0, 1

# per task: the generator, the keyword its variants go to, and the defaults (objects, variants)
_GENERATORS: dict[str, Callable[..., Any]] = {
    "scene": scene_description, "query": binding_query, "search": visual_search, "count": counting,
}
_OBJECTS_KEY = {"scene": "n_objects", "query": "n_objects", "search": "n_objects", "count": "objects"}
_VARIANT_KEY = {"scene": "entropy", "query": "query", "search": "kind", "count": "diversity"}
_DEFAULT_OBJECTS: dict[str, tuple[int, int]] = {
    "scene": (2, 4), "query": (3, 4), "search": SEARCH_SPLITS["train"], "count": COUNT_SPLITS["train"],
}
_DEFAULT_VARIANTS: dict[str, tuple[str, ...]] = {
    "scene": ("high", "low"), "query": ("shape", "colour"), "search": ("disjunctive", "conjunctive"),
    "count": ("low", "high"),
}
OPTION_KEYS = ("objects", "variants", "present", "colours", "shapes")


def canvas_for(image_size: int) -> Canvas:
    """The stimuli canvas aligned with an organism's image-token grid: one 28 px cell per merged token."""
    return Canvas(image_size=image_size, grid=grid_side(image_size))


def training_canvas(training: Mapping[str, Any]) -> Canvas:
    """The canvas an organism was trained on, from its training record (``VLM.training``: ``image_size`` and
    ``grid``)."""
    return Canvas(image_size=int(training["image_size"]), grid=int(training["grid"]))


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task of the mixture and how its examples are drawn.

    Attributes:
        task: ``scene``, ``query``, ``search`` or ``count``.
        weight: relative share of batch rows (> 0).
        objects: inclusive ``(lo, hi)`` object count per image (scene: 2-4; query: 3-4; search: PbP's training split,
            one object; count: PbP's training split, 5-10).
        variants: drawn uniformly per example: scene ``entropy`` (high / low), query kind (shape / colour), search
            ``kind`` (disjunctive / conjunctive), count ``diversity`` (low / high).
        present: search only: probability that the target is present.
        colours: colour pool (scene, query and count; None: the generator's default, all colours).
        shapes: shape pool (scene, query and count; None: the generator's default, the eight shapes).
    """

    task: str
    weight: float = 1.0
    objects: tuple[int, int] | None = None
    variants: tuple[str, ...] | None = None
    present: float | None = None
    colours: tuple[str, ...] | None = None
    shapes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise TrainingError(f"unknown task {self.task!r}.{close_matches(str(self.task), TASKS)} "
                                f"Tasks: {', '.join(TASKS)}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not (
                math.isfinite(self.weight) and self.weight > 0):
            raise TrainingError(f"task {self.task!r}: weight must be a finite number > 0, got {self.weight!r}")
        objects = self.objects if self.objects is not None else _DEFAULT_OBJECTS[self.task]
        if isinstance(objects, (int, np.integer)) and not isinstance(objects, bool):
            objects = (int(objects), int(objects))
        if not (isinstance(objects, (tuple, list)) and len(objects) == 2
                and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in objects)
                and 1 <= objects[0] <= objects[1]):
            raise TrainingError(f"task {self.task!r}: objects must be an inclusive (lo, hi) pair of ints with "
                                f"1 <= lo <= hi, got {self.objects!r}")
        object.__setattr__(self, "objects", (int(objects[0]), int(objects[1])))
        variants = self.variants if self.variants is not None else _DEFAULT_VARIANTS[self.task]
        variants = (variants,) if isinstance(variants, str) else tuple(variants)
        if not variants:
            raise TrainingError(f"task {self.task!r}: variants must name at least one of "
                                f"{', '.join(_DEFAULT_VARIANTS[self.task])}")
        for v in variants:
            if v not in _DEFAULT_VARIANTS[self.task]:
                choices = _DEFAULT_VARIANTS[self.task]
                raise TrainingError(f"task {self.task!r}: unknown {_VARIANT_KEY[self.task]} {v!r}."
                                    f"{close_matches(str(v), choices)} Choose from {', '.join(choices)}")
        object.__setattr__(self, "variants", variants)
        if self.present is not None and self.task != "search":
            raise TrainingError(f"task {self.task!r}: present applies to search only")
        if self.task == "search" and self.present is None:
            object.__setattr__(self, "present", 0.5)
        for name in ("colours", "shapes"):
            value = getattr(self, name)
            if value is None:
                continue
            if self.task == "search":
                raise TrainingError(f"task 'search': {name} do not apply (its target and distractors are fixed)")
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))

    @classmethod
    def from_options(cls, task: str, weight: float, options: Mapping[str, Any] | None = None) -> TaskSpec:
        """A spec from a weight and a JSON-style options mapping (keys: ``objects``, ``variants``, ``present``,
        ``colours``, ``shapes``).

        Raises:
            TrainingError: an unknown option key or a bad value.
        """
        options = dict(options or {})
        for key in options:
            if key not in OPTION_KEYS:
                raise TrainingError(f"task {task!r}: unknown option {key!r}.{close_matches(key, OPTION_KEYS)} "
                                    f"Options: {', '.join(OPTION_KEYS)}")
        objects = options.get("objects")
        return cls(task=task, weight=weight, objects=tuple(objects) if isinstance(objects, list) else objects,
                   variants=options.get("variants"), present=options.get("present"),
                   colours=options.get("colours"), shapes=options.get("shapes"))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"task": self.task, "weight": float(self.weight), "objects": list(self.objects),
                             "variants": list(self.variants)}
        for name in ("present", "colours", "shapes"):
            value = getattr(self, name)
            if value is not None:
                d[name] = list(value) if isinstance(value, tuple) else value
        return d

    def generator_kwargs(self, variant: str, regime: str, canvas: Canvas) -> dict[str, Any]:
        """Keyword arguments of the stimuli generator for one example of ``variant``."""
        kwargs: dict[str, Any] = {_OBJECTS_KEY[self.task]: self.objects, "canvas": canvas}
        kwargs[_VARIANT_KEY[self.task]] = variant
        if self.task in ("search", "count"):
            kwargs["regime"] = regime
        if self.task == "search":
            kwargs["present"] = self.present
        if self.colours is not None:
            kwargs["colours"] = list(self.colours)
        if self.shapes is not None:
            kwargs["shapes"] = list(self.shapes)
        return kwargs

    def generate(self, seed: int, variant: str, regime: str, canvas: Canvas) -> Example:
        """One example (the generator's example 0 under ``seed``)."""
        return _GENERATORS[self.task](1, seed, **self.generator_kwargs(variant, regime, canvas))[0]

    def check(self, regime: str, canvas: Canvas) -> None:
        """Let the generator validate every variant's parameters (an empty data set costs nothing).

        Raises:
            TrainingError: the generator rejects the parameters (e.g. more objects than grid cells).
        """
        for variant in self.variants:
            try:
                _GENERATORS[self.task](0, 0, **self.generator_kwargs(variant, regime, canvas))
            except (StimulusError, TypeError) as exc:
                raise TrainingError(f"task {self.task!r} ({_VARIANT_KEY[self.task]} {variant!r}) on a "
                                    f"{canvas.image_size} px canvas with a {canvas.shape[0]}x{canvas.shape[1]} grid: "
                                    f"{exc}") from exc


@dataclass
class TrainingExample:
    """One drawn example: the stimulus, its task and variant, and the answer text of the regime."""

    example: Example
    task: str
    variant: str
    answer: str

    @property
    def image(self) -> Image.Image:
        return self.example.image

    @property
    def prompt(self) -> str:
        return self.example.prompt


class TaskMixture:
    """Seeded, stateless example source for training and evaluation.

    Args:
        specs: the tasks and their weights.
        regime: ``"direct"`` or ``"p2a"``.
        image_size: the organism's image size (the canvas grid follows it).
        seed: the run's data seed.

    Raises:
        TrainingError: no tasks, a repeated task, an unknown regime, or parameters a generator rejects.
    """

    def __init__(self, specs: Sequence[TaskSpec], *, regime: str, image_size: int, seed: int):
        if regime not in REGIMES:
            raise TrainingError(f"unknown regime {regime!r}.{close_matches(str(regime), REGIMES)} "
                                f"Regimes: {', '.join(REGIMES)}")
        specs = list(specs)
        if not specs:
            raise TrainingError("the mixture needs at least one task with a weight > 0")
        names = [s.task for s in specs]
        if len(set(names)) != len(names):
            raise TrainingError(f"a task appears twice in the mixture: {names}")
        self.specs = specs
        self.regime = regime
        self.image_size = image_size
        self.seed = int(seed)
        self.canvas = canvas_for(image_size)
        for spec in specs:
            spec.check(regime, self.canvas)
        weights = np.array([s.weight for s in specs], dtype=np.float64)
        self.probs = weights / weights.sum()

    def _draw(self, stream: int, step: int, row: int, spec: TaskSpec | None = None,
              variant: str | None = None) -> TrainingExample:
        rng = np.random.default_rng([self.seed, stream, int(step), int(row)])
        if spec is None:
            spec = self.specs[int(rng.choice(len(self.specs), p=self.probs))]
        if variant is None:
            variant = spec.variants[int(rng.integers(len(spec.variants)))]
        example = spec.generate(int(rng.integers(2**62)), variant, self.regime, self.canvas)
        return TrainingExample(example, spec.task, variant, example.answer)

    def example(self, step: int, row: int) -> TrainingExample:
        """Row ``row`` of the training batch at ``step`` (a pure function of seed, step and row)."""
        return self._draw(TRAIN_STREAM, step, row)

    def batch(self, step: int, batch_size: int) -> list[TrainingExample]:
        """The training examples of ``step``."""
        return [self.example(step, r) for r in range(batch_size)]

    def eval_set(self, n: int) -> dict[str, list[TrainingExample]]:
        """A fixed evaluation set: ``n`` examples for every task and variant, keyed ``"task/variant"``."""
        out: dict[str, list[TrainingExample]] = {}
        for k, spec in enumerate(self.specs):
            for j, variant in enumerate(spec.variants):
                key = f"{spec.task}/{variant}"
                # one step index per (task, variant) in the evaluation stream
                out[key] = [self._draw(EVAL_STREAM, 1000 * TASKS.index(spec.task) + j, i, spec, variant)
                            for i in range(n)]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"regime": self.regime, "image_size": self.image_size, "seed": self.seed,
                "grid": list(self.canvas.shape), "tasks": [s.to_dict() for s in self.specs]}


# ----------------------------------------------------------------------------------------------------------------
# Fast batches
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TrainBatch:
    """Model inputs plus labels for one batch (right-padded).

    Attributes:
        inputs: ``input_ids`` ``B P``, ``attention_mask`` ``B P``, ``mm_token_type_ids`` ``B P`` (1 on image tokens),
            ``pixel_values`` ``B*N_patches 1176``, ``image_grid_thw`` ``B 3``: pass as ``model(**inputs)``.
        labels: ``B P``, the token ids of the answer and eos, -100 elsewhere (aligned with ``input_ids``: the loss
            compares position ``p``'s logits with ``labels[p + 1]``).
        tasks: the task of each row (``"task/variant"``).
    """

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    tasks: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class BatchBuilder:
    """Builds :class:`TrainBatch` es for an organism without calling the processor.

    Args:
        processor: the organism's ``Qwen2_5_VLProcessor`` (its image size must be fixed: min = max pixels, a square
            multiple of 28 px).

    Raises:
        TrainingError: the processor's image size is not fixed and square, or its tokenizer lacks the Qwen tokens.
    """

    def __init__(self, processor: Any):
        ip = processor.image_processor
        self.tokenizer = processor.tokenizer
        lo, hi = int(ip.size["shortest_edge"]), int(ip.size["longest_edge"])
        side = math.isqrt(lo)
        if lo != hi or side * side != lo or side % CELL_PX:
            raise TrainingError(f"the processor's image size is not fixed and aligned (min_pixels {lo}, max_pixels "
                                f"{hi}); build it with min_pixels = max_pixels = image_size**2, image_size a "
                                f"multiple of {CELL_PX}")
        self.image_size = side
        self.patch = int(ip.patch_size)
        self.merge = int(ip.merge_size)
        self.temporal = int(ip.temporal_patch_size)
        if not (ip.do_rescale and ip.do_normalize) or ip.do_resize is False:
            raise TrainingError("the fast batch path mirrors a processor that resizes, rescales and normalises")
        # the processor fuses rescale and normalise: (x - mean / r) / (std / r), in float32
        self.mean = (torch.tensor(ip.image_mean) * (1.0 / ip.rescale_factor))[:, None, None]
        self.std = (torch.tensor(ip.image_std) * (1.0 / ip.rescale_factor))[:, None, None]
        self.grid_h = self.grid_w = side // self.patch
        self.n_image_tokens = (self.grid_h // self.merge) * (self.grid_w // self.merge)
        tok = self.tokenizer
        ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
        if None in ids.values() or (tok.unk_token_id is not None and tok.unk_token_id in ids.values()):
            raise TrainingError(f"the tokenizer lacks Qwen's vision tokens: {ids}")
        self.image_token_id = ids["<|image_pad|>"]
        self.prefix = [ids["<|vision_start|>"]] + [self.image_token_id] * self.n_image_tokens + [ids["<|vision_end|>"]]
        if tok.eos_token_id is None or tok.pad_token_id is None:
            raise TrainingError("the tokenizer needs an eos and a pad token")
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id)
        self._encode = lru_cache(maxsize=4096)(self._encode_uncached)

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def pixel_values(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """The processor's ``pixel_values`` for square RGB images of the fixed size.

        Returns:
            ``B*H*W 1176`` float32 patches (``H = W = image_size / 14``), in the processor's order: per image, 2x2
            merge groups in raster order, each patch repeated over the temporal axis.

        Raises:
            InputError: an image of another size or mode.
        """
        arrays = []
        for i, im in enumerate(images):
            if im.size != (self.image_size, self.image_size) or im.mode != "RGB":
                raise InputError(f"image {i} is {im.mode} {im.size[0]}x{im.size[1]}; the fast path takes RGB "
                                 f"{self.image_size}x{self.image_size} images (the stimuli canvas of this organism)")
            arrays.append(np.asarray(im))
        # on the device of the builder's constants (the run's: see train's device)
        x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).to(self.mean.device, torch.float32)  # B 3 S S
        x = (x - self.mean) / self.std
        b, c, gh, gw, m, p = x.shape[0], x.shape[1], self.grid_h, self.grid_w, self.merge, self.patch
        x = x.reshape(b, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, self.temporal, -1, -1)
        return x.reshape(b * gh * gw, c * self.temporal * p * p)

    def __call__(self, examples: Sequence[TrainingExample | tuple[Image.Image, str, str]]) -> TrainBatch:
        """A batch: image placeholder, prompt, `` answer``, eos per row; right-padded with the pad token.

        Args:
            examples: :class:`TrainingExample` s or ``(image, prompt, answer)`` triples.
        """
        rows, labels, images, tasks = [], [], [], []
        for ex in examples:
            if isinstance(ex, TrainingExample):
                image, prompt, answer, task = ex.image, ex.prompt, ex.answer, f"{ex.task}/{ex.variant}"
            else:
                (image, prompt, answer), task = ex, ""
            head = self.prefix + list(self._encode(prompt))
            tail = list(self._encode(" " + answer)) + [self.eos_id]
            rows.append(head + tail)
            labels.append([IGNORE_INDEX] * len(head) + tail)
            images.append(image)
            tasks.append(task)
        if not rows:
            raise InputError("an empty batch: pass at least one example")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, l) in enumerate(zip(rows, labels)):
            ids[i, : len(r)] = torch.tensor(r)
            lab[i, : len(l)] = torch.tensor(l)
            mask[i, : len(r)] = 1
        inputs = {
            "input_ids": ids,
            "attention_mask": mask,
            "mm_token_type_ids": (ids == self.image_token_id).long(),
            "pixel_values": self.pixel_values(images),
            "image_grid_thw": torch.tensor([[1, self.grid_h, self.grid_w]] * len(rows), dtype=torch.long),
        }
        return TrainBatch(inputs=inputs, labels=lab, tasks=tasks)


# ----------------------------------------------------------------------------------------------------------------
# Loss and accuracy on answer tokens
# ----------------------------------------------------------------------------------------------------------------
def answer_loss(logits: torch.Tensor, labels: torch.Tensor, norm: str = "example") -> torch.Tensor:
    """Cross-entropy on the answer tokens only.

    Args:
        logits: ``B P V``.
        labels: ``B P`` (-100 where no loss is taken), aligned with the inputs.
        norm: ``"example"``: mean over each row's answer tokens, then over rows (every example weighs the same,
            whatever its answer length: a P2A count answer is ~10x longer than a scene answer); ``"token"``: mean
            over all answer tokens of the batch.

    Returns:
        The scalar loss.
    """
    target = labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(target.shape)
    return _answer_mean(per_token, target, norm)


def _answer_mean(per_token: torch.Tensor, target: torch.Tensor, norm: str) -> torch.Tensor:
    mask = (target != IGNORE_INDEX).to(per_token.dtype)
    if norm == "token":
        return (per_token * mask).sum() / mask.sum().clamp_min(1)
    if norm == "example":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
    raise TrainingError(f"unknown loss norm {norm!r}; choose 'example' or 'token'")


def answer_unlikelihood(logits: torch.Tensor, labels: torch.Tensor, norm: str = "example") -> torch.Tensor:
    """Unlikelihood on the answer tokens: ``-log(1 - p(label))`` per token, normed as :func:`answer_loss`; 0 when
    the model gives the answer no probability, large when it is sure of it."""
    target = labels[:, 1:]
    log_p = torch.log_softmax(logits[:, :-1].float(), -1)
    picked = log_p.gather(-1, target.clamp_min(0)[..., None])[..., 0]
    per_token = -torch.log1p(-picked.exp().clamp_max(1 - 1e-6))
    return _answer_mean(per_token, target, norm)


def answer_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``B`` bool: every answer token (and eos) is the argmax given the correct prefix.

    This equals exact-match accuracy of greedy decoding: if every step's argmax is the gold token, greedy decoding
    reproduces the gold answer and stops at eos; if one is not, greedy decoding leaves the gold answer there.
    """
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    hit = (logits[:, :-1].argmax(-1) == target) | ~mask
    return hit.all(1)

