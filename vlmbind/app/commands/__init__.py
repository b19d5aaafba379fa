"""The ``vlmbind`` command: the table of subcommands, the parser and :func:`main`, which owns the exit codes.

Design: each subcommand is a module here with ``add_parser(sub, common)`` and a ``cmd_*`` function from parsed arguments
to ``(summary, text, exit code)``: a JSON-serialisable summary (printed with ``--json``) and a short human summary
(printed otherwise), so scripts and people read the same facts. :func:`main` owns the exit codes: 0 on success; 2 on
bad usage or bad input, with exactly one line ``vlmbind: error: <reason>`` on stderr (argparse's own errors are
routed through the same line, and every :class:`~vlmbind.core.errors.VlmbindError` message already names the bad value
and the fix); 130 on Ctrl-C, with one line saying what the run kept and the command that resumes it; 1 for any other
failure, also as one line (set ``VLMBIND_DEBUG=1`` to see the traceback).

A new subcommand is one module here with those two functions and its ``HELP_ORDER`` (its place in ``vlmbind
--help``): :data:`COMMANDS` finds it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import shlex
import sys
import traceback
from collections.abc import Sequence

from ...core.errors import VlmbindError
from .arguments import Parser, UsageError, one_line

# modules of this package that are not subcommands
HELPERS = ("arguments",)


def _discover() -> tuple:
    # command modules import only the light core modules at their top, so importing them all keeps `--help` fast
    found = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
             if m.name not in HELPERS]
    return tuple(sorted(found, key=lambda module: module.HELP_ORDER))


# the subcommands in the order `vlmbind --help` lists them
COMMANDS = _discover()


def build_parser() -> argparse.ArgumentParser:
    """The ``vlmbind`` argument parser with its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    parser = Parser(prog="vlmbind", description="Mechanistic interpretability of vision-language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub, common)
    return parser


def fail(reason: str) -> None:
    print(f"vlmbind: error: {one_line(reason)}", file=sys.stderr)


def interrupted(args: argparse.Namespace, args_list: list[str]) -> str:
    """The reason printed on Ctrl-C: what the run kept and the command that resumes it (the same command line with
    ``--resume``), for the commands that keep finished work (``args.kept_in``, set by ``model_session``)."""
    from ...core.kept import kept_work

    kept_in = getattr(args, "kept_in", None)
    if kept_in is None:
        return "interrupted"
    kept = kept_work(*kept_in)
    if not kept:
        return "interrupted before anything was kept"
    if not hasattr(args, "resume"):
        return f"interrupted; {'; '.join(kept)}"
    resume = args_list if "--resume" in args_list else [*args_list, "--resume"]
    return f"interrupted; {'; '.join(kept)}; resume with: {shlex.join(['vlmbind', *resume])}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``vlmbind`` command.

    Args:
        argv: the arguments after the program name (``sys.argv[1:]`` when None).

    Returns:
        The exit code: 0 success, 2 bad usage or bad input, 1 any other failure.
    """
    args_list = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except UsageError as exc:
        fail(f"{exc}; see 'vlmbind --help'")
        return 2
    except SystemExit as exc:  # --help prints and exits 0
        return exc.code if isinstance(exc.code, int) else 0
    args.rank_entry = main  # what spawned ranks of a sweep run (parallel's entry point, handed down)
    try:
        summary, text, code = args.func(args, ["vlmbind", *args_list])
        print(json.dumps(summary, indent=2) if args.json else text)
        sys.stdout.flush()
    except VlmbindError as exc:
        fail(str(exc))
        return 2
    except KeyboardInterrupt:
        fail(interrupted(args, args_list))
        return 130
    except BrokenPipeError:  # e.g. `vlmbind models | head -1`
        return 0
    except Exception as exc:  # noqa: BLE001 - the one place that turns any failure into exit code 1
        if os.environ.get("VLMBIND_DEBUG"):
            traceback.print_exc()
        fail(f"{type(exc).__name__}: {exc} (set VLMBIND_DEBUG=1 to see the traceback)")
        return 1
    return code
