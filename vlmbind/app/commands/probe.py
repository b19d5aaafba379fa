"""``vlmbind probe``: binding-information probes (FBP) and IsSameObject probes (VOB) on BalancedColorShape."""

from __future__ import annotations

from typing import Any

from ...core.choices import DEFAULT_SITE_CHOICE, PROBE_FAMILIES, WORLD_NAMES
from ...core.choices import PROBE_CHECKPOINT as CHECKPOINT
from ...core.errors import InputError
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
HELP_ORDER = 80


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("probe", parents=[common], help="binding-information probes on BalancedColorShape",
                       description="Capture BalancedColorShape (train/val/test splits by feature code) and estimate "
                                   "each site's binding information in bits (FBP) or IsSameObject accuracy (VOB).")
    p.add_argument("--model", required=True, help="registered name, model directory or cached hub id")
    add_placement(p)
    add_prompt_format(p)
    p.add_argument("--sites", default=None, help="comma-separated sites or patterns (default: "
                                                 + ", ".join(DEFAULT_SITE_CHOICE) + ")")
    p.add_argument("--family", default="linear",
                   help=f"comma-separated probe families: {', '.join(PROBE_FAMILIES)} (default linear)")
    p.add_argument("--world", choices=("auto", *WORLD_NAMES), default="auto",
                   help="the BalancedColorShape world: fbp (FBP's 8 x 8 palette, 18 objects on 256 px), organism "
                        "(the organisms' 4 x 4 palette, 5 objects on their 168 px canvas); default auto: the "
                        "organism world for the organisms, fbp otherwise")
    p.add_argument("--n-train", type=int_at_least(1, "--n-train 39200"), default=39_200,
                   help="training images (default FBP's 39,200; each image is drawn when it is captured)")
    p.add_argument("--n-val", type=int_at_least(1, "--n-val 9800"), default=9_800,
                   help="validation images, for early stopping (default 9,800)")
    p.add_argument("--n-test", type=int_at_least(1, "--n-test 9800"), default=9_800,
                   help="test images the bits are estimated on (default 9,800)")
    p.add_argument("--epochs", type=int_at_least(1, "--epochs 1"), default=None,
                   help="a fixed number of epochs (FBP: 40); default: train each probe to convergence on the "
                        "validation loss")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (FBP: 1e-3; small sets want ~1e-2)")
    p.add_argument("--batch-size", type=int_at_least(1, "--batch-size 512"), default=512,
                   help="probe mini-batch (FBP: 512)")
    p.add_argument("--seed", type=int, default=0, help="stimulus and probe seed")
    p.add_argument("--resume", action="store_true",
                   help=f"continue an interrupted run: its capture in OUT/activations and the probes in OUT/{CHECKPOINT}")
    p.add_argument("--out", default=None, help="output directory (default runs/probe/<model>)")
    add_capture_arguments(p)
    p.set_defaults(func=cmd_probe)


def cmd_probe(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    families = tuple(f.strip() for f in args.family.split(",") if f.strip())
    bad = [f for f in families if f not in PROBE_FAMILIES]
    if bad or not families:
        raise InputError(f"--family {args.family!r}: unknown {bad}; families: {', '.join(PROBE_FAMILIES)}")
    if not args.lr > 0:
        raise InputError(f"--lr must be positive, got {args.lr}")
    out = out_dir(args, "probe")
    checkpoint = out / CHECKPOINT
    if checkpoint.is_file() and not args.resume:
        raise InputError(f"{out} holds an interrupted run ({CHECKPOINT}); pass --resume to continue it, or choose "
                         "another --out")
    # after the checks of the arguments alone: these import torch
    from ...analysis import sweeps
    from ...analysis.binding import check_pairwise_world, colorshape_splits, default_sites, default_world, probe_sites
    from ...engine import parallel
    from ...probes import ProbeConfig
    from ...stimuli.colorshape import WORLDS

    sweeps.check_shards(args.n_train + args.n_val + args.n_test, args.shard_size,
                        parallel.world_size(args.processes))
    with model_session(args, command, out, checkpoint=checkpoint) as (group, vlm):
        world = default_world(vlm) if args.world == "auto" else WORLDS[args.world]
        examples, split = colorshape_splits(args.n_train, args.n_val, args.n_test, args.seed, world, lazy=True)
        if "pairwise" in families:  # before the capture, which takes minutes at the default size
            check_pairwise_world(vlm, examples, world)
        sites = [s.strip() for s in args.sites.split(",")] if args.sites else default_sites(vlm)
        sites = [s.name for s in vlm.sites(sites)]
        # the pooled families read one mean per image: storing only that costs a token count's fraction of the disk
        tokens = "image" if {"attention", "pairwise"} & set(families) else "image_mean"
        acts = sweeps.capture(group, vlm, examples, sites, out / "activations", resume=args.resume,
                              shard_size=args.shard_size, tokens=tokens, progress=group.is_main and not args.json)
        if not group.is_main:
            return rank_done(group, out)
    config = ProbeConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
    result = probe_sites(acts, split, families=families, config=config, checkpoint=checkpoint, world=world)
    result.save(out)
    checkpoint.unlink(missing_ok=True)
    summary = {"model": vlm.name, "rows": result.frame.to_dict(orient="records"),
               "prompt_format": vlm.active_prompt_format,
               "out": str(out),
               "command": " ".join(command), "recipe": {"epochs": args.epochs, "lr": args.lr,
                                                        "batch_size": args.batch_size}}
    summary["world"] = world.name
    lines = [f"{vlm.name}: probes on BalancedColorShape, world {world.name} ({args.n_train}/{args.n_val}/"
             f"{args.n_test} images)"]
    for _, r in result.frame.iterrows():
        if r["family"] == "pairwise":
            lines.append(f"  {r['site']} pairwise: accuracy {r.get('accuracy', float('nan')):.3f}")
        else:
            lines.append(f"  {r['site']} {r['family']}: B_O {r['B_O']:.2f} bits (beta {r['beta_O']:.3f}), "
                         f"B*_OF {r['B_star_OF']:.2f} bits; over the prior-only probe {r['margin_O']:+.3f} "
                         f"+- {r['margin_O_se']:.3f} bits: {r['finding']}")
    lines.append(f"  wrote {out}/probe.csv, probe.html")
    return summary, "\n".join(lines), 0
