"""Hook overhead: capturing every head's z versus a plain forward, and versus the same capture in an nnsight trace.

For each tiny model (or the names given): median wall time of a 1-example forward, plain; with vlmbind capturing
``blocks.*.attn.hook_z``; and with an nnsight trace saving every ``o_proj`` input. Timings on a busy machine are noisy:
read the ratios, which come from one interleaved run.

    python benchmarks/hooks.py [--repeats 20] [--json out.json] [--save] [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

import vlmbind as vb
from vlmbind.tiny import TINY_NAMES

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py


def _scene() -> Image.Image:
    img = Image.new("RGB", (224, 224), "white")
    d = ImageDraw.Draw(img)
    d.rectangle([30, 40, 80, 90], fill="red")
    d.ellipse([120, 100, 170, 150], fill="blue")
    return img


def measure(name: str, repeats: int) -> dict:
    vlm = vb.load(name)
    batch = vlm.prepare(_scene(), "In this image there is a red square, a blue circle and a")
    a = vlm.adapter
    nn_model = vlm.nnsight()
    paths = [a.o_proj_path(layer) for layer in range(a.n_layers)]

    def plain():
        with torch.no_grad():
            vlm.model(**batch.inputs, use_cache=False)

    def hooked():
        vlm.run(batch, sites="blocks.*.attn.hook_z")

    def nnsight_trace():
        with torch.no_grad(), nn_model.trace(**batch.inputs, use_cache=False):
            for p in paths:
                vlm.nnsight_module(nn_model, p).input.save()

    fns = {"plain": plain, "vlmbind_hook_z": hooked, "nnsight_hook_z": nnsight_trace}
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():  # interleaved so drift hits all three alike
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    grids = [f"{g.name}:{g.shape[0]}x{g.shape[1]}" for g in batch.index[0].grids]
    return {
        "name": name, "family": vlm.family, "layers": a.n_layers, "heads": a.n_heads, "kv_heads": a.n_kv_heads,
        "grids": grids, "seq_len": batch.seq_len, "params": sum(p.numel() for p in vlm.model.parameters()),
        "forward_ms": 1000 * med["plain"], "vlmbind_ms": 1000 * med["vlmbind_hook_z"],
        "nnsight_ms": 1000 * med["nnsight_hook_z"],
        "vlmbind_overhead_ratio": med["vlmbind_hook_z"] / med["plain"],
        "nnsight_over_vlmbind_ratio": med["nnsight_hook_z"] / med["vlmbind_hook_z"],
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'model':24s} {'L x H (kv)':11s} {'image grid':28s} {'tokens':>6s} {'fwd ms':>7s} "
             f"{'hook_z ms':>9s} {'ratio':>6s} {'nnsight/vlmbind':>15s}"]
    for r in rows:
        lines.append(f"{r['name']:24s} {r['layers']}x{r['heads']} ({r['kv_heads']}){'':4s} {' '.join(r['grids']):28s} "
                     f"{r['seq_len']:6d} {r['forward_ms']:7.1f} {r['vlmbind_ms']:9.1f} "
                     f"{r['vlmbind_overhead_ratio']:6.2f} {r['nnsight_over_vlmbind_ratio']:15.2f}")
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    rows = record["result"]["rows"]
    return (heading(record, "hook overhead") + "\n\n"
            f"Median wall time of a one-example forward over {record['result']['repeats']} interleaved repeats: plain "
            "(\"fwd\"), with vlmbind capturing `blocks.*.attn.hook_z` (\"hook_z\"; \"ratio\" is its time over the "
            "plain forward's), and with an nnsight trace saving every `o_proj` input (\"nnsight/vlmbind\": its time "
            "over vlmbind's).\n\n" + code_block(table(rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(TINY_NAMES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    add_save_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = [measure(n, args.repeats) for n in args.names]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.save_run:
        save("hooks", argv if argv is not None else sys.argv[1:], {"rows": rows, "repeats": args.repeats},
             threads=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
