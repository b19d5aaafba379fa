"""The command line of ``python -m vlmbind.organisms``: train an organism from a JSON
:class:`~vlmbind.organisms.training.config.TrainConfig`, and (with ``--rank``) be one of the two processes that
``train(processes=2)`` starts.

    python -m vlmbind.organisms --config run.json --out runs/p2a [--resume] [--until N] [--threads 2] [--quiet]
        [--processes 2 | --device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..core.errors import VlmbindError
from .processes import error_file, join, leave, sigterm_as_interrupt, stop_when_orphaned
from .training.config import TrainConfig
from .training.run import train, train_here


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vlmbind.organisms --config run.json --out DIR [--resume] [--until N] [--threads N] [--quiet]``."""
    parser = argparse.ArgumentParser(prog="python -m vlmbind.organisms", description="The organisms trainer: AdamW "
                                     "on answer tokens over a seeded task mixture, with atomic, resumable checkpoints.")
    parser.add_argument("--config", required=True, help="a JSON TrainConfig (fields as in TrainConfig.to_dict)")
    parser.add_argument("--out", required=True, help="the run directory (checkpoints are written here)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--until", type=int, default=None, help="stop after this step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a busy machine)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--processes", type=int, default=1,
                        help="2: train in two processes of --threads threads each (faster on an idle 2-core machine)")
    parser.add_argument("--device", default="cpu", help="where to train: cpu (default) or cuda[:N], one process")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a process that train() started
    parser.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--launcher", type=int, default=None, help=argparse.SUPPRESS)  # the starting process's pid
    args = parser.parse_args(argv)
    if args.rank is not None:
        return _worker(args)
    try:
        config = TrainConfig.from_json(args.config)
        with sigterm_as_interrupt():  # a scheduler's SIGTERM leaves a checkpoint to resume from, as a Ctrl-C does
            result = train(config, args.out, resume=args.resume, progress=not args.quiet, until=args.until,
                           threads=args.threads, processes=args.processes, device=args.device)
    except VlmbindError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in result.to_dict().items() if k not in ("losses", "evals")}
    summary["final_loss"] = result.losses[-1] if result.losses else None
    summary["last_eval"] = result.evals[-1] if result.evals else None
    print(json.dumps(summary, indent=1))
    return 0


def _worker(args: argparse.Namespace) -> int:
    """One of the two processes of ``train(processes=2)``: its error message goes to a file the launcher reads."""
    if args.rendezvous is None or args.processes != 2:
        print("error: --rank is for the processes train(processes=2) starts; run with --processes 2 instead",
              file=sys.stderr)
        return 2
    if args.rank == 0 and args.launcher is not None:
        stop_when_orphaned(args.launcher)  # rank 1 stops at its next exchange with a stopped rank 0
    try:
        config = TrainConfig.from_json(args.config)
        split = join(args.rank, args.rendezvous)
        train_here(config, args.out, resume=args.resume, progress=not args.quiet, until=args.until,
                    threads=args.threads, share_image_features=True, split=split)
    except VlmbindError as exc:
        error_file(args.rendezvous, args.rank).write_text(str(exc))
        return 2
    finally:
        leave()
    return 0
