"""Loading models: :func:`load` and :func:`registered_names`.

``load`` accepts a registered name (``tiny-*`` random-weight models built offline, the shipped organisms, tiny vision
encoders), a local directory or a hub id. Directories and hub ids go through the real ``from_pretrained`` path for
model and processor; the family is detected from the config's ``model_type`` (vision-encoder configs give a
:class:`~vlmbind.encoders.VisionEncoder`). ``trust_remote_code`` is never set on the user's behalf.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import transformers
from safetensors import SafetensorError
from transformers import CONFIG_MAPPING, AutoConfig, AutoProcessor

from . import tiny
from .adapters.base import adapter_class_for_config, supported_families
from .encoders import ENCODER_NAMES, ENCODERS, build_tiny_encoder, load_encoder
from .errors import ModelLoadError, UnsupportedModelError, close_matches
from .models import TRAINING_FILE, VLM
from .shipped import ORGANISM_NAMES, organism_dir, shipped_organisms


def registered_names() -> list[str]:
    """Names ``load`` accepts besides directories and hub ids."""
    return [*shipped_organisms(), *tiny.TINY_NAMES, *ENCODER_NAMES]


def load(name_or_path: str | os.PathLike, **hf_kwargs: Any) -> VLM:
    """Load a model by registered name, local directory or hub id.

    Args:
        name_or_path: ``tiny-<family>``, a directory saved with ``save_pretrained``, or a hub id. Standalone vision
            encoders (CLIP, SigLIP, DINOv2 vision models; ``tiny-clip``, ``tiny-siglip``, ``tiny-dinov2``) load as a
            :class:`~vlmbind.encoders.VisionEncoder`.
        **hf_kwargs: passed to ``from_pretrained`` (``torch_dtype``, ``device_map``, ``attn_implementation``, ...).
            ``attn_implementation`` defaults to ``"eager"``; attention patterns are available with any choice.

    Raises:
        UnsupportedModelError: the config's family is not supported (the message lists the supported ones).
        ModelLoadError: the directory or hub id has no loadable config, weights or processor.
    """
    name = os.fspath(name_or_path)
    if name in ENCODER_NAMES:
        return build_tiny_encoder(name, seed=int(hf_kwargs.pop("seed", 0)))
    if name in tiny.TINY_NAMES:
        seed = int(hf_kwargs.pop("seed", 0))
        model, processor = tiny.build(name, seed=seed, **hf_kwargs)
        return VLM(model, processor, name=name, source=f"tiny (random weights, seed {seed})")
    if name in ORGANISM_NAMES:
        path = organism_dir(name)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name} is not shipped with this installation (no {path}); train it with "
                                 f"python -m vlmbind.organisms.recipes {name} --out DIR and load DIR")
        vlm = _from_pretrained(str(path), **hf_kwargs)
        vlm.name, vlm.source = name, f"shipped organism ({path.relative_to(path.parents[3])})"
        return vlm
    if name.startswith("tiny-") or name.startswith("organism-"):
        raise UnsupportedModelError(
            f"unknown model name {name!r}.{close_matches(name, registered_names())} Registered names: "
            f"{', '.join(registered_names())}; or pass a directory or hub id."
        )
    return _from_pretrained(name, **hf_kwargs)


def _refuse_unknown_model_type(path: Path) -> None:
    """Raise UnsupportedModelError (listing the supported families) when the config at ``path`` names a
    ``model_type`` that neither transformers nor a vlmbind adapter knows; return quietly otherwise (a missing or
    malformed config is a load error, reported by the caller)."""
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        adapter_class_for_config(SimpleNamespace(model_type=model_type))  # raises when no family handles it


def _from_pretrained(name: str, **hf_kwargs: Any) -> VLM:
    if hf_kwargs.get("trust_remote_code"):
        config_kwargs = {"trust_remote_code": True}
    else:
        config_kwargs = {}
    is_dir = Path(name).is_dir()
    if not is_dir and (Path(name).exists() or name.startswith((".", "/", "~"))):
        raise ModelLoadError(f"{name!r} is not a model directory; pass a directory saved with save_pretrained")
    try:
        config = AutoConfig.from_pretrained(name, **config_kwargs)
    except (OSError, ValueError) as exc:
        if is_dir:
            _refuse_unknown_model_type(Path(name) / "config.json")
        where = "directory" if is_dir else "hub id"
        raise ModelLoadError(
            f"could not read a model config from {where} {name!r}: {str(exc).splitlines()[0]}. "
            f"Check the path, or that the hub id is downloaded (this machine may have no network)."
        ) from exc
    if config.model_type in ENCODERS:
        return load_encoder(name, config, **hf_kwargs)
    adapter_cls = adapter_class_for_config(config)
    model_cls = getattr(transformers, adapter_cls.model_class_name)
    hf_kwargs.setdefault("attn_implementation", "eager")
    try:
        model = model_cls.from_pretrained(name, **hf_kwargs)
        processor = AutoProcessor.from_pretrained(name, **config_kwargs)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise ModelLoadError(f"could not load {adapter_cls.display_name} weights or processor from {name!r}: "
                             f"{str(exc).splitlines()[0]}") from exc
    vlm = VLM(model, processor, name=name, source=str(Path(name).resolve()) if is_dir else f"hub:{name}")
    card = Path(name) / TRAINING_FILE
    if is_dir and card.is_file():
        vlm.training = json.loads(card.read_text())
    return vlm


__all__ = ["load", "registered_names", "supported_families"]
