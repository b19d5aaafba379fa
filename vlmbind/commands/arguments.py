"""What the subcommands share: the parser class that raises instead of exiting, argument types, the capture options,
and the preamble of every command that runs a model (:func:`out_dir`, then :func:`load_model` or, for
the sweeps, :func:`model_session` and :func:`rank_done`).

The preamble's order is part of the contract: a bad ``--out`` fails before anything else (nothing written, no model
loaded), then checks of the run's size against the ranks and of leftovers of an interrupted run, then the ranks start
and each loads the model.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import loading, parallel
from ..io import check_out_dir
from ..models import PROMPT_FORMATS
from ..precision import low_precision_warning
from ..stimuli.answers import FRAMES


class UsageError(Exception):
    """An argparse usage error, raised instead of argparse's print-and-exit."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser that raises on bad usage so ``main`` prints one line and returns 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def int_at_least(low: int, example: str):
    """An argparse type: an int >= ``low``; ``example`` shows a valid value in the message."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; pass e.g. {example}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; pass e.g. {example}")
        return value

    return parse


non_negative_int = int_at_least(0, "--seed 0")
positive_int = int_at_least(1, "16")


def parse_range(text: str) -> int | tuple[int, int]:
    """``"7"`` -> 7, ``"2-4"`` -> (2, 4) (inclusive)."""
    try:
        if "-" in text.strip().lstrip("-"):
            lo, hi = (int(p) for p in text.split("-", 1))
            if lo > hi:
                raise argparse.ArgumentTypeError(f"range {text!r} is empty: write LOW-HIGH with LOW <= HIGH")
            return lo, hi
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count or a range like 2-4") from None
def one_line(text: str) -> str:
    return " ".join(str(text).split())


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def add_capture_arguments(p: Any) -> None:
    """``--processes`` and ``--shard-size`` of the commands that capture a data set (``probe``, ``rsa``)."""
    p.add_argument("--processes", type=int, default=1,
                   help="split the capture's shards over N worker processes (default 1; implied by torchrun / "
                        "accelerate launch)")
    p.add_argument("--shard-size", type=int, default=64, help="examples per activation shard (default 64)")


def add_prompt_format(p: Any) -> None:
    """``--prompt-format raw|chat`` (default: the model's own, chat for checkpoints with a chat template)."""
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=None,
                   help="how prompts reach the model: raw text after the image, or the chat template's user turn "
                        "(default: chat for checkpoints with a chat template, raw for organisms and tiny models)")


def add_placement(p: Any) -> None:
    """Where and in what precision the model runs: ``--device``, ``--dtype``, ``--device-map``,
    ``--attn-implementation`` (the keywords of :func:`vlmbind.load`)."""
    g = p.add_argument_group("placement and precision")
    g.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N, mps or auto (a GPU when there is one); default: the CPU")
    g.add_argument("--dtype", choices=tuple(loading.DTYPES), default=None,
                   help="weights' dtype (default: float32 on the CPU, the checkpoint's own on a GPU); scores are "
                        "computed in float32 either way, but bfloat16 weights change them (a warning says how much)")
    g.add_argument("--device-map", default=None, help="accelerate placement for large checkpoints, e.g. auto")
    g.add_argument("--attn-implementation", choices=loading.ATTN_IMPLEMENTATIONS, default=None,
                   help="attention kernel (default sdpa for checkpoints); runs that read or edit attention "
                        "patterns switch to vlmbind's eager attention on their own")


def placement(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`vlmbind.load` keywords of :func:`add_placement`'s flags (absent flags: none)."""
    keys = ("device", "dtype", "device_map", "attn_implementation")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def out_dir(args: argparse.Namespace, command: str, *qualifiers: str) -> Path:
    """``--out``, or ``runs/<command>/<model>[-<qualifier>...]``, checked before any work (:func:`check_out_dir`)."""
    default = "-".join([f"runs/{command}/{Path(str(args.model)).name}", *qualifiers])
    return check_out_dir(args.out or default)


def load_model(args: argparse.Namespace) -> Any:
    """``--model``, loaded in this process (commands that run on one process), in ``--prompt-format``."""
    return _warned(_formatted(loading.load(args.model, **placement(args)), args))


def _formatted(vlm: Any, args: argparse.Namespace) -> Any:
    """``vlm`` prompting in ``--prompt-format`` (the one place a command's choice reaches every prompt)."""
    vlm.use_prompt_format(getattr(args, "prompt_format", None))
    return vlm


def _warned(vlm: Any) -> Any:
    """``vlm``, after printing the measured low-precision warning to stderr when its weights are bf16 / fp16."""
    warning = low_precision_warning(vlm)
    if warning:
        print(warning, file=sys.stderr)
    return vlm


@contextlib.contextmanager
def model_session(args: argparse.Namespace, command: list[str], out: Path | None = None, *,
                  sweep: str | None = None, checkpoint: Path | None = None) -> Iterator[tuple[parallel.Group, Any]]:
    """The ranks of a sweep (``--processes``) and the model each loads: ``(group, vlm)``.

    With ``sweep`` (the command's part prefix), leftovers of an interrupted run in ``out`` are refused unless
    ``--resume`` (see :func:`vlmbind.parallel.check_leftovers`); spawned ranks rerun the command line through
    ``args.rank_entry`` (the command's ``main``).
    """
    if sweep is not None:
        world = parallel.world_size(args.processes)
        parallel.check_leftovers(out, sweep, checkpoint, world, args.resume)
    with parallel.session(args.processes, command[1:], entry=args.rank_entry, quiet=True) as group:
        options = placement(args)
        if "device" not in options and "device_map" not in options:
            options.update(group.load_kwargs())
        vlm = _formatted(loading.load(args.model, **options), args)
        yield group, (_warned(vlm) if group.is_main else vlm)


def rank_done(group: parallel.Group, out: str | Path) -> tuple[dict[str, Any], str, int]:
    """The CLI result of a rank other than 0 (its work is in the parts; rank 0 writes the results)."""
    return ({"rank": group.rank, "processes": group.world, "out": str(out)},
            f"rank {group.rank} of {group.world}: part written to {Path(out) / parallel.PARTS}", 0)


def add_point_frame(p: Any) -> None:
    """``--point-frame``: the coordinate frame of generated points whose format does not carry one."""
    p.add_argument("--point-frame", choices=tuple(FRAMES), default=None,
                   help="coordinate frame of points the model writes in a format without its own frame (plain "
                        "(x, y) from a checkpoint vlmbind did not train, JSON from a family that declares none); "
                        "default: refuse such points rather than compare numbers in an unknown frame")
