"""Organism training with shared image features against the plain path, stage by stage, timed in one run.

For each chosen stage of organism-vsm's recipe (its configuration as the recipe has it, on freshly initialised
weights of the stage's size: a step's cost does not depend on the weights), ``--steps`` training steps and one
evaluation are timed with ``share_image_features`` on (each distinct image of an optimiser step's forwards, and of
an evaluation, through the vision tower once) and off (the vision tower in every forward). The projection scales
each stage's step and evaluation times to the stage's steps and evaluations; ``--recorded`` puts the wall time the
shipped release recorded per stage beside it (that run used the plain path, on its own day and load).

A second table times the evaluation's strictness shares on the shipped organism-vsm (stage 12's evaluation pairs,
every unplanted head interchanged alone): one ``answer_changes`` call per head, the vision tower in every forward
(the straightforward way), against ``answer_changes_per_set`` in a ``shared_image_features`` block (one unpatched
and one source run per batch for all heads, as training evaluates now); ``equal`` says the shares came out the same.

    python benchmarks/training.py [--stages 1,6,12] [--steps 8] [--threads 1] [--recorded] [--strictness-pairs N]
        [--json] [--save]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import vlmbind as vb
from vlmbind.core.shipped import organism_dir
from vlmbind.engine.vlm import TRAINING_FILE
from vlmbind.organisms.data import BatchBuilder, training_canvas
from vlmbind.organisms.model import shared_image_features
from vlmbind.organisms.recipes import recipe_stages, stage_config
from vlmbind.organisms.siit.evaluation import answer_changes, answer_changes_per_set
from vlmbind.organisms.siit.interchange import HeadInterchange
from vlmbind.organisms.siit.pairs import evaluation_pairs
from vlmbind.organisms.siit.spec import SIITSpec
from vlmbind.organisms.training.run import train

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py


def timed_stage_config(fields: dict, steps: int, eval_every: int):
    fields = {k: v for k, v in fields.items() if k not in ("init_from", "init_layers", "until")}
    fields.update(steps=steps, eval_every=eval_every, checkpoint_every=steps, keep_checkpoints=1)
    return stage_config(fields)[0]


def _time(config, share: bool, threads: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        train(config, Path(out) / "run", progress=False, threads=threads, share_image_features=share)
        return time.perf_counter() - start


def strictness_evaluation(threads: int, n_pairs: int | None = None) -> dict:
    """Stage 12's strictness evaluation on the shipped organism-vsm (``n_pairs`` per variable, None: the stage's
    evaluation size), per head against per set."""
    import torch

    torch.set_num_threads(threads)
    vlm = vb.load("organism-vsm")
    fields = recipe_stages("organism-vsm")[-1][1]
    spec = SIITSpec.from_value(fields["siit"])
    canvas = training_canvas(vlm.training)
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    heads = [[h] for h in spec.unaligned(vlm.adapter.n_layers, vlm.adapter.n_heads)]
    n = n_pairs or fields["eval_size"]
    pairs = {v: evaluation_pairs(spec, v, seed=0, canvas=canvas, n=n) for v in sorted(spec.alignments)}
    start = time.perf_counter()
    alone = {v: [answer_changes(vlm.model, interchange, builder, rows, h, batch_size=fields["batch_size"])
                 for h in heads] for v, rows in pairs.items()}
    per_head = time.perf_counter() - start
    start = time.perf_counter()
    with shared_image_features(vlm.model):
        together = {v: answer_changes_per_set(vlm.model, interchange, builder, rows, heads,
                                              batch_size=fields["batch_size"]) for v, rows in pairs.items()}
    per_set = time.perf_counter() - start
    return {"heads": len(heads), "pairs_per_variable": n, "variables": sorted(pairs),
            "per_head_s": round(per_head, 2), "per_set_s": round(per_set, 2), "ratio": round(per_head / per_set, 2),
            "equal": alone == together}


def run(stages: list[int], steps: int, threads: int, recorded: bool = False,
        strictness_pairs: int | None = None) -> dict:
    recipe = recipe_stages("organism-vsm")
    record = json.loads((organism_dir("organism-vsm") / TRAINING_FILE).read_text()) if recorded else {}
    walls = {s["stage"]: s.get("wall_time_s") for s in record.get("stage_results", [])}
    rows = []
    for index in stages:
        name, fields = recipe[index - 1]
        total = fields.get("until") or fields["steps"]
        evals = total // fields["eval_every"] if fields.get("eval_every") else 0
        row = {"stage": name, "steps": total, "evals": evals}
        for share in (False, True):
            label = "shared" if share else "plain"
            without_eval = _time(timed_stage_config(fields, steps, 0), share, threads)
            one_step = _time(timed_stage_config(fields, 1, 0), share, threads)
            with_eval = _time(timed_stage_config(fields, 1, 1), share, threads)
            step_s = (without_eval - one_step) / (steps - 1)  # the set-up (build, data) cancels
            row[f"{label}_step_s"] = round(step_s, 3)
            row[f"{label}_eval_s"] = round(max(with_eval - one_step, 0.0), 2)
            row[f"{label}_projected_min"] = round((total * step_s + evals * row[f"{label}_eval_s"]) / 60, 1)
            print(name, label, row, file=sys.stderr, flush=True)
        row["step_ratio"] = round(row["plain_step_s"] / row["shared_step_s"], 2)
        row["eval_ratio"] = round(row["plain_eval_s"] / max(row["shared_eval_s"], 1e-9), 2)
        if recorded and walls.get(name) is not None:
            row["recorded_min"] = round(walls[name] / 60, 1)
        rows.append(row)
    plain = sum(r["plain_projected_min"] for r in rows)
    shared = sum(r["shared_projected_min"] for r in rows)
    return {"stages": rows, "steps_timed": steps, "threads": threads, "strictness": strictness_evaluation(threads, strictness_pairs),
            "plain_projected_min": round(plain, 1),
            "shared_projected_min": round(shared, 1), "ratio": round(plain / shared, 2),
            **({"recorded_min": round(sum(r.get("recorded_min", 0.0) for r in rows), 1)} if recorded else {})}


def table(out: dict) -> str:
    recorded = "recorded_min" in out
    lines = [f"organism-vsm recipe, {out['steps_timed']} steps timed per stage and path, {out['threads']} thread(s)",
             f"{'stage':42s} {'steps':>6s} {'plain s/step':>12s} {'shared':>7s} {'x':>5s} {'plain eval s':>12s} "
             f"{'shared':>7s} {'x':>5s} {'plain min':>9s} {'shared min':>10s}" + ("  recorded min" if recorded else "")]
    for r in out["stages"]:
        lines.append(f"{r['stage']:42s} {r['steps']:6d} {r['plain_step_s']:12.3f} {r['shared_step_s']:7.3f} "
                     f"{r['step_ratio']:5.2f} {r['plain_eval_s']:12.2f} {r['shared_eval_s']:7.2f} "
                     f"{r['eval_ratio']:5.2f} {r['plain_projected_min']:9.1f} {r['shared_projected_min']:10.1f}"
                     + (f"  {r.get('recorded_min', float('nan')):12.1f}" if recorded else ""))
    lines.append(f"projected total: plain {out['plain_projected_min']} min, shared {out['shared_projected_min']} min, "
                 f"x{out['ratio']}" + (f"; recorded {out['recorded_min']} min" if recorded else ""))
    st = out["strictness"]
    lines.append(f"strictness evaluation on the shipped organism-vsm ({st['heads']} unplanted heads, "
                 f"{st['pairs_per_variable']} pairs x {len(st['variables'])} variables): one call per head "
                 f"{st['per_head_s']:.2f} s, per set with shared images {st['per_set_s']:.2f} s, x{st['ratio']:.2f}, "
                 f"same shares: {st['equal']}")
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    return (heading(record, "organism training with shared image features") + "\n\n"
            "organism-vsm's recipe, stage by stage, on freshly initialised weights of each stage's size: training "
            "steps and one evaluation timed with the vision tower in every forward (\"plain\") and with each distinct "
            "image of an optimiser step (or of an evaluation) through the vision tower once (\"shared\", what `train` "
            "does); minutes project each stage's step and evaluation times onto its steps and evaluations. "
            "\"recorded\" is the wall time the shipped release logged per stage (the plain path, on its own day and "
            "load). The last line times the evaluation's strictness shares on the shipped organism-vsm: one call per "
            "unplanted head against one pass per set with shared images. One run's ratios per stage are noisy at a "
            "few steps; the projected total is the figure to read.\n\n" + code_block(table(record["result"])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="1,6,12", help="recipe stages (1-12), comma-separated, or 'all'")
    p.add_argument("--steps", type=int, default=8, help="training steps timed per stage and path (at least 2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--recorded", action="store_true", help="show the release's recorded wall time per stage")
    p.add_argument("--strictness-pairs", type=int, default=None,
                   help="pairs per variable in the strictness timing (default: stage 12's evaluation size)")
    p.add_argument("--json", action="store_true")
    add_save_option(p)
    args = p.parse_args(argv)
    n = len(recipe_stages("organism-vsm"))
    try:
        stages = list(range(1, n + 1)) if args.stages == "all" else [int(s) for s in args.stages.split(",")]
    except ValueError:
        p.error(f"--stages takes stage numbers 1-{n} separated by commas, or 'all'; got {args.stages!r}")
    if any(not 1 <= s <= n for s in stages) or args.steps < 2:
        p.error(f"--stages must be within 1-{n} and --steps at least 2")
    if args.strictness_pairs is not None and args.strictness_pairs < 1:
        p.error(f"--strictness-pairs must be at least 1; got {args.strictness_pairs}")
    out = run(stages, args.steps, args.threads, args.recorded, args.strictness_pairs)
    print(json.dumps(out) if args.json else table(out))
    if args.save_run:
        save("training", argv if argv is not None else sys.argv[1:], out, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
