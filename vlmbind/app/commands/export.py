"""``vlmbind export``: re-render saved results as figures or tidy tables, without a model."""

from __future__ import annotations

import argparse
from typing import Any

from ...core.choices import EXPORT_FORMATS as FORMATS
from ...core.choices import check_export_arguments

# its place in `vlmbind --help`
HELP_ORDER = 120


def add_parser(sub: Any, common: Any) -> None:
    """Register ``vlmbind export``."""
    p = sub.add_parser(
        "export", parents=[common], help="re-render saved results as png/svg/html figures or csv tables",
        description="Rebuild the figures (or tidy tables) of a vlmbind result folder from its saved numbers, without "
                    "loading a model. Sub-folders holding results (e.g. a demo's causal/ and representations/) are "
                    "exported too, to the same relative paths under --out.",
    )
    p.add_argument("result_dir", metavar="RESULT_DIR", help="a folder written by a vlmbind command")
    p.add_argument("--format", default="html", help=f"one of {', '.join(FORMATS)} (default html; HTML pages share "
                                                    f"one plotly.min.js written at the top of the output folder)")
    p.add_argument("--out", default=None, help="output folder (default RESULT_DIR/export, or runs/export/<path> "
                                               "when RESULT_DIR is part of a git-tracked source tree)")
    p.add_argument("--width", type=int, default=None, help="png/svg/pdf: page width in CSS pixels (default: the "
                                                           "figure's own)")
    p.add_argument("--height", type=int, default=None, help="png/svg/pdf: page height in CSS pixels (default: the "
                                                            "figure's own)")
    p.add_argument("--scale", type=float, default=None, help="png/svg/pdf: size multiplier (default 2 for png, "
                                                             "1 for svg and pdf)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace, command: list[str]) -> tuple[dict[str, Any], str, int]:
    """``vlmbind export``: see :func:`export_results`."""
    # a bad argument is refused before the renderers' imports (torch, plotly, pandas), which take seconds
    check_export_arguments(args.result_dir, args.format, width=args.width, height=args.height, scale=args.scale)
    from ..export import export_results

    report = export_results(args.result_dir, args.format, args.out, width=args.width, height=args.height,
                            scale=args.scale)
    kinds = ", ".join(f"{r['dir']} ({r['kind']})" for r in report.results)
    slowest = max(report.timings, key=lambda t: t["seconds"])
    text = (f"vlmbind export: {len(report.results)} result folder(s): {kinds}\n"
            f"  wrote {len(report.files)} {report.format} file(s) to {report.out} in {report.seconds:.1f} s "
            f"(slowest {slowest['file']}: {slowest['seconds']:.2f} s)")
    return report.summary(), text, 0
