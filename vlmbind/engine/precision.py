"""How far head scores move when the weights are bfloat16 or float16, from saved measurements.

Scores are always computed in float32 from the logits, but low-precision weights change every activation on the way
there. ``benchmarks/precision.py`` measures the agreement of bfloat16 with float32 head scores on the
real-vocabulary tiny models and saves it in ``precision.json`` beside this module; :func:`low_precision_warning`
turns that saved measurement into the warning a command prints when a user scores in low precision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

PRECISION_FILE = Path(__file__).with_name("precision.json")
LOW_PRECISION = (torch.bfloat16, torch.float16)


def weights_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the language model's weights (the first floating-point parameter)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def low_precision_warning(vlm: Any) -> str | None:
    """A one-paragraph warning with the measured bfloat16 agreement when ``vlm``'s weights are bfloat16 / float16;
    None in float32."""
    dtype = weights_dtype(vlm.model)
    if dtype not in LOW_PRECISION:
        return None
    name = str(dtype).removeprefix("torch.")
    try:
        m = json.loads(PRECISION_FILE.read_text())
        figure = (f"on the real-vocabulary tiny models, bfloat16 head scores agreed with float32 at a median Spearman "
                  f"of {m['median_spearman']:.2f} (lowest {m['min_spearman']:.2f}), a median top-5 overlap of "
                  f"{m['median_top5_overlap']:.0f}/5 and a median relative difference of "
                  f"{100 * m['median_relative_difference']:.0f}% ({len(m['rows'])} family x condition runs, "
                  f"benchmarks/precision.py, {m['date']})")
    except (OSError, ValueError, KeyError):
        figure = "no saved measurement of the difference was found (run benchmarks/precision.py)"
    return (f"warning: {vlm.name} runs in {name}; scores are computed in float32 from its logits, but {name} weights "
            f"change them: {figure}. Rank heads with --dtype float32 where memory allows, or check the top heads "
            f"in float32.")
