"""Where heads look from one query position: each head's attention mass on the image tokens (the demo's first
table), as :class:`AttentionMass`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..viz import head_heatmap, write_html_atomic, write_text_atomic

TITLE = "Attention mass from the last token to the image tokens"


def last_token_attention(patterns: Sequence[torch.Tensor], last: int) -> np.ndarray:
    """Every head's attention from one query position, gathered over layers.

    Args:
        patterns: one ``B H P P`` attention pattern per layer (batch row 0 is used).
        last: the query position (the last real token).

    Returns:
        ``L H P`` float64 attention weights from ``last`` to every key position.
    """
    return torch.stack([p[0, :, last, :].detach().to("cpu", torch.float64) for p in patterns]).numpy()


@register_result
@dataclass
class AttentionMass(Result):
    """Each head's attention mass (the sum of its weights over the image positions) from the last prompt token.

    Attributes:
        model: the model's name.
        frame: one row per head: ``layer``, ``head``, ``mass``.
    """

    model: str
    frame: pd.DataFrame

    kind = "demo"
    reproduced_files = ("attention_mass.csv", "heatmap.html")
    marker_files = ("attention_mass.csv", "summary.json")
    figure_name = "heatmap"
    table_name = "attention_mass.csv"

    @classmethod
    def from_attention(cls, model: str, attention: np.ndarray, image_positions: np.ndarray,
                       layers: Sequence[int] | None = None) -> AttentionMass:
        """From ``L H P`` attention weights (:func:`last_token_attention`) and the image tokens' positions;
        ``layers`` names the layer of each row (default ``0..L-1``; a hybrid model's softmax layers)."""
        mass = attention[:, :, image_positions].sum(-1)  # L H
        layers = list(range(mass.shape[0])) if layers is None else [int(layer) for layer in layers]
        frame = pd.DataFrame(
            [(layer, head, float(mass[row, head])) for row, layer in enumerate(layers) for head in range(mass.shape[1])],
            columns=["layer", "head", "mass"],
        )
        return cls(model, frame)

    @property
    def mass(self) -> np.ndarray:
        """``L H`` the masses."""
        return self.frame.pivot(index="layer", columns="head", values="mass").to_numpy()

    @classmethod
    def load(cls, directory: str | os.PathLike) -> AttentionMass:
        directory = Path(directory)
        frame = read_csv_columns(directory / "attention_mass.csv", ("layer", "head", "mass"))
        summary = read_json_object(directory / "summary.json")
        require_keys(summary, ("model",), directory / "summary.json")
        return cls(summary["model"], frame)

    def to_frame(self) -> pd.DataFrame:
        return self.frame

    def figure(self) -> Any:
        return head_heatmap(self.frame, "mass", title=TITLE, model=self.model, n=1)

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``attention_mass.csv`` and ``heatmap.html`` atomically."""
        out = Path(out)
        write_text_atomic(self.frame.to_csv(index=False), out / "attention_mass.csv")
        write_html_atomic(self.figure(), out / "heatmap.html")
        return out
