"""Training one organism in two processes: each computes part of a step's summed loss, and the gradients are added.

Why: a training step of an organism is many small operations, and a second torch thread speeds it up by 1.1-1.6x
depending on the stage and the run, while two independent one-thread jobs on the two cores each keep their speed.
Two processes of one thread each, each computing part of the step, measured 1.4-1.7x against one thread and on a
par with two threads, ahead where the step's work splits evenly (``benchmarks/two_processes.py``).
The step's loss is a sum of terms that run their own forwards (the behaviour loss; the SIIT losses of the ``iit``
part; those of the ``strict`` part), and the gradient of a sum is the sum of the gradients, so the step splits by
terms, not by rows, and every term means what it means in one process (a mean ablation still averages over the
whole batch, a readout loss sees all its rows):

* rank 0 computes the ``iit`` part, rank 1 the ``strict`` part (each draws the step's pairs and heads itself: the
  draws are a function of the seed and the step);
* the behaviour batch is split by rows so that the ranks' estimated work evens out (:func:`part_costs`: all of it
  to rank 1 where the strictness weights are 0, most to rank 0 where the ablation losses make the ``strict`` part
  the larger, halves without SIIT), and each share is weighted by its part of the batch's rows (or answer tokens,
  ``loss_norm="token"``), so the two add up to the whole batch's loss;
* after each rank's backward one ``all_reduce`` adds the gradients (a parameter no term reached keeps no gradient,
  as in one process, so AdamW skips it the same way), the logged losses and the step's loss; both ranks then clip
  and step alike, so their weights stay equal without being sent.

Rank 0 evaluates, writes checkpoints and logs; rank 1 only trains. The result equals the one-process run up to the
order of float sums (the split is fixed by the config, so a two-process run repeats bit for bit and resumes
exactly). :func:`launch` starts the two processes (``python -m vlmbind.organisms ... --rank R``, plain arguments
and a JSON config: nothing is pickled) and waits for them.

Stopping: a Ctrl-C or a SIGTERM to the launcher is passed on to rank 0 as an interrupt, which writes a checkpoint at
its last finished step, as one process does on Ctrl-C; rank 1 is stopped after it. If the launcher dies without
passing anything on (SIGKILL), rank 0 notices that its parent is gone (:func:`stop_when_orphaned`) and stops the same
way, and rank 1 stops at its next exchange with rank 0: no training process outlives its launcher for long.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import TrainingError
from .data import IGNORE_INDEX
from .siit.pointing import PointSIITSpec

PROCESS_COUNTS = (1, 2)
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=30)
ERROR_FILE = "error-rank{rank}.txt"


ABLATION_COST = 0.75  # an ablation loss against an interchange run with gradients (measured: organism-vsm stage 12)


def part_costs(siit: Any, batch_size: int) -> tuple[float, float, float]:
    """Estimated work of a step's ``iit`` part, ``strict`` part and behaviour batch, in runs of the step's pairs with
    gradients: a source run without them (``source_grad=False``) counts a third (a forward is about a third of a
    forward and backward), an ablation loss :data:`ABLATION_COST`, the gathering and selecting interchanges their
    share of the steps (those of ID selection). On the recipe's stages this puts the behaviour rows where they even the
    two processes out (``benchmarks/two_processes.py``).
    """
    if siit is None:
        return 0.0, 0.0, 1.0
    if isinstance(siit, PointSIITSpec):  # a source run with gradients and the patched run; one without and one
        iit = 2.0 if max(siit.iit_weight, siit.attention_weight, siit.readout_weight) > 0 else 0.0
        return iit, (1.0 / 3.0 + 1.0) * (siit.strict_weight > 0), batch_size / siit.pairs
    source = 1.0 if siit.source_grad else 1.0 / 3.0
    selecting = 1.0 / len(siit.alignments) if "id_selection" in siit.alignments else 0.0
    iit = 0.0
    if siit.iit_weight > 0:
        iit = source + 1.0 + selecting * ((siit.gather_interchange_weight > 0)
                                          + (siit.selecting_interchange_weight > 0))
    strict = (source + 1.0) * (siit.strict_weight > 0) + ABLATION_COST * (siit.ablation_strict_weight > 0) \
        + ABLATION_COST * (siit.ablation_necessity_weight > 0)
    return iit, strict, batch_size / siit.pairs


@dataclass(frozen=True)
class RankSplit:
    """What one of two training processes computes of each step.

    Attributes:
        rank: 0 or 1.
        group: the ``torch.distributed`` process group (None in tests that only ask for the split).
    """

    rank: int
    group: Any = None
    world: int = 2

    def siit_parts(self) -> tuple[str, ...]:
        return ("iit",) if self.rank == 0 else ("strict",)

    def behaviour_rows(self, n: int, siit: Any) -> range:
        """The rows of an ``n``-row behaviour batch this rank computes (rank 0 the first ones): as many as even out
        the two ranks' estimated work (:func:`part_costs`); all of them without SIIT."""
        iit, strict, behaviour = part_costs(siit, n)
        share = min(max((strict - iit + behaviour) / (2 * behaviour), 0.0), 1.0)
        first = int(round(share * n))
        return range(0, first) if self.rank == 0 else range(first, n)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (float sums of two terms: the same on both ranks)."""
        torch.distributed.all_reduce(tensor, group=self.group)
        return tensor


def sync_step(split: RankSplit, params: Sequence[torch.nn.Parameter], logged: Mapping[str, float],
              names: Sequence[str], value: float) -> tuple[dict[str, float], float]:
    """Add the ranks' gradients of ``params`` (in place), their logged losses and their step losses.

    A parameter that has no gradient on any rank is left without one (AdamW skips it, as in one process).

    Returns:
        ``({name: summed value for the names some rank logged}, summed step loss)``.
    """
    numel = sum(p.numel() for p in params)
    buffer = torch.zeros(numel + len(params) + 2 * len(names) + 1, dtype=torch.float32)
    offset = 0
    for i, p in enumerate(params):
        k = p.numel()
        if p.grad is not None:
            buffer[offset:offset + k] = p.grad.detach().reshape(-1).float()
            buffer[numel + i] = 1.0
        offset += k
    base = numel + len(params)
    for j, name in enumerate(names):
        if name in logged:
            buffer[base + j] = float(logged[name])
            buffer[base + len(names) + j] = 1.0
    buffer[-1] = float(value)
    split.all_reduce(buffer)
    offset = 0
    for i, p in enumerate(params):
        k = p.numel()
        p.grad = buffer[offset:offset + k].view_as(p).to(p.dtype).clone() if buffer[numel + i] > 0 else None
        offset += k
    summed = {name: float(buffer[base + j]) for j, name in enumerate(names) if buffer[base + len(names) + j] > 0}
    return summed, float(buffer[-1])


def behaviour_shares(split: RankSplit, batch: Any, image_token_id: int, norm: str) -> tuple[float, float]:
    """This rank's share of the step's behaviour loss and of its position-code loss.

    Both ranks call it every step (``batch`` None where a rank has no behaviour rows): the shares are this rank's
    rows (``norm="example"``) or answer tokens (``"token"``), and its image tokens, over both ranks' together.
    """
    counts = torch.zeros(3, dtype=torch.float64)  # rows, answer tokens, image tokens
    if batch is not None:
        target = batch.labels[:, 1:]
        counts[0] = target.shape[0]
        counts[1] = float((target != IGNORE_INDEX).sum())
        counts[2] = float((batch.inputs["input_ids"] == image_token_id).sum())
    local = counts.clone()
    split.all_reduce(counts)
    answer = local[0] / counts[0] if norm == "example" else local[1] / counts[1].clamp_min(1)
    position = local[2] / counts[2] if counts[2] > 0 else torch.zeros(())
    return float(answer), float(position)


def join(rank: int, rendezvous: str | os.PathLike) -> RankSplit:
    """Join the two-process group through the file ``rendezvous`` (gloo, the CPU backend)."""
    if rank not in (0, 1):
        raise TrainingError(f"rank must be 0 or 1 (two processes), got {rank!r}")
    torch.distributed.init_process_group("gloo", init_method=Path(rendezvous).resolve().as_uri(), rank=rank,
                                         world_size=2, timeout=RENDEZVOUS_TIMEOUT)
    return RankSplit(rank=rank, group=torch.distributed.group.WORLD)


def leave() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_processes(processes: Any, siit: Any) -> int:
    """``processes`` as an int, or a :class:`TrainingError` that says what to pass instead."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes not in PROCESS_COUNTS:
        raise TrainingError(f"processes must be 1 or 2, got {processes!r}")
    if processes == 2 and siit is not None and not siit.single_loss:
        raise TrainingError("processes=2 splits one summed loss between two processes; siit.single_loss=False "
                            "takes one optimiser step per loss; train that run with processes=1")
    return processes


def launch(config_dict: Mapping[str, Any], out: Path, *, resume: bool, progress: bool, until: int | None,
           threads: int | None) -> None:
    """Run the two training processes on ``config_dict`` into ``out`` and wait for both.

    Raises:
        TrainingError: a process failed (its message, where it wrote one), or was stopped.
    """
    with tempfile.TemporaryDirectory(prefix="vlmbind-train-") as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(config_dict, default=str))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1)}
        procs: list[subprocess.Popen] = []
        logs = [Path(tmp) / f"stderr-rank{r}.txt" for r in (0, 1)]
        with sigterm_as_interrupt():  # a SIGTERM stops the run as a Ctrl-C does
            try:
                for rank in (0, 1):
                    cmd = [sys.executable, "-m", "vlmbind.organisms", "--config", str(config_path), "--out", str(out),
                           "--threads", str(threads or 1), "--processes", "2", "--rank", str(rank),
                           "--rendezvous", str(Path(tmp) / "rendezvous"), "--launcher", str(os.getpid())]
                    cmd += ["--resume"] if resume else []
                    cmd += ["--until", str(until)] if until is not None else []
                    cmd += [] if progress and rank == 0 else ["--quiet"]
                    stderr = None if progress and rank == 0 else logs[rank].open("w")
                    # a session of their own: a Ctrl-C reaches this process only, which passes one on to rank 0
                    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                                  start_new_session=True))
                failed = _wait(procs)
            except KeyboardInterrupt:  # rank 0 writes a checkpoint at the last finished step; rank 1 is stopped after
                if procs and procs[0].poll() is None:
                    procs[0].send_signal(signal.SIGINT)
                    procs[0].wait()
                raise
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        if failed is not None:
            rank, code = failed
            message = Path(tmp) / ERROR_FILE.format(rank=rank)
            if message.is_file():
                raise TrainingError(message.read_text().strip())
            tail = logs[rank].read_text()[-2000:].strip() if logs[rank].is_file() else ""
            raise TrainingError(f"training process {rank} of 2 stopped with exit code {code}"
                                + (f":\n{tail}" if tail else " (its output is above)"))


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within: a SIGTERM raises KeyboardInterrupt, so it stops a training run as a Ctrl-C does (a checkpoint at the
    last finished step; with two processes, none left behind). Signal handlers can only be set in the main thread;
    elsewhere SIGTERM keeps its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def stop_when_orphaned(launcher: int, interval: float = 1.0) -> threading.Thread:
    """Interrupt this process's main thread (as the launcher's Ctrl-C would) once its parent is no longer
    ``launcher``: the launcher died without passing a stop on. Returns the watching (daemon) thread."""
    # the launcher's interrupt must arrive even where SIGINT was ignored when the launcher started (a run started in
    # the background): the workers have a session of their own, so nothing else sends them one
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=watch, name="vlmbind-launcher-watch", daemon=True)
    thread.start()
    return thread


def _wait(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait for every process; on the first failure stop the other. Returns ``(rank, code)`` of a failure."""
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                for other in procs:
                    if other.poll() is None:
                        other.terminate()
                return rank, code
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)


def error_file(rendezvous: str | os.PathLike, rank: int) -> Path:
    """Where a worker writes the message of the error that stopped it (beside the rendezvous file)."""
    return Path(rendezvous).parent / ERROR_FILE.format(rank=rank)
