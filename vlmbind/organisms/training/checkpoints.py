"""Checkpoints: atomic, complete model directories with the optimiser, the trainer state and the trained readouts.

Every checkpoint is a complete model directory that ``vlmbind.load`` and ``from_pretrained`` read
(``model.safetensors``, ``config.json``, tokenizer and processor files), plus ``train_config.json``,
``trainer_state.json`` and the optimizer as ``optimizer.safetensors`` (tensors, keyed by parameter name) and
``optimizer.json`` (hyper-parameters); a run's trained readouts travel beside it (``*_probe.safetensors``). Nothing is
pickled. A checkpoint is written into a temporary sibling directory and moved into place with ``os.replace``, so a
crash never leaves a half-written ``checkpoint-*``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from ...core.errors import TrainingError
from ...engine.loading import quiet_progress_bars
from .config import TrainConfig

CHECKPOINT_PREFIX = "checkpoint-"
PROBE_FILE = "position_probe.safetensors"
SELECTION_PROBE_FILE = "selection_probe.safetensors"
RETRIEVAL_PROBE_FILE = "retrieval_probe.safetensors"
GATHER_PROBE_FILE = "gather_probe.safetensors"
POINT_PROBE_FILE = "point_probe.safetensors"


def list_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``out_dir``, oldest first (temporary directories are never listed)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        suffix = p.name[len(CHECKPOINT_PREFIX):]
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


_LAYER_KEY = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")


def grow_state_dict(source: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor],
                    layers: Sequence[int | None]) -> dict[str, torch.Tensor]:
    """A state dict for a model with ``len(layers)`` decoder layers: layer ``i`` is ``source``'s layer
    ``layers[i]``, or, for None, ``fresh``'s layer ``i`` with its ``o_proj`` and ``down_proj`` zeroed (a residual
    block that adds nothing). Everything outside the decoder layers comes from ``source``."""
    out: dict[str, torch.Tensor] = {}
    by_layer: dict[int, dict[str, str]] = {}
    for key in source:
        m = _LAYER_KEY.match(key)
        if m:
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = key
        else:
            out[key] = source[key]
    for key, value in fresh.items():
        m = _LAYER_KEY.match(key)
        if not m:
            continue
        i, rest = int(m.group(1)), m.group(2)
        origin = layers[i]
        if origin is None:
            zero = rest.endswith("self_attn.o_proj.weight") or rest.endswith("mlp.down_proj.weight")
            out[key] = torch.zeros_like(value) if zero else value.clone()
        else:
            if origin not in by_layer or rest not in by_layer[origin]:
                raise TrainingError(f"init_layers[{i}] = {origin}: the source has no decoder layer {origin} "
                                    f"(layers 0..{max(by_layer) if by_layer else -1})")
            out[key] = source[by_layer[origin][rest]]
    return out


def load_weights(model: torch.nn.Module, directory: str | os.PathLike,
                 layers: Sequence[int | None] | None = None) -> None:
    """Copy the weights of a saved organism (``from_pretrained`` layout) into ``model``; ``layers`` grows it (see
    :attr:`TrainConfig.init_layers`).

    Raises:
        TrainingError: the directory has no loadable weights, or they do not fit ``model``'s architecture.
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise TrainingError(f"{str(directory)!r} is not a saved model directory (no config.json); pass a "
                            f"checkpoint-* directory or a directory written by save_pretrained")
    cls = getattr(transformers, type(model).__name__)
    try:
        with quiet_progress_bars():
            source = cls.from_pretrained(directory, attn_implementation="eager")
    except (OSError, ValueError, RuntimeError) as exc:
        raise TrainingError(f"cannot load weights from {str(directory)!r}: {str(exc).splitlines()[0]}") from exc
    src, dst = source.state_dict(), model.state_dict()
    if layers is not None:
        src = grow_state_dict(src, dst, layers)
    missing = sorted(set(dst) - set(src))
    shapes = [k for k in dst if k in src and src[k].shape != dst[k].shape]
    if missing or shapes or set(src) - set(dst):
        detail = f"missing {missing[:3]}" if missing else f"shape mismatch at {shapes[:3]}" if shapes else \
            f"unexpected {sorted(set(src) - set(dst))[:3]}"
        raise TrainingError(f"weights in {str(directory)!r} do not fit this organism's size ({detail}); "
                            f"use the same model size as the run that wrote them")
    model.load_state_dict(src, strict=True)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """AdamW's state as (tensors keyed ``param/name``, JSON with the groups' hyper-parameters and param names)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise TrainingError(f"optimizer state {key!r} is not a tensor; cannot save it as safetensors")
                tensors[f"{names[id(p)]}/{key}"] = value.detach().contiguous()
    return tensors, {"param_groups": groups}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                          meta: dict[str, Any]) -> None:
    index = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[id(p)] = len(index)
    by_name = {n: index[id(p)] for n, p in model.named_parameters() if id(p) in index}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, slot = key.rpartition("/")
        if name not in by_name:
            raise TrainingError(f"optimizer state for unknown parameter {name!r}; the checkpoint does not fit")
        state.setdefault(by_name[name], {})[slot] = value
    groups = []
    for g in meta["param_groups"]:
        hyper = {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [by_name[n] for n in g["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module, processor: Any,
                    optimizer: torch.optim.Optimizer, config: TrainConfig, state: dict[str, Any],
                    keep: int, extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``checkpoint-{step}`` atomically (temporary sibling + ``os.replace``) and prune old ones; ``extra``
    writes more files into the checkpoint before it moves into place."""
    final = out_dir / f"{CHECKPOINT_PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=out_dir))
    try:
        with quiet_progress_bars():
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
        tensors, meta = optimizer_state(model, optimizer)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        write_json(tmp / "optimizer.json", meta)
        write_json(tmp / "train_config.json", config.to_dict())
        write_json(tmp / "trainer_state.json", state)
        if extra is not None:
            extra(tmp)
        if final.exists():  # only when re-writing the same step: move the old one aside first
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=out_dir))
            os.replace(final, trash / final.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainingError(f"checkpoint {str(checkpoint)!r} has no readable trainer_state.json: {exc}") from exc


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [f"{k}: {a.get(k)!r} (checkpoint) vs {b.get(k)!r} (now)" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def start_state(out: Path, existing: Sequence[Path], config: TrainConfig, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, resume: bool) -> dict[str, Any]:
    """The trainer state a run starts from: with ``resume``, the newest checkpoint's (its weights, optimiser state
    and torch RNG state loaded into this process), else a fresh one (with ``init_from``'s weights, if any).

    Raises:
        TrainingError: ``resume`` without a checkpoint, a fresh run into a directory that has checkpoints, or a
            config that differs from the checkpoint's.
    """
    if not resume:
        if existing:
            raise TrainingError(f"{str(out)!r} already holds checkpoints ({existing[-1].name}); pass resume=True "
                                f"to continue that run, or choose another out_dir")
        if config.init_from is not None:
            load_weights(model, config.init_from, config.init_layers)
        return {"step": 0, "losses": [], "evals": [], "wall_time_s": 0.0}
    if not existing:
        raise TrainingError(f"resume=True but {str(out)!r} has no checkpoint; start the run without resume")
    ckpt = existing[-1]
    state = read_state(ckpt)
    diff = config_diff(state.get("config", {}), config.to_dict())
    if diff:
        raise TrainingError(f"the config differs from the one checkpoint {ckpt.name} was trained with: "
                            f"{'; '.join(diff)}. Resume with the same config, or start a new run with "
                            f"init_from={str(ckpt)!r}")
    load_weights(model, ckpt)
    try:
        tensors = load_file(str(ckpt / "optimizer.safetensors"))
        meta = json.loads((ckpt / "optimizer.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainingError(f"checkpoint {str(ckpt)!r} has no readable optimizer state: {exc}") from exc
    load_optimizer_state(model, optimizer, tensors, meta)
    torch.set_rng_state(torch.tensor(state["rng"]["torch"], dtype=torch.uint8, device="cpu"))
    return state


def save_probe(directory: Path, probe: torch.nn.Module, optimizer: torch.optim.Optimizer,
                name: str = PROBE_FILE) -> None:
    tensors = {f"param.{n}": p.detach().clone() for n, p in probe.named_parameters()}
    by_id = {id(p): n for n, p in probe.named_parameters()}
    for p, st in optimizer.state.items():
        for key, value in st.items():
            tensors[f"state.{by_id[id(p)]}.{key}"] = torch.as_tensor(value).detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / name))


def load_probe(directory: Path, probe: torch.nn.Module, optimizer: torch.optim.Optimizer,
                name: str = PROBE_FILE) -> None:
    path = directory / name
    if not path.is_file():
        raise TrainingError(f"checkpoint {str(directory)!r} has no {name}; it was not written by a run with "
                            f"this trained readout")
    tensors = load_file(str(path))
    with torch.no_grad():
        for n, p in probe.named_parameters():
            p.copy_(tensors[f"param.{n}"])
    for n, p in probe.named_parameters():
        # the moments where the readout is; AdamW keeps its step count on the CPU
        st = {key.rsplit(".", 1)[1]: v if key.endswith(".step") else v.to(p.device)
              for key, v in tensors.items() if key.startswith(f"state.{n}.")}
        if st:
            optimizer.state[p] = st
