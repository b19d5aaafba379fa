"""``vlmbind rsa``: RSA and PCA of object representations on the single-object set."""

from __future__ import annotations

from typing import Any

from ...core.choices import RSA_DEFAULT_SITES as DEFAULT_SITES
from ...core.choices import SIMILARITIES
from .arguments import (
    add_capture_arguments,
    add_placement,
    add_prompt_format,
    check_model,
    int_at_least,
    model_session,
    out_dir,
    rank_done,
)

# its place in `vlmbind --help`
HELP_ORDER = 70


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("rsa", parents=[common], help="RSA and PCA of object representations on the single-object set",
                       description="Capture the single-object RSA set, then compare each site's object similarity "
                                   "matrix with the conjunctive, compositional and position model matrices.")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--sites", default=DEFAULT_SITES, help=f"comma-separated sites or patterns (default {DEFAULT_SITES})")
    p.add_argument("--positions", type=int_at_least(1, "--positions 4"), default=4,
                   help="cells per colour-shape conjunction (default 4)")
    p.add_argument("--similarity", choices=SIMILARITIES, default="pearson",
                   help="how two objects' representations are compared (default pearson)")
    p.add_argument("--permutations", type=int_at_least(0, "--permutations 1000"), default=1000,
                   help="permutations of the p-values (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="stimulus and permutation seed")
    p.add_argument("--resume", action="store_true", help="continue an interrupted capture in OUT/activations")
    p.add_argument("--out", default=None, help="output directory (default runs/rsa/<model>)")
    add_capture_arguments(p)
    p.set_defaults(func=cmd_rsa)


def cmd_rsa(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    out = out_dir(args, "rsa")  # a bad --out is refused before the imports below, which import torch
    from ...analysis import sweeps
    from ...analysis.rsa import pca, rsa, rsa_stimuli
    from ...viz import write_html_atomic
    from ...viz.rsa import pca_figure

    with model_session(args, command, out) as (group, vlm):
        sites = [s.strip() for s in args.sites.split(",") if s.strip()]
        vlm.sites(sites)  # a misspelt site fails here, before anything is written
        data = rsa_stimuli(vlm, args.positions, args.seed)
        acts = sweeps.capture(group, vlm, data, sites, out / "activations", resume=args.resume,
                                shard_size=args.shard_size, progress=group.is_main and not args.json)
        if not group.is_main:
            return rank_done(group, out)
    result = rsa(acts, similarity=args.similarity, permutations=args.permutations, seed=args.seed)
    result.save(out)
    lm = [s for s in acts.sites if s.startswith("blocks.")]
    frames = [pca(acts, s) for s in lm]
    if frames:
        for colour_by in ("cell", "colour"):
            write_html_atomic(pca_figure(frames, colour_by), out / f"pca_by_{colour_by}.html")
    frame = result.frame
    best = frame.loc[frame.groupby("site")["r"].idxmax().dropna()]
    summary = {**result.summary(), "prompt_format": vlm.active_prompt_format,
               "out": str(out), "command": " ".join(command), "n_objects": len(data)}
    lines = [f"{vlm.name}: RSA on {len(data)} single-object images ({args.similarity}, {args.permutations} permutations)"]
    for _, row in best.iterrows():
        lines.append(f"  {row['site']}: best {row['model_matrix']} r={row['r']:.3f} (p={row['p']:.3g})")
    lines.append(f"  wrote {out}/rsa.csv, rsa.html, pca_by_cell.html, pca_by_colour.html")
    return summary, "\n".join(lines), 0
