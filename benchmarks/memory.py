"""Peak host memory of locate and eval on a 7B-shaped Qwen2.5-VL layer at a real prompt length, against the budget.

The model is one decoder layer of Qwen2.5-VL-7B's shape (hidden 3584, 28 heads, 4 KV heads, intermediate 18944) with
random weights, the real Qwen2 vocabulary (151,665 tokens: a 3584 x 151,665 embedding and LM head, as in the
checkpoint) and a small vision tower. A 1008 px scene becomes 36 x 36 = 1,296 image tokens, the length at which
full-sequence logits take 0.79 GB per row in float32. Each job runs in a fresh process: the model is built, the
process's peak resident memory is reset (``/proc/self/clear_refs``), the job runs, and the new peak minus the
resident memory before the job is its extra memory. Jobs:

* ``locate``: ``vb.locate`` (exact) on two ``id_retrieval`` pairs (a mid-prompt patch: the packed layout's rows);
* ``eval``: ``vb.evaluate`` on two scene examples (greedy generation with the cache);
* ``full_logits``: the straightforward forward a user would write, ``model(**inputs).logits`` on eval's two-row batch
  (every position's logits: 2 x 1,320 x 151,665 floats), for comparison with ``eval``, whose forwards keep logits
  at the last position only.

The budget it checks: every vlmbind job's extra memory stays under :data:`BUDGET_BYTES` (1.5 GiB: activations of one
1,300-token forward at this width, the key/value cache, the exact method's default 2 GiB attention budget never
reached at this size, and logits at the scored positions only).

    python benchmarks/memory.py [--out FILE] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from saved import add_save_option, heading, save  # benchmarks/saved.py

BUDGET_BYTES = int(1.5 * 1024**3)
IMAGE_SIZE = 1008
JOBS = ("locate", "eval", "full_logits")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _build() -> Any:
    import torch

    from vlmbind.engine.vlm import VLM
    from vlmbind.tiny.qwen import build_qwen_vl
    from vlmbind.tiny.real import real_tokenizer

    model, processor = build_qwen_vl(
        "qwen2_5_vl", 0, IMAGE_SIZE, layers=1, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
        vision_depth=1, vision_hidden=128, vision_heads=4, text_init_std=None, attn_implementation="sdpa",
        tokenizer=real_tokenizer("qwen2_5_vl"))
    model.requires_grad_(False)
    torch.set_grad_enabled(False)
    return VLM(model, processor, "random-qwen2_5_vl-7b-shape-1-layer", "benchmarks/memory.py")


def run_job(job: str) -> dict[str, Any]:
    """One job in this process: its extra peak memory and time."""
    import vlmbind as vb
    from vlmbind.stimuli import Canvas, scene_description, scene_pairs

    vlm = _build()
    canvas = Canvas(image_size=IMAGE_SIZE, grid=3)
    if job == "locate":
        data = scene_pairs(2, "id_retrieval", 0, canvas=canvas, n_objects=3)
    else:
        data = scene_description(2, 0, canvas=canvas, n_objects=3)
    tokens = vlm.prepare([data[0].clean.image if job == "locate" else data[0].image],
                         [data[0].clean.prompt if job == "locate" else data[0].prompt]).seq_len
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set (VmHWM) to the current one
    before = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    if job == "locate":
        vb.locate(vlm, data, method="exact", prompt_format="raw")
    elif job == "eval":
        vb.evaluate(vlm, data, batch_size=2, chat=False)
    else:
        batch = vlm.prepare([e.image for e in data], [e.prompt for e in data])
        logits = vlm.model(**vlm.model_inputs(batch)).logits
        assert logits.shape[:2] == (2, batch.seq_len)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    return {"job": job, "tokens": int(tokens), "extra_bytes": int(peak - before), "rss_before_bytes": int(before),
            "seconds": round(seconds, 1)}


def render(record: dict[str, Any]) -> str:
    """RESULTS.md's section for a saved run."""
    summary = record["result"]
    rows = {r["job"]: r for r in summary["rows"]}
    lines = ["| job | prompt tokens | extra peak memory | time | resident before |", "|---|---|---|---|---|"]
    for job in JOBS:
        r = rows[job]
        lines.append(f"| {job} | {r['tokens']} | {r['extra_bytes'] / 2**30:.2f} GiB | {r['seconds']:.0f} s | "
                     f"{r['rss_before_bytes'] / 2**30:.2f} GiB |")
    return (heading(record, "peak memory at a real prompt length") + "\n\n"
            "One decoder layer of Qwen2.5-VL-7B's shape with the real 151,665-token vocabulary, a 1008 px scene "
            "(1,296 image tokens); each job in a fresh process, its peak resident memory above what the built model "
            f"holds. Budget: {summary['budget_bytes'] / 2**30:.2f} GiB for locate (exact, two id_retrieval pairs) and "
            f"eval (two scene examples); within it: {summary['within_budget']}.\n\n" + "\n".join(lines) +
            "\n\nThe straightforward forward of eval's two-row batch with every position's logits takes "
            f"{summary['full_logits_over_eval']:.2f}x the memory of the whole vlmbind eval run. A 28-layer model adds "
            "its weights and its key/value cache (28 x the one layer's) to these figures; the per-forward transients "
            "do not grow with depth.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=JOBS, help=argparse.SUPPRESS)  # one job, in a child process
    parser.add_argument("--out", default=None, help="write the measurements here as JSON")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(run_job(args.job)))
        return 0
    rows = []
    for job in JOBS:
        done = subprocess.run([sys.executable, __file__, "--job", job], capture_output=True, text=True,
                              env={**os.environ, "TQDM_DISABLE": "1"})
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    by_job = {r["job"]: r for r in rows}
    print(f"7B-shaped Qwen2.5-VL layer, real vocabulary, {by_job['locate']['tokens']}-token prompts "
          f"({platform.machine()}, {os.cpu_count()} CPUs); budget {BUDGET_BYTES / 2**30:.2f} GiB extra")
    for r in rows:
        print(f"  {r['job']:<12} extra peak {r['extra_bytes'] / 2**30:6.2f} GiB  ({r['seconds']:.0f} s, "
              f"resident before {r['rss_before_bytes'] / 2**30:.2f} GiB)")
    within = all(by_job[j]["extra_bytes"] <= BUDGET_BYTES for j in ("locate", "eval"))
    ratio = by_job["full_logits"]["extra_bytes"] / max(by_job["eval"]["extra_bytes"], 1)
    print(f"  full-sequence logits (one forward of eval's batch) / vlmbind eval (the whole run): {ratio:.2f}x; "
          f"within budget: {within}")
    import torch

    summary = {"budget_bytes": BUDGET_BYTES, "rows": rows, "within_budget": within, "full_logits_over_eval": ratio}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    if args.save_run:
        save("memory", argv if argv is not None else sys.argv[1:], summary, threads=torch.get_num_threads())
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
