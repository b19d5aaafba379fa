"""``vlmbind benchmark``: the saved table prints as the markdown the docs hold, and what it cannot run is refused
by name before any model loads."""

from __future__ import annotations

import json

import pytest

from vlmbind import cli
from vlmbind.analysis.benchmark import COLUMNS, BenchmarkResult


def _row(**values):
    row = dict.fromkeys(COLUMNS)
    row.update(values)
    return row


def test_the_saved_table_prints_as_markdown(tmp_path, capsys):
    result = BenchmarkResult(rows=[_row(organism="organism-vsm", role="planted", condition="id_selection",
                                        method="exact", family="node", auroc=1.0, recall_at_k=1.0, ratio=101.9, n=24,
                                        seconds=1.1),
                                   _row(organism="organism-vsm", role="planted", condition="id_selection",
                                        method="ablation:zero", family="ablation", separation=0.9,
                                        separation_low=0.8, separation_high=1.0, n=64, seconds=3.0)],
                             organisms={"organism-vsm": "organism-vsm-natural"})
    result.save(tmp_path)
    assert cli.main(["benchmark", "--table", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == result.markdown()
    assert "| organism-vsm | planted | exact | id_selection | 1.00 | 1.00 | 101.9 | - | - | 24 | 1.1 |" in out
    assert "+0.90 [+0.80, +1.00]" in out
    assert BenchmarkResult.load(tmp_path).rows == result.rows
    assert cli.main(["benchmark", "--table", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["organisms"] == {"organism-vsm": "organism-vsm-natural"}


def test_the_compact_table_has_a_row_per_method_and_a_column_per_organism(tmp_path, capsys):
    rows = [_row(organism=o, role=role, condition=c, method="exact", family="node", auroc=a)
            for o, role, c, a in (("organism-vsm", "planted", "id_selection", 1.0),
                                  ("organism-vsm", "planted", "feature_retrieval", 0.5),
                                  ("organism-vsm-natural", "twin", "id_selection", 0.25))]
    rows.append(_row(organism="organism-vsm", role="planted", condition="id_selection", method="ablation:zero",
                     family="ablation", separation=0.9, separation_low=0.8, separation_high=1.0))
    BenchmarkResult(rows=rows, organisms={"organism-vsm": "organism-vsm-natural"}).save(tmp_path)
    assert cli.main(["benchmark", "--table", str(tmp_path), "--compact"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("| organism-vsm (planted) | organism-vsm-natural (twin) |")
    assert lines[2:] == ["| exact | 0.75 | 0.25 |", "| ablation:zero | +0.90 | - |"]  # AUROC: the conditions' mean


@pytest.mark.parametrize("args, match", [
    (["--table", "{missing}"], "holds no benchmark.json"),
    (["--organisms", "organism-p2a"], "not a shipped organism with a planted mechanism"),
    (["--methods", "exact,nope"], "nope"),
    (["--modes", "zero,half"], "half"),
    (["--compact"], "give --table DIR with it"),
])
def test_what_cannot_run_is_refused_by_name(args, match, tmp_path, capsys):
    args = [a.replace("{missing}", str(tmp_path / "nothing")) for a in args]
    assert cli.main(["benchmark", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlmbind: error:") and match in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
