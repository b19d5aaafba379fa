"""``vlmbind lens``: writes its files, and refuses bad input with exit 2 and one line."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from vlmbind import cli
from vlmbind.analysis.lens import LensResult
from vlmbind.core.results import detect


def test_lens_writes_its_files_and_summary(tmp_path, capsys):
    out = tmp_path / "lens"
    argv = ["lens", "--model", "tiny-qwen2_5_vl", "--n", "2", "--layers", "0,1", "--words", "red,square",
            "--heads", "1.0", "--out", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "decodable at their own image tokens" in text and f"wrote {out}" in text
    summary = json.loads((out / "summary.json").read_text())
    for name in (*LensResult.reproduced_files, "summary.json"):
        assert (out / name).is_file(), name
    assert detect(out) is LensResult
    assert summary["layers"] == ["embed", "0", "1"] and summary["words"] == ["red", "square"]
    assert summary["heads"] == ["1.0"] and summary["head_cells"]
    cells = pd.read_csv(out / "lens.csv")
    assert {"p_red", "p_square"} <= set(cells.columns) and set(cells["layer"].astype(str)) == {"embed", "0", "1"}
    decodable = pd.read_csv(out / "decodable.csv")
    assert len(decodable) == 2 * 3 and (decodable["n"] == summary["n_objects"]).all()
    heads = pd.read_csv(out / "head_lens.csv")
    assert set(heads["where"]) == {"last", "image"} and set(zip(heads["layer"], heads["head"])) == {(1, 0)}


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0-x"], "--layers"),
    (["--layers", "99"], "outside the model's"),
    (["--heads", "1.x"], "LAYER.HEAD"),
    (["--heads", "9.0"], "outside the model's"),
    (["--words", "red,,square"], "--words"),
    (["--n", "0"], "--n"),
    (["--task", "count"], "invalid choice"),
])
def test_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["lens", "--model", "tiny-qwen2_5_vl", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vlmbind: error:") and message in err[0]
    assert not (out / "lens.csv").exists()


def test_a_family_without_image_tokens_is_refused_by_name(tmp_path, capsys):
    assert cli.main(["lens", "--model", "tiny-mllama", "--n", "1", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "cross-attention" in err and err.count("\n") == 1
