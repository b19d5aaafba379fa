"""``vlmbind ui``: the local web app (click heads to ablate or patch them)."""

from __future__ import annotations

import sys
from typing import Any

from ...core.choices import UI_CONDITIONS
from ...core.errors import InputError
from .arguments import add_placement, add_prompt_format, check_model, int_at_least, load_model

# its place in `vlmbind --help`
HELP_ORDER = 130


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("ui", parents=[common], help="local web app: click heads to ablate or patch them",
                       description="Serve a Dash app on 127.0.0.1 (unless --host): generate or upload an image, "
                                   "click heads of the scores heatmap to ablate or patch them, and see the answer.")
    p.add_argument("--model", default="organism-p2a", help="registered name or model directory")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--scores", default=None, help="a scores.csv from vlmbind locate (default: locate on demand)")
    p.add_argument("--condition", choices=UI_CONDITIONS, default=None,
                   help="counterfactual of generated scenes, patched at the last token (default: the condition of "
                        "--scores when it is one of these, else id_selection); the page can switch it")
    p.add_argument("--pairs", type=int_at_least(1, "--pairs 8"), default=8, help="pairs for on-demand locate")
    p.add_argument("--seed", type=int, default=0, help="first scene's seed")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8050, help="TCP port (default 8050)")
    p.set_defaults(func=cmd_ui)


def build_app(*args: Any, **kwargs: Any) -> Any:
    """:func:`vlmbind.app.ui.build_app` (imported when the app is built: it needs torch and dash)."""
    from ..ui import build_app as build

    return build(*args, **kwargs)


def cmd_ui(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    if not 0 < args.port < 65536:
        raise InputError(f"--port {args.port} is not a TCP port; pass 1..65535")
    vlm = load_model(args)
    app = build_app(vlm, scores=args.scores, seed=args.seed, condition=args.condition, n_pairs=args.pairs)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"vlmbind: warning: serving on {args.host}: anyone who can reach this address can run the model; "
              "there is no authentication", file=sys.stderr)
    print(f"vlmbind ui: http://{args.host}:{args.port}/ (Ctrl-C stops)", file=sys.stderr)
    app.run(host=args.host, port=args.port, debug=False, threaded=True)
    return {"model": vlm.name, "host": args.host, "port": args.port}, "vlmbind ui stopped", 0
