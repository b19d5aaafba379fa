"""The ``vlmbind`` command: ``vlmbind models`` lists the registered models, ``vlmbind demo`` runs one end to end.

Design: each subcommand is a function from parsed arguments to ``(summary, text, exit code)``: a JSON-serialisable
summary (printed with ``--json``) and a short human summary (printed otherwise), so scripts and people read the same
facts.
:func:`main` owns the exit codes: 0 on success; 2 on bad usage or bad input, with exactly one line
``vlmbind: error: <reason>`` on stderr (argparse's own errors are routed through the same line, and every
:class:`~vlmbind.errors.VlmbindError` message already names the bad value and the fix); 1 for any other failure, also
as one line (set ``VLMBIND_DEBUG=1`` to see the traceback). The demo writes every file atomically and embeds
plotly.js once in ``report.html`` so the report opens offline; apart from the recorded command line, the same model
and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import os
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image, ImageDraw

from .errors import InputError, VlmbindError

# the shipped organism trained with Point-to-Answer answers (see vlmbind/organisms/weights/organism-p2a/README.md)
DEFAULT_MODEL = "organism-p2a"
DEFAULT_OUT = "runs/demo"
DEMO_PROMPT = "In this image there is a red square, a blue circle and a"
DEMO_SITES = "blocks.*.attn.hook_pattern"
# the image size `vlmbind models` probes each model's image-token grid(s) with
PROBE_SIZE = 224
TOP_K = 5

_SCENE_RGB = {
    "red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 70), "yellow": (235, 200, 30),
    "purple": (140, 60, 180), "orange": (245, 140, 30),
}
# the prompt names the first two objects; the third (the answer) is drawn from these by the seed
_FIXED_OBJECTS = (("red", "square"), ("blue", "circle"))
_THIRD_OBJECTS = tuple((c, s) for c in ("green", "yellow", "purple", "orange") for s in ("triangle", "square", "circle"))


class _UsageError(Exception):
    """An argparse usage error, raised instead of argparse's print-and-exit."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that raises on bad usage so :func:`main` prints one line and returns 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _int_at_least(low: int, example: str):
    """An argparse type: an int >= ``low``; ``example`` shows a valid value in the message."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; pass e.g. {example}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; pass e.g. {example}")
        return value

    return parse


_non_negative_int = _int_at_least(0, "--seed 0")
_positive_int = _int_at_least(1, "16")


def build_parser() -> argparse.ArgumentParser:
    """The ``vlmbind`` argument parser with its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")

    parser = _Parser(prog="vlmbind", description="Mechanistic interpretability of vision-language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    models = sub.add_parser(
        "models", parents=[common], help="list the registered models",
        description=f"One row per registered model: family, layers x heads, the image-token grid(s) of a "
                    f"{PROBE_SIZE}x{PROBE_SIZE} image, and where the weights come from.",
    )
    models.set_defaults(func=cmd_models)

    demo = sub.add_parser(
        "demo", parents=[common], help="run a model on a drawn scene and write figures and a report",
        description="Draw a scene of three shapes, run the model on it with the prompt "
                    f"{DEMO_PROMPT!r}, measure each head's attention from the last token to the image tokens, and "
                    "write a CSV, two figures, the scene, a JSON summary and an offline report.html.",
    )
    demo.add_argument("--model", default=DEFAULT_MODEL,
                      help=f"registered name, model directory or hub id (default: {DEFAULT_MODEL})")
    demo.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    demo.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the drawn scene (default: 0)")
    demo.add_argument("--pairs", type=_positive_int, default=16,
                      help="counterfactual pairs per mediation condition (default: 16)")
    demo.add_argument("--eval-n", type=_positive_int, default=64,
                      help="examples per ablation arm and edit evaluation (default: 64)")
    demo.add_argument("--no-causal", action="store_true",
                      help="skip the causal overview (located heads, ablations, position-ID edit)")
    demo.add_argument("--probe-n", type=_positive_int, default=512,
                      help="BalancedColorShape training images for the probes (val and test: a quarter each)")
    demo.add_argument("--no-representations", action="store_true",
                      help="skip the representational overview (RSA, centroid tracking, probes)")
    demo.set_defaults(func=cmd_demo)

    from .stimuli.commands import add_parser as add_stimuli_parser

    add_stimuli_parser(sub, common)

    from .evaluate import add_parser as add_eval_parser

    add_eval_parser(sub, common)

    from .analysis.mediation import add_parser as add_locate_parser

    add_locate_parser(sub, common)

    from .analysis.tracking import add_parser as add_track_parser

    add_track_parser(sub, common)

    from .analysis.rsa import add_parser as add_rsa_parser

    add_rsa_parser(sub, common)

    from .analysis.binding import add_parser as add_probe_parser

    add_probe_parser(sub, common)

    from .analysis.ablation import add_parser as add_ablate_parser

    add_ablate_parser(sub, common)

    from .analysis.edits import add_parser as add_edit_parser

    add_edit_parser(sub, common)

    from .export import add_parser as add_export_parser

    add_export_parser(sub, common)

    from .ui import add_parser as add_ui_parser

    add_ui_parser(sub, common)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(reason: str) -> None:
    print(f"vlmbind: error: {_one_line(reason)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``vlmbind`` command.

    Args:
        argv: the arguments after the program name (``sys.argv[1:]`` when None).

    Returns:
        The exit code: 0 success, 2 bad usage or bad input, 1 any other failure.
    """
    args_list = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except _UsageError as exc:
        _fail(f"{exc}; see 'vlmbind --help'")
        return 2
    except SystemExit as exc:  # --help prints and exits 0
        return exc.code if isinstance(exc.code, int) else 0
    try:
        summary, text, code = args.func(args, ["vlmbind", *args_list])
        print(json.dumps(summary, indent=2) if args.json else text)
        sys.stdout.flush()
    except VlmbindError as exc:
        _fail(str(exc))
        return 2
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except BrokenPipeError:  # e.g. `vlmbind models | head -1`
        return 0
    except Exception as exc:  # noqa: BLE001 - the one place that turns any failure into exit code 1
        if os.environ.get("VLMBIND_DEBUG"):
            traceback.print_exc()
        _fail(f"{type(exc).__name__}: {exc} (set VLMBIND_DEBUG=1 to see the traceback)")
        return 1
    return code


# ----------------------------------------------------------------------------------------------------------------
# vlmbind models
# ----------------------------------------------------------------------------------------------------------------
def describe_model(name: str) -> dict[str, Any]:
    """Load one registered model and describe it, including the image-token grid(s) of a probe image.

    Returns:
        ``name, family, display_name, layers, heads, kv_heads, d_head, d_model, vision_layers, image_tokens,
        grids [{name, image, rows, cols}], source``.
    """
    from . import load

    vlm = load(name)
    probe = Image.new("RGB", (PROBE_SIZE, PROBE_SIZE), "white")
    index = vlm.prepare(probe, "What is in this image?").index[0]
    d = vlm.describe()
    if vlm.n_layers == 0:  # a standalone vision encoder: no language model, one patch grid
        return {"name": name, "family": d["family"], "display_name": d["display_name"], "layers": 0, "heads": 0,
                "kv_heads": 0, "d_head": 0, "d_model": d["hidden"], "vision_layers": d["vision_layers"],
                "image_tokens": index.n_tokens,
                "grids": [{"name": "patches", "image": 0, "rows": index.rows, "cols": index.cols}],
                "source": vlm.source}
    return {
        "name": name,
        "family": d["family"],
        "display_name": d["display_name"],
        "layers": d["layers"],
        "heads": d["heads"],
        "kv_heads": d["kv_heads"],
        "d_head": d["d_head"],
        "d_model": d["d_model"],
        "vision_layers": d["vision_layers"],
        "image_tokens": int(len(index.image_positions)),
        "grids": [{"name": g.name, "image": g.image, "rows": g.shape[0], "cols": g.shape[1]} for g in index.grids],
        "source": vlm.source,
    }


def _format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def cmd_models(args: argparse.Namespace, command: list[str]) -> tuple[dict[str, Any], str, int]:
    """``vlmbind models``: one row per registered name.

    A registered model that fails to build is listed with its ``error`` (the other rows are still useful) and makes
    the exit code 1: a registered name that cannot load is a bug in vlmbind, not bad input.
    """
    from . import registered_names

    rows, failed = [], []
    for name in registered_names():
        try:
            rows.append(describe_model(name))
        except Exception as exc:  # noqa: BLE001 - reported per row, and through the exit code
            failed.append({"name": name, "error": _one_line(f"{type(exc).__name__}: {exc}")})
    table = _format_table(
        ["name", "family", "layers x heads (kv)", f"image grid(s) @{PROBE_SIZE}px", "weights"],
        [
            [
                r["name"], r["display_name"], f"{r['layers']} x {r['heads']} ({r['kv_heads']})",
                " + ".join(f"{g['name']} {g['rows']}x{g['cols']}" for g in r["grids"]) + f" = {r['image_tokens']}",
                r["source"],
            ]
            for r in rows
        ],
    )
    for f in failed:
        table += f"\n{f['name']}  FAILED: {f['error']}"
    summary = {"command": "models", "probe_image": [PROBE_SIZE, PROBE_SIZE], "models": rows, "failed": failed}
    return summary, table, 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------------
# vlmbind demo
# ----------------------------------------------------------------------------------------------------------------
def _draw_scene(seed: int, size: int = 224) -> tuple[Image.Image, list[dict[str, Any]]]:
    """Three coloured shapes on white, deterministic from ``seed``.

    The red square and the blue circle the prompt names, plus a third object whose colour and shape the seed picks;
    each sits in its own cell of a 3x3 layout so that no two overlap.

    Returns:
        The ``size x size`` RGB image and one ``{colour, shape, box}`` per object (box ``x0, y0, x1, y1`` pixels).
    """
    rng = np.random.default_rng(seed)
    third = _THIRD_OBJECTS[int(rng.integers(len(_THIRD_OBJECTS)))]
    cells = rng.permutation(9)[:3]
    cell = size / 3
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    objects = []
    for (colour, shape), k in zip((*_FIXED_OBJECTS, third), cells):
        row, col = divmod(int(k), 3)
        side = float(rng.uniform(0.55, 0.8)) * cell
        x0 = round(col * cell + float(rng.uniform(0, cell - side)))
        y0 = round(row * cell + float(rng.uniform(0, cell - side)))
        x1, y1 = x0 + round(side), y0 + round(side)
        fill = _SCENE_RGB[colour]
        if shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
        objects.append({"colour": colour, "shape": shape, "box": [x0, y0, x1, y1]})
    return image, objects


def last_token_attention(patterns: Sequence[torch.Tensor], last: int) -> np.ndarray:
    """Every head's attention from one query position, gathered over layers.

    Args:
        patterns: one ``B H P P`` attention pattern per layer (batch row 0 is used).
        last: the query position (the last real token).

    Returns:
        ``L H P`` float64 attention weights from ``last`` to every key position.
    """
    return torch.stack([p[0, :, last, :].detach().to("cpu", torch.float64) for p in patterns]).numpy()


def _versions() -> dict[str, str]:
    import plotly
    import transformers

    from . import __version__

    return {
        "vlmbind": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "plotly": plotly.__version__, "python": platform.python_version(),
    }


def _demo_scene(vlm: Any, seed: int) -> tuple[Image.Image, list[dict[str, Any]], str, str | None]:
    """The demo's scene, prompt and expected answer: for a model vlmbind trained (an organism), a scene-description
    stimulus on its own canvas and pools, so the model is asked what it learned; otherwise the fixed drawn scene."""
    if not getattr(vlm, "training", None):
        image, objects = _draw_scene(seed)
        return image, objects, DEMO_PROMPT, None
    from .evaluate import training_defaults
    from .stimuli import scene_description

    example = scene_description(1, seed, n_objects=3, **training_defaults(vlm, "scene", {}))[0]
    objects = [{"colour": o.colour, "shape": o.shape, "box": [round(v) for v in o.box]} for o in example.objects]
    return example.image, objects, example.prompt, example.answer


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def cmd_demo(args: argparse.Namespace, command: list[str]) -> tuple[dict[str, Any], str, int]:
    """``vlmbind demo``: run a model on a drawn scene and write the CSV, figures, scene, summary and report."""
    from . import load
    from .io import check_out_dir
    from .viz import attention_overlay, head_heatmap, write_bytes_atomic, write_html_atomic, write_text_atomic

    start = time.perf_counter()
    out = check_out_dir(args.out)  # a bad --out fails now, not after the whole run

    vlm = load(args.model)
    image, objects, prompt, expected = _demo_scene(vlm, args.seed)
    batch = vlm.prepare(image, prompt)
    index = batch.index[0]
    run = vlm.run(batch, sites=DEMO_SITES)
    last, image_positions = index.last_position, index.image_positions
    if image_positions.size == 0:
        raise InputError(f"{vlm.name} put no image tokens in the prompt; the demo needs an image-conditioned prompt")
    patterns = [run.cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(vlm.n_layers)]
    attn = last_token_attention(patterns, last)  # L H P
    mass = attn[:, :, image_positions].sum(-1)  # L H
    frame = pd.DataFrame(
        [(layer, head, float(mass[layer, head])) for layer in range(mass.shape[0]) for head in range(mass.shape[1])],
        columns=["layer", "head", "mass"],
    )
    layer, head = (int(v) for v in np.unravel_index(int(np.argmax(mass)), mass.shape))
    grid = index.grid(image=0)  # the first grid of the image (families with several grids: the first one)
    weights = attn[layer, head][grid.positions]  # rows cols

    probs = torch.softmax(run.logits[0, last].detach().to("cpu", torch.float64), -1)
    top = torch.topk(probs, TOP_K)
    tokenizer = vlm.adapter.tokenizer
    predictions = [
        {"token": tokenizer.decode([int(i)]), "id": int(i), "prob": float(p)}
        for p, i in zip(top.values.tolist(), top.indices.tolist())
    ]

    heatmap = head_heatmap(
        frame, "mass", title="Attention mass from the last token to the image tokens", model=vlm.name, n=1
    )
    overlay = attention_overlay(
        image, grid.positions, grid.boxes, weights,
        title=f"L{layer}.H{head}: last-token attention over the {grid.name} grid "
              f"({grid.shape[0]}x{grid.shape[1]}), mass {mass[layer, head]:.3f}",
    )
    summary: dict[str, Any] = {
        "command": shlex.join(command),
        "model": vlm.name,
        "model_source": vlm.source,
        "family": vlm.family,
        "layers": vlm.n_layers,
        "heads": vlm.n_heads,
        "seed": args.seed,
        "prompt": prompt,
        "expected_answer": expected,
        "scene": {"size": list(image.size), "objects": objects},
        "image_tokens": int(len(image_positions)),
        "last_position": last,
        "top_predictions": predictions,
        "head": {
            "layer": layer, "head": head, "mass": float(mass[layer, head]), "grid": grid.name,
            "grid_shape": list(grid.shape),
        },
        "versions": _versions(),
    }

    causal = None
    if not args.no_causal:
        from .analysis.overview import causal_overview

        causal = causal_overview(vlm, n_pairs=args.pairs, n_eval=args.eval_n, n_estimate=4 * args.eval_n,
                                 seed=args.seed)
        summary["causal"] = causal.summary()
    representations = None
    if not args.no_representations:
        from .analysis.overview import representation_overview

        quarter = max(8, args.probe_n // 4)
        representations = representation_overview(vlm, seed=args.seed, n_track=max(4, args.eval_n // 2),
                                                  n_train=args.probe_n, n_val=quarter, n_test=quarter)
        summary["representations"] = representations.summary()

    out.mkdir(parents=True, exist_ok=True)
    files = {
        "attention_mass.csv": lambda p: write_text_atomic(frame.to_csv(index=False), p),
        "heatmap.html": lambda p: write_html_atomic(heatmap, p),
        "overlay.html": lambda p: write_html_atomic(overlay, p),
        "scene.png": lambda p: write_bytes_atomic(_png_bytes(image), p),
        "summary.json": lambda p: write_text_atomic(json.dumps(summary, indent=2) + "\n", p),
        "report.html": lambda p: write_text_atomic(
            _report_html(summary, frame, heatmap, overlay, (causal.html() if causal else "")
                         + (representations.html() if representations else "")), p),
    }
    written = []
    if causal is not None:
        causal.save(out / "causal")
        written.append("causal")
    if representations is not None:
        representations.save(out / "representations")
        written.append("representations")
    for name, write in files.items():
        write(out / name)
    written += list(files)
    elapsed = time.perf_counter() - start

    result = {**summary, "out": str(out), "files": written, "elapsed_s": round(elapsed, 3)}
    preds = ", ".join(f"{p['token']!r} (id {p['id']}) {p['prob']:.4f}" for p in predictions)
    lines = []
    if causal is not None:
        for condition, scores in causal.scores.items():
            lines.append(f"  {condition}: top heads " + ", ".join(f"{l}.{h} ({scores.scores[l, h]:+.3f})"
                                                                   for l, h in scores.top(3)))
        for name, study in causal.ablations.items():
            acc = study.summary()["accuracy"]
            lines.append(f"  ablate top-{study.k} ({name}): accuracy clean {acc['clean']:.2f}, top {acc['top']:.2f}, "
                         f"random {acc['random']:.2f}, bottom {acc['bottom']:.2f}")
    if representations is not None:
        rsa_lm = representations.summary()["rsa_lm"]
        lines.append("  RSA r by LM layer: compositional " + ", ".join(f"{v:.2f}" for v in rsa_lm["compositional"])
                     + "; conjunctive " + ", ".join(f"{v:.2f}" for v in rsa_lm["conjunctive"]))
        if representations.track is not None:
            lines.append(f"  centroid RMSE valley: layer {representations.track.valley_layer}")
        for _, r in representations.probes.frame.iterrows():
            lines.append(f"  probe {r['site']} ({r['family']}): B_O {r['B_O']:.2f} bits, beta_O {r['beta_O']:.3f}")
    text = "\n".join([
        f"vlmbind demo: {vlm.name} ({vlm.source}), scene seed {args.seed}",
        f"  prompt: {prompt!r}" + (f" (expected: {expected!r})" if expected else ""),
        f"  top next tokens: {preds}",
        f"  head with the most last-token attention on the image: L{layer}.H{head} (mass {mass[layer, head]:.3f})",
        *lines,
        f"  wrote {len(written)} files to {out} in {elapsed:.1f} s; open {out / 'report.html'}",
    ])
    return result, text, 0


_REPORT_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table.vb-table, table.vb-prov { border-collapse: collapse; font-size: 0.9em; }
table.vb-table td, table.vb-table th, table.vb-prov td, table.vb-prov th { padding: 2px 10px; text-align: right; }
table.vb-prov th, table.vb-prov td { text-align: left; vertical-align: top; }
table.vb-table tr:nth-child(even) { background: #f6f6f6; }
code { background: #f3f3f3; padding: 0 3px; }
.figs { display: flex; flex-wrap: wrap; gap: 1em; }
"""


def _report_html(summary: dict[str, Any], frame: pd.DataFrame, heatmap: Any, overlay: Any, causal: str = "") -> str:
    """One offline page: provenance, the two figures (plotly.js embedded once), the tables, and the causal overview's
    sections when given."""
    from .viz import frame_to_html_table

    esc = html.escape
    chosen = summary["head"]
    # plotly.js goes into the first figure only; the second reuses it
    heatmap_div = heatmap.to_html(full_html=False, include_plotlyjs=True, div_id="vlmbind-heatmap")
    overlay_div = overlay.to_html(full_html=False, include_plotlyjs=False, div_id="vlmbind-overlay")
    pivot = frame.pivot(index="layer", columns="head", values="mass")
    pivot.columns = [f"head {h}" for h in pivot.columns]
    pivot.index.name = "layer"
    predictions = pd.DataFrame(summary["top_predictions"])
    objects = pd.DataFrame(summary["scene"]["objects"])
    provenance = [
        ("model", f"{summary['model']} ({summary['family']})"),
        ("weights", summary["model_source"]),
        ("shape", f"{summary['layers']} layers x {summary['heads']} heads"),
        ("scene seed", str(summary["seed"])),
        ("prompt", summary["prompt"]),
        ("image tokens", f"{summary['image_tokens']} (last token at position {summary['last_position']})"),
        ("command", summary["command"]),
        ("versions", ", ".join(f"{k} {v}" for k, v in summary["versions"].items())),
    ]
    prov_rows = "\n".join(f"<tr><th>{esc(k)}</th><td><code>{esc(v)}</code></td></tr>" for k, v in provenance)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>vlmbind demo: {esc(summary['model'])}, seed {summary['seed']}</title>
<style>{_REPORT_CSS}</style>
</head>
<body>
<h1>vlmbind demo: attention from the last token to the image</h1>
<p>Each head's attention mass from the last prompt token to the image tokens (the sum of its attention weights over
the image positions). The overlay shows the head with the largest mass, <b>L{chosen['layer']}.H{chosen['head']}</b>
(mass {chosen['mass']:.4f}), over the {esc(chosen['grid'])} grid of image tokens.</p>
<h2>Provenance</h2>
<table class="vb-prov">
{prov_rows}
</table>
<h2>Figures</h2>
<div class="figs">
<div class="fig">{heatmap_div}</div>
<div class="fig">{overlay_div}</div>
</div>
<h2>Top next-token predictions</h2>
{frame_to_html_table(predictions, index=False)}
<h2>Scene</h2>
{frame_to_html_table(objects, index=False)}
<h2>Attention mass (layer x head)</h2>
<p>The same values as <code>attention_mass.csv</code> (full precision there).</p>
{frame_to_html_table(pivot)}
{causal}
</body>
</html>
"""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
