"""``vlmbind benchmark``: every method on every planted organism and its twin, one table."""

from __future__ import annotations

from typing import Any

from ...core.choices import ABLATION_MODES as MODES
from ...core.choices import VALIDATION_METHODS
from ...core.errors import InputError
from .arguments import int_at_least

# its place in `vlmbind --help`
HELP_ORDER = 112
# the benchmark's default methods: every validation method (naive is exact's check, not a method of its own)
DEFAULT_METHODS = tuple(m for m in VALIDATION_METHODS if m != "naive")


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("benchmark", parents=[common], help="every method on every planted organism and its twin",
                       description="Validate each shipped organism with a planted mechanism against its planted "
                                   "heads and its twin (the same recipe without the planting) against the same "
                                   "heads, and gather one table: node AUROC, recall@k, planted-vs-rest ratio, "
                                   "ablation separation, edit efficacy, edge AUROC and seconds per method. "
                                   "--table prints a saved table as markdown without running anything.")
    p.add_argument("--organisms", default=None,
                   help="planted organisms, comma-separated (default: every shipped one: organism-vsm, "
                        "organism-search); each brings its twin")
    p.add_argument("--n-pairs", type=int_at_least(1, "16"), default=16,
                   help="pairs per condition (scene pairs, or attention_swap pairs for search heads; default 16)")
    p.add_argument("--seed", type=int, default=1000, help="stimulus seed (default 1000, away from training's)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"mediation methods, comma-separated (default {','.join(DEFAULT_METHODS)})")
    p.add_argument("--modes", default=",".join(MODES), help=f"ablation modes (default {','.join(MODES)})")
    p.add_argument("--n-eval", type=int_at_least(1, "64"), default=64,
                   help="scenes or counting displays the ablation and the edit are scored on (default 64)")
    p.add_argument("--ablation-seeds", type=int_at_least(1, "5"), default=5, help="random-k draws (default 5)")
    p.add_argument("--n-estimate", type=int_at_least(1, "2048"), default=2048,
                   help="scenes the position IDs of the edit are estimated from (default 2048)")
    p.add_argument("--n-probe", type=int_at_least(16, "512"), default=512,
                   help="scenes for the probes of scene heads, a quarter held out (default 512)")
    p.add_argument("--edge-pairs", type=int_at_least(0, "8"), default=8,
                   help="id_selection pairs the declared edges are scored on by path patching (default 8; 0 skips)")
    p.add_argument("--n-track", type=int_at_least(1, "32"), default=32,
                   help="counting displays tracked for search heads (default 32)")
    p.add_argument("--table", metavar="DIR", default=None,
                   help="print the table of a saved benchmark (its benchmark.json) as markdown and stop")
    p.add_argument("--compact", action="store_true",
                   help="with --table: one row per method, one column per organism (the README's table)")
    p.add_argument("--out", default=None, help="output directory (default runs/benchmark)")
    p.set_defaults(func=cmd_benchmark)


def _organisms(text: str | None, planted: dict[str, Any]) -> dict[str, Any]:
    if text is None:
        if not planted:
            raise InputError("no organism with a planted mechanism is shipped in this installation")
        return planted
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in planted]
    if unknown or not names:
        raise InputError(f"--organisms {text!r}: {', '.join(unknown) or 'none given'} "
                         f"{'is' if len(unknown) == 1 else 'are'} not a shipped organism with a planted mechanism; "
                         f"choose from {', '.join(planted) or 'none'}")
    return {n: planted[n] for n in names}


def cmd_benchmark(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    if args.table is not None:
        from pathlib import Path

        from ...analysis.benchmark import BenchmarkResult

        if not (Path(args.table) / "benchmark.json").is_file():
            raise InputError(f"--table {args.table!r} holds no benchmark.json; give the folder a vlmbind benchmark "
                             f"run wrote")
        saved = BenchmarkResult.load(args.table)
        text = saved.compact_markdown() if args.compact else saved.markdown()
        return {**saved.summary(), "table": args.table}, text, 0
    if args.compact:
        raise InputError("--compact shapes the table --table prints; give --table DIR with it")
    from ...core.checks import check_ablation_modes, check_validation_methods
    from ...core.io import check_out_dir

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_validation_methods(methods, "--methods")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    check_ablation_modes(modes, "--modes")
    from ...core.shipped import planted_organisms

    organisms = _organisms(args.organisms, planted_organisms())
    out = check_out_dir(args.out or "runs/benchmark")
    from functools import partial

    from ...analysis.benchmark import benchmark
    from ...analysis.search_validation import validate_search
    from ...analysis.validate import recorded_edges, recorded_planted, validate

    common = {"n_pairs": args.n_pairs, "seed": args.seed, "methods": methods, "modes": modes, "n_eval": args.n_eval,
              "ablation_seeds": args.ablation_seeds, "progress": not args.json}
    scene = partial(_scene, validate, recorded_edges,
                    {**common, "n_estimate": args.n_estimate, "n_probe": args.n_probe, "edge_pairs": args.edge_pairs})
    search = partial(_search, validate_search, {**common, "n_track": args.n_track})
    validations = {n: (search if "search" in recorded_planted(n) else scene) for n in organisms}
    result = benchmark(organisms, validations, out=out)
    result.params = {"n_pairs": args.n_pairs, "seed": args.seed, "methods": methods, "modes": modes,
                     "n_eval": args.n_eval, "ablation_seeds": args.ablation_seeds, "n_estimate": args.n_estimate,
                     "n_probe": args.n_probe, "edge_pairs": args.edge_pairs, "n_track": args.n_track,
                     "command": " ".join(command)}
    result.save(out)
    summary = {**result.summary(), "out": str(out), "command": " ".join(command)}
    return summary, f"{result.markdown()}\n\nwrote {out}/benchmark.json, benchmark.csv (and each validation)", 0


def _scene(validate: Any, recorded_edges: Any, options: dict[str, Any], vlm: Any, reference: Any,
           source: Any) -> Any:
    """The scene validation of one organism (a twin is scored against its planted organism's heads and edges)."""
    edges = recorded_edges(source) if source is not None else None
    return validate(vlm, reference=reference, reference_source=source, reference_edges=edges, **options)


def _search(validate_search: Any, options: dict[str, Any], vlm: Any, reference: Any, source: Any) -> Any:
    """The search-head validation of one organism."""
    return validate_search(vlm, reference=reference, reference_source=source, **options)
