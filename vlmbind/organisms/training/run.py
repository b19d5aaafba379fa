"""Run a training: :func:`train` (in this process, or in two), and the run in this process as named steps (set up
or restore, then step, evaluate and checkpoint until done or stopped).

Design: a run is a pure function of its :class:`~vlmbind.organisms.training.config.TrainConfig`. The weights come from
the seed (or from ``init_from``, another checkpoint, for curricula); each step's batch is a function of
``(seed, step, row)`` (:class:`~vlmbind.organisms.data.TaskMixture`); the learning rate is a function of the step
(linear warm-up, then cosine). So a checkpoint only has to hold what changes: the weights, AdamW's moments, the step,
the torch RNG state and the loss history, and resuming from it continues the exact run an uninterrupted process
would have made (tested bit-for-bit on CPU). An interrupt (Ctrl-C, or SIGTERM from the command line) writes a
checkpoint at the last finished step before stopping.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from ...core.errors import TrainingError
from ..data import BatchBuilder
from ..model import build_organism, grid_side
from ..processes import RankSplit, check_processes, launch
from ..siit.interchange import HeadInterchange
from .checkpoints import list_checkpoints, read_state, save_checkpoint, start_state
from .config import TrainConfig, lr_at
from .evaluation import EvaluationSets, evaluate
from .step import Readouts, Run, make_optimizer, train_step


@dataclass
class TrainResult:
    """What a call to :func:`train` did.

    Attributes:
        out_dir: the run directory.
        checkpoint: the last checkpoint written (a loadable model directory).
        step: the step reached.
        losses: training loss of every step of the run so far (including resumed parts).
        evals: ``[{"step": s, "tasks": {"task/variant": {"loss": l, "accuracy": a}}}, ...]``.
        wall_time_s: training time of the whole run so far (all sessions).
        steps_per_s: speed of this session.
    """

    out_dir: Path
    checkpoint: Path
    step: int
    losses: list[float]
    evals: list[dict[str, Any]]
    wall_time_s: float
    steps_per_s: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"], d["checkpoint"] = str(self.out_dir), str(self.checkpoint)
        return d


def train(
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    progress: bool = True,
    until: int | None = None,
    threads: int | None = None,
    share_image_features: bool = True,
    processes: int = 1,
    device: str | torch.device = "cpu",
) -> TrainResult:
    """Train an organism (or continue one) and write checkpoints into ``out_dir``.

    Args:
        config: the run.
        out_dir: the run directory; ``checkpoint-{step:06d}`` directories appear in it.
        resume: continue from the newest checkpoint in ``out_dir`` (its config must equal ``config``).
        progress: show a tqdm bar with the loss.
        until: stop after this step (a checkpoint is written there), as if interrupted; None: run to
            ``config.steps``.
        threads: ``torch.set_num_threads`` for this process (None: leave it). On an otherwise idle 2-core machine
            two threads train 1.2-1.5x faster than one (``benchmarks/training.py``); with another job on it, give
            each one thread (more threads than cores cost several times). Results can differ in the last bits
            between thread counts.
        share_image_features: send each distinct image of an optimiser step's runs (and of an evaluation) through
            the vision tower once (:func:`~vlmbind.organisms.model.shared_image_features`); False runs the vision
            tower in every forward, the plain path it must equal (up to the order of float sums).
        processes: 1, or 2 to train in two processes of ``threads`` threads each (default 1), each computing part
            of every step's summed loss (:mod:`~vlmbind.organisms.processes`): faster than one process on an
            idle 2-core machine (``benchmarks/two_processes.py``), and the same run up to the order of float sums.
            A run may change its process count when it resumes.
        device: where to train (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...): the model is built there, and every
            tensor a step makes without naming a device is made there (``torch.device`` as the default device), so
            batches, masks and targets meet the model on it. One process only; the checkpoints are the same files
            whatever the device, and a run may resume on another device (its numbers then differ in the last bits,
            as between thread counts). The first step on a device records it in the trainer state.

    Returns:
        A :class:`TrainResult`.

    Raises:
        TrainingError: ``resume`` without a checkpoint, a fresh run into a directory that has checkpoints, a config
            that differs from the checkpoint's, ``init_from`` weights that do not fit, or a device that is not
            there (or is not the CPU with two processes).
    """
    if not isinstance(config, TrainConfig):
        raise TrainingError(f"config must be a TrainConfig, got {type(config).__name__}")
    if until is not None and (not isinstance(until, int) or isinstance(until, bool) or until < 1):
        raise TrainingError(f"until must be an int >= 1 or None, got {until!r}")
    processes = check_processes(processes, config.siit)
    device = training_device(device, processes)
    if processes == 2 and not share_image_features:
        raise TrainingError("share_image_features=False (the plain path, for comparisons) runs in one process; "
                            "pass processes=1 with it")
    if processes == 2:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        before = list_checkpoints(out)
        start = int(read_state(before[-1])["step"]) if resume and before else 0
        t0 = time.perf_counter()
        launch(config.to_dict(), out, resume=resume, progress=progress, until=until, threads=threads)
        return _result_of(out, start, time.perf_counter() - t0)
    return train_here(config, out_dir, resume=resume, progress=progress, until=until, threads=threads,
                      share_image_features=share_image_features, device=device)


def training_device(device: str | torch.device, processes: int = 1) -> torch.device:
    """``device`` as a ``torch.device`` a run can train on here.

    Raises:
        TrainingError: a name torch does not read, a CUDA device this machine does not have, or another device than
            the CPU with two processes (they add their gradients through CPU buffers).
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise TrainingError(f"device {device!r} is not a torch device name (e.g. cpu, cuda, cuda:1): {exc}") from exc
    if device.type != "cpu" and processes != 1:
        raise TrainingError(f"two training processes run on the CPU; train on {device} in one process (processes=1)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise TrainingError(f"no CUDA device {device} here ({count} visible); train with device='cpu'")
    elif device.type != "cpu":
        raise TrainingError(f"training runs on cpu or cuda, not {device.type}")
    return device


def _result_of(out: Path, start: int, elapsed: float) -> TrainResult:
    """The :class:`TrainResult` of a run the training processes finished, read from its newest checkpoint."""
    checkpoint = list_checkpoints(out)[-1]
    state = read_state(checkpoint)
    done = int(state["step"])
    return TrainResult(out_dir=out, checkpoint=checkpoint, step=done, losses=[float(v) for v in state["losses"]],
                       evals=list(state["evals"]), wall_time_s=float(state["wall_time_s"]),
                       steps_per_s=(done - start) / elapsed if done > start else 0.0)


def train_here(config: TrainConfig, out_dir: str | os.PathLike, *, resume: bool, progress: bool,
               until: int | None, threads: int | None, share_image_features: bool,
               split: RankSplit | None = None, device: torch.device = torch.device("cpu")) -> TrainResult | None:
    """:func:`train` in this process: the whole step, or (``split``) one rank's part of it (rank 1 returns None)."""
    if threads is not None:
        torch.set_num_threads(int(threads))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = list_checkpoints(out)
    with torch.device(device):  # what the run makes without naming a device is made where the model is
        run, state = _set_up(config, out, existing, resume, split, share_image_features, device)
        return _steps(run, EvaluationSets.of_run(run), out, state, existing[-1] if resume else None, until,
                      progress)


def _set_up(config: TrainConfig, out: Path, existing: list[Path], resume: bool, split: RankSplit | None,
            share_image_features: bool, device: torch.device) -> tuple[Run, dict[str, Any]]:
    """The run's organism, optimiser, data and readouts, and the trainer state it starts from (with ``resume``,
    all restored from the newest checkpoint)."""
    with torch.device("cpu"):  # seeded CPU draws: the same weights, whatever the device
        model, processor = build_organism(seed=config.seed, image_size=config.image_size,
                                          attn_implementation=config.attn_implementation, **config.model.to_dict())
    model.to(device)
    optimizer = make_optimizer(model, config)
    state = start_state(out, existing, config, model, optimizer, resume)
    mixture, builder = config.mixture(), BatchBuilder(processor)
    interchange = HeadInterchange(model, processor) if (config.siit or config.point_siit) is not None else None
    cells = grid_side(config.image_size) ** 2
    with torch.device("cpu"):  # as the weights
        readouts = Readouts.for_run(config, interchange, cells)
    readouts.to(device)
    if resume:
        readouts.load(existing[-1])
    run = Run(config=config, model=model, processor=processor, optimizer=optimizer, mixture=mixture, builder=builder,
              interchange=interchange, readouts=readouts, cells=cells, split=split,
              share_image_features=share_image_features, device=device)
    return run, state


@dataclass
class RunLog:
    """What a run has logged so far (continued from the trainer state it starts from)."""

    losses: list[float]
    siit_losses: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    previous_time: float

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunLog:
        return cls([float(v) for v in state["losses"]], list(state.get("siit_losses", [])), list(state["evals"]),
                   float(state.get("wall_time_s", 0.0)))

    def trainer_state(self, run: Run, step: int, elapsed: float) -> dict[str, Any]:
        """The ``trainer_state.json`` of a checkpoint at ``step``, ``elapsed`` seconds into this session."""
        return {"step": step, "config": run.config.to_dict(), "rng": {"torch": torch.get_rng_state().tolist()},
                "losses": self.losses, "evals": self.evals, "wall_time_s": self.previous_time + elapsed,
                **({"siit_losses": self.siit_losses} if run.planting is not None else {}),
                "threads": torch.get_num_threads(), **({"processes": run.split.world} if run.split is not None else {}),
                **({"device": str(run.device)} if run.device.type != "cpu" else {}),
                "mixture": run.mixture.to_dict(),
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def _steps(run: Run, sets: EvaluationSets, out: Path, state: dict[str, Any], checkpoint: Path | None,
           until: int | None, progress: bool) -> TrainResult | None:
    """Step, evaluate and checkpoint from the state's step to ``until`` (or the end); an interrupt writes a
    checkpoint at the last finished step. Only the writing process returns a result."""
    config = run.config
    writer = run.split is None or run.split.is_writer
    log = RunLog.from_state(state)
    start = done = int(state["step"])
    stop = config.steps if until is None else min(until, config.steps)

    def save(step: int) -> Path:
        return save_checkpoint(out, step, run.model, run.processor, run.optimizer, config,
                               log.trainer_state(run, step, time.perf_counter() - t0), config.keep_checkpoints,
                               run.readouts.save if run.readouts.trained else None)

    run.model.train()
    bar = tqdm(total=config.steps, initial=start, disable=not (progress and writer), unit="step", dynamic_ncols=True,
               desc=f"organism {config.regime}")
    t0 = time.perf_counter()
    ema = None
    try:
        for step in range(start, stop):
            lr = lr_at(config, step)
            value, parts = train_step(run, step, lr)
            if not math.isfinite(value):
                raise TrainingError(f"the loss became {value} at step {step + 1}; lower lr ({config.lr}) or "
                                    f"keep grad_clip on")
            log.losses.append(value)
            if parts:
                log.siit_losses.append(parts)
            done = step + 1
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            postfix = {"loss": f"{ema:.3f}", "lr": f"{lr:.1e}"}
            if writer and config.eval_every and (done % config.eval_every == 0 or done == config.steps):
                entry = evaluate(run, sets, done)
                log.evals.append(entry)
                postfix["acc"] = " ".join(f"{k}={v['accuracy']:.2f}" for k, v in entry["tasks"].items())
                if "siit" in entry:
                    postfix["iia"] = " ".join(f"{v}={r['interchange_accuracy']:.2f}"
                                              for v, r in entry["siit"].items())
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if writer and (done % config.checkpoint_every == 0 or done == stop):
                checkpoint = save(done)
    except KeyboardInterrupt:
        if writer and done > start and (checkpoint is None or not checkpoint.name.endswith(f"{done:06d}")):
            save(done)
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    if not writer:
        return None
    if checkpoint is None:  # nothing to do (already at the end) and nothing written before
        raise TrainingError(f"no steps left to run in {str(out)!r} (step {start} of {config.steps})")
    return TrainResult(out_dir=out, checkpoint=checkpoint, step=done, losses=log.losses, evals=log.evals,
                       wall_time_s=log.previous_time + elapsed,
                       steps_per_s=(done - start) / elapsed if done > start else 0.0)
