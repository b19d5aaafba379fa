"""``vlmbind relevancy``: its files, the result's save / load round trip, export, and exit 2 on bad input."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from vlmbind import cli
from vlmbind.app.export import export_results
from vlmbind.core.results import detect, load_result
from vlmbind.viz import shared_plotlyjs

MODEL = "organism-p2a"
FILES = {"maps.csv", "curves.csv", "knockout.csv", "method_scores.csv", "relevancy.json", "summary.json",
         "relevancy.html", "curves.html", "images/example-0.png"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("relevancy") / "run"
    assert cli.main(["relevancy", "--model", MODEL, "--n", "4", "--fractions", "2", "--random-maps", "1",
                     "--batch-size", "32",
                     "--out", str(out), "--json"]) == 0
    return out


def test_the_command_writes_its_files_and_scores(run):
    assert FILES <= {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["n_examples"] == 4 and summary["target"] == "answer" and summary["task"] == "query"
    assert summary["better"] == {"deletion_auc": "lower is better", "insertion_auc": "higher is better"}
    scores = pd.read_csv(run / "method_scores.csv")
    assert scores["method"].tolist() == ["gradient_attention", "rollout", "input_x_gradient", "random"]
    assert (scores["n"] == 4).all()
    for kind in ("deletion", "insertion"):
        own = scores[scores["method"] != "random"]
        assert ((own[f"{kind}_vs_random_lo"] <= own[f"{kind}_vs_random"])
                & (own[f"{kind}_vs_random"] <= own[f"{kind}_vs_random_hi"])).all()
    # the organism answers from the queried object: rollout's deletion order beats the random ones by a wide margin
    # at this size (deterministic: seeded stimuli and random orders)
    assert scores.set_index("method").loc["rollout", "deletion_vs_random"] < 0
    maps = pd.read_csv(run / "maps.csv", keep_default_na=False)
    assert list(maps.columns) == ["example", "method", "position", "role", "row", "col", "token", "value"]
    assert set(maps["role"]) >= {"image", "text"} and (maps.loc[maps["role"] != "image", "row"] == -1).all()
    curves = pd.read_csv(run / "curves.csv")
    assert set(curves["kind"]) == {"deletion", "insertion"} and curves["fraction"].max() == 1.0


def test_the_result_loads_back_and_saves_the_same_files(run, tmp_path):
    cls = detect(run)
    assert cls is not None and cls.kind == "relevancy"
    result = load_result(run)
    assert isinstance(result.to_frame(), pd.DataFrame) and len(result.images) == 4
    again = tmp_path / "again"
    with shared_plotlyjs(again):  # plotly.js beside the pages, as in the run's own folder
        result.save(again)
    for file in cls.reproduced_files:
        assert (again / file).read_bytes() == (run / file).read_bytes(), file
    report = export_results(run, "html", tmp_path / "html")
    assert (tmp_path / "html" / "relevancy.html").read_bytes() == (run / "relevancy.html").read_bytes()
    assert any(f.endswith("curves.html") for f in report.files)


def test_a_stale_scores_file_is_refused(run, tmp_path):
    import shutil

    from vlmbind.core.errors import InputError

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    scores = pd.read_csv(copy / "method_scores.csv")
    scores.loc[0, "deletion_auc"] += 0.5
    scores.to_csv(copy / "method_scores.csv", index=False)
    with pytest.raises(InputError, match="disagree"):
        load_result(copy)


@pytest.mark.parametrize("argv, needle", [
    (["--model", MODEL, "--methods", "rollout,saliency"], "['saliency'] not among"),
    (["--model", MODEL, "--methods", "rollout,rollout"], "names a method twice"),
    (["--model", MODEL, "--random-maps", "0"], "0 is below 1"),
    (["--model", MODEL, "--task", "count"], "invalid choice: 'count'"),
    (["--model", "tiny-mllama", "--n", "1"], "has none (the image reaches it through the cross-attention layers"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["relevancy", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vlmbind: error: ") and needle in err[-1]
    assert not (out / "maps.csv").exists()
