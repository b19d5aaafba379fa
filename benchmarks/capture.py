"""Capture overhead: streaming one site per layer to disk versus plain forwards over the same data set.

For each model: the same examples, batched alike, run (a) through plain forwards (``vlm.run`` with no site), (b)
through :func:`vlmbind.capture` keeping ``blocks.*.hook_resid_post`` at the image tokens, written to safetensors shards.
Both include preparing the batches; (b) also includes token tables, copies and atomic writes. The ratio (b)/(a) is the
overhead; the target is at most 1.10. Interleaved repeats, median; ratios from one run are what count.

    python benchmarks/capture.py [--n 64] [--repeats 3] [--json] [--save] [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import vlmbind as vb
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.stimuli import scene_description

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py


def measure(name: str, n: int, repeats: int, batch_size: int) -> dict:
    vlm = vb.load(name)
    data = list(scene_description(n, 0, **training_defaults(vlm, "scene", {"n_objects": 3})))
    site = "blocks.*.hook_resid_post"
    tmp = Path(tempfile.mkdtemp(prefix="vlmbind-bench-"))

    def plain() -> None:
        for b in range(0, n, batch_size):
            chunk = data[b : b + batch_size]
            vlm.run(vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk]))

    def captured() -> None:
        out = tmp / "acts"
        shutil.rmtree(out, ignore_errors=True)
        vb.capture(vlm, data, site, out=out, batch_size=batch_size)

    try:
        plain(), captured()  # warm-up
        times: dict[str, list[float]] = {"plain": [], "capture": []}
        for _ in range(repeats):
            for key, fn in (("plain", plain), ("capture", captured)):
                t = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t)
        size = sum(p.stat().st_size for p in (tmp / "acts").iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": name, "n": n, "batch_size": batch_size, "sites": vlm.n_layers, "seconds": med,
            "overhead": med["capture"] / med["plain"], "bytes_written": size}


def table(rows: list[dict]) -> str:
    lines = [f"{'model':20s} {'n':>4s} {'sites':>5s} {'plain s':>8s} {'capture s':>9s} {'overhead':>8s} {'MB':>7s}"]
    for r in rows:
        lines.append(f"{r['model']:20s} {r['n']:4d} {r['sites']:5d} {r['seconds']['plain']:8.3f} "
                     f"{r['seconds']['capture']:9.3f} {r['overhead']:8.3f} {r['bytes_written'] / 1e6:7.2f}")
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    rows = record["result"]["rows"]
    return (heading(record, "capture overhead") + "\n\n"
            f"Plain forwards over {rows[0]['n']} scene-description examples versus `vb.capture` of "
            f"`blocks.*.hook_resid_post` (image tokens) to safetensors shards, batches of {rows[0]['batch_size']}, "
            f"median of {record['result']['repeats']} interleaved repeats; the target overhead is at most 1.10.\n\n"
            + code_block(table(rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=["organism-p2a", "tiny-qwen2_5_vl", "tiny-llava"])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    add_save_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(name, args.n, args.repeats, args.batch_size) for name in args.names]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(table(rows))
    if args.save_run:
        save("capture", argv if argv is not None else sys.argv[1:], {"rows": rows, "repeats": args.repeats},
             threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
