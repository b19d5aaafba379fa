"""Shared fixtures: tiny models of every family (built once per session) and simple drawn images."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from hypothesis import settings
from PIL import Image, ImageDraw

import vlmbind as vb
from vlmbind.adapters.base import get_module
from vlmbind.tiny import TINY_NAMES

# one torch thread per pytest-xdist worker (`make test` runs one worker per core), two when run alone
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

# CI replays the same property-test examples every run (a failure there is reproducible, never a coin toss); locally
# hypothesis keeps exploring new ones
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

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


_CACHE: dict[str, vb.VLM] = {}


def get_tiny(name: str) -> vb.VLM:
    if name not in _CACHE:
        _CACHE[name] = vb.load(name)
    return _CACHE[name]


@pytest.fixture(params=TINY_NAMES)
def tiny(request) -> vb.VLM:
    """Each tiny model in turn (built once per session)."""
    return get_tiny(request.param)


@pytest.fixture
def scene() -> Image.Image:
    return draw_scene(0)


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


def majority_colour(img: Image.Image, box) -> tuple[int, int, int]:
    """The most frequent non-white colour inside a pixel box of an image (an object's drawn colour)."""
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    px = np.asarray(img)[y0:y1, x0:x1].reshape(-1, 3)
    px = px[(px != 255).any(1)]
    values, counts = np.unique(px, axis=0, return_counts=True)
    return tuple(int(v) for v in values[counts.argmax()])
