"""Standalone vision encoders (CLIP, SigLIP, DINOv2): the same capture, probes and site names as a VLM's tower.

FBP and VOB measure binding in plain vision encoders, so vlmbind treats them as models with a vision tower and
nothing else: sites are ``vision.blocks.{l}.hook_resid_post`` (each encoder layer's output, every token: the class
token(s) first, then the patches in raster order), ``prepare`` takes images (prompts are ignored), and each example's
:class:`PatchIndex` maps every token to its patch cell and original-image pixel box, so captures pool per object and
the pairwise probes know which patches belong to the same object.

Design: a small declarative table per family (model class, layer list path, prefix tokens); boxes follow the
image processor's own geometry (resize by shortest edge or to a fixed size, then an optional centre crop), computed
from its settings, never from a guess about the checkpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoImageProcessor

from ..adapters.base import get_module
from ..core.choices import ENCODER_NAMES
from ..core.errors import InputError, ModelLoadError
from ..core.sites import resolve_sites
from .batches import RunOutput
from .hooks import HookSession

ENCODERS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {"class": "CLIPVisionModel", "layers": "encoder.layers", "prefix": 1,
                          "display": "CLIP vision"},
    "siglip_vision_model": {"class": "SiglipVisionModel", "layers": "encoder.layers", "prefix": 0,
                            "display": "SigLIP vision"},
    "dinov2": {"class": "Dinov2Model", "layers": "encoder.layer", "prefix": 1, "display": "DINOv2"},
}


def _size(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value else None


@dataclass
class PatchIndex:
    """Where each token of one encoder input comes from.

    Attributes:
        prefix: class-like tokens before the patches.
        rows, cols: the patch grid.
        boxes: ``rows cols 4`` original-image pixel boxes ``(x0, y0, x1, y1)`` of the patches.
    """

    prefix: int
    rows: int
    cols: int
    boxes: np.ndarray

    @property
    def n_tokens(self) -> int:
        return self.prefix + self.rows * self.cols

    def token_table(self, objects: list[Any] | None) -> dict[str, list]:
        """Every token: position, grid (``cls`` / ``patches``), row, col and the object its patch centre falls in."""
        table: dict[str, list] = {"position": [], "grid": [], "row": [], "col": [], "object": []}
        for t in range(self.prefix):
            for key, value in zip(table, (t, "cls", -1, -1, -1)):
                table[key].append(value)
        for r in range(self.rows):
            for c in range(self.cols):
                x0, y0, x1, y1 = self.boxes[r, c]
                cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
                owner = -1
                for k, o in enumerate(objects or []):
                    ox0, oy0, ox1, oy1 = (o.box if hasattr(o, "box") else o["box"])
                    if ox0 <= cx < ox1 and oy0 <= cy < oy1:
                        owner = k
                        break
                for key, value in zip(table, (self.prefix + r * self.cols + c, "patches", r, c, owner)):
                    table[key].append(value)
        return table


@dataclass
class EncoderBatch:
    inputs: dict[str, torch.Tensor]
    index: list[PatchIndex]
    prompts: list[str]
    images: list[list[Image.Image]]

    def __len__(self) -> int:
        return len(self.index)


class _EncoderAdapter:
    """The part of the VLM adapter interface the hook layer uses for a vision tower."""

    projector_in_sequence_order = False
    n_layers = 0

    def __init__(self, model: Any, layers_path: str):

        self.model = model
        self._layers = get_module(model, layers_path)

    @property
    def n_vision_layers(self) -> int:
        return len(self._layers)

    def vision_block(self, layer: int) -> Any:
        return self._layers[layer]

    def absent_sites(self) -> dict[str, Any]:
        """No language-model layers, so no per-layer site is missing (the hook layer asks every adapter)."""
        return {}


class VisionEncoder:
    """A loaded standalone vision encoder: ``prepare`` images, ``run`` with vision sites, ``capture`` like a VLM."""

    def __init__(self, model: Any, processor: Any, name: str, source: str, family: str):
        self.model = model.eval()
        self.processor = processor
        self.name, self.source, self.family = name, source, family
        self.spec = ENCODERS[family]
        self.adapter = _EncoderAdapter(model, self.spec["layers"])
        self.training = None

    def __repr__(self) -> str:
        return f"VisionEncoder({self.name!r}, {self.spec['display']}, {self.n_vision_layers} layers)"

    @property
    def n_vision_layers(self) -> int:
        return self.adapter.n_vision_layers

    @property
    def n_layers(self) -> int:
        return 0

    def sites(self, patterns: Any) -> list[Any]:
        return resolve_sites(patterns, 0, self.n_vision_layers, projector=False)

    def _geometry(self, image: Image.Image, rows: int, cols: int) -> np.ndarray:
        """Original-image pixel boxes of the patch grid, following the processor's resize and centre crop."""
        ip = self.processor
        w, h = image.size
        sx = sy = 1.0
        if getattr(ip, "do_resize", True):
            short = _size(ip.size, "shortest_edge")
            if short:
                sx = sy = short / min(w, h)
            else:
                sx, sy = _size(ip.size, "width") / w, _size(ip.size, "height") / h
        rw, rh = w * sx, h * sy
        ox = oy = 0.0
        cw, ch = rw, rh
        if getattr(ip, "do_center_crop", False) and getattr(ip, "crop_size", None):
            cw, ch = float(_size(ip.crop_size, "width")), float(_size(ip.crop_size, "height"))
            ox, oy = (rw - cw) / 2, (rh - ch) / 2
        pw, ph = cw / cols, ch / rows
        boxes = np.zeros((rows, cols, 4))
        for r in range(rows):
            for c in range(cols):
                boxes[r, c] = [(ox + c * pw) / sx, (oy + r * ph) / sy, (ox + (c + 1) * pw) / sx,
                               (oy + (r + 1) * ph) / sy]
        return boxes

    def prepare(self, images: Any, prompts: Any = None) -> EncoderBatch:
        """Pixel values and a :class:`PatchIndex` per image (``prompts`` are accepted and ignored).

        Raises:
            InputError: no images, or something that is not a PIL image.
        """
        if isinstance(images, Image.Image):
            images = [images]
        rows_in = [([im] if isinstance(im, Image.Image) else list(im)) for im in images]
        if not rows_in or any(len(r) != 1 for r in rows_in):
            raise InputError("a vision encoder takes exactly one image per example")
        for i, (im,) in enumerate(rows_in):
            if not isinstance(im, Image.Image):
                raise InputError(f"example {i}: expected a PIL image, got {type(im).__name__}")
        rows_in = [[im if im.mode == "RGB" else im.convert("RGB")] for (im,) in rows_in]
        pixel_values = self.processor(images=[r[0] for r in rows_in], return_tensors="pt")["pixel_values"]
        patch = int(self.model.config.patch_size)
        grid_rows, grid_cols = pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch
        index = [PatchIndex(self.spec["prefix"], grid_rows, grid_cols, self._geometry(r[0], grid_rows, grid_cols))
                 for r in rows_in]
        prompts = list(prompts) if prompts is not None and not isinstance(prompts, str) else [""] * len(rows_in)
        return EncoderBatch({"pixel_values": pixel_values}, index, prompts, rows_in)

    def run(self, batch: EncoderBatch, *, sites: Any = ()) -> Any:
        """One forward capturing ``sites``; ``logits`` holds the last hidden state (an encoder has no vocabulary)."""
        resolved = self.sites(sites) if sites else []
        session = HookSession(self.adapter, resolved)
        with torch.no_grad(), session:
            out = self.model(pixel_values=batch.inputs["pixel_values"].to(next(self.model.parameters()).device))
        cache = {k: (v[0] if len(v) == 1 else torch.cat(v, 0)) for k, v in session.captured.items()}
        return RunOutput(logits=out.last_hidden_state, cache=cache)

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "display_name": self.spec["display"], "vision_layers": self.n_vision_layers,
                "patch_size": int(self.model.config.patch_size), "hidden": int(self.model.config.hidden_size)}


def load_encoder(path: str, config: Any, **hf_kwargs: Any) -> VisionEncoder:
    """A standalone vision encoder from a directory or hub id whose config is one of :data:`ENCODERS`."""
    family = config.model_type
    spec = ENCODERS[family]
    with contextlib.suppress(KeyError):
        hf_kwargs.pop("seed")
    try:
        model = getattr(transformers, spec["class"]).from_pretrained(path, **hf_kwargs)
        processor = AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load {spec['display']} weights or image processor from {path!r}: "
                             f"{str(exc).splitlines()[0]}") from exc
    source = str(Path(path).resolve()) if Path(path).is_dir() else f"hub:{path}"
    return VisionEncoder(model, processor, path, source, family)


# ----------------------------------------------------------------------------------------------------------------
# tiny random encoders (tests, examples)
# ----------------------------------------------------------------------------------------------------------------


def build_tiny_encoder(name: str, seed: int = 0, image_size: int = 224, patch: int = 16) -> VisionEncoder:
    """A random-weight encoder of about 0.1M parameters with its real image processor (no crop, fixed size)."""
    if name not in ENCODER_NAMES:
        raise InputError(f"unknown tiny encoder {name!r}; known: {', '.join(ENCODER_NAMES)}")
    torch.manual_seed(seed)
    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
              "image_size": image_size, "patch_size": patch}
    size = {"height": image_size, "width": image_size}
    if name == "tiny-clip":
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**common))
        processor = transformers.CLIPImageProcessor(size=size, do_center_crop=False)
        family = "clip_vision_model"
    elif name == "tiny-siglip":
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common))
        processor = transformers.SiglipImageProcessor(size=size)
        family = "siglip_vision_model"
    else:
        model = transformers.Dinov2Model(transformers.Dinov2Config(**common))
        processor = transformers.BitImageProcessor(size=size, do_center_crop=False)
        family = "dinov2"
    return VisionEncoder(model, processor, name, f"tiny (random weights, seed {seed})", family)
