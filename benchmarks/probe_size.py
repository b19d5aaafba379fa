"""Probe fitting at FBP's data size (39,200 / 9,800 / 9,800 images), timed: capture streamed to disk, then the
default recipe (to convergence) per family, at one site of an organism in its own world.

    python benchmarks/probe_size.py [--model organism-p2a] [--site projector.hook_out] [--families linear,attention]
        [--n-train 39200 --n-val 9800 --n-test 9800] [--threads 2] [--out runs/probe_size] [--save]

Prints one line per stage (seconds, steps, epochs, B_O and its margin over the prior-only probe) and writes them to
``probe_size.json`` in ``--out``; the capture is kept there (delete it afterwards).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

import vlmbind as vb
from vlmbind.analysis.binding import colorshape_splits, default_world, probe_sites
from vlmbind.core.io import write_json_atomic
from vlmbind.probes import ProbeConfig

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-p2a")
    p.add_argument("--site", default="projector.hook_out")
    p.add_argument("--families", default="linear,attention")
    p.add_argument("--n-train", type=int, default=39_200)
    p.add_argument("--n-val", type=int, default=9_800)
    p.add_argument("--n-test", type=int, default=9_800)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/probe_size")
    add_save_option(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    vlm = vb.load(args.model)
    world = default_world(vlm)
    stages = []
    t0 = time.perf_counter()
    examples, split = colorshape_splits(args.n_train, args.n_val, args.n_test, 0, world)
    stages.append({"stage": "generate", "seconds": round(time.perf_counter() - t0, 1), "images": len(examples)})
    t0 = time.perf_counter()
    acts = vb.capture(vlm, examples, [args.site], out=out / "capture", shard_size=512, resume=True)
    stages.append({"stage": "capture", "seconds": round(time.perf_counter() - t0, 1), "images": len(examples)})
    print(json.dumps(stages[-1]), flush=True)
    for family in args.families.split(","):
        t0 = time.perf_counter()
        res = probe_sites(acts, split, sites=[args.site], families=(family,), world=world, config=ProbeConfig())
        row = res.frame.iloc[0]
        stages.append({"stage": f"fit {family}", "seconds": round(time.perf_counter() - t0, 1),
                       "steps": int(row["steps"]), "epochs": int(row["epochs"]), "converged": bool(row["converged"]),
                       "B_O": round(float(row["B_O"]), 3), "margin_O": round(float(row["margin_O"]), 3),
                       "margin_O_se": round(float(row["margin_O_se"]), 3),
                       **({"start": row["start"]} if isinstance(row.get("start"), str) else {})})
        print(json.dumps(stages[-1]), flush=True)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    summary = {"model": vlm.name, "site": args.site, "world": world.name, "threads": args.threads,
               "n": [args.n_train, args.n_val, args.n_test], "stages": stages, "peak_rss_gib": round(peak_gib, 2),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    write_json_atomic(summary, out / "probe_size.json")
    print(json.dumps(summary, indent=1))
    if args.save_run:
        save("probe_size", argv if argv is not None else sys.argv[1:], summary, threads=args.threads)
    return 0


def stage_line(stage: dict) -> str:
    """One stage of a run: its seconds and what it did."""
    if stage["stage"] == "generate":
        detail = f"{stage['images']:,} images drawn (on demand, never all in memory)"
    elif stage["stage"] == "capture":
        detail = (f"streamed to 512-image shards ({stage['images'] / stage['seconds']:.0f} images/s)")
    else:
        detail = (f"{stage['steps']:,} steps, {stage['epochs']} epochs, "
                  f"{'converged' if stage['converged'] else 'NOT converged'}"
                  + (f"; {stage['start']} start kept" if stage.get("start") else "")
                  + f"; B_O {stage['B_O']:.3f} bits, margin {stage['margin_O']:+.3f} +- {stage['margin_O_se']:.3f}")
    return f"{stage['stage']:15s} {stage['seconds']:8.1f}  {detail}"


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    s = record["result"]
    lines = [f"{'stage':15s} {'seconds':>8s}  detail"] + [stage_line(st) for st in s["stages"]]
    fits = [st for st in s["stages"] if st["stage"].startswith("fit ")]
    ratio = (f"\n\nThe slowest fit ({fits[-1]['stage'].removeprefix('fit ')}) takes "
             f"{fits[-1]['seconds'] / fits[0]['seconds']:.0f}x the first ({fits[0]['stage'].removeprefix('fit ')})."
             if len(fits) > 1 else "")
    return (heading(record, "probes at FBP's data size") + "\n\n"
            f"{s['model']}, `{s['site']}`, its own world: {' / '.join(f'{n:,}' for n in s['n'])} images "
            f"(train / validation / test), the default recipe (to convergence; the attention probe from both of its "
            f"starts, the better on validation kept). {s.get('conditions', '')}\n\n"
            + code_block("\n".join(lines)) + ratio)


if __name__ == "__main__":
    sys.exit(main())
