"""Counterfactual pairs made into batches that line up token for token on a model, and where to patch them.

Patching position p of the counterfactual run into position p of the clean run is only meaningful when both
sequences have the same length, the same image tokens at the same places (same grids) and the same text tokens.
:func:`check_alignment` proves it on the model's own processor before any patching and returns the patch positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..stimuli.core import PairAlignmentError, StimulusError
from ..stimuli.pairs import CounterfactualPair, PairSet

__all__ = ["AlignedPairs", "check_alignment", "patch_positions"]


@dataclass
class AlignedPairs:
    """Clean and counterfactual batches that line up token for token, and where to patch.

    Attributes:
        pairs: the pairs, in batch row order.
        clean: the clean batch (row r = pair r).
        counterfactual: the counterfactual batch, same shape and same positions.
        positions: per pair, the sorted patch positions in the batch rows (a text span's tokens, or the last
            position), identical on both sides.
    """

    pairs: list[CounterfactualPair]
    clean: Any
    counterfactual: Any
    positions: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.pairs)


def _differences(a: Any, b: Any, tokenizer: Any, same_text: bool = True) -> list[str]:
    """What differs between two TokenIndex rows that must line up (padding ignored: if every row of the batch lines
    up, both batches pad each row alike). ``same_text`` False: the pair has its own counterfactual prompt, whose text
    tokens may differ (their count and places may not)."""
    out = []
    ra, rb = a.roles[a.roles != "pad"], b.roles[b.roles != "pad"]
    la, lb = len(ra), len(rb)
    if la != lb:
        out.append(f"sequence length {la} (clean) vs {lb} (counterfactual)")
    ia, ib = int((a.roles == "image").sum()), int((b.roles == "image").sum())
    if ia != ib:
        out.append(f"image-token count {ia} (clean) vs {ib} (counterfactual)")
    ga, gb = [(g.name, g.shape) for g in a.grids], [(g.name, g.shape) for g in b.grids]
    if ga != gb:
        out.append(f"image grids {ga} (clean) vs {gb} (counterfactual)")
    if not out and not np.array_equal(ra, rb):
        k = int(np.flatnonzero(ra != rb)[0])
        out.append(f"token roles differ at real position {k}: {ra[k]!r} (clean) vs {rb[k]!r} (counterfactual)")
    if not same_text:
        return out
    ta = a.input_ids[(a.roles != "pad") & (a.roles != "image")]
    tb = b.input_ids[(b.roles != "pad") & (b.roles != "image")]
    if not np.array_equal(ta, tb):
        m = min(len(ta), len(tb))
        k = int(np.flatnonzero(ta[:m] != tb[:m])[0]) if (ta[:m] != tb[:m]).any() else m
        da = tokenizer.decode(ta[k:k + 4].tolist()) if k < len(ta) else "<end>"
        db = tokenizer.decode(tb[k:k + 4].tolist()) if k < len(tb) else "<end>"
        out.append(f"text tokens differ from text token {k}: {da!r} (clean) vs {db!r} (counterfactual)")
    return out


def patch_positions(index: Any, pair: CounterfactualPair) -> np.ndarray:
    """The sorted positions of ``pair``'s patch in one prepared row (``index``, the clean side's TokenIndex).

    Raises:
        StimulusError: a box that covers no image token, a position outside the pair's sequence, or an unknown
            patch kind; the message names the pair.
    """
    patch, kind = pair.patch, pair.patch.get("kind")
    if kind == "last":
        return np.array([index.last_position])
    if kind == "span":
        return index.span(patch["text"], occurrence=int(patch.get("occurrence", -1)))
    if kind == "box":
        found = index.positions_covering(tuple(patch["box"]))
        if not len(found):
            raise StimulusError(f"pair {pair.id!r}: patch box {patch['box']} covers no image token of the clean "
                                f"image on this model; draw a larger box")
        return found
    if kind == "positions":
        real = np.flatnonzero(index.roles != "pad")  # the pair's own sequence inside the padded row
        bad = [p for p in patch["positions"] if not -len(real) <= p < len(real)]
        if bad:
            raise StimulusError(f"pair {pair.id!r}: patch positions {bad} are outside its {len(real)}-token "
                                f"sequence on this model")
        return np.unique(real[np.array(patch["positions"])])
    raise StimulusError(f"pair {pair.id!r} has patch {patch!r}; kind must be 'last', 'span', 'box' or 'positions'")


def check_alignment(vlm: Any, pairs: PairSet | Sequence[CounterfactualPair], *, chat: bool = False) -> AlignedPairs:
    """Prepare both sides of every pair with ``vlm``'s processor and check that they line up token for token.

    Patching position p of the counterfactual run into position p of the clean run is only meaningful when both
    sequences have the same length, the same image tokens at the same places (same grids) and the same text tokens.
    Identical prompts guarantee the text; the image-token count can still differ on families whose count depends on
    the image size or aspect ratio (Qwen2-VL's dynamic resolution, LLaVA-OneVision's any-res tiles).

    Args:
        vlm: a loaded :class:`~vlmbind.engine.vlm.VLM`.
        pairs: the pairs, prepared as one batch (slice a large PairSet).
        chat: wrap prompts in the processor's chat template.

    Returns:
        AlignedPairs with both batches and, per pair, the patch positions (``TokenIndex.span`` on the pair's text
        span and occurrence, or the last position).

    Raises:
        PairAlignmentError: a pair whose sides differ; the message names the pair id and what differs.
        StimulusError: no pairs.
    """
    pairs = list(pairs)
    if not pairs:
        raise StimulusError("check_alignment needs at least one pair")
    clean = vlm.prepare([p.clean.image for p in pairs], [p.clean.prompt for p in pairs], chat=chat)
    cf = vlm.prepare([p.counterfactual.image for p in pairs], [p.counterfactual.prompt for p in pairs], chat=chat)
    tokenizer = vlm.adapter.tokenizer
    # every row first: one misaligned row changes the other rows' left padding, so their positions differ too
    for r, p in enumerate(pairs):
        problems = _differences(clean.index[r], cf.index[r], tokenizer, not p.counterfactual_prompt_differs)
        if problems:
            raise PairAlignmentError(
                f"pair {p.id!r} ({p.condition}) does not line up on {getattr(vlm, 'name', 'this model')}: "
                f"{'; '.join(problems)}. Use prompts of the same token count and images of the same size on both "
                f"sides."
            )
    if clean.seq_len != cf.seq_len:  # unreachable when every row lines up; kept as the guard positions rely on
        raise PairAlignmentError(f"batches padded to {clean.seq_len} (clean) vs {cf.seq_len} (counterfactual)")
    positions = []
    for r, p in enumerate(pairs):
        # the sides line up token for token, so the clean side's positions are the counterfactual's; a text patch
        # of identical prompts is checked on both as a guard
        pos_clean = patch_positions(clean.index[r], p)
        same_span = p.patch.get("kind") in ("span", "last") and not p.counterfactual_prompt_differs
        pos_cf = patch_positions(cf.index[r], p) if same_span else pos_clean
        if not np.array_equal(pos_clean, pos_cf):
            raise PairAlignmentError(f"pair {p.id!r}: patch positions {pos_clean.tolist()} (clean) vs "
                                     f"{pos_cf.tolist()} (counterfactual)")
        positions.append(pos_clean)
    return AlignedPairs(pairs, clean, cf, positions)
