"""The rank group of data-parallel sweeps over N worker processes (``vlmbind locate``, ``eval``, ``probe`` and ``rsa
--processes N``); the sweeps themselves, which wrap the single-process analyses, are in :mod:`vlmbind.analysis.sweeps`.

Design: a sweep (pairs of ``locate``, batches of ``eval``, shards of a capture) is cut into N contiguous blocks, one
per rank; every rank loads the model itself (same name or path -> same weights), computes its block with the ordinary single-process code
(with its own checkpoint, so a killed rank resumes), and writes its part atomically to ``OUT/.parts/``; rank 0 waits
for every part, concatenates them in rank order (which is the original item order) and writes the usual result files.
Results never travel through pickle or a collective: parts are safetensors / JSON files, which also survive a crash of
rank 0. The ranks are a torch.distributed process group (gloo, or nccl when every rank has its own CUDA device), started
either by an external launcher (``torchrun``, ``accelerate launch``: RANK / WORLD_SIZE are set and used) or by vlmbind
itself (``--processes N``: the calling process is rank 0 and spawns ranks 1..N-1 with torch.multiprocessing, which
re-run the same command line through the entry point the caller hands in, the command's ``main``; the rendezvous binds
127.0.0.1 only). Rank 0 waits by polling for the part files rather
than in a collective, so a spawned rank that dies is noticed at once (its error is raised, the others are stopped)
instead of after a collective's timeout; spawned ranks likewise stop when their parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..core.errors import InputError, VlmbindError
from ..core.ranks import launched_world, world_size

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


def _spawned_rank(index: int, world: int, port: int, argv: list[str], parent: int,
                  entry: Callable[[list[str]], int]) -> None:
    """Entry point of rank ``index + 1``, spawned by rank 0: run the same command line as that rank (``entry(argv)``,
    an exit code)."""
    rank = index + 1
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       PARENT_ENV: str(parent)})
    code = entry(argv)
    if code:
        sys.exit(code)


def _rendezvous(rank: int, world: int, backend: str, children: Any = None, port: int | None = None) -> None:
    """Join the process group. Rank 0 of a spawned run hosts the store on 127.0.0.1 and waits, watching its children,
    until every rank has connected, so a rank that died before joining is reported instead of waited for."""
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


def start(processes: int, argv: Sequence[str], entry: Callable[[list[str]], int] | None = None,
          quiet: bool = False) -> Group:
    """Join (or, rank 0 of ``--processes N``, start) the ranks of a sweep.

    With one process nothing is started and torch is left as it is. Otherwise every rank sets torch's threads to
    ``max(1, cpus // N)`` (never more than it had), and the ranks meet in a torch.distributed process group.

    Args:
        processes: the ``--processes`` value.
        argv: the command line after ``vlmbind``; spawned ranks run it again (with RANK / WORLD_SIZE set).
        entry: what spawned ranks run ``argv`` with (a module-level function, e.g. ``vlmbind.app.commands.main``:
            torch.multiprocessing pickles it by name); needed only when this process spawns ranks.
        quiet: ranks other than 0 write nothing to stdout (a command's summary comes from rank 0 alone, so
            ``--json`` output stays one JSON document under torchrun too); errors still go to stderr.

    Raises:
        InputError: bad ``processes`` (see :func:`world_size`).
        RankFailedError: a spawned rank died before joining.
    """
    world = world_size(processes)
    if world == 1:
        return Group()
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
    if entry is None:
        raise ValueError("starting ranks needs the entry point they run the command line with")
    port = _free_port()
    children = mp.start_processes(_spawned_rank, args=(world, port, list(argv), os.getpid(), entry), nprocs=world - 1,
                                  join=False, start_method="spawn")
    group = Group(rank=0, world=world, local_rank=0, backend=backend, children=children)
    try:
        _rendezvous(0, world, backend, children, port)
    except BaseException:
        group.close(ok=False)
        raise
    return group


@contextlib.contextmanager
def session(processes: int, argv: Sequence[str], entry: Callable[[list[str]], int] | None = None,
            quiet: bool = False) -> Iterator[Group]:
    """:func:`start` as a context manager: the group is closed on exit, and spawned ranks are stopped if the body
    raises (a failed rank 0 leaves no processes behind)."""
    group = start(processes, argv, entry, quiet)
    try:
        yield group
    except BaseException:
        group.close(ok=False)
        raise
    group.close(ok=True)
