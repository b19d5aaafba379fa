"""Greedy generation, in the two forms vlmbind needs.

* :func:`generate_ids`: Hugging Face ``generate`` with the key/value cache, under a
:class:`~vlmbind.engine.hooks.HookSession`
  (captures per step, interventions at every step); ``do_sample`` defaults to False. ``VLM.generate``, the pointing
  traces of ``attention_swap`` and centroid tracking go through it.
* :func:`greedy_decode`: full forwards on the growing sequence (no cache), so a position-bound intervention stays at
  one absolute position in every step (the position-ID edit needs that); tokens are appended by
  :func:`vlmbind.engine.batches.append_tokens`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.tokens import decode_generated
from .batches import Batch, append_tokens

# greedy means greedy: a checkpoint's generation config may carry penalties (Qwen2-VL / Qwen2.5-VL Instruct:
# repetition_penalty 1.05, which HF applies under greedy decoding too and which penalises the colour words already in
# the prompt), so they are switched off unless a caller asks for them
GREEDY = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}


def generate_ids(vlm: Any, batch: Batch, max_new_tokens: int, session: Any = None, **kwargs: Any) -> torch.Tensor:
    """``B (P + T)`` ids from ``vlm.model.generate`` on ``batch`` under ``session`` (None: no hooks), no gradients.

    ``kwargs`` go to ``generate``; what they leave out is :data:`GREEDY` (no sampling, no penalties), whatever the
    checkpoint's generation config says.
    """
    for key, value in GREEDY.items():
        kwargs.setdefault(key, value)
    with torch.no_grad(), (session if session is not None else contextlib.nullcontext()):
        return vlm.model.generate(**vlm.model_inputs(batch), max_new_tokens=max_new_tokens, **kwargs)


def eos_ids(vlm: Any) -> list[int]:
    """The end-of-sequence ids: the generation config's, else the tokenizer's (none: ``[]``)."""
    eos = getattr(getattr(vlm.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = vlm.adapter.tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def greedy_decode(vlm: Any, batch: Any, interventions: Sequence[Any] = (), max_new_tokens: int = 3, *,
                  step_interventions: Callable[[int], Sequence[Any]] | None = None) -> list[str]:
    """Greedy continuation of each row by full forwards (no key/value cache), interventions applied in every one.

    Position-bound interventions keep their absolute positions as tokens are appended (the batch is left-padded,
    so the prompt's positions do not move). A row that emits an end-of-sequence token stops there, as in
    ``generate``.

    Args:
        vlm: a loaded VLM.
        batch: a prepared batch (``vlm.prepare``).
        interventions: applied in every forward.
        max_new_tokens: tokens to generate.
        step_interventions: ``step -> interventions`` added to ``interventions`` in the forward that picks token
            ``step`` (0-based), for interventions whose positions grow with the answer.

    Returns:
        The decoded continuations (special tokens dropped, pointing markers kept), one per row.
    """
    eos = eos_ids(vlm)
    inputs = dict(batch.inputs)
    done = torch.zeros(len(batch), dtype=torch.bool)
    new: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        step_batch = Batch(inputs=inputs, index=batch.index, prompts=batch.prompts, images=batch.images)
        active = list(interventions) + (list(step_interventions(step)) if step_interventions else [])
        last = inputs["input_ids"].shape[1] - 1  # the logits of the last column only, never over the sequence
        nxt = vlm.run(step_batch, interventions=active, logits_at=[last]).logits[:, -1].argmax(-1).cpu()
        if eos:
            nxt = torch.where(done, torch.tensor(eos[0]), nxt)
            done |= torch.isin(nxt, torch.tensor(eos))
        new.append(nxt)
        if done.all() or step == max_new_tokens - 1:
            break
        inputs = append_tokens(vlm.adapter, inputs, nxt)
    ids = torch.stack(new, 1) if new else torch.zeros(len(batch), 0, dtype=torch.long)
    return [decode_generated(vlm.adapter.tokenizer, row.tolist()) for row in ids]
