"""Organism training in two processes against one process of one or two threads, stage by stage, timed in one run.

For each chosen stage of organism-vsm's recipe (its configuration as the recipe has it, on freshly initialised
weights of the stage's size: a step's cost does not depend on the weights), ``--steps`` training steps are timed
three ways: one process with one torch thread (the straightforward way), one process with two threads, and two
processes of one thread each (``train(processes=2)``: each computes part of the step's summed loss and the
gradients are added). The set-up (building the model, the data, starting the processes) cancels: each way also
times one step, and the step time is the difference over ``steps - 1`` steps. Evaluations are left out (rank 0
evaluates alone, at one-thread speed). Run it on an otherwise idle machine: two processes need both cores.

    python benchmarks/two_processes.py [--stages 1,6,12] [--steps 12] [--json] [--save]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py
from training import timed_stage_config  # the stage's configuration for a timed run (benchmarks/training.py)
from vlmbind.organisms.recipes import recipe_stages
from vlmbind.organisms.training.run import train

WAYS = (("1 process, 1 thread", 1, 1), ("1 process, 2 threads", 1, 2), ("2 processes, 1 thread each", 2, 1))


def _time(config, processes: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        train(config, Path(out) / "run", progress=False, threads=threads, processes=processes)
        return time.perf_counter() - start


def run(stages: list[int], steps: int, organism: str = "organism-vsm") -> dict:
    recipe = recipe_stages(organism)
    rows = []
    for index in stages:
        name, fields = recipe[index - 1]
        row = {"stage": name, "steps": fields.get("until") or fields["steps"]}
        for label, processes, threads in WAYS:
            many = _time(timed_stage_config(fields, steps, 0), processes, threads)
            one = _time(timed_stage_config(fields, 1, 0), processes, threads)
            row[label] = round((many - one) / (steps - 1), 3)
            print(name, label, row[label], file=sys.stderr, flush=True)
        base = row[WAYS[0][0]]
        row["threads_x"] = round(base / row[WAYS[1][0]], 2)
        row["processes_x"] = round(base / row[WAYS[2][0]], 2)
        rows.append(row)
    return {"organism": organism, "steps_timed": steps, "stages": rows}


def table(out: dict) -> str:
    lines = [f"{out['organism']} recipe, {out['steps_timed']} steps timed per stage and way; seconds per step",
             f"{'stage':42s} {'steps':>6s} " + " ".join(f"{w[0]:>26s}" for w in WAYS) + f" {'2 threads x':>11s} "
             f"{'2 processes x':>13s}"]
    for r in out["stages"]:
        lines.append(f"{r['stage']:42s} {r['steps']:6d} " + " ".join(f"{r[w[0]]:26.3f}" for w in WAYS)
                     + f" {r['threads_x']:11.2f} {r['processes_x']:13.2f}")
    minutes = {w[0]: sum(r["steps"] * r[w[0]] for r in out["stages"]) / 60 for w in WAYS}
    one = minutes[WAYS[0][0]]
    lines.append("over these stages' steps: " + ", ".join(
        f"{label} {m:.1f} min" + ("" if label == WAYS[0][0] else f" (x{one / m:.2f})") for label, m in minutes.items()))
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    return (heading(record, "organism training in two processes") + "\n\n"
            "Stages of the recipe on freshly initialised weights of each stage's size, training steps timed three ways "
            "in one run: one process with one thread (the straightforward way), one process with two threads, and "
            "`train(processes=2)` (two processes of one thread each, each computing part of every step's summed "
            "loss, gradients added by one `all_reduce`); the set-up cancels (each way also times one step). Two "
            "processes gain most where a step's work splits evenly between its IIT and strictness halves; what keeps "
            "both ways under 2x is the work that does not split (the second process repeats the vision tower for its "
            "images). Ratios between runs move by several tenths: read the columns against each other.\n\n"
            + code_block(table(record["result"])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="1,6,12", help="recipe stages, comma-separated, or 'all'")
    p.add_argument("--steps", type=int, default=12, help="training steps timed per stage and way (at least 2)")
    p.add_argument("--organism", default="organism-vsm", choices=["organism-vsm", "organism-vsm-natural"])
    p.add_argument("--json", action="store_true")
    add_save_option(p)
    args = p.parse_args(argv)
    n = len(recipe_stages(args.organism))
    try:
        stages = list(range(1, n + 1)) if args.stages == "all" else [int(s) for s in args.stages.split(",")]
    except ValueError:
        p.error(f"--stages takes stage numbers 1-{n} separated by commas, or 'all'; got {args.stages!r}")
    if any(not 1 <= s <= n for s in stages) or args.steps < 2:
        p.error(f"--stages must be within 1-{n} and --steps at least 2")
    out = run(stages, args.steps, args.organism)
    print(json.dumps(out) if args.json else table(out))
    if args.save_run:
        save("two_processes", argv if argv is not None else sys.argv[1:], out, threads=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
