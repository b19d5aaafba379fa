"""Tests of the ``vlmbind`` command (models, demo, exit codes) and of the figure builders it uses.

The demo's numbers are checked against an independent computation: the model's own ``output_attentions`` on the
scene read back from ``scene.png``, with image positions found from the config's image token id, not the TokenIndex.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import shared_organism
from PIL import Image

import vlmbind as vb
from vlmbind import cli, tiny
from vlmbind.app.commands import demo
from vlmbind.core.errors import InputError
from vlmbind.viz import attention_overlay, head_heatmap, write_html_atomic, write_text_atomic

DEMO_FILES = ("validation", "causal", "representations", "attention_mass.csv", "heatmap.html", "overlay.html",
              "scene.png", "summary.json", "report.html", "plotly.min.js")
SCRIPT_SRC = re.compile(r"<script[^>]*\bsrc\s*=", re.IGNORECASE)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    assert lines[0].startswith("vlmbind: error: ")
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------------------------------------------------
# vlmbind models
# ----------------------------------------------------------------------------------------------------------------
def test_models_json_lists_every_registered_name_with_its_shape(capsys):
    assert cli.main(["models", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed"] == []
    rows = {r["name"]: r for r in summary["models"]}
    assert list(rows) == vb.registered_names()
    assert set(tiny.TINY_NAMES) <= set(rows)
    for name in tiny.TINY_NAMES:
        # the reference is the HF config of an independently built model, not the adapter the CLI reads
        model, _ = tiny.build(name)
        text = model.config.text_config
        row = rows[name]
        assert row["layers"] == text.num_hidden_layers, name
        assert row["heads"] == text.num_attention_heads, name
        # a heterogeneous config (Gemma-4) gives per-layer values only: the row is layer 0's
        layer0 = text.per_layer_config[0] if hasattr(text, "per_layer_config") else text
        assert row["kv_heads"] == layer0.num_key_value_heads, name
        # a family without image tokens in its sequence lays its cross-attention keys on the image instead
        assert bool(row["grids"]) != bool(row["key_grids"]), name
        assert sum(g["rows"] * g["cols"] for g in row["grids"]) <= row["image_tokens"], name
        assert row["source"].startswith("tiny"), name
    # Qwen2.5-VL at 224 px: 16x16 patches of 14 px, merged 2x2 -> one 8x8 grid
    assert rows["tiny-qwen2_5_vl"]["grids"] == [{"name": "image", "image": 0, "rows": 8, "cols": 8}]
    assert rows["tiny-qwen2_5_vl"]["image_tokens"] == 64


def test_the_declared_models_are_what_the_built_models_give():
    """The declarations file `vlmbind models` reads equals what building every registered model gives now (and the
    shipped organisms' fingerprints are those of their files), so it cannot fall behind the builders or the
    weights."""
    from vlmbind.app.commands.models import declarations
    from vlmbind.core.declared import DECLARED_FILE

    assert json.loads(DECLARED_FILE.read_text()) == declarations(), \
        "the declared models are out of date: run python scripts/declare_models.py"


def test_a_name_without_a_current_declaration_is_described_by_building_it(monkeypatch):
    """A shipped organism whose files changed since the declarations were written, and a name the file lacks, are
    described by building them; the other rows come from the file."""
    from vlmbind.core import declared

    real_fingerprint = declared.fingerprint
    monkeypatch.setattr(declared, "fingerprint",
                        lambda name: "changed" if name == "organism-p2a" else real_fingerprint(name))
    names = [*vb.registered_names(), "tiny-undeclared"]
    monkeypatch.setattr("vlmbind.app.commands.models.registered_names", lambda: names)
    from vlmbind.app.commands.models import PROBE_SIZE, cmd_models

    template = declared.declared_rows(PROBE_SIZE)["tiny-llava"]
    built = []

    def fake_describe(name):
        built.append(name)
        return {**template, "name": name, "source": "built"}

    monkeypatch.setattr("vlmbind.app.commands.models.describe_model", fake_describe)
    summary, text, code = cmd_models(argparse.Namespace(families=None), ["vlmbind", "models"])
    assert code == 0 and built == ["organism-p2a", "tiny-undeclared"]
    rows = {r["name"]: r for r in summary["models"]}
    assert list(rows) == names and rows["organism-p2a"]["source"] == "built"
    assert rows["tiny-llava"] == template and rows["organism-direct"]["source"].startswith("shipped organism")
    assert text.count("built") == 2
    # a file for another probe size, or none, declares nothing
    assert declared.declared_rows(PROBE_SIZE + 1) == {}
    assert declared.declared_rows(PROBE_SIZE, Path("no/such/file.json")) == {}


def test_models_failing_row_is_reported_and_exits_1(monkeypatch, capsys):
    names = vb.registered_names()[:2]
    monkeypatch.setattr("vlmbind.app.commands.models.registered_names", lambda: names)
    monkeypatch.setattr("vlmbind.core.declared.declared_rows", lambda probe_size: {})  # every row built

    def fake_describe(name):
        if name == names[1]:
            raise RuntimeError("builder broke")
        return {"name": name, "display_name": "Fake", "layers": 2, "heads": 3, "kv_heads": 1,
                "grids": [{"name": "image", "image": 0, "rows": 2, "cols": 2}], "image_tokens": 4, "source": "x"}

    monkeypatch.setattr("vlmbind.app.commands.models.describe_model", fake_describe)
    assert cli.main(["models"]) == 1
    out = capsys.readouterr().out
    assert "2 x 3 (1)" in out and "image 2x2 = 4" in out
    assert f"{names[1]}  FAILED: RuntimeError: builder broke" in out


# ----------------------------------------------------------------------------------------------------------------
# exit codes and one-line errors
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["frobnicate"], ["'frobnicate'", "models", "demo"]),
        ([], ["COMMAND"]),
        (["demo", "--seed", "-1"], ["--seed", "-1"]),
        (["demo", "--seed", "abc"], ["'abc'"]),
        (["models", "--bogus"], ["--bogus"]),
        (["demo", "--model", "tiny-qwen25"], ["'tiny-qwen25'", "tiny-qwen2_5_vl"]),
        (["demo", "--model", "tiny-qwen2_5_vl", "--validate-model", "organism-p2a"],
         ["--validate-model", "'organism-p2a'", "no planted heads", "--no-validate"]),
    ],
)
def test_bad_usage_exits_2_with_one_line(argv, needles, capsys, tmp_path):
    if argv[:1] == ["demo"]:
        argv = [*argv, "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    for needle in needles:
        assert needle in line
    assert captured.out == ""
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_exits_2(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("keep me")
    assert cli.main(["demo", "--out", str(target)]) == 2
    assert str(target) in _one_error_line(capsys.readouterr().err)
    assert target.read_text() == "keep me"


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


def test_unexpected_failure_exits_1_with_one_line(monkeypatch, tmp_path, capsys):
    def broken(vlm, seed):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("vlmbind.app.commands.demo._demo_scene", broken)
    monkeypatch.delenv("VLMBIND_DEBUG", raising=False)
    assert cli.main(["demo", "--model", "tiny-qwen2_5_vl", "--out", str(tmp_path / "o")]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "RuntimeError: disk on fire" in line


def test_console_script_unknown_model_exits_2():
    script = Path(sys.executable).parent / "vlmbind"
    assert script.exists(), "the console script is not installed in this environment"
    proc = subprocess.run([str(script), "demo", "--model", "tiny-nope", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "'tiny-nope'" in _one_error_line(proc.stderr)
    assert proc.stdout == ""


# ----------------------------------------------------------------------------------------------------------------
# vlmbind demo
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One demo run shared by the tests below (module scope, so stdout is redirected rather than read by capsys)."""
    out = tmp_path_factory.mktemp("demo") / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["demo", "--model", "tiny-qwen2_5_vl", "--out", str(out), "--json", "--pairs", "2",
                         "--eval-n", "4", "--probe-n", "16"])
    return code, out, json.loads(buf.getvalue())


def test_demo_writes_every_file(demo_run):
    code, out, printed = demo_run
    assert code == 0
    assert printed["files"] == list(DEMO_FILES)
    for name in DEMO_FILES:
        assert (out / name).stat().st_size > 0, name
    # atomic writes leave no temporary files behind
    assert sorted(p.name for p in out.iterdir()) == sorted(DEMO_FILES)


def test_demo_masses_equal_output_attentions(demo_run):
    _, out, printed = demo_run
    frame = pd.read_csv(out / "attention_mass.csv")
    vlm = vb.load("tiny-qwen2_5_vl")
    n_layers, n_heads = vlm.model.config.text_config.num_hidden_layers, vlm.model.config.text_config.num_attention_heads
    assert list(frame.columns) == ["layer", "head", "mass"]
    assert len(frame) == n_layers * n_heads
    assert set(zip(frame["layer"], frame["head"])) == {(l, h) for l in range(n_layers) for h in range(n_heads)}
    assert frame["mass"].between(0.0, 1.0).all()

    scene = Image.open(out / "scene.png").convert("RGB")
    batch = vlm.prepare(scene, demo.DEMO_PROMPT)
    ids = batch.inputs["input_ids"][0]
    image_pos = torch.nonzero(ids == vlm.model.config.image_token_id).flatten()
    last = int(batch.inputs["attention_mask"][0].nonzero().max())
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, output_attentions=True, use_cache=False)
    expected = torch.stack([a[0, :, last, image_pos].sum(-1) for a in ref.attentions]).double().numpy()  # L H
    got = np.zeros((n_layers, n_heads))
    got[frame["layer"].to_numpy(), frame["head"].to_numpy()] = frame["mass"].to_numpy()
    np.testing.assert_allclose(got, expected, atol=1e-6)

    summary = json.loads((out / "summary.json").read_text())
    layer, head = np.unravel_index(int(np.argmax(expected)), expected.shape)
    assert (summary["head"]["layer"], summary["head"]["head"]) == (int(layer), int(head))
    assert summary["head"]["mass"] == pytest.approx(float(expected[layer, head]), abs=1e-6)
    probs = torch.softmax(ref.logits[0, last].double(), -1)
    assert [p["id"] for p in summary["top_predictions"]] == torch.topk(probs, demo.TOP_K).indices.tolist()
    assert [p["prob"] for p in summary["top_predictions"]] == pytest.approx(
        torch.topk(probs, demo.TOP_K).values.tolist(), abs=1e-6)
    assert summary["model"] == "tiny-qwen2_5_vl" and summary["seed"] == 0 and summary["prompt"] == demo.DEMO_PROMPT
    assert set(summary["versions"]) >= {"torch", "transformers", "vlmbind"}
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["command"].startswith("vlmbind demo --model tiny-qwen2_5_vl --out ")
    assert printed["head"] == summary["head"]


def test_demo_causal_overview(demo_run):
    _, out, printed = demo_run
    causal = printed["causal"]
    assert set(causal["located"]) == {"id_retrieval", "id_selection", "feature_retrieval"}
    assert "attention_swap" in causal["skipped"]  # a random tiny model does not point
    scores = pd.read_csv(out / "causal" / "locate" / "id_selection" / "scores.csv")
    best = scores.sort_values("score", ascending=False, kind="stable").iloc[0]
    assert causal["located"]["id_selection"]["top_heads"][0] == f"{int(best['layer'])}.{int(best['head'])}"
    assert set(causal["ablation"]) == {"scene-feature_retrieval", "scene-id_selection", "count-id_selection"}
    report = (out / "report.html").read_text()
    for heading in ("Located heads", "Where the top heads look", "Ablation: top-k", "Commands that regenerate"):
        assert heading in report, heading
    # 16 estimation scenes leave most of the 3x3 cells without an estimate: the edit is skipped, and says why
    assert "estimate" in causal["skipped"]["edit"] and "Skipped" in report
    assert html.escape(causal["skipped"]["edit"]) in report


def test_demo_opens_with_the_validation_on_the_planted_organism(demo_run):
    """The report opens with every method scored against organism-vsm's planted heads (from its training record),
    then says the rest is about the demo model, where nothing was planted."""
    _, out, printed = demo_run
    validation = printed["validation"]
    planted = shared_organism("organism-vsm").training["planted"]
    assert validation["model"] == "organism-vsm" and validation["heads"] == planted
    report = (out / "report.html").read_text()
    opening = report.index("How do I know the methods work?")
    assert opening < report.index("Provenance") < report.index("Located heads")
    saved = json.loads((out / "validation" / "validation.json").read_text())
    assert saved["methods"] == validation["methods"]
    for row in validation["methods"]:
        if row["heads"]:
            assert " ".join(map(str, row["planted_ranks"])) in report
    # the random arm from the top heads' own layers (the edit needs more estimation scenes than this run has)
    assert "random_same_layers" in report and all("random_same_layers" in arms
                                                  for arms in validation["ablation"].values())


def test_demo_representational_overview(demo_run):
    _, out, printed = demo_run
    reps = printed["representations"]
    rsa = pd.read_csv(out / "representations" / "rsa" / "rsa.csv")
    lm = rsa[(rsa["component"] == "lm") & (rsa["model_matrix"] == "compositional")].sort_values("layer")
    assert reps["rsa_lm"]["compositional"] == pytest.approx(lm["r"].tolist())
    probe = pd.read_csv(out / "representations" / "probe" / "probe.csv")
    assert len(probe) == 3 and set(probe["family"]) == {"linear"}
    report = (out / "report.html").read_text()
    for heading in ("RSA by layer", "Binding information"):
        assert heading in report, heading
    # a random tiny model does not point, so tracking is skipped, and says why
    assert "track" in reps["skipped"] or "Attention-centroid tracking" in report


def test_demo_report_is_offline_with_every_figure(demo_run):
    _, out, printed = demo_run
    report = (out / "report.html").read_text()
    assert 'id="vlmbind-heatmap"' in report and 'id="vlmbind-overlay"' in report
    # attention mass + overlay, one heatmap per located condition, the edit curve unless it was skipped, RSA, the
    # tracking curve, the lens's decodable shares and the relevancy curves unless each was skipped
    reps = printed["representations"]
    figures = (2 + len(printed["causal"]["located"]) + ("edit" in printed["causal"]) + 1 + ("track" in reps)
               + ("lens" in reps) + ("relevancy" in reps) + 1)
    assert "lens" in reps and "relevancy" in reps  # tiny-qwen2_5_vl runs both
    assert report.count("Plotly.newPlot") == figures  # the last 1: the validation figure the page opens with
    # plotly.js once for the whole folder: the report and every figure below it load out/plotly.min.js
    bundle = out / "plotly.min.js"
    assert re.search(r"\* plotly\.js v\d", bundle.read_text()[:2000])
    assert SCRIPT_SRC.findall(report) and re.findall(r'<script[^>]*src="([^"]+)"', report) == ["plotly.min.js"]
    pages = list(out.rglob("*.html"))
    assert len(pages) >= 8 and list(out.rglob("plotly.min.js")) == [bundle]
    for page in pages:
        srcs = re.findall(r'<script[^>]*src="([^"]+)"', page.read_text())
        assert len(srcs) == 1 and (page.parent / srcs[0]).resolve() == bundle.resolve(), page
        assert "* plotly.js v" not in page.read_text(), page  # not embedded again
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size < 10e6, f"{out} holds {size / 1e6:.1f} MB"
    # the first screen states what was found, from the numbers
    head = report.split("<h2>", 3)
    assert "What was found" in head[1] and "Validation on organism-vsm" in report.split("</section>")[0]
    assert "95%" in report.split("</section>")[0]
    assert re.search(r"data:image(/|\\u002f)png;base64,", report)  # the overlay's image is in the page (plotly escapes /)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"]["transformers"] in report
    assert f"L{summary['head']['layer']}.H{summary['head']['head']}" in report
    for name in ("heatmap.html", "overlay.html"):
        page = (out / name).read_text()
        assert page.count("Plotly.newPlot") == 1, name


def test_demo_is_deterministic_and_prints_a_summary(demo_run, tmp_path, capsys):
    _, out, _ = demo_run
    again = tmp_path / "again"
    assert cli.main(["demo", "--model", "tiny-qwen2_5_vl", "--out", str(again), "--pairs", "2", "--eval-n", "4",
                     "--probe-n", "16"]) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert f"L{summary['head']['layer']}.H{summary['head']['head']}" in text
    assert str(again / "report.html") in text
    for name in ("attention_mass.csv", "scene.png", "heatmap.html", "overlay.html"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    other = json.loads((again / "summary.json").read_text())
    for s in (other, summary):  # wall times differ between runs; everything else must not
        s.pop("command"), s["causal"].pop("seconds"), s["representations"].pop("seconds")
        s["validation"].pop("seconds")
        for row in s["validation"]["methods"]:
            row.pop("seconds")
        for check in s["validation"]["naive_check"].values():
            check.pop("seconds")
        for row in s["validation"]["edges"]:
            row.pop("seconds"), row.get("faithfulness", {}).pop("seconds", None)
        for row in s["validation_steering"]:
            row.pop("seconds")
    assert any("faithfulness" in row for row in summary["validation"]["edges"])
    assert [r["heads"] for r in summary["validation_steering"]] == [["2.3"], ["3.1"], ["5.2"]]
    assert other == summary


def test_scene_is_deterministic_and_draws_what_it_reports():
    image, objects = demo._draw_scene(3)
    image_again, _ = demo._draw_scene(3)
    assert image.tobytes() == image_again.tobytes()
    assert any(demo._draw_scene(s)[0].tobytes() != image.tobytes() for s in (4, 5, 6))
    assert [(o["colour"], o["shape"]) for o in objects[:2]] == [("red", "square"), ("blue", "circle")]
    pixels = np.asarray(image)
    boxes = [o["box"] for o in objects]
    for o in objects:
        x0, y0, x1, y1 = o["box"]
        centre = pixels[(y0 + y1) // 2 + (y1 - y0) // 4, (x0 + x1) // 2]  # below the centre: inside triangles too
        assert tuple(centre) == demo._SCENE_RGB[o["colour"]], o
    for i in range(3):
        for j in range(i + 1, 3):
            a, b = boxes[i], boxes[j]
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)


# ----------------------------------------------------------------------------------------------------------------
# figures
# ----------------------------------------------------------------------------------------------------------------
def _frame(values):
    values = np.asarray(values, dtype=float)
    return pd.DataFrame([(l, h, values[l, h]) for l in range(values.shape[0]) for h in range(values.shape[1])],
                        columns=["layer", "head", "mass"])


def test_head_heatmap_axes_hover_and_scales():
    values = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 1 / 3]])
    fig = head_heatmap(_frame(values), "mass", title="Mass", model="tiny-x", n=7)
    trace = fig.data[0]
    assert fig.layout.xaxis.title.text == "head" and fig.layout.yaxis.title.text == "layer"
    np.testing.assert_array_equal(np.asarray(trace.z, dtype=float), values)
    assert trace.text[1][2] == repr(1 / 3)  # exact value on hover
    assert "Mass" in fig.layout.title.text and "tiny-x" in fig.layout.title.text and "n=7" in fig.layout.title.text
    assert trace.zmid is None and trace.colorscale[0][1] != trace.colorscale[-1][1]
    sequential = [c[1] for c in trace.colorscale]

    signed = head_heatmap(_frame(values - 0.3), "mass", title="Effect")
    assert signed.data[0].zmid == 0.0
    assert [c[1] for c in signed.data[0].colorscale] != sequential


def test_head_heatmap_rejects_bad_frames():
    with pytest.raises(InputError, match="effect"):
        head_heatmap(_frame(np.ones((2, 2))), "effect")
    dup = pd.concat([_frame(np.ones((1, 2)))] * 2)
    with pytest.raises(InputError, match=r"\(0, 0\)"):
        head_heatmap(dup)


def test_attention_overlay_cells_and_shapes():
    image = Image.new("RGB", (40, 20), "white")
    positions = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    boxes = np.array([[[c * 10, r * 10, c * 10 + 10, r * 10 + 10] for c in range(4)] for r in range(2)], float)
    weights = np.array([[0.0, 0.1, 0.2, 0.3], [0.05, 0.0, 0.0, 0.35]])
    fig = attention_overlay(image, positions, boxes, weights, "t")
    assert len(fig.layout.shapes) == 8
    # nothing is filled, so the image keeps its colours; the heaviest cell has the widest outline and is drawn last
    assert {s.fillcolor for s in fig.layout.shapes} == {"rgba(0,0,0,0)"}
    widths = [s.line.width for s in fig.layout.shapes]
    assert widths == sorted(widths) and widths[-1] == 5.0 and widths[0] == 0.5
    heaviest = fig.layout.shapes[-1]  # cell (1, 3), box (30, 10, 40, 20), inset by 6% of its side
    assert (heaviest.x0, heaviest.y0, heaviest.x1, heaviest.y1) == pytest.approx((30.6, 10.6, 39.4, 19.4))
    custom = fig.data[0].customdata
    assert custom[7][1] == 12 and custom[7][2] == repr(0.35)
    assert fig.layout.images[0].source.startswith("data:image/png;base64,")
    assert list(fig.layout.yaxis.range) == [20, 0]  # y down, as in the image
    with pytest.raises(InputError, match="do not agree"):
        attention_overlay(image, positions, boxes[:1], weights, "t")


def test_write_html_atomic_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "fig.html"
    fig = head_heatmap(_frame(np.ones((1, 1))))
    write_html_atomic(fig, path)
    first = path.read_bytes()
    assert b"<html>" in first and b'id="vlmbind-fig"' in first
    write_html_atomic(fig, path)
    assert path.read_bytes() == first  # same figure, same bytes

    def boom(src, dst):
        raise OSError("no space left")

    monkeypatch.setattr("vlmbind.viz.figures.os.replace", boom)
    with pytest.raises(OSError, match="no space"):
        write_text_atomic("partial", path)
    assert path.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.html", "plotly.min.js"]  # no temporary file left


def test_pages_share_one_plotlyjs_per_results_folder(tmp_path):
    """A page loads plotly.js from beside it, or from the root of an active shared_plotlyjs; the bundle is the
    installed plotly's, written once and rewritten only when it differs."""
    from plotly.offline import get_plotlyjs

    from vlmbind.viz import shared_plotlyjs

    fig = head_heatmap(_frame(np.ones((1, 1))))
    alone = write_html_atomic(fig, tmp_path / "alone" / "fig.html")
    assert '<script charset="utf-8" src="plotly.min.js"></script>' in alone.read_text()
    assert (tmp_path / "alone" / "plotly.min.js").read_text() == get_plotlyjs()
    root = tmp_path / "run"
    with shared_plotlyjs(root):
        deep = write_html_atomic(fig, root / "a" / "b" / "fig.html")
        top = write_html_atomic(fig, root / "fig.html")
        outside = write_html_atomic(fig, tmp_path / "elsewhere" / "fig.html")
    assert 'src="../../plotly.min.js"' in deep.read_text() and 'src="plotly.min.js"' in top.read_text()
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("plotly.min.js")) == ["plotly.min.js"]
    assert (outside.parent / "plotly.min.js").is_file()  # a page outside the root keeps its own copy
    bundle = root / "plotly.min.js"
    stamp = bundle.stat().st_mtime_ns
    with shared_plotlyjs(root):
        write_html_atomic(fig, root / "c" / "fig.html")
    assert bundle.stat().st_mtime_ns == stamp  # identical bundle: not rewritten
    bundle.write_text("stale")
    write_html_atomic(fig, root / "fig.html")
    assert bundle.read_text() == get_plotlyjs()  # a stale copy is replaced
    embedded = write_html_atomic(fig, tmp_path / "emb" / "fig.html", include_plotlyjs=True)
    assert not (embedded.parent / "plotly.min.js").exists() and "* plotly.js v" in embedded.read_text()


def test_conditions_side_by_side_share_one_colour_scale():
    from vlmbind.viz.figures import share_colour_scale

    small = head_heatmap(_frame(np.array([[0.0005, -0.0002], [0.0001, 0.0]])), "mass", signed=True)
    large = head_heatmap(_frame(np.array([[15.6, -1.0], [0.5, 0.0]])), "mass", signed=True)
    assert share_colour_scale([small, large]) == 15.6
    for fig in (small, large):
        assert (fig.data[0].zmin, fig.data[0].zmax, fig.data[0].zmid) == (-15.6, 15.6, 0.0)
        assert "+-15.6" in fig.layout.title.text
    assert small.data[0].text[0][0] == repr(0.0005)  # hover keeps the exact value


def test_scores_of_another_model_are_used_only_when_asked(tmp_path, capsys):
    """ablate reads the model a scores table was located on from the summary.json beside it: the same model passes,
    another one is refused (tests/app/test_bad_input.py) unless --scores-from-any-model, and a table without a
    summary (made by hand) is taken as it is."""
    rows = "layer,head,score\n" + "".join(f"{l},{h},{4 * l + h}\n" for l in range(4) for h in range(4))
    for folder, model in (("same", "tiny-qwen2_5_vl"), ("other", "organism-p2a"), ("hand", None)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "scores.csv").write_text(rows)
        if model:
            (tmp_path / folder / "summary.json").write_text(json.dumps({"model": model}))
    base = ["ablate", "--model", "tiny-qwen2_5_vl", "--task", "scene", "--n", "2", "--top-k", "1", "--seeds", "1",
            "--json"]
    for folder, extra in (("same", []), ("other", ["--scores-from-any-model"]), ("hand", [])):
        code = cli.main([*base, "--scores", str(tmp_path / folder / "scores.csv"), *extra,
                         "--out", str(tmp_path / f"run-{folder}")])
        assert code == 0, (folder, capsys.readouterr().err)
        arms = {a["arm"]: a for a in json.loads(capsys.readouterr().out)["arms"]}
        assert arms["top"]["heads"] == ["3.3"], folder
    assert cli.main([*base, "--scores", str(tmp_path / "other" / "scores.csv"), "--out", str(tmp_path / "x")]) == 2
    assert "located on organism-p2a" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_resume_on_a_finished_locate_with_other_arguments_is_refused(tmp_path, capsys):
    """--resume over a finished run has nothing to resume: with other arguments it exits 2 naming each difference
    and leaves the run as it was; with the same arguments it runs again to the same scores."""
    out = tmp_path / "run"
    argv = ["locate", "--model", "tiny-qwen2_5_vl", "--condition", "id_selection", "--n-pairs", "3", "--out", str(out),
            "--json"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    before = (out / "scores.csv").read_bytes()
    assert cli.main([*argv[:6], "2", *argv[7:], "--method", "naive", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--n-pairs 3 (this command: 2)" in err and "--method exact (this command: naive)" in err
    assert len(err.strip().splitlines()) == 1 and (out / "scores.csv").read_bytes() == before
    assert cli.main([*argv, "--resume"]) == 0
    assert (out / "scores.csv").read_bytes() == before


def test_default_output_folders_tell_runs_apart(tmp_path, monkeypatch, capsys):
    """Two ablate runs that differ in mode (or k) write two default folders, never one over the other."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scores.csv").write_text(
        "layer,head,score\n" + "".join(f"{l},{h},{4 * l + h}\n" for l in range(4) for h in range(4)))
    base = ["ablate", "--model", "tiny-qwen2_5_vl", "--task", "scene", "--n", "2", "--seeds", "1", "--json"]
    for extra in (["--mode", "zero", "--top-k", "1"], ["--mode", "mean", "--top-k", "1"],
                  ["--mode", "zero", "--top-k", "2"]):
        assert cli.main([*base, "--scores", "scores.csv", *extra]) == 0
    assert cli.main([*base, "--heads", "0.0", "--mode", "zero"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "runs" / "ablate").iterdir()) == [
        "tiny-qwen2_5_vl-scene-mean-top1", "tiny-qwen2_5_vl-scene-zero-heads", "tiny-qwen2_5_vl-scene-zero-top1",
        "tiny-qwen2_5_vl-scene-zero-top2"]


@pytest.mark.parametrize("condition, mode", [("id_selection", "zero"), ("id_retrieval", "zero"),
                                             ("feature_retrieval", "image_attention"), (None, "image_attention")])
def test_ablate_chooses_a_mode_that_can_remove_the_located_heads(tmp_path, monkeypatch, capsys, condition, mode):
    """Heads located on a condition where they act at text positions are ablated with zero by default (removing
    their attention to the image would leave them working); otherwise, and for a table without a summary, the
    default is image_attention. Asking for image_attention on such heads says in one line why it cannot work."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scores.csv").write_text(
        "layer,head,score\n" + "".join(f"{l},{h},{4 * l + h}\n" for l in range(4) for h in range(4)))
    if condition:
        (tmp_path / "summary.json").write_text(json.dumps({"model": "tiny-qwen2_5_vl", "condition": condition}))
    base = ["ablate", "--model", "tiny-qwen2_5_vl", "--task", "scene", "--scores", "scores.csv", "--n", "2",
            "--top-k", "1", "--seeds", "1"]
    assert cli.main([*base, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["mode"] == mode and summary.get("scores_condition") == condition
    assert (tmp_path / "runs" / "ablate" / f"tiny-qwen2_5_vl-scene-{mode}-top1").is_dir()
    assert cli.main([*base, "--mode", "image_attention", "--out", "explicit"]) == 0
    noted = "cannot remove them" in capsys.readouterr().out
    assert noted == (condition in ("id_selection", "id_retrieval"))


def test_ablate_reports_random_arms_from_outside_the_top_k_and_from_its_layers(tmp_path, capsys):
    """By default ablate draws random-k twice on the same seeds: from the heads outside the top-k (``random``) and,
    per top-k head, another head of its layer (``random_same_layers``), each printed with its mean and interval;
    ``--random-from all`` runs the one arm; an unknown pool is refused naming --random-from. Where a layer holds too
    many top-k heads, the default leaves the same-layer arm out with a note, and asking for it is refused."""
    base = ["ablate", "--model", "organism-vsm", "--task", "scene", "--n", "32", "--seeds", "2"]
    assert cli.main([*base, "--heads", "2.3,3.1", "--out", str(tmp_path / "both")]) == 0
    text = capsys.readouterr().out
    results = json.loads((tmp_path / "both" / "results.json").read_text())
    arms = results["arms"]
    assert [a["arm"] for a in arms] == ["clean", "top", "random", "random", "random_same_layers",
                                        "random_same_layers", "bottom"]
    top = {"2.3", "3.1"}
    assert [a["heads"] for a in arms if a["arm"] == "top"] == [["2.3", "3.1"]]
    for a in arms:
        if a["arm"] == "random":
            assert len(a["heads"]) == 2 and not set(a["heads"]) & top, a
        if a["arm"] == "random_same_layers":
            assert [h.split(".")[0] for h in a["heads"]] == ["2", "3"] and not set(a["heads"]) & top, a
    for arm in ("random", "random_same_layers"):
        iv = results["intervals"][arm]
        assert iv["seeds"] == 2 and results["accuracy"][arm] == iv["accuracy"]
        assert iv["accuracy"] == np.mean([a["accuracy"] for a in arms if a["arm"] == arm])
        assert f"{arm} {iv['accuracy']:.3f} [{iv['low']:.2f}, {iv['high']:.2f}] over 2 seeds" in text
    assert "random-k (outside the top-k): seed 0" in text and "random_same_layers (from the top-k's layers)" in text

    assert cli.main([*base, "--heads", "2.3,3.1", "--random-from", "all", "--out", str(tmp_path / "all")]) == 0
    capsys.readouterr()
    alone = json.loads((tmp_path / "all" / "results.json").read_text())
    assert alone["random_from"] == "all"
    assert [a["arm"] for a in alone["arms"]] == ["clean", "top", "random", "random", "bottom"]

    assert cli.main([*base, "--heads", "2.3,3.1", "--random-from", "rest,layers", "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--random-from 'rest,layers': unknown pool 'layers'" in line and "rest, same_layers" in line
    assert not (tmp_path / "x").exists()

    # three top heads in one four-head layer leave too few of its heads to match them
    crowded = [*base[:-4], "--n", "4", "--seeds", "1", "--heads", "2.0,2.1,2.2"]
    assert cli.main([*crowded, "--out", str(tmp_path / "crowded")]) == 0
    text = capsys.readouterr().out
    assert "note: no random arm from the top-k's layers: layer 2 has too few heads" in text
    assert {a["arm"] for a in json.loads((tmp_path / "crowded" / "results.json").read_text())["arms"]} == {
        "clean", "top", "random", "bottom"}
    assert cli.main([*crowded, "--random-from", "rest,same_layers", "--out", str(tmp_path / "y")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--random-from same_layers" in line and "layer 2" in line and "drop same_layers" in line
    assert not (tmp_path / "y").exists()


def test_demo_on_a_hybrid_model_tables_its_softmax_layers_only(tmp_path):
    """Qwen3.5's linear-attention layers have no attention pattern: the demo's attention table holds the softmax
    layers, and the head it draws is one of them."""
    import pandas as pd
    from helpers import get_tiny

    out = tmp_path / "demo"
    assert cli.main(["demo", "--model", "tiny-qwen3_5", "--no-validate", "--no-causal", "--no-representations",
                     "--out", str(out)]) == 0
    frame = pd.read_csv(out / "attention_mass.csv")
    hybrid = get_tiny("tiny-qwen3_5")
    softmax = hybrid.adapter.pattern_layers()
    assert sorted(set(frame["layer"])) == sorted(softmax) and len(softmax) < hybrid.n_layers
    summary = json.loads((out / "summary.json").read_text())
    assert summary["head"]["layer"] in softmax
