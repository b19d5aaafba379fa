"""PbP's attention_swap condition: mediation on the model's own Point-to-Answer traces.

A model that counts by pointing writes ``(x, y)`` for each object in turn. For two points A and B of one trace, the
clean run is the trace up to the step that writes A's first coordinate, the counterfactual run the same trace up to
the step that writes B's; a head's output at A's step is replaced by its output at B's step, and the score is the
usual one with a = A's first coordinate token and a* = B's: how far that head alone moves the model from pointing
at A to pointing at B. Heads that carry "where to point next" (PbP's search heads) score high.

Design: traces are generated greedily by the model under study and extended token by token from the generated ids
(never re-tokenised text, whose merges could differ from what the model produced), so both runs are exactly the
contexts the model saw while generating. B is the point before A; pairs whose two x tokens are equal are useless (a
equals a*) and the next pair of consecutive points is tried. Examples whose traces hold no usable pair are skipped
and counted, never silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import InputError
from ..core.tokens import decoded_spans
from ..engine.decoding import generate_ids
from ..engine.patching import PatchTask
from ..stimuli import counting, visual_search
from ..stimuli.points import point_spans
from .evaluation import training_defaults

_OPEN = re.compile(r"\(\s*")


def extend_batch(vlm: Any, batch: Any, ids: list[int]) -> Any:
    """A one-row batch with ``ids`` appended as text tokens (:meth:`vlmbind.engine.vlm.VLM.extend`)."""
    return vlm.extend(batch, ids)


def x_token_steps(tokenizer: Any, ids: list[int]) -> list[int]:
    """For each ``(x, y)`` point of the decoded ``ids``, the index of the token holding x's first character."""
    spans, text = decoded_spans(tokenizer, ids)
    ends = [e for _, e in spans]
    steps = []
    for start, _, points in point_spans(text):
        if len(points) != 1:
            continue
        opening = _OPEN.match(text, start)
        first = opening.end() if opening else start
        step = next((k for k, end in enumerate(ends) if end > first), None)
        if step is not None:
            steps.append(step)
    return steps


@dataclass
class PointSwapPair:
    """Points A and B of one generated trace (see the module docstring).

    Attributes:
        id: the pair's id.
        batch: the prompt (one row).
        trace: the generated token ids.
        step_a: index in ``trace`` of A's first x token (the clean run stops before it).
        step_b: index in ``trace`` of B's first x token.
        text: the decoded trace.
    """

    id: str
    batch: Any
    trace: list[int]
    step_a: int
    step_b: int
    text: str = ""
    condition: str = field(default="attention_swap", init=False)

    @property
    def a(self) -> int:
        return int(self.trace[self.step_a])

    @property
    def a_star(self) -> int:
        return int(self.trace[self.step_b])

    def task(self, vlm: Any, layers: Any) -> PatchTask:
        clean = extend_batch(vlm, self.batch, self.trace[: self.step_a])
        cf = extend_batch(vlm, self.batch, self.trace[: self.step_b])
        return PatchTask.from_counterfactual(vlm, clean, cf, [clean.index[0].last_position], layers, self.a,
                                             self.a_star, counterfactual_positions=[cf.index[0].last_position])


@dataclass
class PointSwapPairs:
    """Pairs built from a model's traces, with the examples that gave none."""

    pairs: list[PointSwapPair]
    skipped: list[str]

    def __iter__(self):
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


def point_swap_pairs(vlm: Any, n: int, seed: int = 0, *, task: str = "count", max_new_tokens: int = 64,
                     max_tries: int | None = None, **stimulus_kwargs: Any) -> PointSwapPairs:
    """Up to ``n`` attention_swap pairs from the model's own Point-to-Answer traces on counting (or search) displays.

    Args:
        vlm: the model (it writes the traces).
        n: pairs wanted.
        seed: stimulus seed.
        task: ``count`` or ``search``.
        max_new_tokens: trace length limit.
        max_tries: examples to try at most (default ``4 n``).
        stimulus_kwargs: passed to the stimulus generator (the organism's training options fill the rest).

    Raises:
        InputError: bad arguments, or no example gave a usable pair.
    """
    if not isinstance(n, int) or n < 1:
        raise InputError(f"n must be a positive number of pairs, got {n!r}")
    if task not in ("count", "search"):
        raise InputError(f"attention_swap traces come from 'count' or 'search' displays, got {task!r}")
    kwargs = training_defaults(vlm, task, stimulus_kwargs)
    kwargs.setdefault("regime", "p2a")
    options = (getattr(vlm, "training", None) or {}).get("task_options", {}).get(task, {})
    if options.get("objects") and "objects" not in kwargs:
        kwargs["objects"] = tuple(options["objects"])
    if task == "search":
        kwargs.pop("colours", None), kwargs.pop("shapes", None)
    tries = max_tries or 4 * n
    make = counting if task == "count" else visual_search
    examples = make(tries, seed, **kwargs)
    tokenizer = vlm.adapter.tokenizer
    pairs, skipped = [], []
    for ex in examples:
        if len(pairs) == n:
            break
        batch = vlm.prepare([ex.image], [ex.prompt])
        out = generate_ids(vlm, batch, max_new_tokens)
        trace = out[0, batch.seq_len :].tolist()
        steps = x_token_steps(tokenizer, trace)
        pick = next(((b, a) for b, a in zip(steps, steps[1:]) if trace[a] != trace[b]), None)
        if pick is None:
            skipped.append(ex.id)
            continue
        pairs.append(PointSwapPair(f"{ex.id}-swap", batch, trace, pick[1], pick[0], tokenizer.decode(trace)))
    if not pairs:
        raise InputError(f"none of {len(examples)} traces had two points with different x tokens; is this a "
                         "Point-to-Answer model? (attention_swap needs pointing traces)")
    return PointSwapPairs(pairs, skipped)
