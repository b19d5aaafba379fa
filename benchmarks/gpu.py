"""All-heads mediation sweeps on a 7B-shaped Qwen2.5-VL: exact, naive (sampled, extrapolated) and attribution.

The model has Qwen2.5-VL-7B's text decoder (28 layers x 28 heads, 4 KV heads, hidden 3584, intermediate 18944; 784
heads) with random weights, the tiny byte-level tokenizer's vocabulary (so the LM head is small: logits are read at
one position anyway) and a small vision tower; what sets the cost of a sweep is the prompt, and an 896 px image gives
the ~1000 image tokens of a real scene (64 x 64 patches of 14 px, merged 2 x 2 into 32 x 32 = 1024 tokens). It is
built directly on the device in the chosen dtype (7B parameters in float32 would not fit most hosts' memory). Two
conditions: a last-token patch (``id_selection``) and a mid-prompt span (``id_retrieval``, the second-to-last object's
text span), each a :class:`~vlmbind.engine.patching.PatchTask` built like ``vlmbind locate`` builds it, with the
counterfactual head outputs pushed far from the clean ones (``--strength``) so that head effects stand above the
dtype's rounding. Timed given the task (the alignment and the counterfactual run are the same for every method):
``exact_diffs`` over all 784 heads (one run per ``--max-tokens`` value and one in the ``batched`` layout; the fastest
counts), ``naive_diffs`` on ``--naive-heads`` heads spread over the layers, extrapolated to all heads by its cost per
forward (a full sweep is heads + 1 forwards), and ``attribution_diffs`` (one forward-backward). Exact is checked
against naive on the sampled heads. Every stage runs under ``--time-limit``: naive stops sampling when its share of
the remaining time is spent, stages that would start past the limit are skipped and listed. ``--scale ci`` is a
4-layer x 4-head, hidden-64, 224 px model that runs on CPU in float32 in seconds (tests/project/test_benchmarks.py
runs it).

    python benchmarks/gpu.py [--scale 7b|ci] [--device cuda] [--dtype bfloat16] [--out result.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from vlmbind.analysis.mediation import scene_task
from vlmbind.engine.patching import DEFAULT_MEMORY_BUDGET, PatchTask, attribution_diffs, exact_diffs, naive_diffs
from vlmbind.engine.vlm import VLM
from vlmbind.stimuli import Canvas, scene_pairs
from vlmbind.tiny.qwen import build_qwen_vl

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py

CONDITIONS = {"last_token": "id_selection", "mid_prompt": "id_retrieval"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A Qwen2.5-VL shape: the text decoder, the vision tower and the image size (a multiple of 28 px).

    ``text_init_std`` re-draws the text Linear weights on the host (small models only, so head effects are O(0.1-1)
    logits); None keeps Hugging Face's init and lets the model be built on the device directly.
    """

    layers: int
    heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    image_size: int
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    text_init_std: float | None
    naive_heads: int
    max_tokens: tuple[int, ...]


SCALES = {
    "7b": Shape(layers=28, heads=28, kv_heads=4, hidden=3584, intermediate=18944, image_size=896, vision_depth=2,
                vision_hidden=128, vision_heads=4, text_init_std=None, naive_heads=28, max_tokens=(64, 256, 1024)),
    "ci": Shape(layers=4, heads=4, kv_heads=2, hidden=64, intermediate=128, image_size=224, vision_depth=2,
                vision_hidden=32, vision_heads=2, text_init_std=0.2, naive_heads=16, max_tokens=(64,)),
}


class Deadline:
    """Seconds left before a wall-clock limit."""

    def __init__(self, seconds: float):
        self.start = time.perf_counter()
        self.limit = seconds

    @property
    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.start)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating tensors in ``dtype`` inside the block (Hugging Face's init honours it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> VLM:
    """The Qwen2.5-VL of ``shape`` with random weights, sdpa attention, on ``device`` in ``dtype``."""
    kwargs = dict(layers=shape.layers, hidden=shape.hidden, intermediate=shape.intermediate, heads=shape.heads,
                  kv_heads=shape.kv_heads, vision_depth=shape.vision_depth, vision_hidden=shape.vision_hidden,
                  vision_heads=shape.vision_heads, text_init_std=shape.text_init_std, attn_implementation="sdpa")
    if shape.text_init_std is None:
        # built in place: no host copy of the weights, no float32 detour
        with torch.device(device), default_dtype(dtype):
            model, processor = build_qwen_vl("qwen2_5_vl", seed, shape.image_size, **kwargs)
    else:
        # the re-draw uses a seeded host generator: build on the host, then move
        model, processor = build_qwen_vl("qwen2_5_vl", seed, shape.image_size, **kwargs)
        model = model.to(device=device, dtype=dtype)
    model.requires_grad_(False)  # attribution differentiates w.r.t. head outputs only, never the weights
    return VLM(model, processor, f"random-qwen2_5_vl-{shape.layers}x{shape.heads}-h{shape.hidden}", "benchmarks/gpu.py")


def strong(task: PatchTask, strength: float, seed: int) -> PatchTask:
    """``task`` with counterfactual values pushed ``strength`` standard deviations (per layer) from the captured
    ones, so random-weight head effects rise above rounding; the work of every method is unchanged."""
    if strength == 0:
        return task
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for layer, v in task.values.items():
        noise = torch.randn(v.shape, generator=gen).to(device=v.device, dtype=v.dtype)
        values[layer] = v + strength * v.float().std().to(v.dtype) * noise
    return replace(task, values=values)


class Meter:
    """Times a call (device synchronised) and records the device's peak memory during it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak = 0  # the largest peak of any call so far (bytes)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float, int | None]:
        """``(result, seconds, peak bytes allocated during the call or None off CUDA)``."""
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        result = fn()
        self.sync()
        seconds = time.perf_counter() - t
        if not self.cuda:
            return result, seconds, None
        peak = int(torch.cuda.max_memory_allocated())
        self.peak = max(self.peak, peak)
        return result, seconds, peak


def sample_heads(heads: list[tuple[int, int]], k: int) -> list[int]:
    """Indices of ``k`` heads spread evenly over ``heads`` (all layers represented)."""
    k = max(1, min(k, len(heads)))
    return sorted({int(round(i)) for i in np.linspace(0, len(heads) - 1, k)})


def tolerance(dtype: torch.dtype, effect_range: float) -> float:
    """What exact may differ from naive by: float32 rounding of O(10) logits, or a half-precision ulp budget (the
    two paths sum attention and residuals in different orders)."""
    if dtype == torch.float32:
        return max(1e-4 * effect_range, 1e-5)
    return max(5e-2 * effect_range, 5e-2)


def run_condition(vlm: VLM, kind: str, condition: str, args: argparse.Namespace, shape: Shape, meter: Meter,
                  deadline: Deadline, dtype: torch.dtype) -> dict[str, Any]:
    """Every method on one condition's task; see the module docstring."""
    heads = [(l, h) for l in range(vlm.n_layers) for h in range(vlm.n_heads)]
    canvas = Canvas(image_size=shape.image_size, grid=3)
    pair = scene_pairs(1, condition, args.seed, n_objects=3, canvas=canvas)[0]
    task, task_seconds, _ = meter(lambda: scene_task(vlm, pair, range(vlm.n_layers)))
    task = strong(task, args.strength, args.seed)
    index = task.batch.index[0]
    row: dict[str, Any] = {
        "kind": kind, "condition": condition, "tokens": int(task.batch.seq_len),
        "image_tokens": int(index.image_positions.size), "positions": task.positions.tolist(),
        "suffix": int(task.batch.seq_len - task.positions.min()), "heads": len(heads),
        "task_seconds": task_seconds, "skipped": [],
    }
    # warm-up: first-call costs (kernel selection, allocator growth) hit no timed run
    exact_diffs(vlm, task, heads[:2])
    attribution_diffs(vlm, task, heads[:1])
    naive_diffs(vlm, task, heads[:1])

    variants = {f"max_tokens={m}": {"max_tokens": m} for m in args.max_tokens}
    variants["layout=batched"] = {"layout": "batched", "memory_budget": args.memory_budget}
    exact: dict[str, float] = {}
    exact_peak: dict[str, int | None] = {}
    best = None
    for name, kwargs in variants.items():
        if deadline.left <= 0:
            row["skipped"].append(f"exact {name}")
            continue
        (clean, patched), seconds, peak = meter(lambda: exact_diffs(vlm, task, heads, **kwargs))
        exact[name], exact_peak[name] = seconds, peak
        if best is None or seconds < exact[best[0]]:
            best = (name, clean, patched)
    if best is None:
        row["skipped"] += ["attribution", "naive"]
        return row
    row["exact"] = {"seconds": exact, "peak_memory_bytes": exact_peak, "fastest": best[0]}
    _, exact_clean, exact_patched = best

    if deadline.left > 0:
        _, seconds, peak = meter(lambda: attribution_diffs(vlm, task, heads))
        row["attribution"] = {"seconds": seconds, "peak_memory_bytes": peak}
    else:
        row["skipped"].append("attribution")

    # naive: groups of heads (one clean forward + one per head each) until the sample or the time share is spent
    chosen = sample_heads(heads, args.naive_heads)
    budget = min(args.naive_seconds, max(deadline.left, 0.0) / args.naive_share)
    done: list[int] = []
    naive_effects: list[float] = []
    naive_seconds, forwards, naive_peak = 0.0, 0, 0
    for g in range(0, len(chosen), args.naive_group):
        if naive_seconds >= budget or deadline.left <= 0:
            break
        group = chosen[g : g + args.naive_group]
        (clean, patched), seconds, peak = meter(lambda: naive_diffs(vlm, task, [heads[i] for i in group]))
        naive_seconds += seconds
        forwards += len(group) + 1
        naive_peak = max(naive_peak, peak or 0)
        done += group
        naive_effects += (patched - clean).tolist()
    if not done:
        row["skipped"].append("naive")
        return row
    per_forward = naive_seconds / forwards
    naive_full = per_forward * (len(heads) + 1)
    effects = np.asarray(naive_effects)
    exact_effects = exact_patched[done] - exact_clean
    effect_range = float(np.ptp(effects)) if effects.size > 1 else float(abs(effects).max())
    diff = float(np.abs(exact_effects - effects).max())
    row["naive"] = {
        "sampled_heads": [f"{heads[i][0]}.{heads[i][1]}" for i in done], "forwards": forwards,
        "seconds_sampled": naive_seconds, "seconds_per_forward": per_forward, "seconds_extrapolated": naive_full,
        "peak_memory_bytes": naive_peak if meter.cuda else None,
        "truncated": len(done) < len(chosen),
    }
    seconds = {"naive": naive_full, "exact": exact[best[0]]}
    if "attribution" in row:
        seconds["attribution"] = row["attribution"]["seconds"]
    row["seconds"] = seconds
    row["heads_per_second"] = {m: len(heads) / s for m, s in seconds.items()}
    row["speedup_vs_naive"] = {m: naive_full / s for m, s in seconds.items()}
    row["exact_vs_naive"] = {
        "max_abs_diff": diff, "effect_range": effect_range, "max_abs_effect": float(np.abs(effects).max()),
        "tolerance": tolerance(dtype, effect_range), "matches": diff <= tolerance(dtype, effect_range),
        "heads_compared": len(done),
    }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=tuple(SCALES), default="7b")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--naive-heads", type=int, default=None, help="heads naive runs on (default: the scale's)")
    parser.add_argument("--naive-group", type=int, default=4, help="naive heads per call between time checks")
    parser.add_argument("--naive-seconds", type=float, default=90.0, help="most seconds naive samples per condition")
    parser.add_argument("--naive-share", type=float, default=2.0,
                        help="naive takes at most 1/share of the time left when it starts")
    parser.add_argument("--max-tokens", type=lambda s: [int(v) for v in s.split(",")], default=None,
                        help="comma-separated exact_diffs max_tokens values to time (default: the scale's)")
    parser.add_argument("--memory-budget", type=int, default=DEFAULT_MEMORY_BUDGET,
                        help="bytes for the batched layout's materialised prefix cache")
    parser.add_argument("--strength", type=float, default=30.0,
                        help="push counterfactual values this many std from the captured ones (0: as captured)")
    parser.add_argument("--time-limit", type=float, default=420.0, help="wall-clock seconds for the whole run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_save_option(parser)
    args = parser.parse_args(argv)
    shape = SCALES[args.scale]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    args.naive_heads = args.naive_heads or shape.naive_heads
    args.max_tokens = args.max_tokens or list(shape.max_tokens)
    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = Deadline(args.time_limit)
    meter = Meter(device)

    vlm, build_seconds, _ = meter(lambda: build(shape, device, dtype, args.seed))
    weights = int(sum(p.numel() * p.element_size() for p in vlm.model.parameters()))
    on_cuda = device.type == "cuda"
    result: dict[str, Any] = {
        "scale": args.scale, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "device_name": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__, "shape": asdict(shape),
        "parameters": int(sum(p.numel() for p in vlm.model.parameters())),
        "text_parameters": int(sum(p.numel() for p in vlm.adapter.layer(0).parameters())) * vlm.n_layers,
        "weights_bytes": weights, "build_seconds": build_seconds, "strength": args.strength,
        "time_limit": args.time_limit, "naive_heads": args.naive_heads, "conditions": [],
    }
    for kind, condition in CONDITIONS.items():
        if deadline.left <= 0:
            result.setdefault("skipped", []).append(kind)
            continue
        row = run_condition(vlm, kind, condition, args, shape, meter, deadline, dtype)
        result["conditions"].append(row)
        print(_line(row), flush=True)
    if device.type == "cuda":
        result["peak_memory_bytes"] = meter.peak
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["total_seconds"] = deadline.elapsed
    result["within_time_limit"] = deadline.left > 0
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    if args.save_run:
        save("gpu", argv if argv is not None else sys.argv[1:], result, threads=torch.get_num_threads())
    return 0


def render(record: dict[str, Any]) -> str:
    """RESULTS.md's section for a saved run."""
    result = record["result"]
    shape = result["shape"]
    lines = "\n".join(_line(row) for row in result["conditions"])
    text = (heading(record, f"all-heads sweeps, {shape['layers']} layers x {shape['heads']} heads "
                            f"({result['dtype']}, {result['device']})") + "\n\n"
            "Per condition (last token: `id_selection`; mid-prompt span: `id_retrieval`), given the task: "
            "`exact_diffs` on every head (each `--max-tokens` value and the `batched` layout; the fastest counts), "
            "`naive_diffs` on a sample of heads extrapolated to a full sweep (heads + 1 forwards at the measured cost "
            "per forward), `attribution_diffs`; speed-ups over naive, and exact against naive on the sampled heads.\n\n"
            + code_block(lines))
    if result["scale"] != "7b":
        text += ("\n\nThis is the scaled-down twin that the tests run on CPU. The 7B-shaped run (Qwen2.5-VL-7B's text "
                 "decoder, 28 x 28 heads, 1,040 tokens of which 1,024 image tokens, random weights built on the device "
                 "in bfloat16) waits for a GPU; on one it replaces this section:\n\n"
                 "    python benchmarks/gpu.py --scale 7b --device cuda --dtype bfloat16 --save")
    return text


def _line(row: dict[str, Any]) -> str:
    """One human line per condition."""
    if "seconds" not in row:
        return f"{row['kind']}: incomplete, skipped {row['skipped']}"
    s, r, m = row["seconds"], row["speedup_vs_naive"], row["exact_vs_naive"]
    peaks = {k: row[k]["peak_memory_bytes"] for k in ("exact", "attribution", "naive") if k in row}
    peak = peaks["exact"][row["exact"]["fastest"]] if "exact" in peaks else None
    mem = f", exact peak {peak / 2**30:.2f} GiB" if peak else ""
    return (f"{row['kind']} ({row['tokens']} tokens, {row['image_tokens']} image, suffix {row['suffix']}, "
            f"{row['heads']} heads): exact {s['exact']:.3f} s ({row['exact']['fastest']}), naive {s['naive']:.1f} s "
            f"(extrapolated from {len(row['naive']['sampled_heads'])} heads), attribution "
            f"{s.get('attribution', float('nan')):.3f} s; x naive: exact {r['exact']:.1f}, attribution "
            f"{r.get('attribution', float('nan')):.1f}; exact vs naive max|d| {m['max_abs_diff']:.2e} "
            f"(range {m['effect_range']:.2e}){mem}")


if __name__ == "__main__":
    sys.exit(main())
