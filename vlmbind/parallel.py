"""Data-parallel sweeps over N worker processes: ``vlmbind locate``, ``eval``, ``probe`` and ``rsa --processes N``.

Design: a sweep (pairs of ``locate``, batches of ``eval``, shards of a capture) is cut into N contiguous blocks, one
per rank; every rank loads the model itself (same name or path -> same weights), computes its block with the ordinary single-process code
(with its own checkpoint, so a killed rank resumes), and writes its part atomically to ``OUT/.parts/``; rank 0 waits
for every part, concatenates them in rank order (which is the original item order) and writes the usual result files.
Results never travel through pickle or a collective: parts are safetensors / JSON files, which also survive a crash of
rank 0. The ranks are a torch.distributed process group (gloo, or nccl when every rank has its own CUDA device), started
either by an external launcher (``torchrun``, ``accelerate launch``: RANK / WORLD_SIZE are set and used) or by vlmbind
itself (``--processes N``: the calling process is rank 0 and spawns ranks 1..N-1 with torch.multiprocessing, which
re-run the same command line; the rendezvous binds 127.0.0.1 only). Rank 0 waits by polling for the part files rather
than in a collective, so a spawned rank that dies is noticed at once (its error is raised, the others are stopped)
instead of after a collective's timeout; spawned ranks likewise stop when their parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from .errors import InputError, VlmbindError

PARTS = ".parts"
# set in the processes vlmbind spawns itself: the rank-0 process they watch
PARENT_ENV = "VLMBIND_PARENT_PID"
# how long ranks wait for each other to join (not for each other's work: that wait has no limit)
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
POLL_S = 0.05


class RankFailedError(RuntimeError):
    """Another rank of the sweep exited with an error (its own message is on stderr)."""


class BadRankError(RankFailedError, VlmbindError):
    """Another rank stopped on bad input (exit code 2); the CLI turns this into exit code 2 as well."""


def launched_world() -> tuple[int, int, int] | None:
    """``(rank, world size, local rank)`` set by an external launcher (or by vlmbind for its spawned ranks), or None
    when the process runs alone (no ``WORLD_SIZE`` above 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    rank = int(os.environ.get("RANK", "0"))
    return rank, world, int(os.environ.get("LOCAL_RANK", str(rank)))


def world_size(processes: int) -> int:
    """The number of ranks a command asked for ``--processes N`` runs with (a launcher's WORLD_SIZE wins over 1).

    Raises:
        InputError: ``processes`` is below 1, or disagrees with the launcher's WORLD_SIZE.
    """
    if processes < 1:
        raise InputError(f"--processes must be at least 1, got {processes}")
    launched = launched_world()
    if launched is None:
        return processes
    if processes not in (1, launched[1]):
        raise InputError(f"--processes {processes} disagrees with the launcher's WORLD_SIZE={launched[1]}; drop "
                         "--processes under torchrun / accelerate launch")
    return launched[1]


def block(n: int, rank: int, world: int) -> range:
    """The contiguous block of ``n`` items rank ``rank`` of ``world`` takes (sizes differ by at most one; earlier ranks
    take the larger blocks), so concatenating the blocks in rank order gives the items in their original order."""
    q, r = divmod(n, world)
    start = rank * q + min(rank, r)
    return range(start, start + q + (1 if rank < r else 0))


def part_path(out: str | os.PathLike, name: str, rank: int, world: int, suffix: str) -> Path:
    """``OUT/.parts/<name>.rank<k>-of-<N><suffix>``: where rank ``k`` of ``N`` keeps a part or its checkpoint."""
    return Path(out) / PARTS / f"{name}.rank{rank}-of-{world}{suffix}"


def check_leftovers(out: str | os.PathLike, name: str, single_checkpoint: Path, world: int, resume: bool) -> None:
    """Refuse to start over an interrupted run unless ``resume``, and refuse to resume one with another number of
    processes (its parts hold other blocks of items).

    Args:
        out: the output directory.
        name: the command's part prefix (``locate``, ``eval``).
        single_checkpoint: the 1-process run's checkpoint file.
        world: the number of ranks of this run.
        resume: ``--resume`` was given.

    Raises:
        InputError: leftovers exist without ``resume``, or they come from another number of processes.
    """
    parts = sorted((Path(out) / PARTS).glob(f"{name}*.rank*"))
    found = [single_checkpoint] if single_checkpoint.is_file() else []
    found += parts
    if not found:
        return
    if not resume:
        raise InputError(f"{out} holds an interrupted run ({found[0].relative_to(out)}); pass --resume to continue it, "
                         "or choose another --out")
    worlds = {int(p.name.split("-of-")[1].split(".")[0]) for p in parts}
    if single_checkpoint.is_file():
        worlds.add(1)
    if worlds != {world}:
        raise InputError(f"{out} holds an interrupted run with --processes {', '.join(map(str, sorted(worlds)))}; "
                         f"resume it with that number of processes (this run has {world})")


def remove_parts(out: str | os.PathLike, name: str) -> None:
    """Remove a finished run's parts (and ``OUT/.parts`` once empty)."""
    folder = Path(out) / PARTS
    for path in folder.glob(f"{name}*.rank*"):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def backend_for(world: int) -> str:
    """``nccl`` when CUDA gives every rank a device of its own, else ``gloo`` (ranks sharing a GPU cannot use nccl)."""
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


@dataclass
class Group:
    """This process's place in a sweep: its rank among ``world`` ranks.

    Attributes:
        rank: this process's rank (0 writes the results).
        world: the number of ranks (1: a plain single-process run, nothing is started).
        local_rank: the rank on this machine (which CUDA device it uses).
        backend: the torch.distributed backend (None for a single process).
        children: rank 0 of a ``--processes N`` run: the spawned ranks' torch.multiprocessing context.
        parent: a spawned rank: the pid of the rank-0 process that started it.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None
    children: Any = None
    parent: int | None = None
    _closed: bool = field(default=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def block(self, n: int) -> range:
        """This rank's contiguous block of ``n`` items (see :func:`block`)."""
        return block(n, self.rank, self.world)

    def load_kwargs(self) -> dict[str, Any]:
        """``vb.load`` options for this rank: with several ranks and CUDA, its own device (round robin); otherwise
        none, so a single process loads exactly as before."""
        import torch

        if self.world == 1 or not torch.cuda.is_available():
            return {}
        return {"device_map": {"": self.local_rank % torch.cuda.device_count()}}

    def check(self) -> None:
        """Raise if a spawned rank has failed (rank 0), or exit if the rank-0 process is gone (a spawned rank).

        Raises:
            BadRankError: a spawned rank exited with code 2 (bad input).
            RankFailedError: a spawned rank exited with another non-zero code.
        """
        if self.children is not None:
            for i, proc in enumerate(self.children.processes):
                code = proc.exitcode
                if code not in (None, 0):
                    error = BadRankError if code == 2 else RankFailedError
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code} (its error is above)"
                    raise error(f"rank {i + 1} of {self.world} {how}; rerun with --resume to continue")
        if self.parent is not None and os.getppid() != self.parent:
            # the rank-0 process died: nobody will merge this rank's work, and it must not linger
            os._exit(1)

    def wait_for(self, paths: Sequence[Path]) -> None:
        """Block until every file in ``paths`` exists (parts are written atomically: existing means complete), while
        watching the other ranks (see :meth:`check`)."""
        while True:
            self.check()
            if all(p.is_file() for p in paths):
                return
            time.sleep(POLL_S)

    def close(self, ok: bool) -> None:
        """Leave the process group; rank 0 also ends its spawned ranks: waits for them after success (and raises a
        failure of theirs), stops them after a failure of its own."""
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        if self.children is not None:
            if ok:
                while any(p.exitcode is None for p in self.children.processes):
                    self.check()
                    time.sleep(POLL_S)
                self.check()
            else:
                for proc in self.children.processes:
                    if proc.exitcode is None:
                        proc.terminate()
                for proc in self.children.processes:
                    proc.join(10)
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _spawned_rank(index: int, world: int, port: int, argv: list[str], parent: int) -> None:
    """Entry point of rank ``index + 1``, spawned by rank 0: run the same command line as that rank."""
    rank = index + 1
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       PARENT_ENV: str(parent)})
    from .cli import main

    code = main(argv)
    if code:
        sys.exit(code)


def _rendezvous(rank: int, world: int, backend: str, children: Any = None, port: int | None = None) -> None:
    """Join the process group. Rank 0 of a spawned run hosts the store on 127.0.0.1 and waits, watching its children,
    until every rank has connected, so a rank that died before joining is reported instead of waited for."""
    import torch.distributed as dist

    spawned = children is not None or os.environ.get(PARENT_ENV)
    if not spawned:  # an external launcher: its MASTER_ADDR / MASTER_PORT
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=RENDEZVOUS_TIMEOUT)
        return
    port = int(os.environ["MASTER_PORT"]) if rank else port
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False,
                          timeout=RENDEZVOUS_TIMEOUT)
    if rank:
        store.set(f"vlmbind/joined/{rank}", "1")
    else:
        keys = [f"vlmbind/joined/{r}" for r in range(1, world)]
        probe = Group(world=world, children=children)
        while not store.check(keys):
            probe.check()
            time.sleep(POLL_S)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=RENDEZVOUS_TIMEOUT)


def start(processes: int, argv: Sequence[str], quiet: bool = False) -> Group:
    """Join (or, rank 0 of ``--processes N``, start) the ranks of a sweep.

    With one process nothing is started and torch is left as it is. Otherwise every rank sets torch's threads to
    ``max(1, cpus // N)`` (never more than it had), and the ranks meet in a torch.distributed process group.

    Args:
        processes: the ``--processes`` value.
        argv: the command line after ``vlmbind``; spawned ranks run it again (with RANK / WORLD_SIZE set).
        quiet: ranks other than 0 write nothing to stdout (a command's summary comes from rank 0 alone, so
            ``--json`` output stays one JSON document under torchrun too); errors still go to stderr.

    Raises:
        InputError: bad ``processes`` (see :func:`world_size`).
        RankFailedError: a spawned rank died before joining.
    """
    world = world_size(processes)
    if world == 1:
        return Group()
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), _cpu_count() // world)))
    backend = backend_for(world)
    launched = launched_world()
    if launched is not None:
        rank, _, local_rank = launched
        parent = os.environ.get(PARENT_ENV)
        group = Group(rank=rank, world=world, local_rank=local_rank, backend=backend,
                      parent=int(parent) if parent else None)
        if quiet and rank:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of this rank
        _rendezvous(rank, world, backend)
        return group
    import torch.multiprocessing as mp

    port = _free_port()
    children = mp.start_processes(_spawned_rank, args=(world, port, list(argv), os.getpid()), nprocs=world - 1,
                                  join=False, start_method="spawn")
    group = Group(rank=0, world=world, local_rank=0, backend=backend, children=children)
    try:
        _rendezvous(0, world, backend, children, port)
    except BaseException:
        group.close(ok=False)
        raise
    return group


@contextlib.contextmanager
def session(processes: int, argv: Sequence[str], quiet: bool = False) -> Iterator[Group]:
    """:func:`start` as a context manager: the group is closed on exit, and spawned ranks are stopped if the body
    raises (a failed rank 0 leaves no processes behind)."""
    group = start(processes, argv, quiet)
    try:
        yield group
    except BaseException:
        group.close(ok=False)
        raise
    group.close(ok=True)


# ----------------------------------------------------------------------------------------------------------------
# the two sweeps
# ----------------------------------------------------------------------------------------------------------------
def locate(group: Group, vlm: Any, pairs: Any, out: str | os.PathLike, *, method: str = "exact",
           layers: list[int] | None = None, verify_top: int = 10, progress: bool = False) -> Any:
    """:func:`vlmbind.analysis.locate` over the ranks of ``group``: each rank scores its block of pairs, rank 0
    merges the parts into the :class:`~vlmbind.analysis.HeadScores` a single process would give (same per-pair
    values, same order).

    ``attribution`` with ``verify_top`` runs in two rounds: the candidates come from every rank's estimates, then each
    rank verifies them on its own pairs.

    Args:
        group: this process's rank (:func:`start`).
        vlm: the model, loaded by this rank.
        pairs: all pairs (every rank builds the same list).
        out: the output directory (parts and checkpoints go to ``OUT/.parts``).
        method, layers, verify_top, progress: as in :func:`~vlmbind.analysis.locate`.

    Returns:
        Rank 0: the merged scores. Other ranks: None.

    Raises:
        InputError: fewer pairs than ranks, or a part of another run in ``OUT/.parts``.
    """
    import numpy as np

    from .analysis.mediation import HeadScores, locate as locate_one, top_candidates, verify_heads

    start_time = time.perf_counter()
    pairs_in, pairs = pairs, list(pairs)
    if len(pairs) < group.world:
        raise InputError(f"{len(pairs)} pairs cannot be shared by {group.world} processes; pass --processes "
                         f"{max(1, len(pairs))} or more pairs")
    span = group.block(len(pairs))
    mine = pairs[span.start : span.stop]
    layer_list = list(range(vlm.n_layers)) if layers is None else [int(l) for l in layers]
    key = {"model": vlm.name, "method": method, "layers": layer_list, "verify_top": verify_top,
           "pairs": [p.id for p in mine]}

    def path(rank: int, round_: str) -> Path:
        return part_path(out, f"locate-{round_}", rank, group.world, ".safetensors")

    estimate = _read_part(path(group.rank, "scores"), key)
    if estimate is None:
        scores = locate_one(vlm, mine, method=method, layers=layers, verify_top=0, progress=progress,
                            checkpoint=part_path(out, "locate", group.rank, group.world, ".partial.safetensors"))
        estimate = scores.per_pair
        _write_part(path(group.rank, "scores"), key, estimate)
    verify = method == "attribution" and verify_top > 0
    if verify:
        mine_verified = _read_part(path(group.rank, "verified"), key)
        if mine_verified is None:
            everyone = [path(r, "scores") for r in range(group.world)]
            group.wait_for(everyone)
            per_pair = np.concatenate([_read_part(p) for p in everyone])
            heads = [(l, h) for l in layer_list for h in range(vlm.n_heads)]
            candidates = top_candidates(per_pair, heads, verify_top)
            mine_verified = verify_heads(vlm, mine, layer_list, candidates, per_pair.shape[1:])
            _write_part(path(group.rank, "verified"), key, mine_verified)
    if not group.is_main:
        return None
    rounds = ["scores", "verified"] if verify else ["scores"]
    group.wait_for([path(r, name) for name in rounds for r in range(group.world)])
    per_pair = np.concatenate([_read_part(path(r, "scores")) for r in range(group.world)])
    verified = np.concatenate([_read_part(path(r, "verified")) for r in range(group.world)]) if verify else None
    return HeadScores(condition=pairs[0].condition, method=method, model=vlm.name, per_pair=per_pair,
                      seconds=time.perf_counter() - start_time, pair_ids=[p.id for p in pairs], verified=verified,
                      skipped=list(getattr(pairs_in, "skipped", [])))


def evaluate(group: Group, vlm: Any, dataset: Any, out: str | os.PathLike, *, batch_size: int = 16,
             progress: bool = False, chat: bool = False) -> Any:
    """:func:`vlmbind.evaluate.evaluate` over the ranks of ``group``. Ranks take contiguous blocks of whole batches,
    so every batch is the one a single process would generate (batch composition can change greedy outputs through
    padding); rank 0 concatenates the records.

    Returns:
        Rank 0: the :class:`~vlmbind.evaluate.EvalResult`. Other ranks: None.

    Raises:
        InputError: fewer batches than ranks, or a part of another run in ``OUT/.parts``.
    """
    from .evaluate import EvalResult, evaluate as evaluate_one, record_from_json, run_key

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
                              checkpoint=part_path(out, "eval", group.rank, group.world, ".partial.jsonl"))
        from .io import write_json_atomic

        write_json_atomic({"run": key, "records": result.records}, path(group.rank), indent=None)
    if not group.is_main:
        return None
    group.wait_for([path(r) for r in range(group.world)])
    records = [record_from_json(r) for rank in range(group.world) for r in _read_json_part(path(rank))["records"]]
    params = dataset.describe() if hasattr(dataset, "describe") else {}
    params.pop("n", None)
    return EvalResult(model=vlm.name, task=examples[0].task, records=records, params=params)


def rank_done(group: Group, out: str | os.PathLike) -> tuple[dict[str, Any], str, int]:
    """The CLI result of a rank other than 0 (its work is in the parts; rank 0 writes the results)."""
    return ({"rank": group.rank, "processes": group.world, "out": str(out)},
            f"rank {group.rank} of {group.world}: part written to {Path(out) / PARTS}", 0)


def add_capture_arguments(p: Any) -> None:
    """``--processes`` and ``--shard-size`` of the commands that capture a data set (``probe``, ``rsa``)."""
    p.add_argument("--processes", type=int, default=1,
                   help="split the capture's shards over N worker processes (default 1; implied by torchrun / "
                        "accelerate launch)")
    p.add_argument("--shard-size", type=int, default=64, help="examples per activation shard (default 64)")


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
    """:func:`vlmbind.activations.capture` over the ranks of ``group``: each rank captures a contiguous block of
    shards straight into ``out`` (shard files carry the whole set's names and indices) and keeps its progress in its
    own manifest under ``OUT/.parts``; rank 0 then writes the manifest a single process would write, so the directory
    is byte-identical to a one-process capture.

    Args:
        group: this process's rank (:func:`start`).
        vlm: the model, loaded by this rank.
        data: all examples (every rank builds the same list).
        sites: as in :func:`~vlmbind.activations.capture`.
        out: the capture directory.
        resume: continue an interrupted run (each rank from its own manifest).
        **options: ``tokens``, ``batch_size``, ``shard_size``, ``dtype``, ``progress`` as in
            :func:`~vlmbind.activations.capture`.

    Returns:
        Rank 0: the complete :class:`~vlmbind.activations.ActivationSet`. Other ranks: None.

    Raises:
        InputError: fewer shards than ranks, a finished capture in ``out`` (without ``resume``), or leftovers of
            another number of processes.
    """
    import json

    from .activations import MANIFEST, ActivationSet, capture as capture_one
    from .io import write_json_atomic

    examples = list(data)
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
    write_json_atomic(manifest, final)
    remove_parts(root, "capture")
    return ActivationSet(root, manifest)


def _write_part(path: Path, key: dict[str, Any], values: Any) -> None:
    """One rank's ``N L H`` float64 scores, exactly, with the run they belong to."""
    import json

    import numpy as np
    from safetensors.numpy import save

    from .io import write_bytes_atomic

    write_bytes_atomic(save({"values": np.ascontiguousarray(values)}, metadata={"run": json.dumps(key)}), path)


def _read_part(path: Path, key: dict[str, Any] | None = None) -> Any:
    """A part's values; None when it does not exist (yet). With ``key``, a part of another run is refused.

    Raises:
        InputError: the part belongs to another run.
    """
    import json

    from safetensors import safe_open

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
    import json

    if not path.is_file():
        return None
    part = json.loads(path.read_text())
    if key is not None and part.get("run") != key:
        raise InputError(f"{path} is from another run (model, data or options differ); remove it or use another "
                         "--out")
    return part
