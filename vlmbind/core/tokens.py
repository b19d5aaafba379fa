"""TokenIndex: what every position of a prepared prompt is.

For each position: its role (``image``, ``text`` or ``special``); for image tokens, the grid they belong to (an image
can have several: Molmo2's low-res and high-res grids, LLaVA-OneVision's base grid and any-res tiles), the cell
(row, col) in that grid, and the pixel box the token covers in the *original* image, ``(x0, y0, x1, y1)`` in pixels
with x to the right and y down. Boxes are computed from the processor's own resize / crop arithmetic and are checked in
tests against the model's patch embeddings (changing pixels inside a box changes the features only of the tokens whose
boxes contain them).

Text spans: :meth:`TokenIndex.span` finds the positions of a piece of the prompt (e.g. ``"blue circle"``), which
mediation uses to patch the tokens of one described object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import SpanNotFoundError

ROLES = ("text", "image", "special", "pad")
ROLE_DTYPE = "<U8"


@dataclass(frozen=True)
class ImageGrid:
    """One grid of image tokens.

    Attributes:
        name: e.g. ``"image"``, ``"base"``, ``"tile"``, ``"low_res"``, ``"high_res"``.
        image: index of the image within the example.
        positions: ``rows cols`` int array, the sequence position of each cell's token.
        boxes: ``rows cols 4`` float array, ``(x0, y0, x1, y1)`` in original-image pixels.
    """

    name: str
    image: int
    positions: np.ndarray
    boxes: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.positions.shape[0]), int(self.positions.shape[1])


@dataclass
class TokenIndex:
    """Roles, image grids and text offsets of one example of a batch (positions index the padded batch row).

    Attributes:
        input_ids: ``P`` token ids of the row.
        roles: ``P`` array of role strings (see ``ROLES``).
        grids: the image-token grids of this example.
        text_offsets: ``P 2`` character offsets of each text token in ``text`` (``-1`` for non-text tokens).
        text: the prompt's text tokens decoded and concatenated (image placeholders removed).
        image_sizes: ``(width, height)`` of each original image.
        key_grids: grids over the image keys of cross-attention layers (Llama-3.2-Vision, whose image never enters
            the sequence): a cell's "position" is its index on the last axis of ``cross_attn.hook_pattern``, not a
            sequence position, so these are kept apart from ``grids``; empty for every other family.
    """

    input_ids: np.ndarray
    roles: np.ndarray
    grids: list[ImageGrid]
    text_offsets: np.ndarray
    text: str
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    key_grids: list[ImageGrid] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    def positions(self, role: str) -> np.ndarray:
        """All positions with this role, in order."""
        return np.flatnonzero(self.roles == role)

    @property
    def image_positions(self) -> np.ndarray:
        return self.positions("image")

    @property
    def last_position(self) -> int:
        """The last non-padding position (where the next token is predicted)."""
        return int(np.flatnonzero(self.roles != "pad")[-1])

    def grid(self, name: str | None = None, image: int = 0) -> ImageGrid:
        """The grid called ``name`` of image ``image`` (the first grid of that image when name is None)."""
        for g in self.grids:
            if g.image == image and (name is None or g.name == name):
                return g
        names = [(g.name, g.image) for g in self.grids]
        raise KeyError(f"no grid {name!r} for image {image}; this example has {names}")

    def cell(self, position: int) -> tuple[str, int, int, int] | None:
        """``(grid name, image, row, col)`` of an image token, or None for other positions."""
        for g in self.grids:
            hit = np.argwhere(g.positions == position)
            if len(hit):
                return g.name, g.image, int(hit[0, 0]), int(hit[0, 1])
        return None

    def box(self, position: int) -> tuple[float, float, float, float] | None:
        """The original-image pixel box of an image token, or None for other positions."""
        for g in self.grids:
            hit = np.argwhere(g.positions == position)
            if len(hit):
                return tuple(float(v) for v in g.boxes[hit[0, 0], hit[0, 1]])
        return None

    def positions_covering(
        self, box: tuple[float, float, float, float], image: int = 0, grid: str | None = None, min_overlap: float = 0.0
    ) -> np.ndarray:
        """Image-token positions whose boxes overlap ``box`` (x0, y0, x1, y1) by more than ``min_overlap`` of the
        token's area; all grids of the image unless ``grid`` names one."""
        return _covering(self.grids, box, image, grid, min_overlap)

    def keys_covering(
        self, box: tuple[float, float, float, float], image: int = 0, min_overlap: float = 0.0
    ) -> np.ndarray:
        """As :meth:`positions_covering`, over :attr:`key_grids`: the cross-attention keys (indices on the last axis
        of ``cross_attn.hook_pattern``) whose patches overlap ``box``."""
        return _covering(self.key_grids, box, image, None, min_overlap)

    def span(self, text: str, occurrence: int = -1) -> np.ndarray:
        """Positions of the tokens that cover ``text`` in the prompt.

        Args:
            text: a piece of the prompt, e.g. ``"blue circle"``.
            occurrence: which occurrence when it appears several times (``-1``: the last, ``0``: the first).

        Raises:
            SpanNotFoundError: ``text`` is not in the prompt.
        """
        starts, i = [], self.text.find(text)
        while i >= 0:
            starts.append(i)
            i = self.text.find(text, i + 1)
        if not starts:
            raise SpanNotFoundError(f"{text!r} does not occur in the prompt {self.text!r}")
        try:
            start = starts[occurrence]
        except IndexError:
            raise SpanNotFoundError(
                f"{text!r} occurs {len(starts)} times in the prompt; occurrence {occurrence} does not exist"
            ) from None
        end = start + len(text)
        o = self.text_offsets
        hit = (o[:, 0] >= 0) & (o[:, 0] < end) & (o[:, 1] > start)
        return np.flatnonzero(hit)


def _covering(grids: list[ImageGrid], box: tuple[float, float, float, float], image: int, grid: str | None,
              min_overlap: float) -> np.ndarray:
    """The cells of ``grids`` (image ``image``, grid ``grid`` or all) whose boxes overlap ``box`` by more than
    ``min_overlap`` of the cell's area."""
    x0, y0, x1, y1 = box
    out = []
    for g in grids:
        if g.image != image or (grid is not None and g.name != grid):
            continue
        b = g.boxes.reshape(-1, 4)
        ix = np.clip(np.minimum(b[:, 2], x1) - np.maximum(b[:, 0], x0), 0, None)
        iy = np.clip(np.minimum(b[:, 3], y1) - np.maximum(b[:, 1], y0), 0, None)
        area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        keep = (ix * iy) > min_overlap * area
        keep &= (ix > 0) & (iy > 0)
        out.append(g.positions.reshape(-1)[keep])
    return np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=int)


# special tokens that belong to an answer's text: Qwen's, InternVL's and GLM's grounding markers (a box means nothing
# without them)
POINTING_TOKENS = ("<|box_start|>", "<|box_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|quad_start|>",
                   "<|quad_end|>", "<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>", "<|begin_of_box|>",
                   "<|end_of_box|>")


def hidden_ids(tokenizer) -> frozenset[int]:
    """Ids a reader of generated text does not see: the special tokens (end of turn, padding, image placeholders),
    except :data:`POINTING_TOKENS`. Cached on the tokenizer."""
    cached = getattr(tokenizer, "_vlmbind_hidden_ids", None)
    if cached is not None:
        return cached
    special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    for i, token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(token, "special", False):
            special.add(int(i))
    vocab = tokenizer.get_vocab()
    hidden = frozenset(special - {vocab[t] for t in POINTING_TOKENS if t in vocab})
    try:
        tokenizer._vlmbind_hidden_ids = hidden
    except AttributeError:  # a tokenizer that refuses attributes: recomputed each time
        pass
    return hidden


def decode_generated(tokenizer, ids) -> str:
    """Generated ids as the answer's text: special tokens dropped, Qwen's pointing markers kept (see
    :func:`hidden_ids`)."""
    hidden = hidden_ids(tokenizer)
    return tokenizer.decode([int(i) for i in ids if int(i) not in hidden], skip_special_tokens=False)


def decoded_spans(tokenizer, ids: list[int], *, skip_special_tokens: bool = False) -> tuple[list[tuple[int, int]], str]:
    """``([(start, end) of each token in the text], text)`` of ``ids`` decoded together.

    Offsets come from decoding growing prefixes, never one token at a time: a SentencePiece decoder drops the leading
    space of a lone token (``decode([▁red]) == "red"``), so token-by-token text loses every space. A token whose
    prefix decodes to a text that does not extend the previous one (a byte-fallback character still incomplete)
    starts where the two texts agree.
    """
    spans, previous = [], ""
    for k in range(len(ids)):
        current = tokenizer.decode(ids[: k + 1], skip_special_tokens=skip_special_tokens,
                                   clean_up_tokenization_spaces=False)
        start = len(previous)
        if not current.startswith(previous):
            start = next((i for i, (a, b) in enumerate(zip(previous, current)) if a != b), min(len(previous),
                                                                                              len(current)))
        spans.append((start, len(current)))
        previous = current
    return spans, previous


def text_offsets(tokenizer, input_ids: np.ndarray, roles: np.ndarray) -> tuple[np.ndarray, str]:
    """The prompt's text tokens decoded together (image and special tokens left out) and where each token lands."""
    offsets = np.full((len(input_ids), 2), -1, dtype=np.int64)
    positions = np.flatnonzero(np.asarray(roles) == "text")
    spans, text = decoded_spans(tokenizer, [int(i) for i in np.asarray(input_ids)[positions]])
    for pos, span in zip(positions, spans):
        offsets[pos] = span
    return offsets, text


def grid_boxes(rows: int, cols: int, cell_w: float, cell_h: float, x_off: float = 0.0, y_off: float = 0.0,
               scale_x: float = 1.0, scale_y: float = 1.0, image_size: tuple[int, int] | None = None) -> np.ndarray:
    """Pixel boxes of a regular grid laid on a processed image, mapped back to the original image.

    A cell (r, c) covers ``[x_off + c*cell_w, x_off + (c+1)*cell_w)`` in processed pixels (likewise y); dividing by
    ``scale`` maps processed pixels back to original pixels. With ``image_size`` the boxes are clipped to the image.
    """
    c = np.arange(cols, dtype=np.float64)
    r = np.arange(rows, dtype=np.float64)
    x0 = (x_off + c * cell_w) / scale_x
    x1 = (x_off + (c + 1) * cell_w) / scale_x
    y0 = (y_off + r * cell_h) / scale_y
    y1 = (y_off + (r + 1) * cell_h) / scale_y
    boxes = np.zeros((rows, cols, 4))
    boxes[..., 0] = x0[None, :]
    boxes[..., 2] = x1[None, :]
    boxes[..., 1] = y0[:, None]
    boxes[..., 3] = y1[:, None]
    if image_size is not None:
        w, h = image_size
        boxes[..., [0, 2]] = boxes[..., [0, 2]].clip(0, w)
        boxes[..., [1, 3]] = boxes[..., [1, 3]].clip(0, h)
    return boxes


def stretched_image_grids(image_positions: np.ndarray, image_sizes: list[tuple[int, int]], rows: int, cols: int,
                          cell: float, resized: tuple[int, int]) -> list[ImageGrid]:
    """One ``rows x cols`` grid per image, in prompt order, for families that stretch every image to the same
    ``resized`` ``(height, width)`` and give it one token per ``cell``-pixel square: image ``k`` takes the next
    ``rows * cols`` of ``image_positions``, row by row, and each cell's box is mapped back to its original image
    (``image_sizes``: ``(width, height)`` per image)."""
    n = rows * cols
    height, width = resized
    grids = []
    for k, (orig_w, orig_h) in enumerate(image_sizes):
        positions = image_positions[k * n : (k + 1) * n].reshape(rows, cols)
        boxes = grid_boxes(rows, cols, cell, cell, scale_x=width / orig_w, scale_y=height / orig_h,
                           image_size=(orig_w, orig_h))
        grids.append(ImageGrid("image", k, positions, boxes))
    return grids
