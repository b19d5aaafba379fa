"""``vlmbind export``: figures and tables rebuilt from saved results equal the originals; bad input exits 2."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from vlmbind import cli
from vlmbind.app.export import MANIFEST, export_results, safe_target
from vlmbind.core.errors import InputError
from vlmbind.viz import shared_plotlyjs

MODEL = "organism-p2a"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A small demo (locate, ablate, rsa, track, probe folders inside), an edit run with repair, an eval run and one
    run of circuit, steer, lens, relevancy and benchmark each."""
    base = tmp_path_factory.mktemp("export")
    demo, edit, evaluation = base / "demo", base / "edit", base / "eval"
    assert cli.main(["demo", "--model", MODEL, "--out", str(demo), "--pairs", "2", "--eval-n", "8",
                     "--probe-n", "32"]) == 0
    assert cli.main(["edit", "--model", MODEL, "--heads", "2.1", "--alpha", "0,1", "--n-estimate", "256",
                     "--n-eval", "8", "--repair", "--out", str(edit)]) == 0
    assert cli.main(["eval", "--model", MODEL, "--task", "scene", "--n", "6", "--out", str(evaluation)]) == 0
    circuit = base / "circuit"
    assert cli.main(["circuit", "--model", MODEL, "--condition", "id_selection", "--n-pairs", "2", "--heads",
                     "0.1,1.2,2.1", "--out", str(circuit)]) == 0
    steer = base / "steer"
    assert cli.main(["steer", "--model", MODEL, "--heads", "2.1", "--n", "4", "--random-draws", "1", "--out",
                     str(steer)]) == 0
    lens = base / "lens"
    assert cli.main(["lens", "--model", MODEL, "--n", "2", "--layers", "0,1", "--out", str(lens)]) == 0
    relevancy = base / "relevancy"
    assert cli.main(["relevancy", "--model", MODEL, "--n", "2", "--fractions", "1", "--random-maps", "1",
                     "--out", str(relevancy)]) == 0
    bench = base / "benchmark"
    assert cli.main(["benchmark", "--organisms", "organism-vsm", "--n-pairs", "1", "--n-eval", "2",
                     "--ablation-seeds", "1", "--n-estimate", "16", "--n-probe", "16", "--edge-pairs", "0",
                     "--methods", "exact", "--modes", "zero", "--out", str(bench)]) == 0
    return {"demo": demo, "edit": edit, "eval": evaluation, "circuit": circuit, "steer": steer, "lens": lens,
            "relevancy": relevancy, "benchmark": bench}


def _figure_json(html: str) -> list:
    """The ``data`` argument of ``Plotly.newPlot`` in a plotly HTML page."""
    match = re.search(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*\{', html, re.S)
    assert match, "no Plotly.newPlot call in the page"
    return json.loads(match.group(1))


def _array(value) -> np.ndarray:
    """A plotly JSON array: a plain list, or plotly's typed-array dict (``dtype``, base64 ``bdata``, ``shape``)."""
    if isinstance(value, dict):
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        shape = value.get("shape")
        return flat.reshape([int(v) for v in str(shape).split(",")] if shape else -1).astype(float)
    return np.array(value, dtype=float)


def _files(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


def test_html_export_recurses_and_equals_the_originals(runs, tmp_path):
    out = tmp_path / "html"
    report = export_results(runs["demo"], "html", out)
    kinds = {r["dir"]: r["kind"] for r in report.results}
    assert kinds["."] == "demo" and kinds["causal/locate/id_selection"] == "locate"
    assert {"ablate", "rsa", "track", "probe"} <= set(kinds.values())
    for rel in ("heatmap.html", "causal/locate/id_selection/heatmap.html", "representations/rsa/rsa.html",
                "representations/track/rmse.html", "representations/probe/probe.html"):
        # same builder, same numbers, same div id: the re-rendered page is the original byte for byte
        assert (out / rel).read_bytes() == (runs["demo"] / rel).read_bytes(), rel
    assert (out / "causal/ablation/scene-id_selection/ablation.html").stat().st_size > 0
    assert _files(out) == {*report.files, MANIFEST}


def test_heatmap_z_equals_the_scores_pivot(runs, tmp_path):
    export_results(runs["demo"], "html", tmp_path)
    folder = "causal/locate/id_retrieval"
    trace = _figure_json((tmp_path / folder / "heatmap.html").read_text())[0]
    scores = pd.read_csv(runs["demo"] / folder / "scores.csv", float_precision="round_trip")
    pivot = scores.pivot(index="layer", columns="head", values="score").to_numpy()
    assert trace["type"] == "heatmap"
    np.testing.assert_array_equal(_array(trace["z"]), pivot)
    assert trace["text"][0][0] == repr(float(pivot[0, 0]))  # exact values on hover
    if (pivot < 0).any():  # signed scores: diverging scale centred at zero
        assert trace["zmid"] == 0


def test_edit_export_rebuilds_the_curve_and_flattens_rows(runs, tmp_path):
    export_results(runs["edit"], "html", tmp_path / "h")
    assert (tmp_path / "h/curve.html").read_bytes() == (runs["edit"] / "curve.html").read_bytes()
    export_results(runs["edit"], "csv", tmp_path / "c")
    saved = json.loads((runs["edit"] / "results.json").read_text())
    rows = pd.read_csv(tmp_path / "c/rows.csv")
    assert rows["efficacy"].tolist() == [r["efficacy"] for r in saved["rows"]]
    repair = pd.read_csv(tmp_path / "c/repair_rows.csv")
    assert repair["accuracy"].tolist() == [r["accuracy"] for r in saved["repair"]["rows"]]


def test_csv_export_copies_tables_and_flattens_ablation_arms(runs):
    report = export_results(runs["demo"], "csv")  # default out: RESULT_DIR/export
    out = runs["demo"] / "export"
    assert Path(report.out) == out
    for rel in ("attention_mass.csv", "causal/locate/id_selection/scores.csv", "representations/rsa/rsa.csv",
                "representations/track/rmse.csv", "representations/probe/probe.csv", "causal/object_attention.csv"):
        assert (out / rel).read_bytes() == (runs["demo"] / rel).read_bytes(), rel
    folder = "causal/ablation/scene-id_selection"
    arms = pd.read_csv(out / folder / "arms.csv")
    saved = json.loads((runs["demo"] / folder / "results.json").read_text())
    assert arms["arm"].tolist() == [a["arm"] for a in saved["arms"]]
    assert arms["accuracy"].tolist() == [a["accuracy"] for a in saved["arms"]]
    assert arms["heads"].fillna("").tolist() == [" ".join(a["heads"]) for a in saved["arms"]]
    # a second export does not mistake the first one's tables for results
    again = export_results(runs["demo"], "csv")
    assert not any(r["dir"].startswith("export") for r in again.results)
    with pytest.raises(InputError, match="output of vlmbind export"):
        export_results(out, "csv", runs["demo"].parent / "x")


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_image_export(runs, tmp_path, fmt):
    report = export_results(runs["demo"] / "causal/locate/id_selection", fmt, tmp_path)
    data = (tmp_path / f"heatmap.{fmt}").read_bytes()
    assert report.files == [f"heatmap.{fmt}"] and len(data) > 1000
    if fmt == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        import xml.etree.ElementTree as ET

        assert ET.fromstring(data).tag == "{http://www.w3.org/2000/svg}svg"


def test_safe_target_refuses_escaping_paths(tmp_path):
    assert safe_target(tmp_path, "a/b.csv") == (tmp_path / "a/b.csv").resolve()
    for bad in ("../evil.csv", "a/../../evil.csv", "/etc/evil.csv", "."):
        with pytest.raises(InputError):
            safe_target(tmp_path, bad)
    (tmp_path / "link").symlink_to(tmp_path.parent)
    with pytest.raises(InputError, match="outside the output directory"):
        safe_target(tmp_path, "link/evil.csv")


def test_bad_inputs_raise_and_leave_nothing(runs, tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        export_results(tmp_path / "missing", "html")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no vlmbind results"):
        export_results(tmp_path / "empty", "html")
    assert not (tmp_path / "empty/export").exists()
    with pytest.raises(InputError, match="unknown export format"):
        export_results(runs["edit"], "jpg", tmp_path / "o")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError, match="cannot write"):
        export_results(runs["edit"], "csv", blocker / "sub")
    # a malformed result file is refused before anything is written
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "scores.csv").write_text("layer,head\n0,0\n")
    (broken / "summary.json").write_text("{}")
    with pytest.raises(InputError, match="no column"):
        export_results(broken, "html", tmp_path / "o2")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def test_cli_exit_codes(runs, tmp_path, capsys):
    assert cli.main(["export", str(runs["edit"]), "--format", "csv", "--out", str(tmp_path / "ok"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["results"] == [{"dir": ".", "kind": "edit"}] and "rows.csv" in summary["files"]
    for argv in (["export", str(tmp_path / "nope")], ["export", str(runs["edit"]), "--format", "gif"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("vlmbind: error:") and err.count("\n") == 1


def test_signed_scores_always_get_a_diverging_scale_centred_at_zero():
    import pandas as pd

    from vlmbind.analysis import HeadScores
    from vlmbind.viz import head_heatmap

    positive = np.abs(np.random.default_rng(0).normal(size=(2, 3, 4))) + 0.1
    fig = HeadScores("feature_retrieval", "exact", "m", positive).figure()
    assert fig.data[0].zmid == 0.0
    masses = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "mass": [0.2, 0.7]})
    assert head_heatmap(masses, "mass").data[0].zmid is None  # a mass is not signed: sequential


# ----------------------------------------------------------------------------------------------------------------
# the result contract (vlmbind.core.results): every kind loads back what it saved
# ----------------------------------------------------------------------------------------------------------------
def test_every_kind_is_registered_with_the_contract():
    from vlmbind.core.results import RESULTS, Result

    for kind, cls in RESULTS.items():
        assert isinstance(cls.reproduced_files, tuple), kind
        assert issubclass(cls, Result) and cls.kind == kind
        for method in ("to_frame", "figure", "save", "load", "matches", "exports"):
            assert callable(getattr(cls, method)), (kind, method)
        assert cls.load is not Result.load and cls.save is not Result.save, kind


def test_saved_results_load_back_and_save_the_same_files(runs, tmp_path):
    from vlmbind.core.results import RESULTS, detect, load_result

    seen = set()
    for name, root in runs.items():
        exports = [m.parent for m in root.rglob(MANIFEST)]  # what other tests exported here: not results
        for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            if any(folder == e or e in folder.parents for e in exports):
                continue
            cls = detect(folder)
            if cls is None:
                continue
            result = load_result(folder)
            assert type(result) is cls and isinstance(result.to_frame(), pd.DataFrame)
            again = tmp_path / name / folder.relative_to(root)
            with shared_plotlyjs(tmp_path / name):  # the same place for plotly.js as the run's own pages
                result.save(again)
            for file in cls.reproduced_files:
                assert (again / file).read_bytes() == (folder / file).read_bytes(), (folder, file)
            seen.add(cls.kind)
    # every kind that names its reproduced files is among the runs (same_object round-trips in
    # tests/analysis/test_same_object.py: the demo writes none)
    assert seen == {kind for kind, cls in RESULTS.items() if cls.reproduced_files}


def test_loaded_scores_keep_means_stderr_and_ranking(runs):
    from vlmbind.analysis import HeadScores

    folder = runs["demo"] / "causal/locate/id_selection"
    loaded = HeadScores.load(folder)
    frame = pd.read_csv(folder / "scores.csv", float_precision="round_trip")
    assert loaded.per_pair is None and loaded.n == int(frame["n"].iloc[0])
    np.testing.assert_array_equal(loaded.scores, frame.pivot(index="layer", columns="head", values="score"))
    np.testing.assert_array_equal(loaded.stderr, frame.pivot(index="layer", columns="head", values="stderr"))
    summary = json.loads((folder / "summary.json").read_text())
    assert [f"{l}.{h}" for l, h in loaded.top(10)] == summary["top_heads"]


def test_a_folder_with_two_results_or_none_is_named(tmp_path, runs):
    import shutil

    from vlmbind.core.results import detect, load_result

    both = tmp_path / "both"
    shutil.copytree(runs["demo"] / "causal/locate/id_selection", both)
    shutil.copy(runs["demo"] / "representations/rsa/rsa.csv", both / "rsa.csv")
    with pytest.raises(InputError, match="several results.*locate.*rsa|several results.*rsa.*locate"):
        detect(both)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no vlmbind result"):
        load_result(tmp_path / "empty")


def test_image_export_size_scale_and_pdf(runs, tmp_path):
    """PNG at twice the figure's size by default; --width/--height/--scale set the page; PDF is a PDF."""
    folder = runs["demo"] / "causal/locate/id_selection"
    export_results(folder, "png", tmp_path / "d")
    export_results(folder, "png", tmp_path / "w", width=900, height=500, scale=1)
    export_results(folder, "pdf", tmp_path / "p")
    default, sized = (Image.open(tmp_path / d / "heatmap.png").size for d in ("d", "w"))
    assert sized == (900, 500)
    assert default[0] % 2 == 0 and default[0] >= 1000  # scale 2 of the figure's own width (500 px or more)
    assert (tmp_path / "p" / "heatmap.pdf").read_bytes()[:5] == b"%PDF-"
    for bad in (dict(width=3), dict(scale=0), dict(scale=True)):
        with pytest.raises(InputError):
            export_results(folder, "png", tmp_path / "bad", **bad)
    with pytest.raises(InputError, match="apply to png, svg and pdf"):
        export_results(folder, "html", tmp_path / "bad", scale=2)
    assert not (tmp_path / "bad").exists()
    assert cli.main(["export", str(folder), "--format", "png", "--width", "700", "--height", "400", "--scale", "1",
                     "--out", str(tmp_path / "c")]) == 0
    assert Image.open(tmp_path / "c" / "heatmap.png").size == (700, 400)


def test_html_export_writes_plotlyjs_once(runs, tmp_path):
    report = export_results(runs["demo"], "html", tmp_path / "h")
    bundles = list((tmp_path / "h").rglob("plotly.min.js"))
    assert bundles == [tmp_path / "h" / "plotly.min.js"] and "plotly.min.js" in report.files
    for page in (tmp_path / "h").rglob("*.html"):
        src = re.findall(r'<script[^>]*src="([^"]+)"', page.read_text())
        assert len(src) == 1 and (page.parent / src[0]).resolve() == bundles[0].resolve(), page


def test_default_export_folder_is_never_in_a_source_tree(runs, tmp_path):
    """Results that git tracks (a repository's shipped results) export to runs/export/<path> at the top of the work
    tree; untracked results export next to themselves."""
    import shutil
    import subprocess

    from vlmbind.app.export import default_export_dir

    repo = tmp_path / "repo"
    shipped = repo / "circuits" / "x" / "results"
    shutil.copytree(runs["edit"], shipped)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "results"], check=True)
    assert default_export_dir(shipped) == repo / "runs" / "export" / "circuits" / "x" / "results"
    report = export_results(shipped, "csv")
    assert Path(report.out) == repo / "runs" / "export" / "circuits" / "x" / "results"
    assert not (shipped / "export").exists()
    untracked = repo / "scratch"
    shutil.copytree(runs["edit"], untracked)
    assert default_export_dir(untracked) == untracked / "export"
    assert default_export_dir(runs["edit"]) == runs["edit"] / "export"  # not in any work tree
