"""Data-parallel sweeps: the single-process analyses run by each rank of a :class:`~vlmbind.engine.parallel.Group` on
its contiguous block of the work, merged by rank 0 into exactly the single-process result.

* :func:`locate`: pairs of :func:`vlmbind.analysis.locate` (attribution's candidates are chosen from every rank's
  estimates);
* :func:`evaluate`: whole batches of :func:`vlmbind.analysis.evaluation.evaluate` (batch composition can change greedy
outputs
  through padding, so batches are never re-cut);
* :func:`capture`: activation shards of :func:`vlmbind.engine.activations.capture`, written straight into the capture
folder.

Parts travel as safetensors / JSON files in ``OUT/.parts`` (never pickled), keyed by the run they belong to, so a
killed rank resumes and a part of another run is refused.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from ..core.errors import InputError
from ..core.io import write_bytes_atomic, write_json_atomic
from ..core.sites import parse_heads
from ..engine.activations import MANIFEST, ActivationSet
from ..engine.activations import capture as capture_one
from ..engine.decoding import GREEDY
from ..engine.parallel import Group, block, part_path, remove_parts
from .evaluation import EvalResult, record_from_json, run_key
from .evaluation import evaluate as evaluate_one
from .mediation import ESTIMATES, HeadScores, pairs_digest
from .mediation import locate as locate_one


def locate(group: Group, vlm: Any, pairs: Any, out: str | os.PathLike, *, method: str = "exact",
           layers: list[int] | None = None, heads: Any = None, verify_top: int = 10, progress: bool = False,
           **method_kwargs: Any) -> HeadScores | None:
    """:func:`vlmbind.analysis.locate` over the ranks of ``group``: each rank runs it on its block of pairs, rank 0
    concatenates the parts into the :class:`~vlmbind.analysis.HeadScores` a single process would give (same per-pair
    values, same order).

    ``attribution`` with ``verify_top`` chooses its candidates from every rank's estimates: each rank's ``locate``
    hands its estimates over through ``gather``, which writes them as a part and returns all ranks' parts.

    Args:
        group: this process's rank (:func:`vlmbind.engine.parallel.start`).
        vlm: the model, loaded by this rank.
        pairs: all pairs (every rank builds the same list).
        out: the output directory (parts and checkpoints go to ``OUT/.parts``).
        method, layers, heads, verify_top, progress: as in :func:`~vlmbind.analysis.locate`.

    Returns:
        Rank 0: the merged scores. Other ranks: None.

    Raises:
        InputError: fewer pairs than ranks, or a part of another run in ``OUT/.parts``.
    """
    start_time = time.perf_counter()
    pairs_in, pairs = pairs, list(pairs)
    if len(pairs) < group.world:
        raise InputError(f"{len(pairs)} pairs cannot be shared by {group.world} processes; pass --processes "
                         f"{max(1, len(pairs))} or more pairs")
    blocks = [pairs[b.start : b.stop] for b in (block(len(pairs), r, group.world) for r in range(group.world))]
    mine = blocks[group.rank]
    layer_list = list(range(vlm.n_layers)) if layers is None else [int(l) for l in layers]
    key = {"model": vlm.name, "method": method, "layers": layer_list, "heads": None if heads is None else str(heads),
           "verify_top": verify_top,
           "pairs": [p.id for p in mine], "content": pairs_digest(mine),
           "prompt_format": method_kwargs.get("prompt_format")}
    verify = method in ESTIMATES and verify_top > 0
    rounds = ("scores", "verified") if verify else ("scores",)

    def path(rank: int, round_: str) -> Path:
        return part_path(out, f"locate-{round_}", rank, group.world, ".safetensors")

    def gather(estimate: np.ndarray) -> np.ndarray:
        _write_part(path(group.rank, "scores"), key, estimate)
        everyone = [path(r, "scores") for r in range(group.world)]
        group.wait_for(everyone)
        return np.concatenate([_read_part(p) for p in everyone])

    if any(_read_part(path(group.rank, name), key) is None for name in rounds):
        scores = locate_one(vlm, mine, method=method, layers=layers, heads=heads, verify_top=verify_top,
                            progress=progress,
                            checkpoint=part_path(out, "locate", group.rank, group.world, ".partial.safetensors"),
                            gather=gather, **method_kwargs)
        _write_part(path(group.rank, "scores"), key, scores.per_pair)
        if verify:
            _write_part(path(group.rank, "verified"), key, scores.verified)
    if not group.is_main:
        return None
    group.wait_for([path(r, name) for name in rounds for r in range(group.world)])
    scored = None
    if heads is not None or layers is not None:
        chosen = set(parse_heads(heads)) if heads is not None else None
        scored = [f"{l}.{h}" for l in layer_list for h in range(vlm.n_heads) if chosen is None or (l, h) in chosen]
        scored = None if len(scored) == vlm.n_layers * vlm.n_heads else scored
    parts = [HeadScores(condition=pairs[0].condition, method=method, model=vlm.name, scored_heads=scored,
                        per_pair=_read_part(path(r, "scores")), pair_ids=[p.id for p in blocks[r]],
                        verified=_read_part(path(r, "verified")) if verify else None,
                        prompt_format=vlm.prompt_format(method_kwargs.get("prompt_format")))
             for r in range(group.world)]
    return HeadScores.concat(parts, seconds=time.perf_counter() - start_time,
                             skipped=list(getattr(pairs_in, "skipped", [])))


def evaluate(group: Group, vlm: Any, dataset: Any, out: str | os.PathLike, *, batch_size: int = 16,
             progress: bool = False, chat: bool = False, point_frame: str | None = None) -> Any:
    """:func:`vlmbind.analysis.evaluation.evaluate` over the ranks of ``group``. Ranks take contiguous blocks of whole
    batches, so every batch is the one a single process would generate (batch composition can change greedy outputs
    through padding); rank 0 concatenates the records.

    Returns:
        Rank 0: the :class:`~vlmbind.analysis.evaluation.EvalResult`. Other ranks: None.

    Raises:
        InputError: fewer batches than ranks, or a part of another run in ``OUT/.parts``.
    """
    examples = list(dataset)
    n_batches = -(-len(examples) // batch_size)
    if n_batches < group.world:
        raise InputError(f"{len(examples)} examples in batches of {batch_size} make {n_batches} batches, fewer than "
                         f"--processes {group.world}; lower --batch-size or --processes")
    span = group.block(n_batches)
    mine = examples[span.start * batch_size : span.stop * batch_size]
    key = run_key(vlm, mine, batch_size, chat)

    def path(rank: int) -> Path:
        return part_path(out, "eval", rank, group.world, ".json")

    if _read_json_part(path(group.rank), key) is None:
        result = evaluate_one(vlm, mine, batch_size=batch_size, progress=progress, chat=chat,
                              checkpoint=part_path(out, "eval", group.rank, group.world, ".partial.jsonl"),
                              point_frame=point_frame, canvas=getattr(dataset, "params", {}).get("canvas"))
        write_json_atomic({"run": key, "records": result.records}, path(group.rank), indent=None)
    if not group.is_main:
        return None
    group.wait_for([path(r) for r in range(group.world)])
    records = [record_from_json(r) for rank in range(group.world) for r in _read_json_part(path(rank))["records"]]
    params = dataset.describe() if hasattr(dataset, "describe") else {}
    params.pop("n", None)
    return EvalResult(model=vlm.name, task=examples[0].task, records=records, params=params,
                      prompt_format="chat" if chat else "raw", generation=dict(GREEDY))


def check_shards(n: int, shard_size: Any, world: int) -> int:
    """The number of shards ``n`` examples make; refuses a shard size below 1 and fewer shards than ranks.

    Raises:
        InputError: ``shard_size`` is not a positive int, or the shards are fewer than ``world``.
    """
    if not isinstance(shard_size, int) or shard_size < 1:
        raise InputError(f"--shard-size must be at least 1, got {shard_size!r}")
    n_shards = -(-n // shard_size)
    if world > 1 and n_shards < world:
        raise InputError(f"{n} examples in shards of {shard_size} make {n_shards} shards, fewer than --processes "
                         f"{world}; lower --shard-size or --processes")
    return n_shards


def capture(group: Group, vlm: Any, data: Any, sites: Any, out: str | os.PathLike, *, resume: bool = False,
            **options: Any) -> Any:
    """:func:`vlmbind.engine.activations.capture` over the ranks of ``group``: each rank captures a contiguous block of
    shards straight into ``out`` (shard files carry the whole set's names and indices) and keeps its progress in its
    own manifest under ``OUT/.parts``; rank 0 then writes the manifest a single process would write, so the directory
    is byte-identical to a one-process capture.

    Args:
        group: this process's rank (:func:`start`).
        vlm: the model, loaded by this rank.
        data: all examples (every rank builds the same list).
        sites: as in :func:`~vlmbind.engine.activations.capture`.
        out: the capture directory.
        resume: continue an interrupted run (each rank from its own manifest).
        **options: ``tokens``, ``batch_size``, ``shard_size``, ``dtype``, ``progress`` as in
            :func:`~vlmbind.engine.activations.capture`.

    Returns:
        Rank 0: the complete :class:`~vlmbind.engine.activations.ActivationSet`. Other ranks: None.

    Raises:
        InputError: fewer shards than ranks, a finished capture in ``out`` (without ``resume``), or leftovers of
            another number of processes.
    """
    examples = data if isinstance(data, Sequence) else list(data)  # an on-demand sequence stays one
    shard_size = options.get("shard_size", 64)
    n_shards = check_shards(len(examples), shard_size, group.world)
    root = Path(out)
    if group.world == 1:
        return capture_one(vlm, examples, sites, out=root, resume=resume, **options)
    final = root / MANIFEST
    if final.is_file():
        if not resume:
            raise InputError(f"{root} already holds a capture; pass --resume to continue it, or choose another "
                             "directory")
        if group.is_main:
            return ActivationSet.load(root)
        return None
    mine = part_path(root, "capture", group.rank, group.world, ".json")
    done = part_path(root, "capture", group.rank, group.world, ".done.json")
    if not done.is_file():
        capture_one(vlm, examples, sites, out=root, resume=resume, shards=group.block(n_shards),
                    manifest_name=str(mine.relative_to(root)), **options)
        write_json_atomic(json.loads(mine.read_text()), done)
    if not group.is_main:
        return None
    everyone = [part_path(root, "capture", r, group.world, ".done.json") for r in range(group.world)]
    group.wait_for(everyone)
    parts = [json.loads(p.read_text()) for p in everyone]
    manifest = {**parts[0], "shards": [s for part in parts for s in part["shards"]]}
    maps = {k: v for part in parts for k, v in part.get("vision_row_tokens", {}).items()}
    if maps:
        manifest["vision_row_tokens"] = maps
    write_json_atomic(manifest, final)
    remove_parts(root, "capture")
    return ActivationSet(root, manifest)


def _write_part(path: Path, key: dict[str, Any], values: Any) -> None:
    """One rank's ``N L H`` float64 scores, exactly, with the run they belong to."""
    write_bytes_atomic(save({"values": np.ascontiguousarray(values)}, metadata={"run": json.dumps(key)}), path)


def _read_part(path: Path, key: dict[str, Any] | None = None) -> Any:
    """A part's values; None when it does not exist (yet). With ``key``, a part of another run is refused.

    Raises:
        InputError: the part belongs to another run.
    """
    if not path.is_file():
        return None
    with safe_open(str(path), framework="numpy") as f:
        saved = json.loads(f.metadata()["run"])
        values = f.get_tensor("values")
    if key is not None and saved != key:
        diff = sorted(k for k in set(saved) | set(key) if saved.get(k) != key.get(k))
        raise InputError(f"{path} is from another run ({', '.join(diff)} differ); remove it or use another --out")
    return values


def _read_json_part(path: Path, key: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A JSON part (``{"run": key, "records": [...]}``); None when it does not exist (yet).

    Raises:
        InputError: the part belongs to another run.
    """
    if not path.is_file():
        return None
    part = json.loads(path.read_text())
    if key is not None and part.get("run") != key:
        raise InputError(f"{path} is from another run (model, data or options differ); remove it or use another "
                         "--out")
    return part
