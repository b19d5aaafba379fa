"""What the subcommands share: the parser class that raises instead of exiting, argument types, the capture options,
and the preamble of every command that runs a model (:func:`check_model`, :func:`out_dir`, then :func:`load_model`
or, for the sweeps, :func:`model_session` and :func:`rank_done`).

The preamble's order is part of the contract: a ``--model`` that cannot load by its name alone (a misspelt registered
name, a hub id whose config is not in the Hugging Face cache: :func:`check_model`) fails first, before torch is
imported; then a bad ``--out`` fails (nothing written, no model loaded), then checks of the run's size against the
ranks and of leftovers of an interrupted run, then the ranks start and each loads the model.

This module and the commands' ``add_parser`` functions import nothing heavy (the choices come from
:mod:`vlmbind.core.choices`), so ``vlmbind --help`` and those errors answer at once; the heavy modules are imported by
the functions that use them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.choices import (
    ATTN_IMPLEMENTATIONS,
    DTYPE_NAMES,
    FRAMES,
    PROMPT_FORMATS,
    hub_config_message,
    is_registered,
    registered_names,
    unknown_name_error,
)
from ...core.errors import InputError, ModelLoadError

if TYPE_CHECKING:
    from ...engine.parallel import Group


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

    parse.lowest = low  # what the tests read to try every bounded option
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
def parse_layers(text: str | None) -> list[int] | None:
    """``0-3`` or ``1,2,5`` as a list of layers (None stays None)."""
    if text is None:
        return None
    layers: list[int] = []
    try:
        for part in str(text).split(","):
            low, _, high = part.strip().partition("-")
            layers += list(range(int(low), int(high) + 1)) if high else [int(low)]
    except ValueError:
        raise InputError(f"--layers {text!r}: give layers as 0-3 or 1,2,5") from None
    if not layers:
        raise InputError(f"--layers {text!r} names no layer")
    return sorted(set(layers))


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
    g.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="weights' dtype (default: float32 on the CPU, the checkpoint's own on a GPU); scores are "
                        "computed in float32 either way, but bfloat16 weights change them (a warning says how much)")
    g.add_argument("--device-map", default=None, help="accelerate placement for large checkpoints, e.g. auto")
    g.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default=None,
                   help="attention kernel (default sdpa for checkpoints); runs that read or edit attention "
                        "patterns switch to vlmbind's eager attention on their own")


def placement(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`vlmbind.load` keywords of :func:`add_placement`'s flags (absent flags: none)."""
    keys = ("device", "dtype", "device_map", "attn_implementation")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def check_model(args: argparse.Namespace) -> None:
    """Refuse ``--model`` at once, without importing torch, when :func:`vlmbind.load` would refuse it by its name
    alone: a misspelt registered name (the same :class:`~vlmbind.core.errors.UnsupportedModelError`, with close
    matches), or a hub id whose config is not in the Hugging Face cache (vlmbind never downloads; the same
    :class:`~vlmbind.core.errors.ModelLoadError` wording, saying how to fetch it or to pass a directory). Registered
    names and local paths pass; :func:`vlmbind.load` checks them (and repeats these checks for the Python API). Every
    command that runs a model calls it first, before its own imports; :func:`load_model` and :func:`model_session` call
    it
    too."""
    name = os.fspath(args.model)
    if is_registered(name):
        return
    unknown = unknown_name_error(name, registered_names())
    if unknown is not None:
        raise unknown
    if Path(name).exists() or name.startswith((".", "/", "~")):
        return
    reason = _not_cached(name)
    if reason:
        raise ModelLoadError(hub_config_message(name, reason))


def _not_cached(hub_id: str) -> str | None:
    """Why ``hub_id``'s config cannot be read from the Hugging Face cache (the cache transformers reads), or None when
    it is there or the id is one the hub library refuses (then loading says why)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(hub_id, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub library refuses: the full load reports it as today
        return None
    if isinstance(found, str):
        return None
    return "its config.json is not in the Hugging Face cache"


def add_scores_options(p: argparse.ArgumentParser, group: Any) -> None:
    """``--scores`` (into the mutually exclusive ``group``) and ``--scores-from-any-model``."""
    group.add_argument("--scores", help="a scores.csv from vlmbind locate, run on the same --model")
    p.add_argument("--scores-from-any-model", action="store_true",
                   help="use --scores located on another model than --model (refused otherwise)")


def check_scores_model(args: argparse.Namespace) -> None:
    """Refuse ``--scores`` located on another model than ``--model`` (read from the summary.json beside it), unless
    ``--scores-from-any-model``: another model's heads have the same names and mean something else."""
    from ...core.userfiles import UserFileError, same_model, scores_model

    if not getattr(args, "scores", None) or args.scores_from_any_model:
        return
    origin = scores_model(args.scores)
    if origin is not None and not same_model(origin, str(args.model)):
        raise UserFileError(f"--scores {args.scores!r} were located on {origin} (its summary.json says so), not on "
                            f"--model {args.model}; run vlmbind locate on {args.model}, or pass "
                            f"--scores-from-any-model to use them anyway")


def out_dir(args: argparse.Namespace, command: str, *qualifiers: str) -> Path:
    """``--out``, or ``runs/<command>/<model>[-<qualifier>...]``, checked before any work (:func:`check_out_dir`)."""
    from ...core.io import check_out_dir

    default = "-".join([f"runs/{command}/{Path(str(args.model)).name}", *qualifiers])
    return check_out_dir(args.out or default)


def load_model(args: argparse.Namespace) -> Any:
    """``--model``, loaded in this process (commands that run on one process), in ``--prompt-format``."""
    from ...engine import loading

    check_model(args)
    return _warned(_formatted(loading.load(args.model, **placement(args)), args))


def _formatted(vlm: Any, args: argparse.Namespace) -> Any:
    """``vlm`` prompting in ``--prompt-format`` (the one place a command's choice reaches every prompt)."""
    vlm.use_prompt_format(getattr(args, "prompt_format", None))
    return vlm


def _warned(vlm: Any) -> Any:
    """``vlm``, after printing the measured low-precision warning to stderr when its weights are bf16 / fp16."""
    from ...engine.precision import low_precision_warning

    warning = low_precision_warning(vlm)
    if warning:
        print(warning, file=sys.stderr)
    return vlm


@contextlib.contextmanager
def model_session(args: argparse.Namespace, command: list[str], out: Path | None = None, *,
                  sweep: str | None = None, checkpoint: Path | None = None) -> Iterator[tuple[Group, Any]]:
    """The ranks of a sweep (``--processes``) and the model each loads: ``(group, vlm)``.

    With ``sweep`` (the command's part prefix), leftovers of an interrupted run in ``out`` are refused unless
    ``--resume`` (see :func:`vlmbind.engine.parallel.check_leftovers`); spawned ranks rerun the command line through
    ``args.rank_entry`` (the command's ``main``).
    """
    from ...engine import loading, parallel

    check_model(args)
    if sweep is not None:
        world = parallel.world_size(args.processes)
        parallel.check_leftovers(out, sweep, checkpoint, world, args.resume)
    note_kept_work(args, out, checkpoint)
    with parallel.session(args.processes, command[1:], entry=args.rank_entry, quiet=True) as group:
        options = placement(args)
        if "device" not in options and "device_map" not in options:
            options.update(group.load_kwargs())
        vlm = _formatted(loading.load(args.model, **options), args)
        yield group, (_warned(vlm) if group.is_main else vlm)


def note_kept_work(args: argparse.Namespace, out: Path | None, checkpoint: Path | None) -> None:
    """Record where the run keeps finished work (``out``, and its checkpoint file), so that a Ctrl-C can say what is
    kept and how to resume (``args.kept_in``, read by :func:`vlmbind.app.commands.main`)."""
    if out is not None:
        args.kept_in = (out, checkpoint)


def rank_done(group: Group, out: str | Path) -> tuple[dict[str, Any], str, int]:
    """The CLI result of a rank other than 0 (its work is in the parts; rank 0 writes the results)."""
    from ...engine import parallel

    return ({"rank": group.rank, "processes": group.world, "out": str(out)},
            f"rank {group.rank} of {group.world}: part written to {Path(out) / parallel.PARTS}", 0)


def add_point_frame(p: Any) -> None:
    """``--point-frame``: the coordinate frame of generated points whose format does not carry one."""
    p.add_argument("--point-frame", choices=tuple(FRAMES), default=None,
                   help="coordinate frame of points the model writes in a format without its own frame (plain "
                        "(x, y) from a checkpoint vlmbind did not train, JSON from a family that declares none); "
                        "default: refuse such points rather than compare numbers in an unknown frame")


def task_data(args: argparse.Namespace, generator_options: tuple[str, ...]) -> Any:
    """``--data``'s examples, read and checked before any model loads (None for a built-in ``--task``, whose
    ``--n`` and ``--seed`` defaults are filled in).

    Raises:
        InputError: a generator option given with --data; a task file that does not validate.
    """
    if args.data is None:
        load_plugins(args)
        check_task_name(args.task)
        args.n = 200 if args.n is None else args.n
        args.seed = 1 if args.seed is None else args.seed
        return None
    given = [name for name in generator_options if getattr(args, name, None) is not None]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise InputError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply with --data (the task file holds "
                         f"the examples); drop {'it' if len(given) == 1 else 'them'}")
    from ...stimuli.user import load_task

    return load_task(args.data)


def task_label(args: argparse.Namespace) -> str:
    """What names the run's default folder: the task, or the task file's folder (its stem for a bare file)."""
    if args.data is None:
        return args.task
    path = Path(args.data)
    return path.name if path.is_dir() else (path.parent.name if path.stem == "task" else path.stem)


def check_task_name(task: str) -> None:
    """``--task``: a built-in task or one a ``--plugin`` file registered.

    Raises:
        InputError: any other name (the message lists the registered ones).
    """
    from ...core.errors import close_matches
    from ...stimuli.registry import TASKS

    if task not in TASKS:
        raise InputError(f"--task {task!r} is not registered.{close_matches(task, TASKS)} Registered: "
                         f"{', '.join(TASKS)}; a task of your own comes with --data PATH (a task file) or --plugin "
                         "FILE.py (as code)")


def add_plugin(p: Any, what: str) -> None:
    """``--plugin FILE.py``: a researcher's file that registers conditions or tasks, run only when given."""
    p.add_argument("--plugin", action="append", metavar="FILE.py", default=None,
                   help=f"a Python file of yours that registers {what} (vlmbind.stimuli.register_condition / "
                        "register_task; docs/your_experiment.md); run only when given; repeatable")


def load_plugins(args: argparse.Namespace) -> list[str]:
    """Run the ``--plugin`` files; what they registered (``condition NAME`` / ``task NAME``).

    Raises:
        PluginError: a file that is not Python, fails while running, or registers a name twice.
    """
    if not getattr(args, "plugin", None):
        return []
    from ...stimuli.registry import load_plugin

    return [name for path in args.plugin for name in load_plugin(path)]
