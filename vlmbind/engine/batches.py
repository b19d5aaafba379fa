"""What a forward takes and gives: :class:`Batch` (processor outputs plus a TokenIndex per row), :class:`RunOutput`,
and :func:`append_tokens`, the one way tokens are appended to a batch's inputs (greedy decoding by full forwards,
pointing traces extended by their generated ids). Which inputs are per token is the adapter's declaration
(``ModelAdapter.token_inputs``), never a guess from tensor shapes; an undeclared per-token input is an error, so a
family whose processor gains one cannot be extended silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from ..core.errors import InputError
from ..core.tokens import TokenIndex

if TYPE_CHECKING:
    from ..adapters.base import ModelAdapter


@dataclass
class Batch:
    """Processor outputs for a batch plus what every position is.

    Attributes:
        inputs: the processor's tensors (``input_ids``, ``attention_mask``, ``pixel_values``, ...).
        index: one TokenIndex per row.
        prompts: the user prompts (before image placeholders were added).
        images: the RGB images of each row.
    """

    inputs: dict[str, torch.Tensor]
    index: list[TokenIndex]
    prompts: list[str]
    images: list[list[Image.Image]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def seq_len(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    @property
    def last_positions(self) -> np.ndarray:
        """``B`` the last real position of each row."""
        return np.array([ti.last_position for ti in self.index])


@dataclass
class RunOutput:
    """Logits of one forward and the captured activations (site name -> tensor)."""

    logits: torch.Tensor
    cache: dict[str, torch.Tensor]

    def __getitem__(self, site: str) -> torch.Tensor:
        return self.cache[site]


def append_tokens(adapter: ModelAdapter, inputs: dict[str, Any], tokens: torch.Tensor) -> dict[str, Any]:
    """``inputs`` with ``tokens`` (``B`` or ``B T``) appended as text tokens to every per-token input.

    ``input_ids`` get the tokens, ``attention_mask`` ones, the family's ``token_inputs`` (token type ids) zeros, or
    the family's ``appended_token_values`` (``"last"``: a copy of the last position's entry, as Llama-3.2-Vision's
    ``cross_attention_mask`` grows in HF's generation; rows are left-padded, so it is a real token's); everything else (pixels, grids) is passed on unchanged. The input dict
    is not modified.

    Raises:
        InputError: a per-token input has another shape than ``input_ids``, or a tensor shaped like ``input_ids``
            is not declared by the adapter (it would be left one token short).
    """
    ids = inputs["input_ids"]
    tokens = torch.as_tensor(tokens)
    if tokens.ndim == 1:
        tokens = tokens[:, None]
    if tokens.ndim != 2 or tokens.shape[0] != ids.shape[0]:
        raise InputError(f"append_tokens takes B or B T tokens for {ids.shape[0]} rows, got shape "
                         f"{tuple(tokens.shape)}")
    declared = ("input_ids", "attention_mask", *adapter.token_inputs)
    undeclared = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in declared
                  and tuple(v.shape) == tuple(ids.shape)]
    if undeclared:
        raise InputError(f"{', '.join(undeclared)} look per-token (shape {tuple(ids.shape)}) but "
                         f"{type(adapter).__name__}.token_inputs does not declare them; add them there")
    out = dict(inputs)
    for key in declared:
        value = inputs.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if value.shape[:2] != ids.shape[:2]:
            raise InputError(f"{key} has shape {tuple(value.shape)}, not (batch, sequence) like input_ids; cannot "
                             f"append tokens")
        if key == "input_ids":
            col = tokens.to(value.device, value.dtype)
        elif adapter.appended_token_values.get(key) == "last":
            col = value[:, -1:].expand(-1, tokens.shape[1], *value.shape[2:])
        else:
            fill = 1 if key == "attention_mask" else adapter.appended_token_values.get(key, 0)
            col = torch.full(tokens.shape, fill, dtype=value.dtype, device=value.device)
        out[key] = torch.cat([value, col], 1)
    return out
