"""``vlmbind ui``: the local web app (click heads to ablate or patch them)."""

from __future__ import annotations

import errno
import os
import socket
import sys
from typing import Any

from ...core.choices import UI_CONDITIONS
from ...core.errors import InputError
from .arguments import add_placement, add_prompt_format, check_model, int_at_least, load_model

# its place in `vlmbind --help`
HELP_ORDER = 130


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("ui", parents=[common], help="local web app: click heads to ablate, patch or steer them",
                       description="Serve a Dash app on 127.0.0.1 (unless --host): generate or upload an image, "
                                   "click heads of the scores heatmap to ablate or patch them, and see the answer.")
    p.add_argument("--model", default="organism-p2a", help="registered name or model directory")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--scores", default=None, help="a scores.csv from vlmbind locate (default: locate on demand)")
    p.add_argument("--condition", default=None, metavar="CONDITION",
                   help=f"counterfactual of generated scenes, patched at the last token: {', '.join(UI_CONDITIONS)} "
                        "(default: the condition of --scores when it is one of these, else id_selection; the page "
                        "can switch it); with --pairs, which of the file's conditions")
    p.add_argument("--pairs", default=None, metavar="PATH",
                   help="your own counterfactual pairs (a folder holding pairs.jsonl, or the file): the page shows "
                        "them, patches where each says, and locates on them")
    p.add_argument("--n-pairs", type=int_at_least(1, "--n-pairs 8"), default=8,
                   help="generated pairs for on-demand locate (default 8)")
    p.add_argument("--seed", type=int, default=0, help="first scene's seed (with --pairs: the first pair shown)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8050, help="TCP port (default 8050)")
    p.set_defaults(func=cmd_ui)


def build_app(*args: Any, **kwargs: Any) -> Any:
    """:func:`vlmbind.app.ui.build_app` (imported when the app is built: it needs torch and dash)."""
    from ..ui import build_app as build

    return build(*args, **kwargs)


def bind_error(host: str, port: int) -> OSError | None:
    """Why the server could not bind ``host:port`` now (None: it could), found by binding a socket as the server
    does (with SO_REUSEADDR, so a port left in TIME_WAIT by an earlier run counts as free) and closing it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, socket.IPPROTO_TCP,
                                                             socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            if os.name != "nt":  # on Windows the option lets a bind share a port that is in use
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:  # socket.gaierror (an unknown host) included
        return exc
    return None


def check_port_free(host: str, port: int) -> None:
    """Refuse ``--host`` / ``--port`` that the server cannot bind, before the model loads (minutes for a checkpoint)
    and before anything is printed.

    Raises:
        InputError: the port is in use or reserved, or the host is not an address of this machine.
    """
    exc = bind_error(host, port)
    if exc is None:
        return
    if exc.errno == errno.EADDRINUSE:
        free = next((p for p in range(port + 1, min(port + 20, 65535) + 1) if bind_error(host, p) is None), None)
        other = f"--port {free}" if free is not None else "another --port"
        raise InputError(f"--port {port} is already in use on {host} (another server, or a vlmbind ui still "
                         f"running); pass {other}, or stop that program")
    if exc.errno == errno.EACCES and port < 1024:
        raise InputError(f"--port {port} on {host} needs administrator rights (ports below 1024 are reserved); pass "
                         "a port from 1024 to 65535, e.g. --port 8050")
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        raise InputError(f"--host {host} is not an address of this machine; pass --host 127.0.0.1 (this machine "
                         "only) or 0.0.0.0 (every interface)")
    raise InputError(f"cannot serve on --host {host} --port {port}: {exc.strerror or exc}; pass another --port")


def cmd_ui(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    if not 0 < args.port < 65536:
        raise InputError(f"--port {args.port} is not a TCP port; pass 1..65535")
    pairs = None
    if args.pairs is not None:
        from ...stimuli.pairs import load_pairs

        if args.pairs.isdigit() and not os.path.exists(args.pairs):
            raise InputError(f"--pairs {args.pairs} names no file: --pairs takes your pairs file; the number of "
                             f"pairs on-demand locate generates is --n-pairs {args.pairs}")
        pairs = load_pairs(args.pairs, args.condition)
    elif args.condition is not None and args.condition not in UI_CONDITIONS:
        raise InputError(f"--condition {args.condition!r} is not one of {', '.join(UI_CONDITIONS)} (a condition of "
                         "your own comes with --pairs PATH)")
    check_port_free(args.host, args.port)
    vlm = load_model(args)
    app = build_app(vlm, scores=args.scores, seed=args.seed, condition=args.condition, n_pairs=args.n_pairs,
                    pairs=pairs)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"vlmbind: warning: serving on {args.host}: anyone who can reach this address can run the model; "
              "there is no authentication", file=sys.stderr)
    print(f"vlmbind ui: http://{args.host}:{args.port}/ (Ctrl-C stops)", file=sys.stderr)
    app.run(host=args.host, port=args.port, debug=False, threaded=True)
    return {"model": vlm.name, "host": args.host, "port": args.port}, "vlmbind ui stopped", 0
