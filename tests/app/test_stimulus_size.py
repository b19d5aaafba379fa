"""The size generated stimuli are drawn at: the family's typical input size, an organism's training canvas, or
``--image-size``; recorded in what locate, eval and ablate write."""

from __future__ import annotations

import json

import pytest
from helpers import write_hand_pairs

import vlmbind as vb
from vlmbind.cli import main

FAMILY_SIZE = vb.load("tiny-qwen2_5_vl").adapter.typical_image_size


def locate_canvas(tmp_path, capsys, model, *extra):
    out = tmp_path / "run"
    argv = ["locate", "--model", model, "--condition", "id_selection", "--n-pairs", "2", "--out", str(out), "--json"]
    assert main([*argv, *extra]) == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "summary.json").read_text())
    assert printed["canvas"] == saved["canvas"]
    return saved["canvas"]


@pytest.mark.parametrize("model, extra, canvas", [
    ("tiny-qwen2_5_vl", [], {"image_size": FAMILY_SIZE, "grid": [3, 3], "image_size_from": "family default"}),
    ("tiny-qwen2_5_vl", ["--image-size", "336"],
     {"image_size": 336, "grid": [3, 3], "image_size_from": "--image-size"}),
    ("organism-vsm", [], {"image_size": 168, "grid": [6, 6], "image_size_from": "training record"}),
])
def test_locate_records_the_image_size_its_pairs_were_drawn_at(tmp_path, capsys, model, extra, canvas):
    assert locate_canvas(tmp_path, capsys, model, *extra) == canvas


def test_the_family_size_is_the_adapters_declaration():
    assert FAMILY_SIZE == 448


@pytest.mark.parametrize("argv, message", [
    (["--pairs", "PAIRS", "--image-size", "336"], "--image-size does not apply with --pairs"),
    (["--condition", "attention_swap", "--image-size", "336"], "--image-size does not apply to --condition "
                                                               "attention_swap"),
])
def test_image_size_is_refused_where_no_pairs_are_drawn(tmp_path, capsys, argv, message):
    write_hand_pairs(tmp_path / "mine", 2)
    argv = [str(tmp_path / "mine") if a == "PAIRS" else a for a in argv]
    code = main(["locate", "--model", "tiny-qwen2_5_vl", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_resume_on_a_finished_locate_drawn_at_another_size_is_refused(tmp_path, capsys):
    locate_canvas(tmp_path, capsys, "tiny-qwen2_5_vl")
    assert main(["locate", "--model", "tiny-qwen2_5_vl", "--condition", "id_selection", "--n-pairs", "2", "--out",
                 str(tmp_path / "run"), "--image-size", "336", "--resume"]) == 2
    assert f"--image-size {FAMILY_SIZE} (this command: 336)" in capsys.readouterr().err


def test_eval_and_ablate_record_the_image_size(tmp_path, capsys):
    assert main(["eval", "--model", "tiny-qwen2_5_vl", "--task", "scene", "--n", "2", "--out", str(tmp_path / "ev"),
                 "--json"]) == 0
    params = json.loads((tmp_path / "ev" / "results.json").read_text())["params"]
    assert params["canvas"] == {"image_size": FAMILY_SIZE, "grid": [3, 3], "image_size_from": "family default"}
    assert params["params"]["canvas"]["image_size"] == FAMILY_SIZE
    assert main(["eval", "--model", "tiny-qwen2_5_vl", "--task", "scene", "--n", "2", "--image-size", "336", "--grid",
                 "4", "--out", str(tmp_path / "ev4"), "--json"]) == 0
    params = json.loads((tmp_path / "ev4" / "results.json").read_text())["params"]
    assert params["canvas"] == {"image_size": 336, "grid": [4, 4], "image_size_from": "--image-size"}
    assert main(["ablate", "--model", "tiny-qwen2_5_vl", "--task", "count", "--n", "2", "--heads", "0.0", "--seeds",
                 "1", "--image-size", "336", "--out", str(tmp_path / "ab"), "--json"]) == 0
    saved = json.loads((tmp_path / "ab" / "results.json").read_text())
    # the count generator's own grid, at the size asked for
    assert saved["canvas"] == {"image_size": 336, "grid": [5, 5], "image_size_from": "--image-size"}
    capsys.readouterr()
    # a task file holds its own images
    (tmp_path / "task").mkdir()
    assert main(["ablate", "--model", "tiny-qwen2_5_vl", "--data", str(tmp_path / "task"), "--heads", "0.0",
                 "--image-size", "336"]) == 2
    assert "--image-size does not apply with --data" in capsys.readouterr().err
