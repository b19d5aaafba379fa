"""Loading models: :func:`load` and :func:`registered_names`.

``load`` accepts a registered name (``tiny-*`` random-weight models built offline, the shipped organisms, tiny vision
encoders), a local directory or a hub id. Directories and hub ids go through the real ``from_pretrained`` path for
model and processor; the family is detected from the config's ``model_type`` (vision-encoder configs give a
:class:`~vlmbind.engine.encoders.VisionEncoder`). ``trust_remote_code`` is never set on the user's behalf.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers
from safetensors import SafetensorError
from transformers import CONFIG_MAPPING, AutoConfig, AutoProcessor
from transformers.utils import is_flash_attn_2_available, is_kernels_available
from transformers.utils import logging as hf_logging

from .. import tiny
from ..adapters.base import adapter_class_for_config, supported_families
from ..core.choices import ATTN_IMPLEMENTATIONS, hub_config_message, unknown_name_error
from ..core.errors import InputError, ModelLoadError
from ..core.shipped import ORGANISM_NAMES, organism_dir, shipped_organisms
from ..core.userfiles import read_json_object
from .encoders import ENCODER_NAMES, ENCODERS, build_tiny_encoder, load_encoder
from .vlm import TRAINING_FILE, VLM


def registered_names() -> list[str]:
    """Names ``load`` accepts besides directories and hub ids."""
    return [*shipped_organisms(), *tiny.TINY_NAMES, *ENCODER_NAMES]


# its keys are vlmbind.core.choices.DTYPE_NAMES (the --dtype choices; tests/app/test_cli_startup.py checks they agree)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


# the --attn-implementation choices that need a package besides torch: (its pip name, its module, transformers' check
# that it can run here)
ATTN_PACKAGES = {"flash_attention_2": ("flash-attn", "flash_attn", is_flash_attn_2_available)}


def _attn_alternatives(impl: str) -> str:
    """The implementations that need nothing besides torch, as flags (``--attn-implementation eager or ... sdpa``)."""
    others = [a for a in ATTN_IMPLEMENTATIONS if a != impl and a not in ATTN_PACKAGES]
    return " or ".join(f"--attn-implementation {a}" for a in others)


def check_attn_implementation(impl: str | None) -> None:
    """Refuse, before any weights load, an attention implementation whose package is missing here (transformers
    raises an ImportError only once the model is being built).

    Raises:
        InputError: naming the implementation, what is missing and the implementations that need nothing more.
    """
    if impl not in ATTN_PACKAGES:
        return
    package, module, available = ATTN_PACKAGES[impl]
    if available():
        return
    if importlib.util.find_spec(module) is None:
        if is_kernels_available():  # transformers then tries the hub's build of the kernel: its error is converted
            return
        missing = f"the {package} package, which is not installed here (pip install {package}, on a CUDA machine)"
    elif not torch.cuda.is_available():
        missing = f"a CUDA GPU, and none is usable here ({package} is installed)"
    else:
        return  # installed on a GPU machine: transformers names the problem (an old version), converted at load
    raise InputError(f"--attn-implementation {impl} needs {missing}; pass {_attn_alternatives(impl)} instead")


@contextlib.contextmanager
def _attn_import_errors(impl: str | None) -> Iterator[None]:
    """transformers' ImportError for an attention implementation that cannot run here, as an InputError."""
    try:
        yield
    except ImportError as exc:
        if impl not in ATTN_PACKAGES:
            raise
        raise InputError(f"--attn-implementation {impl} cannot run here ({str(exc).splitlines()[0]}); pass "
                         f"{_attn_alternatives(impl)} instead") from exc


def resolve_device(device: str | None) -> str | None:
    """``auto``: the first CUDA device when there is one, else the CPU; None stays None (HF's default placement).

    Raises:
        InputError: a device this machine does not have or a name torch does not know.
    """
    if device is None:
        return None
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}; use cpu, cuda, cuda:N, mps or auto") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (parsed.index or 0) >= count:
            raise InputError(f"device {device!r} is not available here ({count} CUDA devices); use --device cpu")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InputError("device 'mps' is not available here; use --device cpu")
    return str(parsed)


def placement_kwargs(*, device: str | None = None, dtype: str | None = None, device_map: str | None = None,
                     attn_implementation: str | None = None) -> dict[str, Any]:
    """``from_pretrained`` keywords for a placement: ``device`` (one device) or ``device_map`` (accelerate's
    sharding, e.g. ``auto``), ``dtype`` (``float32``, ``bfloat16``, ``float16`` or ``auto``: the checkpoint's own;
    None: float32 on the CPU, the checkpoint's own on an accelerator) and the attention implementation.

    Raises:
        InputError: both ``device`` and ``device_map``, an unknown dtype, or an attention implementation that is
            unknown or cannot run here (:func:`check_attn_implementation`).
    """
    if device is not None and device_map is not None:
        raise InputError("pass --device or --device-map, not both (--device-map auto shards over every GPU)")
    out: dict[str, Any] = {}
    resolved = resolve_device(device)
    if resolved is not None:
        out["device_map"] = {"": resolved}
    elif device_map is not None:
        out["device_map"] = device_map
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; dtypes: {', '.join(DTYPES)}")
    on_cpu = resolved in (None, "cpu") and device_map is None
    out["dtype"] = DTYPES[dtype] if dtype is not None else (torch.float32 if on_cpu else "auto")
    if attn_implementation is not None:
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise InputError(f"unknown attention implementation {attn_implementation!r}; choose from "
                             f"{', '.join(ATTN_IMPLEMENTATIONS)}")
        check_attn_implementation(attn_implementation)
        out["attn_implementation"] = attn_implementation
    return out


def _place_built(model: Any, dtype: Any, device_map: Any) -> Any:
    """Apply a dtype and a one-device placement to a model built in this process (tiny models)."""
    if isinstance(dtype, torch.dtype):
        model = model.to(dtype)
    if isinstance(device_map, dict) and set(device_map) == {""}:
        model = model.to(device_map[""])
    elif device_map is not None:
        raise InputError(f"device_map {device_map!r} is for checkpoints; a tiny model goes on one --device")
    return model


def load(name_or_path: str | os.PathLike, *, device: str | None = None, dtype: str | None = None,
         device_map: str | None = None, attn_implementation: str | None = None, **hf_kwargs: Any) -> VLM:
    """Load a model by registered name, local directory or hub id.

    Args:
        name_or_path: ``tiny-<family>``, a directory saved with ``save_pretrained``, or a hub id. Standalone vision
            encoders (CLIP, SigLIP, DINOv2 vision models; ``tiny-clip``, ``tiny-siglip``, ``tiny-dinov2``) load as a
            :class:`~vlmbind.engine.encoders.VisionEncoder`.
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto`` (a GPU when there is one); None: the CPU.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (the checkpoint's own); None: float32 on the CPU,
            the checkpoint's own on an accelerator. Scores are computed in float32 from the logits either way, but
            bfloat16 weights change head scores (see ``benchmarks/RESULTS.md``).
        device_map: accelerate's placement for checkpoints too large for one device (``auto``).
        attn_implementation: ``sdpa`` (the default for checkpoints, eager for those without it: the adapter's
            ``default_attn_implementation``), ``eager`` or ``flash_attention_2``; vlmbind switches to its own eager
            attention for the runs that read or edit attention patterns, whatever this is.
        **hf_kwargs: passed to ``from_pretrained``.

    Raises:
        InputError: a device this machine lacks, both device and device_map, an unknown dtype, an attention
            implementation whose package is not installed here.
        UnsupportedModelError: the config's family is not supported (the message lists the supported ones).
        ModelLoadError: the directory or hub id has no loadable config, weights or processor.
    """
    name = os.fspath(name_or_path)
    placement = placement_kwargs(device=device, dtype=dtype, device_map=device_map,
                                 attn_implementation=attn_implementation)
    if name in ENCODER_NAMES:
        encoder = build_tiny_encoder(name, seed=int(hf_kwargs.pop("seed", 0)))
        _place_built(encoder.model, placement["dtype"], placement.get("device_map"))  # in place: Module.to
        return encoder
    if name in tiny.TINY_NAMES:
        seed = int(hf_kwargs.pop("seed", 0))
        device_map = hf_kwargs.pop("device_map", None) or placement.get("device_map")
        impl = hf_kwargs.pop("attn_implementation", None) or placement.get("attn_implementation")
        hf_kwargs.pop("dtype", None)
        with _attn_import_errors(impl):
            model, processor = tiny.build(name, seed=seed, **({"attn_implementation": impl} if impl else {}),
                                          **hf_kwargs)
        model = _place_built(model, placement["dtype"], device_map)
        return VLM(model, processor, name=name, source=f"tiny (random weights, seed {seed})")
    hf_kwargs = {**placement, **hf_kwargs}
    if name in ORGANISM_NAMES:
        path = organism_dir(name)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name} is not shipped with this installation (no {path}); train it with "
                                 f"python -m vlmbind.organisms.recipes {name} --out DIR and load DIR")
        with quiet_progress_bars():  # a few dozen small tensors: a progress bar would only be noise on stderr
            vlm = _from_pretrained(str(path), **hf_kwargs)
        vlm.name, vlm.source = name, f"shipped organism ({path.relative_to(path.parents[3])})"
        return vlm
    unknown = unknown_name_error(name, registered_names())  # a misspelt registered name (same check as the CLI's)
    if unknown is not None:
        raise unknown
    return _from_pretrained(name, **hf_kwargs)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars (weight loading and writing) off for the block, as they were after it."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


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
    is_dir = Path(name).is_dir()
    # nothing downloads at run time: a hub id loads from the local cache or fails at once (no network retries)
    config_kwargs = {} if is_dir else {"local_files_only": True}
    if hf_kwargs.get("trust_remote_code"):
        config_kwargs["trust_remote_code"] = True
    if not is_dir:
        hf_kwargs = {**hf_kwargs, "local_files_only": True}
    if not is_dir and (Path(name).exists() or name.startswith((".", "/", "~"))):
        raise ModelLoadError(f"{name!r} is not a model directory; pass a directory saved with save_pretrained")
    try:
        config = AutoConfig.from_pretrained(name, **config_kwargs)
    except (OSError, ValueError) as exc:
        if is_dir:
            _refuse_unknown_model_type(Path(name) / "config.json")
        reason = str(exc).splitlines()[0]
        raise ModelLoadError(
            f"could not read a model config from directory {name!r}: {reason}. Check the path." if is_dir
            else hub_config_message(name, reason)
        ) from exc
    if config.model_type in ENCODERS:
        return load_encoder(name, config, **hf_kwargs)
    adapter_cls = adapter_class_for_config(config)
    model_cls = getattr(transformers, adapter_cls.model_class_for(config))
    hf_kwargs.setdefault("attn_implementation", adapter_cls.default_attn_implementation(config))
    try:
        with _attn_import_errors(hf_kwargs.get("attn_implementation")):
            model = model_cls.from_pretrained(name, **hf_kwargs)
        processor = AutoProcessor.from_pretrained(name, **config_kwargs)
    except InputError:  # an attention implementation that cannot run here (an InputError is also a ValueError)
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise ModelLoadError(f"could not load {adapter_cls.display_name} weights or processor from {name!r}: "
                             f"{str(exc).splitlines()[0]}") from exc
    vlm = VLM(model, processor, name=name, source=str(Path(name).resolve()) if is_dir else f"hub:{name}")
    card = Path(name) / TRAINING_FILE
    if is_dir and card.is_file():
        vlm.training = read_json_object(card, "the model folder's training record")
    elif is_dir and (Path(name) / "train_config.json").is_file() and (Path(name) / "trainer_state.json").is_file():
        # a checkpoint of vlmbind's trainer (not yet shipped): the facts the shipped card would carry, so it is
        # prompted raw and its stimuli follow its training, as the shipped organism's would
        config = read_json_object(Path(name) / "train_config.json", "the checkpoint's train_config.json")
        if isinstance(config.get("image_size"), int):
            vlm.training = {"regime": config.get("regime"), "image_size": config["image_size"],
                            "grid": config["image_size"] // 28, "tasks": config.get("tasks", {}),
                            "task_options": config.get("task_options", {}), "checkpoint": str(Path(name))}
    return vlm


__all__ = ["load", "registered_names", "supported_families"]
