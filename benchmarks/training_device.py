"""Organism training on a GPU against the CPU, in one run: a recipe stage's configuration (fresh weights of the
stage's size, drawn on the CPU from the seed, so both runs start from the same weights), ``--steps`` steps on the
CPU and on ``--device``, each after one warm-up step; seconds per step, the ratio, and the largest difference
between the two runs' per-step losses (the same run up to float error, or the device path is wrong). The default
stage is organism-search's planted one (pointing SIIT: interchanges, attention and readout losses every step).

    python benchmarks/training_device.py [--organism organism-search] [--stage N] [--steps 20] [--device cuda]
        [--threads 1] [--json] [--save]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from vlmbind.core.errors import TrainingError
from vlmbind.organisms.recipes import RECIPES, recipe_stages, stage_config
from vlmbind.organisms.training.run import train, training_device

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py


def timed_config(fields: dict, steps: int):
    """The stage's configuration for ``steps`` steps from fresh weights, without evaluations."""
    fields = {k: v for k, v in fields.items() if k not in ("init_from", "init_layers", "until")}
    fields.update(steps=steps, eval_every=0, checkpoint_every=steps, keep_checkpoints=1)
    return stage_config(fields)[0]


def timed_run(fields: dict, steps: int, device: str, threads: int) -> tuple[float, list[float]]:
    """Seconds per step over ``steps`` steps (the set-up and a first step subtracted) and the losses."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        train(timed_config(fields, 1), Path(out) / "one", progress=False, threads=threads, device=device)
        one = time.perf_counter() - start
        start = time.perf_counter()
        result = train(timed_config(fields, steps + 1), Path(out) / "all", progress=False, threads=threads,
                       device=device)
        every = time.perf_counter() - start
    return (every - one) / steps, result.losses


def run(organism: str, stage: int | None, steps: int, device: str, threads: int) -> dict:
    recipe = recipe_stages(organism)
    name, fields = recipe[(stage or len(recipe)) - 1]
    cpu_s, cpu_losses = timed_run(fields, steps, "cpu", threads)
    dev_s, dev_losses = timed_run(fields, steps, device, threads)
    return {"organism": organism, "stage": name, "steps": steps, "device": device, "threads": threads,
            "gpu": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None,
            "cpu_step_s": round(cpu_s, 4), "device_step_s": round(dev_s, 4),
            "speedup": round(cpu_s / max(dev_s, 1e-9), 2),
            "max_loss_difference": max(abs(a - b) for a, b in zip(cpu_losses, dev_losses)),
            "final_loss_cpu": cpu_losses[-1], "final_loss_device": dev_losses[-1]}


def table(out: dict) -> str:
    return (f"{out['organism']}, stage {out['stage']}, {out['steps']} steps timed, {out['threads']} CPU thread(s)\n"
            f"cpu {out['cpu_step_s']:.4f} s/step, {out['device']}{' (' + out['gpu'] + ')' if out['gpu'] else ''} "
            f"{out['device_step_s']:.4f} s/step, x{out['speedup']}; largest per-step loss difference "
            f"{out['max_loss_difference']:.2e} (final losses {out['final_loss_cpu']:.4f} / "
            f"{out['final_loss_device']:.4f})")


def render(record: dict) -> str:
    out = record["result"]
    note = ("" if out["device"] != "cpu" else " This saved run compared the CPU with itself (no GPU was there): it "
            "shows the script runs and both runs are one run, not a GPU's speed; run it with `--device cuda --save` "
            "on a GPU.")
    return (heading(record, "Organism training on a GPU against the CPU") + "\n\n"
            "The same recipe stage from the same fresh weights, timed per step on the CPU and on the device, and "
            "the largest difference between the two runs' per-step losses." + note + "\n\n" + code_block(table(out)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--organism", default="organism-search", choices=sorted(RECIPES))
    p.add_argument("--stage", type=int, default=None, help="the recipe stage (1-based; default: the last)")
    p.add_argument("--steps", type=int, default=20, help="training steps timed per device (at least 1)")
    p.add_argument("--device", default="cuda", help="the device to compare with the CPU (cuda, cuda:1, or cpu)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--json", action="store_true")
    add_save_option(p)
    args = p.parse_args(argv)
    n = len(recipe_stages(args.organism))
    if args.steps < 1 or (args.stage is not None and not 1 <= args.stage <= n):
        p.error(f"--steps must be at least 1 and --stage within 1-{n}")
    try:
        training_device(args.device)
    except TrainingError as exc:
        p.error(str(exc))
    out = run(args.organism, args.stage, args.steps, args.device, args.threads)
    print(json.dumps(out) if args.json else table(out))
    if args.save_run:
        save("training_device", argv if argv is not None else sys.argv[1:], out, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
