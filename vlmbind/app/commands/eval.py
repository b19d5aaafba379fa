"""``vlmbind eval``: task accuracy of a model by greedy generation."""

from __future__ import annotations

import sys
from typing import Any

from ...core.choices import EVAL_CHECKPOINT as CHECKPOINT
from ...core.errors import InputError
from .arguments import (
    add_placement,
    add_plugin,
    add_point_frame,
    add_prompt_format,
    check_model,
    int_at_least,
    model_session,
    out_dir,
    parse_range,
    rank_done,
    task_data,
    task_label,
)

# its place in `vlmbind --help`
HELP_ORDER = 40
TASKS = ("scene", "query", "search", "count")
# the options that generate a built-in task's stimuli (a task file brings its own)
GENERATOR_OPTIONS = ("n", "seed", "objects", "regime", "entropy", "kind", "diversity", "image_size", "grid")


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("eval", parents=[common], help="task accuracy of a model by greedy generation",
                       description="Generate a task's stimuli, let the model answer greedily, and score the answers.")
    p.add_argument("--model", required=True, help="registered name, model directory or hub id")
    add_placement(p)
    add_prompt_format(p)
    add_point_frame(p)
    add_plugin(p, "tasks")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--task", metavar="TASK", help=f"the task to answer: {', '.join(TASKS)}, or one a --plugin "
                                                     "file registers")
    data.add_argument("--data", metavar="PATH", help="your own task: a folder holding task.jsonl, or the file (image, "
                                                     "prompt, answer; optional accept and scorer)")
    p.add_argument("--n", type=int_at_least(1, "--n 200"), default=None, help="number of examples (default 200)")
    p.add_argument("--seed", type=int, default=None, help="stimulus seed (default 1; training uses others)")
    p.add_argument("--objects", type=parse_range, help="objects per image: N or LOW-HIGH")
    p.add_argument("--regime", choices=("direct", "p2a"), help="search / count: the answer format")
    p.add_argument("--entropy", choices=("high", "low"), help="scene: distinct or shared features")
    p.add_argument("--kind", choices=("disjunctive", "conjunctive"), help="search: the display type")
    p.add_argument("--diversity", choices=("low", "high"), help="count: one colour and shape, or many")
    p.add_argument("--image-size", type=int,
                   help="canvas side in pixels (default: an organism's training size, else the model family's typical "
                        "input size; results.json records it)")
    p.add_argument("--grid", type=parse_range, help="object grid: N or ROWS-COLS")
    p.add_argument("--batch-size", type=int_at_least(1, "--batch-size 16"), default=16,
                   help="examples per generation batch (default 16)")
    p.add_argument("--out", default=None, help="output directory (default runs/eval/<model>-<task>)")
    p.add_argument("--resume", action="store_true",
                   help=f"continue an interrupted run from OUT/{CHECKPOINT} (same arguments)")
    p.add_argument("--processes", type=int, default=1,
                   help="split the batches over N worker processes (default 1; implied by torchrun / accelerate "
                        "launch)")
    p.set_defaults(func=cmd_eval)


def refuse_point_frame(args: Any) -> None:
    """Refuse ``--point-frame`` where there are no points to put on the canvas. A count or search answer may hold
    points in either regime (a model that counts by pointing), so it is refused only for a task file and for the
    tasks answered in words.

    Raises:
        InputError: --point-frame with --data, or on scene or query.
    """
    if args.point_frame is None:
        return
    if args.data is not None:
        why = ("with --data (its answers are scored as text: a task file has no canvas to put points on, a pairs "
               "folder's scenes are answered in words)")
    elif args.task in ("scene", "query"):
        why = f"to task {args.task} (its answers are words, with no points; search and count have them)"
    else:
        return
    raise InputError(f"--point-frame does not apply {why}; drop it")


def cmd_eval(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    user_data = task_data(args, GENERATOR_OPTIONS)
    refuse_point_frame(args)
    # the checks of the arguments alone, before the imports below, which import torch
    from ...core.ranks import world_size
    from ...stimuli.tasks import task_kwargs

    # options eval does not take stay None (not given) for the task's check
    options = {k: getattr(args, k) for k in ("objects", "entropy", "kind", "regime", "diversity", "image_size",
                                             "grid")}
    kwargs = task_kwargs(args.task, options) if user_data is None else {}
    if args.image_size is not None:
        # checked above; stimulus_defaults sizes the canvas, which keeps the task's grid unless --grid gives one
        kwargs = task_kwargs(args.task, {**options, "image_size": None})
    world = world_size(args.processes)
    n = len(user_data) if user_data is not None else args.n
    n_batches = -(-n // args.batch_size)
    if n_batches < world:
        what = f"the {n} examples of {args.data} in batches of {args.batch_size} make" if user_data is not None \
            else f"--n {n} in batches of {args.batch_size} makes"
        raise InputError(f"{what} {n_batches} batches, fewer than "
                         f"--processes {world}; lower --batch-size or --processes")
    out = out_dir(args, "eval", task_label(args))
    checkpoint = out / CHECKPOINT
    from ...analysis import sweeps
    from ...analysis.ablation import wilson_interval
    from ...analysis.evaluation import evaluate, outside_training, stimulus_defaults
    from ...engine import parallel
    from ...stimuli.tasks import generate

    canvas = None
    with model_session(args, command, out, sweep="eval", checkpoint=checkpoint) as (group, vlm):
        if user_data is None:
            kwargs, canvas = stimulus_defaults(vlm, args.task, kwargs, args.image_size)
            outside = outside_training(vlm, args.task, kwargs)
            if outside and group.is_main:
                print(f"vlmbind: warning: {outside}", file=sys.stderr)
            dataset = generate(args.task, args.n, args.seed, kwargs)
        else:
            dataset = user_data
        chat = vlm.prompt_format(args.prompt_format) == "chat"
        if group.world == 1:
            result = evaluate(vlm, dataset, batch_size=args.batch_size, progress=not args.json,
                              checkpoint=checkpoint, chat=chat, point_frame=args.point_frame)
        else:
            result = sweeps.evaluate(group, vlm, dataset, out, batch_size=args.batch_size,
                                     progress=group.is_main and not args.json, chat=chat,
                                     point_frame=args.point_frame)
            if not group.is_main:
                return rank_done(group, out)
    if canvas is not None:
        result.params["canvas"] = canvas
    result.save(out)
    parallel.remove_parts(out, "eval")
    summary = {**result.summary(), "out": str(out), "command": " ".join(command)}
    if group.world > 1:
        summary["processes"] = group.world
    source = f"seed {args.seed}" if user_data is None else str(args.data)
    low, high = wilson_interval(result.accuracy, result.n)
    lines = [f"{vlm.name} on {args.task or 'your task'} (n={result.n}, {source}, {result.prompt_format} prompts, "
             f"greedy): accuracy {result.accuracy:.3f} [{low:.3f}, {high:.3f}] (95% Wilson interval)"]
    if user_data is None:
        lines += [f"  {k} objects: {v['accuracy']:.3f} (n={v['n']})" for k, v in result.per_count.items()]
    if result.counts_from_points:
        lines.append(f"  {result.counts_from_points} of {result.n} replies wrote no number: each was read as the "
                     f"number of its points (count_read_from in answers.jsonl)")
    lines.append(f"  wrote {out}/results.json and answers.jsonl")
    return summary, "\n".join(lines), 0
