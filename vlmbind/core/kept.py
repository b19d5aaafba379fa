"""What an interrupted run kept to resume from, read from the headers of its checkpoint files (nothing is loaded or
unpickled), for the line the command line prints on Ctrl-C.

The files are those of :mod:`vlmbind.analysis.mediation` (``locate``: the finished pairs' scores in a safetensors
file whose metadata names every pair of the run), :mod:`vlmbind.analysis.evaluation` (``eval``: a JSON line naming the
run, then one line per finished batch), :mod:`vlmbind.analysis.binding` (``probe``: the finished probes in one JSON
object), :mod:`vlmbind.engine.activations` (``probe`` and ``rsa``: the finished shards of a capture in its manifest)
and :mod:`vlmbind.engine.parallel` (the parts of ``--processes N`` runs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# the capture of probe and rsa (OUT/activations) and its record of finished shards (vlmbind.engine.activations)
CAPTURE_DIR = "activations"
CAPTURE_MANIFEST = "manifest.json"
# where the ranks of --processes N runs keep their parts (vlmbind.engine.parallel.PARTS)
PARTS_DIR = ".parts"
# a safetensors header is a few kilobytes: a larger length means a damaged file, which is not read
MAX_HEADER = 64 * 1024 * 1024


def kept_work(out: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> list[str]:
    """What an interrupted run left in ``out``, one phrase per file, e.g. ``12 of 48 pairs kept in
    runs/locate/x/locate.partial.safetensors``; empty when it kept nothing.

    Args:
        out: the run's output directory.
        checkpoint: the run's checkpoint file (``locate``: ``.safetensors``, ``eval``: ``.jsonl``, ``probe``:
            ``.json``), when it has one.
    """
    out = Path(out)
    found = []
    if checkpoint is not None and Path(checkpoint).is_file():
        found.append(_describe(Path(checkpoint)))
    capture = out / CAPTURE_DIR
    if (capture / CAPTURE_MANIFEST).is_file():
        found.append(_guarded(_capture, capture, [capture / CAPTURE_MANIFEST]))
    elif (capture / PARTS_DIR).is_dir():
        manifests = sorted(p for p in (capture / PARTS_DIR).glob("capture.rank*-of-*.json")
                           if not p.name.endswith(".done.json"))
        if manifests:
            found.append(_guarded(_capture, capture, manifests))
    parts = sorted((out / PARTS_DIR).glob("*.rank*-of-*")) if (out / PARTS_DIR).is_dir() else []
    if parts:
        worlds = sorted({p.name.split("-of-")[1].split(".")[0] for p in parts})
        found.append(f"the work the ranks of --processes {', '.join(worlds)} finished kept in {out / PARTS_DIR}")
    return found


def _describe(path: Path) -> str:
    reader = {".safetensors": _pairs, ".jsonl": _batches, ".json": _probes}.get(path.suffix)
    return _guarded(reader, path) if reader else f"partial results kept in {path}"


def _guarded(reader: Any, path: Path, *more: Any) -> str:
    """``reader``'s phrase, or a plain one where the file is damaged (the Ctrl-C line must not fail)."""
    try:
        return reader(path, *more)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"partial results kept in {path}"


def _pairs(path: Path) -> str:
    """``locate``: the length of the saved ``per_pair`` array and the pairs its run names, from the header."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size <= MAX_HEADER:
            raise ValueError("not a safetensors header")
        header = json.loads(fh.read(size))
    done = int(header["per_pair"]["shape"][0])
    total = len(json.loads(header["__metadata__"]["run"])["pairs"])
    return f"{done} of {total} pairs kept in {path}"


def _batches(path: Path) -> str:
    """``eval``: the whole lines after the run's first line, one per finished batch."""
    lines = path.read_bytes().split(b"\n")[:-1]  # what follows the last newline is a torn write
    run = json.loads(lines[0])["run"]
    n, batch_size, batches = len(run["ids"]), int(run["batch_size"]), len(lines) - 1
    unit = "batch" if batches == 1 else "batches"
    return f"{min(batches * batch_size, n)} of {n} examples ({batches} {unit}) kept in {path}"


def _probes(path: Path) -> str:
    """``probe``: the finished (site, family) probes of the run's sites x families."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    total = len(saved["run"]["sites"]) * len(saved["run"]["families"])
    return f"{len(saved['rows'])} of {total} probes kept in {path}"


def _capture(folder: Path, manifests: list[Path]) -> str:
    """``probe``, ``rsa``: the examples of the finished shards (of every rank's manifest) out of the set's."""
    records = [json.loads(m.read_text(encoding="utf-8")) for m in manifests]
    done = sum(int(s["n"]) for record in records for s in record["shards"])
    return f"the activations of {done} of {int(records[0]['n'])} examples kept in {folder}"
