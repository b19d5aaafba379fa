"""``vlmbind demo``: run a model on a drawn scene, then the causal and representational overviews -> a report.

The demo writes every file atomically; one ``plotly.min.js`` at the top of the output folder serves the report and
every figure below it, so the folder opens offline and holds one copy of plotly.js. Apart from the recorded command
line, the same model and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import shlex
import time
from typing import TYPE_CHECKING, Any

from ...core.errors import InputError
from ...version import __version__
from .arguments import (
    add_placement,
    add_prompt_format,
    check_model,
    load_model,
    non_negative_int,
    placement,
    positive_int,
)

if TYPE_CHECKING:
    from PIL import Image

# the shipped organism trained with Point-to-Answer answers (see vlmbind/organisms/weights/organism-p2a/README.md)
DEFAULT_MODEL = "organism-p2a"
# the organism with a planted mechanism the report opens with (see docs/ground_truth.md)
DEFAULT_VALIDATE = "organism-vsm"
DEFAULT_OUT = "runs/demo"
DEMO_PROMPT = "In this image there is a red square, a blue circle and a"
DEMO_SITES = "blocks.*.attn.hook_pattern"
TOP_K = 5
# the sizes of the demo's parts: option -> (its default, the parts that use it as (flag that skips it, part))
SIZE_OPTIONS = {
    "pairs": (16, (("--no-validate", "validation"), ("--no-causal", "causal overview"))),
    "eval_n": (64, (("--no-validate", "validation"), ("--no-causal", "causal overview"),
                    ("--no-representations", "representational overview"))),
    "probe_n": (512, (("--no-validate", "validation"), ("--no-representations", "representational overview"))),
}

_SCENE_RGB = {
    "red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 70), "yellow": (235, 200, 30),
    "purple": (140, 60, 180), "orange": (245, 140, 30),
}
# the prompt names the first two objects; the third (the answer) is drawn from these by the seed
_FIXED_OBJECTS = (("red", "square"), ("blue", "circle"))
_THIRD_OBJECTS = tuple((c, s) for c in ("green", "yellow", "purple", "orange") for s in ("triangle", "square", "circle"))

# its place in `vlmbind --help`
HELP_ORDER = 20


def add_parser(sub: Any, common: Any) -> None:
    demo = sub.add_parser(
        "demo", parents=[common], help="run a model on a drawn scene and write figures and a report",
        description="Draw a scene of three shapes, run the model on it with the prompt "
                    f"{DEMO_PROMPT!r}, measure each head's attention from the last token to the image tokens, and "
                    "write a CSV, two figures, the scene, a JSON summary and an offline report.html.",
    )
    demo.add_argument("--model", default=DEFAULT_MODEL,
                      help=f"registered name, model directory or hub id (default: {DEFAULT_MODEL})")
    add_placement(demo)
    add_prompt_format(demo)
    demo.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    demo.add_argument("--seed", type=non_negative_int, default=0, help="seed of the drawn scene (default: 0)")
    demo.add_argument("--pairs", type=positive_int, default=None,
                      help=f"counterfactual pairs per mediation condition (default: {SIZE_OPTIONS['pairs'][0]})")
    demo.add_argument("--eval-n", type=positive_int, default=None,
                      help=f"examples per ablation arm and edit evaluation (default: {SIZE_OPTIONS['eval_n'][0]})")
    demo.add_argument("--no-causal", action="store_true",
                      help="skip the causal overview (located heads, ablations, position-ID edit)")
    demo.add_argument("--probe-n", type=positive_int, default=None,
                      help="BalancedColorShape training images for the probes (val and test: a quarter each; default: "
                           f"{SIZE_OPTIONS['probe_n'][0]})")
    demo.add_argument("--no-representations", action="store_true",
                      help="skip the representational overview (RSA, centroid tracking, probes)")
    demo.add_argument("--validate-model", default=None,
                      help="an organism with planted heads whose validation (every method against them) opens the "
                           f"report (default: {DEFAULT_VALIDATE})")
    demo.add_argument("--no-validate", action="store_true", help="skip the validation on the planted organism")
    demo.set_defaults(func=cmd_demo)


def _draw_scene(seed: int, size: int = 224) -> tuple[Image.Image, list[dict[str, Any]]]:
    """Three coloured shapes on white, deterministic from ``seed``.

    The red square and the blue circle the prompt names, plus a third object whose colour and shape the seed picks;
    each sits in its own cell of a 3x3 layout so that no two overlap.

    Returns:
        The ``size x size`` RGB image and one ``{colour, shape, box}`` per object (box ``x0, y0, x1, y1`` pixels).
    """
    import numpy as np
    from PIL import Image, ImageDraw

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


def _versions() -> dict[str, str]:
    import plotly
    import torch
    import transformers

    return {
        "vlmbind": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "plotly": plotly.__version__, "python": platform.python_version(),
    }


def _demo_scene(vlm: Any, seed: int) -> tuple[Image.Image, list[dict[str, Any]], str, str | None]:
    """The demo's scene, prompt and expected answer: for a model vlmbind trained (an organism), a scene-description
    stimulus on its own canvas and pools, so the model is asked what it learned; otherwise the fixed drawn scene."""
    from ...analysis.evaluation import training_defaults
    from ...stimuli import scene_description

    if not getattr(vlm, "training", None):
        image, objects = _draw_scene(seed)
        return image, objects, DEMO_PROMPT, None
    example = scene_description(1, seed, n_objects=3, **training_defaults(vlm, "scene", {}))[0]
    objects = [{"colour": o.colour, "shape": o.shape, "box": [round(v) for v in o.box]} for o in example.objects]
    return example.image, objects, example.prompt, example.answer


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def refuse_unused_sizes(args: argparse.Namespace) -> None:
    """Refuse the options of the parts the --no-* flags skip (then fill in the defaults of the others).

    Raises:
        InputError: --validate-model with --no-validate, or a size no part that runs uses.
    """
    if args.validate_model is not None and args.no_validate:
        raise InputError("--validate-model does not apply with --no-validate (no validation runs); drop one of them")
    args.validate_model = args.validate_model or DEFAULT_VALIDATE
    for name, (default, parts) in SIZE_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif all(getattr(args, skip[2:].replace("-", "_")) for skip, _ in parts):
            flag = "--" + name.replace("_", "-")
            sized = [f"the {part}" for _, part in parts]
            raise InputError(f"{flag} does not apply with {' '.join(skip for skip, _ in parts)}: it sizes "
                             f"{', '.join(sized[:-1])} and {sized[-1]}, and none of them runs; drop {flag}")


def cmd_demo(args: argparse.Namespace, command: list[str]) -> tuple[dict[str, Any], str, int]:
    """``vlmbind demo``: run a model on a drawn scene and write the CSV, figures, scene, summary and report."""
    check_model(args)
    refuse_unused_sizes(args)
    from ...core.io import check_out_dir

    out = check_out_dir(args.out)  # a bad --out fails now, before the imports below (torch) and the whole run
    import numpy as np
    import torch

    from ...analysis.attention import AttentionMass, last_token_attention
    from ...analysis.overview import ABLATION_SEEDS, causal_overview, representation_overview
    from ...analysis.steering import steer
    from ...analysis.validate import recorded_planted, validate
    from ...engine import loading
    from ...viz import (
        PLOTLYJS_FILE,
        attention_overlay,
        plotlyjs_src,
        shared_plotlyjs,
        write_bytes_atomic,
        write_html_atomic,
        write_text_atomic,
    )
    from ..report import (
        causal_sections,
        demo_report_html,
        findings_section,
        representation_sections,
        validation_sections,
    )

    start = time.perf_counter()
    if not args.no_validate:  # so does a validation model with nothing planted (read from its record, no weights)
        try:
            recorded_planted(args.validate_model)
        except InputError as exc:
            raise InputError(f"--validate-model: {exc}, or pass --no-validate") from None

    vlm = load_model(args)
    image, objects, prompt, expected = _demo_scene(vlm, args.seed)
    batch = vlm.prepare(image, prompt)
    index = batch.index[0]
    run = vlm.run(batch, sites=DEMO_SITES)
    last, image_positions = index.last_position, index.image_positions
    if image_positions.size == 0:
        raise InputError(f"{vlm.name} put no image tokens in the prompt; the demo needs an image-conditioned prompt")
    # hybrid models (Qwen3.5) have softmax patterns on some layers only; the others are left out of the table
    softmax_layers = vlm.adapter.pattern_layers()
    patterns = [run.cache[f"blocks.{layer}.attn.hook_pattern"] for layer in softmax_layers]
    attn = last_token_attention(patterns, last)  # L' H P, one row per softmax layer
    attention = AttentionMass.from_attention(vlm.name, attn, image_positions, layers=softmax_layers)
    frame = attention.frame
    row_mass = attn[:, :, image_positions].sum(-1)  # L' H
    row, head = (int(v) for v in np.unravel_index(int(np.argmax(row_mass)), row_mass.shape))
    layer = softmax_layers[row]
    mass = {(layer, head): float(row_mass[row, head])}
    grid = index.grid(image=0)  # the first grid of the image (families with several grids: the first one)
    weights = attn[row, head][grid.positions]  # rows cols

    probs = torch.softmax(run.logits[0, last].detach().to("cpu", torch.float64), -1)
    top = torch.topk(probs, TOP_K)
    tokenizer = vlm.adapter.tokenizer
    predictions = [
        {"token": tokenizer.decode([int(i)]), "id": int(i), "prob": float(p)}
        for p, i in zip(top.values.tolist(), top.indices.tolist())
    ]

    heatmap = attention.figure()
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

    validation, steering = None, []
    if not args.no_validate:
        planted = loading.load(args.validate_model, **placement(args))
        validation = validate(planted, n_pairs=args.pairs // 2 or 1, seed=1000 + args.seed, ig_steps=4,
                              naive_heads=3, modes=("image_attention",), n_eval=max(8, args.eval_n // 2),
                              n_estimate=2 * args.eval_n, n_probe=max(64, args.probe_n // 2), edge_pairs=2)
        summary["validation"] = validation.summary()
        # each planted head of the answer's steps steered to a described object (ID retrieval acts at the names)
        steered = [h for c in ("id_selection", "feature_retrieval") for h in validation.heads.get(c, [])]
        steering = [steer(planted, h, "described", n=max(8, args.eval_n // 2), seed=1000 + args.seed, n_random=2)
                    for h in steered]
        summary["validation_steering"] = [r.summary() for r in steering]
    causal = None
    if not args.no_causal:
        causal = causal_overview(vlm, n_pairs=args.pairs, n_eval=args.eval_n, n_estimate=4 * args.eval_n,
                                 seed=args.seed)
        summary["causal"] = causal.summary()
    representations = None
    if not args.no_representations:
        quarter = max(8, args.probe_n // 4)
        representations = representation_overview(vlm, seed=args.seed, n_track=max(4, args.eval_n // 2),
                                                  n_lens=max(4, args.eval_n // 8), n_relevancy=max(4, args.eval_n // 8),
                                                  n_train=args.probe_n, n_val=quarter, n_test=quarter)
        summary["representations"] = representations.summary()

    summary["sizes"] = {"scene_seed": args.seed, "pairs_per_condition": args.pairs if causal else None,
                        "eval_examples": args.eval_n if causal else None,
                        "ablation_random_seeds": len(ABLATION_SEEDS) if causal else None,
                        "probe_train_images": args.probe_n if representations else None}
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "attention_mass.csv": lambda p: write_text_atomic(frame.to_csv(index=False), p),
        "heatmap.html": lambda p: write_html_atomic(heatmap, p),
        "overlay.html": lambda p: write_html_atomic(overlay, p),
        "scene.png": lambda p: write_bytes_atomic(_png_bytes(image), p),
        "summary.json": lambda p: write_text_atomic(json.dumps(summary, indent=2) + "\n", p),
        "report.html": lambda p: write_text_atomic(
            demo_report_html(summary, frame, heatmap, overlay, (causal_sections(causal) if causal else "")
                             + (representation_sections(representations) if representations else ""),
                             validation_sections(validation, vlm.name, steering) if validation else "",
                             findings=findings_section(causal, validation), plotlyjs=plotlyjs_src(p)), p),
    }
    written = []
    with shared_plotlyjs(out):  # one plotly.min.js for every page below out
        if validation is not None:
            validation.save(out / "validation")
            written.append("validation")
            for r in steering:
                r.save(out / "validation" / "steer" / "_".join(r.heads))
        if causal is not None:
            causal.save(out / "causal")
            written.append("causal")
        if representations is not None:
            representations.save(out / "representations")
            written.append("representations")
        for name, write in files.items():
            write(out / name)
    written += [*files, PLOTLYJS_FILE]
    elapsed = time.perf_counter() - start

    result = {**summary, "out": str(out), "files": written, "elapsed_s": round(elapsed, 3)}
    preds = ", ".join(f"{p['token']!r} (id {p['id']}) {p['prob']:.4f}" for p in predictions)
    lines = []
    if validation is not None:
        for r in validation.methods:
            if r["heads"]:
                lines.append(f"  validation on {validation.model}: {r['condition']} {r['method']} ranks planted "
                             f"{' '.join(r['heads'])} at {' '.join(map(str, r['planted_ranks']))} (AUROC "
                             f"{r['auroc']:.3f})")
        for r in steering:
            st = r.summary()
            if st["efficacy"] is not None:
                lines.append(f"  steering {' '.join(st['heads'])} on {validation.model} to a described object: names "
                             f"it {st['efficacy']:.2f} [{st['efficacy_interval'][0]:.2f}, "
                             f"{st['efficacy_interval'][1]:.2f}] (n={st['n_counted']}), random heads "
                             f"{st['random_heads_efficacy']:.2f}")
    if causal is not None:
        for condition, scores in causal.scores.items():
            lines.append(f"  {condition}: top heads (mean [95% interval], * significant) " + scores.ranking_text(3))
            note = scores.significance_note("--pairs")  # the demo's flag for its number of pairs
            if note:
                lines.append(f"    {note}")
        for name, study in causal.ablations.items():
            iv = study.intervals()
            lines.append(f"  ablate top-{study.k} ({name}, n={iv['clean']['n']}): accuracy clean "
                         f"{iv['clean']['accuracy']:.2f}, top {iv['top']['accuracy']:.2f} [{iv['top']['low']:.2f}, "
                         f"{iv['top']['high']:.2f}], random {iv['random']['accuracy']:.2f} (seeds "
                         + " ".join(f"{a['accuracy']:.2f}" for a in study.random_seeds())
                         + f"), bottom ({study.bottom_label}) {iv['bottom']['accuracy']:.2f}")
    if representations is not None:
        rsa_lm = representations.summary()["rsa_lm"]
        lines.append("  RSA r by LM layer: compositional " + ", ".join(f"{v:.2f}" for v in rsa_lm["compositional"])
                     + "; conjunctive " + ", ".join(f"{v:.2f}" for v in rsa_lm["conjunctive"]))
        if representations.track is not None:
            lines.append(f"  centroid RMSE valley: layer {representations.track.valley_layer}")
        for _, r in representations.probes.frame.iterrows():
            lines.append(f"  probe {r['site']} ({r['family']}): B_O {r['B_O']:.2f} bits, beta_O {r['beta_O']:.3f}"
                         f" (prior-only probe {r['B_O_prior']:.2f}): {r['finding']}")
        if representations.lens is not None:
            lens = representations.lens
            lines.append("  logit lens: first layer where colour / shape words decode at the objects' tokens above "
                         f"chance: {lens.first_layer('colour') or 'none'} / {lens.first_layer('shape') or 'none'}")
        if representations.relevancy is not None:
            for r in representations.relevancy.scores().to_dict("records"):
                if r["method"] != "random":
                    lines.append(f"  relevancy {r['method']}: deletion AUC minus random {r['deletion_vs_random']:+.3f} "
                                 f"[{r['deletion_vs_random_lo']:+.3f}, {r['deletion_vs_random_hi']:+.3f}] "
                                 f"(n={r['n']}, lower is better)")
        for part, reason in representations.skipped.items():
            lines.append(f"  {part} skipped: {reason}")
    text = "\n".join([
        f"vlmbind demo: {vlm.name} ({vlm.source}), scene seed {args.seed}",
        f"  prompt: {prompt!r}" + (f" (expected: {expected!r})" if expected else ""),
        f"  top next tokens: {preds}",
        f"  head with the most last-token attention on the image: L{layer}.H{head} (mass {mass[layer, head]:.3f})",
        "  sizes: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in summary["sizes"].items() if v is not None),
        *lines,
        f"  wrote {len(written)} files to {out} in {elapsed:.1f} s; open {out / 'report.html'}",
    ])
    return result, text, 0
