"""``vlmbind stimuli``: every task writes the contract's files, deterministically; bad arguments exit 2."""

from __future__ import annotations

import json

import pytest

from vlmbind.cli import main

CASES = [
    ["scene", "--n", "6", "--objects", "2-4", "--entropy", "low"],
    ["scene", "--n", "4", "--pairs", "id_retrieval"],
    ["scene", "--n", "4", "--pairs", "feature_retrieval"],
    ["query", "--n", "6"],
    ["search", "--n", "6", "--kind", "conjunctive", "--objects", "1-50", "--image-size", "448", "--grid", "8",
     "--regime", "p2a"],
    ["count", "--n", "6", "--objects", "11-15", "--diversity", "high"],
    ["rsa", "--positions", "2"],
    ["colorshape", "--n", "5", "--split", "test"],
]


@pytest.mark.parametrize("argv", CASES, ids=lambda a: "-".join(a[:1] + a[3:4]))
def test_every_task_writes_the_contract_files(argv, tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["stimuli", *argv, "--seed", "3", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    records_file = out / ("pairs.jsonl" if "--pairs" in argv else "meta.jsonl")
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert len(records) == summary["n"] > 0
    images = sorted(p.name for p in (out / "images").iterdir())
    assert len(images) in (len(records), 2 * len(records))  # pairs write a clean and a counterfactual image
    info = json.loads((out / "dataset.json").read_text())
    assert info["seed"] == 3
    if argv[0] == "colorshape":
        assert abs(info["entropy_bits"]["test"]["H_O"] - 39.94) < 0.01
    # same seed -> byte-identical files
    again = tmp_path / "b"
    assert main(["stimuli", *argv, "--seed", "3", "--out", str(again)]) == 0
    for path in out.rglob("*"):
        if path.is_file():
            assert path.read_bytes() == (again / path.relative_to(out)).read_bytes(), path.name


@pytest.mark.parametrize("argv,reason", [
    (["count", "--n", "3", "--entropy", "low"], "--entropy does not apply to task 'count'"),
    (["search", "--n", "3", "--objects", "51"], "51"),
    (["search", "--n", "3", "--objects", "50", "--grid", "5", "--image-size", "448"], "grid"),
    (["scene", "--n", "3", "--objects", "4", "--grid", "1"], "grid"),
    (["scene", "--n", "0"], "--n"),
    (["rsa", "--n", "3"], "no --n"),
    (["count", "--n", "3", "--objects", "5-2"], "empty"),
    (["colorshape", "--n", "3", "--split", "dev"], "invalid choice"),
    (["nonsense", "--n", "3"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_one_line(argv, reason, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["stimuli", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlmbind: error:") and len(err.splitlines()) == 1
    assert reason in err
    assert not out.exists() or not any(out.iterdir()), "no partial output"
