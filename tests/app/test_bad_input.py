"""The bad-input corpus: every malformed call a user can make ends in a named error, never a traceback.

Two tables. ``CLI_CASES``: an argv for ``vlmbind`` that must exit 2 with exactly one stderr line
``vlmbind: error: <reason>`` naming the problem, nothing on stdout, and no file in the ``--out`` it was given.
``API_CASES``: a library call that must raise a named :class:`~vlmbind.core.errors.VlmbindError` subclass whose message
matches a pattern. The categories follow issue 8: unknown models and families, missing and corrupt weights, corrupt,
truncated, oversized (decompression bomb) and animated images, empty prompts and images, misaligned counterfactual
pairs, heads / layers out of range, misspelt sites, NaN / inf activations, empty data sets, unwritable outputs, bad
numeric ranges and malformed JSON / CSV files. Image modes that have an obvious RGB meaning (L, CMYK, RGBA, palette
with transparency, 16-bit) are converted, not refused; their tests check the pixels and that the model then runs.
Everything runs in-process on the tiny random Qwen2.5-VL (and the shipped organism where a trained one is needed).
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import transformers
from PIL import Image

import vlmbind as vb
from vlmbind import cli
from vlmbind import stimuli as vbs
from vlmbind.analysis import rsa as rsa_mod
from vlmbind.analysis.position_ids import check_heads
from vlmbind.analysis.tracking import centroid
from vlmbind.app.export import export_results
from vlmbind.core.errors import (
    InputError,
    InterventionError,
    ModelLoadError,
    SiteError,
    TrainingError,
    UnsupportedModelError,
    VlmbindError,
)
from vlmbind.core.images import read_image, to_rgb
from vlmbind.core.io import check_out_dir, write_bytes_atomic
from vlmbind.engine.alignment import check_alignment
from vlmbind.probes import Entropies, ProbeConfig, binding_information, pairwise_probe, split_indices
from vlmbind.stimuli import PairAlignmentError, StimulusError
from vlmbind.stimuli.core import Canvas

TINY = "tiny-qwen2_5_vl"
P2A = "organism-p2a"
KEEP = "keep me"


# ----------------------------------------------------------------------------------------------------------------
# fixtures: every broken file the corpus points at, built once
# ----------------------------------------------------------------------------------------------------------------
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header_claiming(width: int, height: int) -> bytes:
    """A tiny PNG file whose header claims ``width x height`` RGB pixels (a decompression bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def animated_gif() -> Image.Image:
    """A two-frame GIF, opened (``is_animated``)."""
    buf = io.BytesIO()
    blue = Image.new("RGB", (32, 32), "blue")
    Image.new("RGB", (32, 32), "red").save(buf, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    buf.seek(0)
    return Image.open(buf)


@dataclass
class Env:
    """Everything the tables refer to: the fixture folder ``fx`` and a few in-memory objects."""

    fx: Path
    vlm: Any
    image: Image.Image
    dataset: Any
    pairs: list[Any]
    acts_nan: Any
    acts_two: Any
    scores: pd.DataFrame


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    fx = tmp_path_factory.mktemp("bad_input")
    vlm = vb.load(TINY)
    # models: unsupported family, unknown model_type, malformed config, config without weights, corrupt weights
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(fx / "gpt2")
    (fx / "frobnet").mkdir()
    (fx / "frobnet" / "config.json").write_text(json.dumps({"model_type": "frobnet", "hidden_size": 8}))
    (fx / "badconfig").mkdir()
    (fx / "badconfig" / "config.json").write_text('{"model_type": "qwen2_5_vl",')
    vlm.model.config.save_pretrained(fx / "noweights")
    for name in ("truncated", "garbage"):
        vlm.model.save_pretrained(fx / name)
        vlm.processor.save_pretrained(fx / name)
    weights = next((fx / "truncated").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    next((fx / "garbage").glob("*.safetensors")).write_bytes(np.random.default_rng(0).bytes(4096))
    # files in the way and malformed tables
    (fx / "afile").write_text(KEEP)
    (fx / "unclosed.csv").write_text('layer,head,score\n"0,0,1\n')
    (fx / "columns.csv").write_text("a,b\n1,2\n")
    (fx / "empty.csv").write_text("")
    # score tables with one bad row among good ones, and a text file handed in as a table
    good_rows = "".join(f"{l},{h},{0.5 * (4 * l + h)}\n" for l in range(4) for h in range(4) if (l, h) != (0, 0))
    (fx / "word_cell.csv").write_text("layer,head,score\n" + good_rows + "0,zero,abc\n")
    (fx / "layer99.csv").write_text("layer,head,score\n" + good_rows + "99,0,1.0\n")
    (fx / "nan_score.csv").write_text("layer,head,score\n" + good_rows + "0,0,nan\n")
    (fx / "twice.csv").write_text("layer,head,score\n" + good_rows + "1,2,0.0\n")
    (fx / "notes.txt").write_text("my favourite heads are 2.1 and 3.0\nthey look interesting\n")
    pd.DataFrame([{"layer": l, "head": h, "score": float(4 * l + h)} for l in range(4) for h in range(4)]).to_csv(
        fx / "scores.csv", index=False)
    # the same table as vlmbind locate leaves it for another model: a summary.json beside it names that model
    (fx / "located_on_p2a").mkdir()
    (fx / "located_on_p2a" / "scores.csv").write_text((fx / "scores.csv").read_text())
    (fx / "located_on_p2a" / "summary.json").write_text(json.dumps({"kind": "head_scores", "model": "organism-p2a"}))
    # result folders for export: malformed JSON, and a valid ablation result
    (fx / "res_badjson").mkdir()
    (fx / "res_badjson" / "results.json").write_text('{"arms": [')
    (fx / "res_demo").mkdir()
    (fx / "res_demo" / "attention_mass.csv").write_text("layer,head,mass\n0,0,0.5\n")
    (fx / "res_demo" / "summary.json").write_text("{broken")
    (fx / "res_ok").mkdir()
    (fx / "res_ok" / "results.json").write_text(json.dumps({
        "model": TINY, "task": "scene", "mode": "zero", "k": 1, "renormalize": False,
        "arms": [{"arm": a, "seed": s, "heads": ["0.0"], "accuracy": 0.5, "n": 2}
                 for a, s in (("clean", None), ("top", None), ("random", 0), ("bottom", None))]}))
    (fx / "empty_dir").mkdir()
    # images: corrupt, truncated, bombs, and prompts files
    good = png_bytes(Image.new("RGB", (64, 64), "red"))
    for name, data in [("garbage", np.random.default_rng(1).bytes(300)), ("truncated", good[:60]),
                       ("bomb", png_header_claiming(100_000, 100_000)),
                       ("bomb_warn", png_header_claiming(10_000, 10_000)),  # past Pillow's warning limit only
                       ("good", good)]:
        (fx / "img" / name).mkdir(parents=True)
        (fx / "img" / name / "a.png").write_bytes(data)
    (fx / "img" / "none").mkdir()
    (fx / "img" / "good" / "bad.jsonl").write_text('{"image": "a.png", "prompt": \n')
    (fx / "img" / "good" / "empty_prompt.jsonl").write_text('{"image": "a.png", "prompt": "  "}\n')
    (fx / "img" / "good" / "blank.jsonl").write_text("\n\n")
    # a saved data set, and copies with a corrupt image, meta.jsonl, dataset.json
    dataset = vbs.scene_description(2, 0)
    dataset.save(fx / "ds")
    pairs_set = vbs.scene_pairs(2, "id_retrieval", 0)
    pairs_set.save(fx / "pairs")
    for name in ("ds_image", "ds_meta", "ds_info", "pairs_meta"):
        src = fx / ("pairs" if name.startswith("pairs") else "ds")
        (fx / name).mkdir()
        for f in src.rglob("*"):
            if f.is_file():
                (fx / name / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                (fx / name / f.relative_to(src)).write_bytes(f.read_bytes())
    next((fx / "ds_image" / "images").glob("*.png")).write_bytes(good[:50])
    (fx / "ds_meta" / "meta.jsonl").write_text("{oops\n")
    (fx / "ds_info" / "dataset.json").write_text("[1,")
    (fx / "pairs_meta" / "pairs.jsonl").write_text('{"id": "x"\n')
    (fx / "acts").mkdir()
    (fx / "acts" / "manifest.json").write_text("{not json")
    # an activation set whose first example is NaN at its one site
    site = "blocks.0.hook_resid_post"
    single_objects = list(vbs.rsa_set(0, positions_per_conjunction=1))
    acts = vb.capture(vlm, single_objects[:6], site)
    acts_two = vb.capture(vlm, single_objects[:2], site)
    memory = {k: (torch.full_like(v, float("nan")) if k == f"{site}|0" else v) for k, v in acts._memory.items()}
    acts_nan = vb.ActivationSet(None, acts.manifest, memory, acts._meta)
    scores = pd.read_csv(fx / "scores.csv")
    return Env(fx, vlm, Image.new("RGB", (64, 64), "white"), dataset, list(pairs_set), acts_nan, acts_two, scores)


# ----------------------------------------------------------------------------------------------------------------
# the CLI table: argv -> exit 2, one line naming the problem
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CliCase:
    """``argv`` may use ``{fx}`` (the fixture folder) and ``{out}`` (a fresh output folder that must stay empty);
    every string of ``needles`` must occur in the error line."""

    id: str
    argv: tuple[str, ...]
    needles: tuple[str, ...]


def C(id: str, argv: str, *needles: str) -> CliCase:
    return CliCase(id, tuple(argv.split()), needles)


T, O = TINY, "--out {out}"
CLI_CASES = [
    # unknown models and families, missing and corrupt weights
    C("unknown-tiny-name", f"demo --model tiny-qwen25 {O}", "'tiny-qwen25'", "Did you mean 'tiny-qwen3_5', 'tiny-qwen2_5_vl'"),
    C("unknown-organism", f"eval --model organism-p2x --task scene {O}", "'organism-p2x'", "'organism-p2a'"),
    C("unsupported-family", f"locate --model {{fx}}/gpt2 --condition id_retrieval {O}", "'gpt2'", "Supported families"),
    C("unknown-model-type", f"ablate --model {{fx}}/frobnet --task scene --heads 0.0 {O}", "'frobnet'",
      "Supported families"),
    C("malformed-config", f"eval --model {{fx}}/badconfig --task scene {O}", "config", "not a valid JSON"),
    C("config-without-weights", f"eval --model {{fx}}/noweights --task scene {O}", "weights", "model.safetensors"),
    C("truncated-weights", f"rsa --model {{fx}}/truncated {O}", "weights", "header"),
    C("garbage-weights", f"probe --model {{fx}}/garbage {O}", "weights", "header"),
    C("model-is-a-file", f"track --model {{fx}}/afile --task count {O}", "not a model directory"),
    C("model-dir-missing", f"edit --model ./no/such/dir --heads 0.0 {O}", "'./no/such/dir'", "not a model directory"),
    # bad numeric ranges
    C("demo-pairs-0", f"demo --model {T} --pairs 0 {O}", "--pairs", "0 is below 1"),
    C("demo-eval-n-negative", f"demo --model {T} --eval-n -3 {O}", "--eval-n", "-3"),
    C("demo-seed-text", f"demo --model {T} --seed abc {O}", "--seed", "'abc' is not an integer"),
    C("eval-n-0", f"eval --model {T} --task scene --n 0 {O}", "--n", "0 is below 1"),
    C("eval-batch-size-0", f"eval --model {T} --task scene --n 2 --batch-size 0 {O}", "--batch-size", "0 is below 1"),
    C("eval-image-size-0", f"eval --model {T} --task scene --n 2 --image-size 0 {O}", "image_size", "got 0"),
    C("eval-objects-0", f"eval --model {T} --task scene --n 2 --objects 0 {O}", "n_objects", ">= 2"),
    C("eval-seed-negative", f"eval --model {T} --task scene --n 2 --seed -1 {O}", "seed", "-1"),
    C("locate-pairs-0", f"locate --model {T} --condition id_retrieval --n-pairs 0 {O}", "--n-pairs", "0 is below 1"),
    C("locate-verify-negative", f"locate --model {T} --condition id_retrieval --verify-top -1 {O}", "--verify-top",
      "-1"),
    C("track-threshold-above-1", f"track --model {P2A} --task count --threshold 1.5 {O}", "--threshold", "1.5"),
    C("track-threshold-nan", f"track --model {P2A} --task count --threshold nan {O}", "--threshold", "nan"),
    C("track-n-0", f"track --model {P2A} --task count --n 0 {O}", "--n", "0 is below 1"),
    C("track-batch-size-0", f"track --model {P2A} --task count --batch-size 0 {O}", "--batch-size", "0 is below 1"),
    C("rsa-positions-0", f"rsa --model {T} --positions 0 {O}", "--positions", "0 is below 1"),
    C("rsa-permutations-negative", f"rsa --model {T} --permutations -1 {O}", "--permutations", "-1"),
    C("probe-epochs-0", f"probe --model {T} --epochs 0 {O}", "--epochs", "0"),
    C("probe-lr-nan", f"probe --model {T} --lr nan {O}", "--lr", "nan"),
    C("probe-n-train-0", f"probe --model {T} --n-train 0 {O}", "--n-train", "0 is below 1"),
    C("probe-unknown-family", f"probe --model {T} --family linaer {O}", "'linaer'", "linear"),
    # refused before the capture of the default 58,800 images, not after it
    C("probe-pairwise-single-token-objects", f"probe --model organism-p2a --family linear,pairwise {O}",
      "covers at most one image token", "same_object_probes"),
    C("ablate-n-0", f"ablate --model {T} --task scene --heads 0.0 --n 0 {O}", "--n", "0 is below 1"),
    C("ablate-seeds-negative", f"ablate --model {T} --task scene --heads 0.0 --seeds -1 {O}", "--seeds", "-1"),
    C("ablate-top-k-0", f"ablate --model {T} --task scene --scores {{fx}}/scores.csv --top-k 0 {O}", "--top-k",
      "0 is below 1"),
    C("ablate-top-k-too-big", f"ablate --model {T} --task scene --scores {{fx}}/scores.csv --top-k 9 --n 2 {O}",
      "k = 9", "half the heads"),
    C("edit-n-eval-0", f"edit --model {T} --heads 0.0 --n-eval 0 {O}", "--n-eval", "got 0"),
    C("edit-alpha-nan", f"edit --model {T} --heads 0.0 --alpha 0,nan {O}", "alpha 'nan'", "not finite"),
    C("edit-alpha-text", f"edit --model {T} --heads 0.0 --alpha 1,two {O}", "alpha 'two'", "not a number"),
    C("stimuli-present-above-1", f"stimuli search --n 2 --present 1.5 {O}", "present", "[0, 1]", "1.5"),
    C("stimuli-present-negative", f"stimuli search --n 2 --present -0.1 {O}", "present", "-0.1"),
    C("stimuli-n-0", f"stimuli scene --n 0 {O}", "--n", "got 0"),
    C("stimuli-n-missing", f"stimuli count {O}", "--n", "None"),
    C("stimuli-empty-range", f"stimuli scene --n 2 --objects 5-2 {O}", "--objects", "'5-2' is empty"),
    C("stimuli-too-many-objects", f"stimuli scene --n 2 --objects 50 {O}", "50 objects", "3x3 grid"),
    C("stimuli-image-size-negative", f"stimuli scene --n 2 --image-size -10 {O}", "image_size", "-10"),
    C("stimuli-object-size-0", f"stimuli scene --n 2 --object-size 0 {O}", "object_size 0"),
    C("stimuli-grid-0", f"stimuli scene --n 2 --grid 0 {O}", "grid", "got 0"),
    C("stimuli-positions-text", f"stimuli rsa --positions many {O}", "--positions 'many'"),
    C("stimuli-stray-option", f"stimuli colorshape --n 10 --entropy high {O}", "--entropy", "colorshape"),
    # heads and layers out of range, malformed heads, misspelt sites
    C("ablate-layer-out-of-range", f"ablate --model {T} --task scene --heads 99.0 {O}", "'99.0'", "layers 0..3"),
    C("ablate-head-out-of-range", f"ablate --model {T} --task scene --heads 0.99 {O}", "'0.99'", "heads 0..3"),
    C("ablate-negative-layer", f"ablate --model {T} --task scene --heads -1.0 {O}", "'-1.0'", "do not exist"),
    C("ablate-malformed-head", f"ablate --model {T} --task scene --heads 1-2 {O}", "'1-2'", "LAYER.HEAD"),
    C("ablate-empty-heads", f"ablate --model {T} --task scene --heads , {O}", "--heads ','", "lists no heads"),
    C("edit-head-out-of-range", f"edit --model {T} --heads 9.9 {O}", "'9.9'", "do not exist"),
    C("edit-repeated-head", f"edit --model {T} --heads 0.0,0.0 {O}", "'0.0'", "more than once"),
    C("rsa-layer-out-of-range", f"rsa --model {T} --sites blocks.99.hook_resid_post {O}", "layer 99",
      "layers 0..3"),
    C("rsa-vision-layer-out-of-range", f"rsa --model {T} --sites vision.blocks.40.hook_resid_post {O}", "layer 40"),
    C("rsa-misspelt-site", f"rsa --model {T} --sites blocks.0.hook_resid_pots {O}", "'blocks.0.hook_resid_pots'",
      "Did you mean 'blocks.0.hook_resid_post'"),
    C("probe-misspelt-site", f"probe --model {T} --sites blocks.0.attn.hook_zz {O}",
      "Did you mean 'blocks.0.attn.hook_z'"),
    # malformed score tables and result files
    C("ablate-scores-of-another-model", f"ablate --model {T} --task scene --scores {{fx}}/located_on_p2a/scores.csv {O}",
      "located on organism-p2a", f"not on --model {T}", "--scores-from-any-model"),
    C("edit-scores-of-another-model", f"edit --model {T} --scores {{fx}}/located_on_p2a/scores.csv {O}",
      "located on organism-p2a", "--scores-from-any-model"),
    C("ablate-scores-unclosed-quote", f"ablate --model {T} --task scene --scores {{fx}}/unclosed.csv --n 2 {O}",
      "--scores", "not a readable CSV"),
    C("ablate-scores-wrong-columns", f"ablate --model {T} --task scene --scores {{fx}}/columns.csv --n 2 {O}",
      "columns.csv", "no column(s) layer, head, score", "header: ['a', 'b']"),
    C("ablate-scores-word-cell", f"ablate --model {T} --task scene --scores {{fx}}/word_cell.csv --n 2 {O}",
      "word_cell.csv", "line 17", "head 'zero'", "not a non-negative integer"),
    C("edit-scores-layer-99", f"edit --model {T} --scores {{fx}}/layer99.csv {O}", "layer99.csv", "line 17",
      "layer 99 is outside the model", "0..3"),
    C("ablate-scores-nan", f"ablate --model {T} --task scene --scores {{fx}}/nan_score.csv --n 2 {O}",
      "nan_score.csv", "line 17", "score 'nan'", "not a finite number"),
    C("edit-scores-head-twice", f"edit --model {T} --scores {{fx}}/twice.csv {O}", "twice.csv", "line 17",
      "head 1.2 is listed again", "first on line 7"),
    C("ablate-scores-text-file", f"ablate --model {T} --task scene --scores {{fx}}/notes.txt --n 2 {O}",
      "notes.txt", "no column(s) layer, head, score", "my favourite heads"),
    C("ablate-scores-missing", f"ablate --model {T} --task scene --scores {{fx}}/nope.csv --n 2 {O}",
      "nope.csv", "does not exist"),
    C("edit-scores-empty-file", f"edit --model {T} --scores {{fx}}/empty.csv {O}", "--scores", "not a readable CSV"),
    C("export-malformed-results-json", f"export {{fx}}/res_badjson {O}", "results.json", "as JSON"),
    C("export-malformed-summary-json", f"export {{fx}}/res_demo {O}", "summary.json", "as JSON"),
    C("export-no-results", f"export {{fx}}/empty_dir {O}", "holds no vlmbind results"),
    C("export-missing-dir", f"export {{fx}}/nope {O}", "does not exist"),
    C("export-unknown-format", f"export {{fx}}/res_ok --format gif {O}", "'gif'", "png, svg, pdf, html, csv"),
    # unwritable output directories: a file, or a path below a file
    C("stimuli-out-is-file", "stimuli scene --n 2 --out {fx}/afile", "afile", "existing file"),
    C("stimuli-out-below-file", "stimuli scene --n 2 --out {fx}/afile/sub", "afile", "is a file"),
    C("eval-out-is-file", f"eval --model {T} --task scene --n 2 --out {{fx}}/afile", "afile", "existing file"),
    C("locate-out-below-file", f"locate --model {T} --condition id_retrieval --out {{fx}}/afile/sub", "is a file"),
    C("track-out-below-file", f"track --model {P2A} --task count --out {{fx}}/afile/x/y", "is a file"),
    C("rsa-out-is-file", f"rsa --model {T} --out {{fx}}/afile", "existing file"),
    C("probe-out-below-file", f"probe --model {T} --out {{fx}}/afile/sub", "is a file"),
    C("ablate-out-is-file", f"ablate --model {T} --task scene --heads 0.0 --out {{fx}}/afile", "existing file"),
    C("edit-out-below-file", f"edit --model {T} --heads 0.0 --out {{fx}}/afile/sub", "is a file"),
    C("demo-out-below-file", f"demo --model {T} --out {{fx}}/afile/sub", "is a file"),
    C("export-out-is-file", "export {fx}/res_ok --format csv --out {fx}/afile", "afile", "cannot write"),
    # usage errors
    C("unknown-command", "frobnicate", "'frobnicate'", "demo"),
    C("missing-required-model", f"eval --task scene {O}", "--model"),
    C("unknown-task-choice", f"eval --model {T} --task sceen {O}", "'sceen'", "scene"),
]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert lines[0].startswith("vlmbind: error: "), lines[0]
    return lines[0]


def test_cli_table_is_large_and_unique():
    ids = [c.id for c in CLI_CASES]
    assert len(set(ids)) == len(ids)
    assert len(CLI_CASES) >= 50


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
def test_cli_bad_input_exits_2_with_one_line(case, env, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VLMBIND_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)  # a default output folder (runs/...) would land here, and is checked below
    out = tmp_path / "out"
    argv = [a.format(fx=env.fx, out=out) for a in case.argv]
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    line = _one_error_line(captured.err)
    for needle in case.needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert captured.out == ""
    assert "Traceback" not in captured.err
    for folder in (out, tmp_path / "runs"):
        assert not folder.exists() or not [p for p in folder.rglob("*") if p.is_file()], f"{folder} has files"
    assert (env.fx / "afile").read_text() == KEEP


def test_cli_out_under_read_only_folder_exits_2(env, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    real = os.access  # root writes anywhere, so access() is also told that this folder is read-only
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    try:
        code = cli.main(["stimuli", "scene", "--n", "2", "--out", str(locked / "sub")])
        line = _one_error_line(capsys.readouterr().err)
    finally:
        locked.chmod(0o755)
    assert code == 2 and "read-only" in line
    assert not (locked / "sub").exists()


def test_check_out_dir_refuses_read_only_folder(tmp_path, monkeypatch):
    """The read-only branch, also where the tests run as root (which writes anywhere): access() says no."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real(p, mode))
    with pytest.raises(InputError, match="read-only"):
        check_out_dir(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------------------------------------------
# the API table: call -> named error whose message matches
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ApiCase:
    id: str
    call: Callable[[Env], Any]
    error: type[VlmbindError]
    match: str


def _misaligned(env: Env, **changes: Any) -> Any:
    pair = env.pairs[0]
    return replace(pair, counterfactual=replace(pair.counterfactual, **changes))


_Z = np.random.default_rng(0).normal(size=(24, 8))
_O = np.random.default_rng(1).integers(0, 2, size=(24, 4))
_SPLIT = np.array(["train"] * 12 + ["val"] * 6 + ["test"] * 6)


def _with(array: np.ndarray, index: tuple, value: float) -> np.ndarray:
    out = array.astype(float).copy()
    out[index] = value
    return out


A = ApiCase
API_CASES = [
    # models
    A("load-unknown-name", lambda e: vb.load("tiny-qwen25_vl"), UnsupportedModelError,
      "Did you mean 'tiny-qwen2_5_vl'"),
    A("load-unsupported-family", lambda e: vb.load(str(e.fx / "gpt2")), UnsupportedModelError, "'gpt2'.*Qwen2.5-VL"),
    A("load-unknown-model-type", lambda e: vb.load(str(e.fx / "frobnet")), UnsupportedModelError,
      "'frobnet'.*Supported families"),
    A("load-malformed-config", lambda e: vb.load(str(e.fx / "badconfig")), ModelLoadError, "not a valid JSON"),
    A("load-config-without-weights", lambda e: vb.load(str(e.fx / "noweights")), ModelLoadError,
      "weights or processor.*model.safetensors"),
    A("load-truncated-weights", lambda e: vb.load(str(e.fx / "truncated")), ModelLoadError, "weights.*header"),
    A("load-garbage-weights", lambda e: vb.load(str(e.fx / "garbage")), ModelLoadError, "weights.*header"),
    A("load-empty-dir", lambda e: vb.load(str(e.fx / "empty_dir")), ModelLoadError, "config"),
    A("load-file", lambda e: vb.load(str(e.fx / "afile")), ModelLoadError, "not a model directory"),
    # images: corrupt, truncated, bombs, animated
    A("image-garbage-bytes", lambda e: vbs.user_images(e.fx / "img" / "garbage"), StimulusError,
      "a.png: not a readable image"),
    A("image-truncated-png", lambda e: vbs.user_images(e.fx / "img" / "truncated"), StimulusError,
      "a.png: not a readable image.*truncated"),
    A("image-decompression-bomb", lambda e: vbs.user_images(e.fx / "img" / "bomb"), StimulusError,
      "too large to decode safely"),
    A("image-bomb-warning-range", lambda e: read_image(e.fx / "img" / "bomb_warn" / "a.png"), InputError,
      "too large to decode safely"),
    A("image-missing-file", lambda e: read_image(e.fx / "img" / "nope.png"), InputError, "nope.png: not a readable"),
    A("image-animated-prepare", lambda e: e.vlm.prepare(animated_gif(), "what is this ?"), InputError,
      "animated \\(2 frames\\).*one frame"),
    A("image-animated-to-rgb", lambda e: to_rgb(animated_gif(), "clip.gif"), InputError, "clip.gif is animated"),
    A("image-not-pil", lambda e: e.vlm.prepare([np.zeros((8, 8, 3))], ["a"]), InputError, "expected a PIL image"),
    A("dataset-corrupt-image", lambda e: vbs.Dataset.load(e.fx / "ds_image"), StimulusError, "not a readable image"),
    # prompts and images missing
    A("prompt-empty", lambda e: e.vlm.prepare(e.image, "   "), InputError, "prompt 0 is empty"),
    A("prompt-none", lambda e: e.vlm.prepare([e.image], [None]), InputError, "prompt 0 is empty"),
    A("prompt-without-image", lambda e: e.vlm.prepare([[]], ["what is this ?"]), InputError, "has no image"),
    A("prompts-more-than-images", lambda e: e.vlm.prepare([], ["a"]), InputError, "0 images for 1 prompts"),
    A("no-prompts", lambda e: e.vlm.prepare([], []), InputError, "no prompts"),
    A("user-prompt-empty", lambda e: vbs.user_images(e.fx / "img" / "good", e.fx / "img/good/empty_prompt.jsonl"),
      StimulusError, "the prompt is empty"),
    # counterfactual pairs that do not line up
    A("pair-different-grid", lambda e: check_alignment(e.vlm, [_misaligned(e, image=e.pairs[0].counterfactual.image
                                                                             .resize((300, 200)))]),
      PairAlignmentError, "image-token count 64 \\(clean\\) vs 54"),
    A("pair-different-length", lambda e: check_alignment(e.vlm, [_misaligned(
        e, prompt=e.pairs[0].counterfactual.prompt + " and more words")]), PairAlignmentError, "sequence length"),
    A("locate-misaligned-pair", lambda e: vb.locate(e.vlm, [_misaligned(
        e, image=e.pairs[0].counterfactual.image.resize((300, 200)))]), PairAlignmentError, "does not line up"),
    A("locate-mixed-conditions",
      lambda e: vb.locate(e.vlm, [e.pairs[0], replace(e.pairs[1], condition="id_selection")]), InputError,
      "mix conditions"),
    A("patch-values-wrong-shape", lambda e: e.vlm.run(e.vlm.prepare(e.image, "a"), interventions=[
        vb.PatchHeads(layer=0, heads=[0], positions=[-1], values=torch.zeros(3, 5))]), InterventionError,
      "PatchHeads: values of shape \\(3, 5\\)"),
    # heads and layers out of range
    A("ablate-layer-out-of-range", lambda e: e.vlm.run(e.vlm.prepare(e.image, "a"), interventions=[
        vb.AblateHeads(layer=99, heads=[0])]), InterventionError, "layer 99 is out of range.*0..3"),
    A("ablate-head-out-of-range", lambda e: e.vlm.run(e.vlm.prepare(e.image, "a"), interventions=[
        vb.AblateHeads(layer=0, heads=[7])]), InterventionError, "heads \\[7\\] are out of range"),
    A("vlm-ablate-head-string", lambda e: e.vlm.ablate("0.99").__enter__(), InterventionError, "heads \\[99\\]"),
    A("vlm-ablate-malformed", lambda e: e.vlm.ablate("1-2"), InputError, "'1-2' is not LAYER.HEAD"),
    A("vlm-ablate-unknown-mode", lambda e: e.vlm.ablate("0.0", mode="zeros"), InputError, "Did you mean 'zero'"),
    A("check-heads-out-of-range", lambda e: check_heads(e.vlm, "3.4"), InputError, "'3.4'.*heads 0..3"),
    A("check-heads-none", lambda e: check_heads(e.vlm, ""), InputError, "no heads given"),
    A("locate-layers-out-of-range", lambda e: vb.locate(e.vlm, e.pairs, layers=[99]), InputError,
      "layers \\[99\\] are out of range"),
    A("head-means-layer-out-of-range", lambda e: e.vlm.head_means(e.vlm.prepare(e.image, "a"), 9, [0]), SiteError,
      "layer 9 is out of range"),
    # misspelt and out-of-range sites
    A("site-misspelt", lambda e: e.vlm.sites("blocks.0.hook_resid_pots"), SiteError,
      "Did you mean 'blocks.0.hook_resid_post'"),
    A("site-misspelt-attn", lambda e: e.vlm.run(e.vlm.prepare(e.image, "a"), sites="blocks.1.attn.hook_patern"),
      SiteError, "Did you mean 'blocks.1.attn.hook_pattern'"),
    A("site-layer-out-of-range", lambda e: e.vlm.sites("blocks.9.hook_resid_post"), SiteError, "layer 9.*0..3"),
    A("site-pattern-matches-nothing", lambda e: vb.capture(e.vlm, e.dataset, "projector.hook_outt"), SiteError,
      "projector.hook_out"),
    A("activation-site-not-captured", lambda e: e.acts_nan.tensor("blocks.0.hook_resid_pots", 0), InputError,
      "Did you mean 'blocks.0.hook_resid_post'"),
    # NaN / inf activations
    A("rsa-nan-activations", lambda e: rsa_mod.rsa(e.acts_nan, permutations=0), InputError,
      "examples \\[0\\] hold NaN or inf"),
    A("pca-nan-activations", lambda e: rsa_mod.pca(e.acts_nan, "blocks.0.hook_resid_post"), InputError, "NaN or inf"),
    A("similarity-inf", lambda e: rsa_mod.similarity_matrix(np.array([[1.0, np.inf], [0.0, 1.0]])), InputError,
      "1 NaN or inf"),
    A("probe-nan-representations", lambda e: binding_information(_with(_Z, (3, 2), np.nan), _O, None, _SPLIT,
                                                                  entropies={"H_O": 2.0}), InputError, "inf or NaN"),
    A("probe-inf-tokens", lambda e: binding_information(np.full((24, 3, 4), np.inf), _O, None, _SPLIT,
                                                        entropies={"H_O": 2.0}, family="attention"), InputError,
      "inf or NaN"),
    A("pairwise-nan-tokens", lambda e: pairwise_probe(np.full((24, 4, 3), np.nan), np.tile([0, 0, 1, 1], (24, 1)),
                                                      _SPLIT), InputError, "inf or NaN"),
    A("centroid-nan", lambda e: centroid(np.full((2, 3, 3), np.nan)), InputError, "NaN or inf"),
    A("entropy-negative", lambda e: Entropies(H_O=-1.0), InputError, "H_O must be a finite number >= 0"),
    A("entropy-nan", lambda e: Entropies(H_O=float("nan")), InputError, "finite"),
    A("probe-code-not-binary", lambda e: binding_information(_Z, _O * 3, None, _SPLIT, entropies={"H_O": 2.0}),
      InputError, "only 0 and 1"),
    # empty data sets
    A("evaluate-empty", lambda e: vb.evaluate(e.vlm, []), InputError, "data set is empty"),
    A("capture-empty", lambda e: vb.capture(e.vlm, [], "blocks.0.hook_resid_post"), InputError, "at least one example"),
    A("locate-empty", lambda e: vb.locate(e.vlm, []), InputError, "at least one counterfactual pair"),
    A("alignment-empty", lambda e: check_alignment(e.vlm, []), StimulusError, "at least one pair"),
    A("ablation-empty", lambda e: vb.ablation_study(e.vlm, [], e.scores, k=2), InputError, "data set is empty"),
    A("user-images-empty-folder", lambda e: vbs.user_images(e.fx / "img" / "none"), StimulusError, "has no .png"),
    A("user-prompts-no-records", lambda e: vbs.user_images(e.fx / "img" / "good", e.fx / "img/good/blank.jsonl"),
      StimulusError, "has no records"),
    A("split-empty", lambda e: split_indices(["train"] * 3, 3), InputError, "\\['val', 'test'\\] have no examples"),
    A("rsa-too-few-objects", lambda e: rsa_mod.rsa(e.acts_two, permutations=0), InputError,
      "RSA needs at least 3 objects, got 2"),
    # bad numeric ranges
    A("evaluate-batch-size-0", lambda e: vb.evaluate(e.vlm, e.dataset, batch_size=0), InputError,
      "batch_size must be a positive int, got 0"),
    A("capture-batch-size-0", lambda e: vb.capture(e.vlm, e.dataset, "blocks.0.hook_resid_post", batch_size=0),
      InputError, "batch_size must be a positive int"),
    A("capture-tokens-mode", lambda e: vb.capture(e.vlm, e.dataset, "blocks.0.hook_resid_post", tokens="every"),
      InputError, "tokens must be one of"),
    A("rsa-permutations-negative", lambda e: rsa_mod.rsa(e.acts_nan, permutations=-1), InputError,
      "permutations must be an int >= 0"),
    A("search-present-above-1", lambda e: vbs.visual_search(2, 0, present=1.5), StimulusError,
      "probability in \\[0, 1\\], got 1.5"),
    A("scene-too-many-objects", lambda e: vbs.scene_description(2, 0, n_objects=50), StimulusError, "do not fit"),
    A("scene-negative-count", lambda e: vbs.scene_description(-1, 0), StimulusError, "-1"),
    A("canvas-size-0", lambda e: Canvas(image_size=0), StimulusError, "image_size must be an int >= 8"),
    A("probe-config-lr", lambda e: ProbeConfig(lr=-1), TrainingError, "lr must be a positive number"),
    A("centroid-threshold", lambda e: centroid(np.ones((3, 3)), threshold=1.5), InputError, "threshold"),
    A("ablation-k-0", lambda e: vb.ablation_study(e.vlm, e.dataset, e.scores, k=0), InputError, "k = 0"),
    A("ablation-no-seeds", lambda e: vb.ablation_study(e.vlm, e.dataset, e.scores, k=2, seeds=()), InputError,
      "seeds is empty"),
    A("ablation-scores-incomplete", lambda e: vb.ablation_study(e.vlm, e.dataset, e.scores.iloc[:5], k=2), InputError,
      "each of the model's 4 x 4 heads"),
    A("edit-study-nan-alpha", lambda e: vb.edit_study(e.vlm, "0.0", [float("nan")]), InputError, "not finite"),
    # unwritable outputs
    A("dataset-save-below-file", lambda e: e.dataset.save(e.fx / "afile" / "ds"), StimulusError, "cannot write"),
    A("atomic-write-to-dir", lambda e: write_bytes_atomic(b"x", e.fx / "empty_dir"), InputError, "is a directory"),
    A("capture-out-is-file", lambda e: vb.capture(e.vlm, e.dataset, "blocks.0.hook_resid_post", out=e.fx / "afile"),
      InputError, "is a file"),
    A("export-out-below-file", lambda e: export_results(e.fx / "res_ok", "csv", e.fx / "afile" / "x"), InputError,
      "cannot write the export"),
    A("check-out-dir-below-file", lambda e: check_out_dir(e.fx / "afile" / "a" / "b"), InputError,
      "'.*afile' is a file"),
    # malformed JSON data files
    A("dataset-malformed-meta", lambda e: vbs.Dataset.load(e.fx / "ds_meta"), StimulusError,
      "meta.jsonl' line 1 is not JSON"),
    A("dataset-malformed-info", lambda e: vbs.Dataset.load(e.fx / "ds_info"), StimulusError,
      "dataset.json' is not readable JSON"),
    A("pairs-malformed-meta", lambda e: vbs.PairSet.load(e.fx / "pairs_meta"), StimulusError, "line 1: not JSON"),
    A("dataset-not-a-dataset", lambda e: vbs.Dataset.load(e.fx / "empty_dir"), StimulusError,
      "not a vlmbind stimuli directory"),
    A("activations-malformed-manifest", lambda e: vb.ActivationSet.load(e.fx / "acts"), InputError,
      "manifest.json is not readable JSON"),
    A("activations-no-manifest", lambda e: vb.ActivationSet.load(e.fx / "empty_dir"), InputError, "holds no manifest"),
    A("user-prompts-malformed", lambda e: vbs.user_images(e.fx / "img" / "good", e.fx / "img" / "good" / "bad.jsonl"),
      StimulusError, "bad.jsonl line 1: not JSON"),
    A("export-malformed-json", lambda e: export_results(e.fx / "res_badjson", "csv", e.fx / "o"), InputError,
      "cannot read .*results.json' as JSON"),
]


def test_api_table_is_large_and_unique():
    ids = [c.id for c in API_CASES]
    assert len(set(ids)) == len(ids)
    assert len(API_CASES) >= 50


@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c.id)
def test_api_bad_input_raises_named_error(case, env):
    with pytest.raises(VlmbindError) as info:
        case.call(env)
    assert isinstance(info.value, case.error), f"{type(info.value).__name__}: {info.value}"
    assert info.match(case.match)
    assert str(info.value).strip(), "a named error needs a message"
    assert (env.fx / "afile").read_text() == KEEP


# ----------------------------------------------------------------------------------------------------------------
# image modes with an obvious RGB meaning are converted, and the model runs on them
# ----------------------------------------------------------------------------------------------------------------
def _transparent_palette() -> Image.Image:
    im = Image.new("P", (32, 32), 0)
    im.putpalette([10, 20, 30, 200, 0, 0] + [0] * 762)
    im.paste(1, (0, 0, 16, 32))
    im.info["transparency"] = 0
    return im


@pytest.mark.parametrize(
    ("make", "left", "right"),
    [
        (lambda: Image.new("L", (32, 32), 128), (128, 128, 128), (128, 128, 128)),
        (lambda: Image.new("CMYK", (32, 32), (0, 255, 255, 0)), (255, 0, 0), (255, 0, 0)),
        # fully transparent red on the right: composited on white, not shown as red
        (lambda: _half(Image.new("RGBA", (32, 32), (255, 0, 0, 0)), (0, 0, 255, 255)), (0, 0, 255), (255, 255, 255)),
        (lambda: _half(Image.new("LA", (32, 32), (0, 0)), (0, 255)), (0, 0, 0), (255, 255, 255)),
        (_transparent_palette, (200, 0, 0), (255, 255, 255)),
        (lambda: Image.fromarray(np.tile(np.array([0, 65535], dtype=np.uint16).repeat(16), (32, 1))),
         (0, 0, 0), (255, 255, 255)),
    ],
    ids=["L", "CMYK", "RGBA", "LA", "P-transparent", "I16"],
)
def test_image_modes_are_converted_and_the_model_runs(env, make, left, right):
    image = make()
    batch = env.vlm.prepare(image, "what is this ?")
    seen = batch.images[0][0]
    assert seen.mode == "RGB" and seen.size == image.size
    assert seen.getpixel((2, 2)) == left and seen.getpixel((29, 2)) == right
    logits = env.vlm.run(batch).logits
    assert torch.isfinite(logits).all()
    # the same logits as for the RGB image the user would have made by hand
    assert torch.equal(logits, env.vlm.run(env.vlm.prepare(seen.copy(), "what is this ?")).logits)


def _half(image: Image.Image, colour: tuple[int, ...]) -> Image.Image:
    """``image`` with its left half painted ``colour``."""
    image.paste(colour, (0, 0, image.width // 2, image.height))
    return image


def test_still_gif_is_accepted_and_user_images_convert(env, tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "blue").save(buf, "GIF")
    buf.seek(0)
    still = Image.open(buf)
    assert env.vlm.prepare(still, "a").images[0][0].getpixel((0, 0)) == (0, 0, 255)
    Image.new("RGBA", (16, 16), (0, 255, 0, 0)).save(tmp_path / "clear.png")
    Image.new("CMYK", (16, 16), (255, 0, 255, 0)).save(tmp_path / "cmyk.jpg")
    ds = vbs.user_images(tmp_path)
    assert [e.image.mode for e in ds] == ["RGB", "RGB"]
    assert ds[0].image.getpixel((0, 0)) == (255, 255, 255)  # clear.png: transparent -> white
    assert ds[1].image.getpixel((0, 0))[1] > 200 and ds[1].image.getpixel((0, 0))[0] < 50  # cmyk.jpg: green


def test_animated_png_is_refused_on_disk(tmp_path):
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue", "green")]
    frames[0].save(tmp_path / "anim.png", save_all=True, append_images=frames[1:])
    with pytest.raises(StimulusError, match="anim.png is animated \\(3 frames\\)"):
        vbs.user_images(tmp_path)
