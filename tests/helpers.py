"""Builders the tests share: the tiny models and shipped organisms (each loaded once per test process), a drawn
scene, the prompt the family tests use, and small image / grid helpers."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from PIL import Image, ImageDraw

import vlmbind as vb
from vlmbind.adapters.base import get_module

PROMPT = "In this image there is a red square, a blue circle and a"


def expected_boxes(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """``rows cols 4`` pixel boxes of a grid from its column edges ``xs`` (cols+1) and row edges ``ys`` (rows+1)."""
    boxes = np.zeros((len(ys) - 1, len(xs) - 1, 4))
    boxes[..., 0], boxes[..., 2] = xs[None, :-1], xs[None, 1:]
    boxes[..., 1], boxes[..., 3] = ys[:-1, None], ys[1:, None]
    return boxes


def draw_scene(seed: int = 0, size: tuple[int, int] = (224, 224)) -> Image.Image:
    """Three coloured shapes on white at seed-dependent places."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    w, h = size
    for colour in ("red", "blue", "green"):
        x, y = int(rng.integers(10, w - 50)), int(rng.integers(10, h - 50))
        if rng.random() < 0.5:
            d.rectangle([x, y, x + 36, y + 36], fill=colour)
        else:
            d.ellipse([x, y, x + 36, y + 36], fill=colour)
    return img


def majority_colour(img: Image.Image, box) -> tuple[int, int, int]:
    """The most frequent non-white colour inside a pixel box of an image (an object's drawn colour)."""
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    px = np.asarray(img)[y0:y1, x0:x1].reshape(-1, 3)
    px = px[(px != 255).any(1)]
    values, counts = np.unique(px, axis=0, return_counts=True)
    return tuple(int(v) for v in values[counts.argmax()])


def write_hand_pairs(folder, n: int = 4, patch=None, size: tuple[int, int] = (224, 224)):
    """A researcher's own colour-swap experiment, written with PIL and json only (nothing from vlmbind): pair i shows
    a red square beside a blue circle; its counterfactual swaps the shapes, so "the red object is a" moves from
    ``square`` to ``circle``. Returns the ``pairs.jsonl`` path (images in ``img/``)."""
    import json
    from pathlib import Path

    folder = Path(folder)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    w, h = size
    lines = []
    for i in range(n):
        y = 40 + 20 * (i % 5)
        for side, red_is_square in (("a", True), ("b", False)):
            img = Image.new("RGB", size, "white")
            d = ImageDraw.Draw(img)
            for x, colour in ((30, "red"), (w // 2 + 20, "blue")):
                square = red_is_square == (colour == "red")
                (d.rectangle if square else d.ellipse)([x, y, x + 60, y + 60], fill=colour)
            img.save(folder / "img" / f"p{i}{side}.png")
        row = {"id": f"p{i}", "condition": "colour_swap", "clean_image": f"img/p{i}a.png",
               "counterfactual_image": f"img/p{i}b.png", "prompt": "the red object is a", "answer": "square",
               "answer_counterfactual": "circle"}
        if patch is not None:
            row["patch"] = patch
        lines.append(json.dumps(row))
    (folder / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "pairs.jsonl"


def write_hand_task(folder, n: int = 4, **fields):
    """The clean images of :func:`write_hand_pairs` as a task file (``task.jsonl``: image, prompt, answer, and
    ``fields`` on every row, e.g. ``accept`` or ``scorer``). Returns its path."""
    import json
    from pathlib import Path

    folder = Path(folder)
    write_hand_pairs(folder, n)
    rows = [{"id": f"q{i}", "image": f"img/p{i}a.png", "prompt": "the red object is a", "answer": "square", **fields}
            for i in range(n)]
    (folder / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "task.jsonl"


# ---- models loaded once per test process --------------------------------------------------------------------------

_LOADED: dict[str, vb.VLM] = {}
_STATE: dict[str, tuple] = {}


def get_tiny(name: str) -> vb.VLM:
    """A tiny random model of one family, built once per test process."""
    return _shared(name)


def shared_organism(name: str = "organism-p2a") -> vb.VLM:
    """A shipped organism, loaded once per test process and shared: a test that changes it (its weights, attention
    implementation or training mode, or a hook left behind) fails in ``shared_models_unchanged``; such a test loads its
    own copy with ``vb.load``."""
    return _shared(name)


def _shared(name: str) -> vb.VLM:
    if name not in _LOADED:
        _LOADED[name] = vb.load(name)
        _STATE[name] = model_state(_LOADED[name].model)
    return _LOADED[name]


def model_state(model: torch.nn.Module) -> dict[str, object]:
    """What a test could change in a shared model without reloading it: each parameter's storage and in-place
    version, gradient flags, training mode, attention implementation and the hooks on every module."""
    return {
        "parameters": tuple((n, p.data_ptr(), p._version) for n, p in model.named_parameters()),
        "requires_grad": tuple(n for n, p in model.named_parameters() if not p.requires_grad),
        "training": tuple(n for n, m in model.named_modules() if m.training),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "hooks": tuple((n, kind, len(hooks)) for n, m in model.named_modules()
                       for kind, hooks in (("forward", _own(m._forward_hooks)), ("pre", _own(m._forward_pre_hooks)),
                                           ("backward", _own(m._backward_hooks))) if hooks),
    }


def _own(hooks: dict) -> list:
    """The hooks not installed by transformers itself (its output recorders hook modules on their first forward)."""
    return [h for h in hooks.values() if not getattr(getattr(h, "func", h), "__module__", "").startswith("transformers")]


def shared_models_changed() -> dict[str, list[str]]:
    """The shared models whose state differs from when they were loaded, with what changed; they are dropped, so
    that the next test loads them afresh and only the test that changed them fails."""
    changed = {}
    for name, vlm in list(_LOADED.items()):
        now = model_state(vlm.model)
        diff = [key for key, value in now.items() if value != _STATE[name][key]]
        if diff:
            changed[name] = diff
            del _LOADED[name], _STATE[name]
    return changed


@contextlib.contextmanager
def silenced_vision_attention(vlm):
    """Zero every vision block's attention output: the tower then works patch by patch."""
    a = vlm.adapter

    def zero(module, args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    handles = [get_module(a.vision_block(i), a.vision_attention).register_forward_hook(zero)
               for i in range(a.n_vision_layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
