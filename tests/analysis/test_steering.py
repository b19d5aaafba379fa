"""``vb.steer`` / ``vlmbind steer``: on organism-vsm steering the planted selecting head 3.1 to a described object makes
the model name it while random heads do not; every outcome and the gaze agree with a hand computation; targets are
laid where they say; bad input is refused by name, exit 2."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from helpers import shared_organism

from vlmbind import cli
from vlmbind.analysis.evaluation import score
from vlmbind.analysis.steering import SteerResult, scene_targets, steer
from vlmbind.core.checks import check_steer_target
from vlmbind.core.errors import InputError
from vlmbind.stimuli import scene_description
from vlmbind.stimuli.core import Canvas


@pytest.fixture(scope="module")
def vsm_steering():
    vlm = shared_organism("organism-vsm")
    return vlm, steer(vlm, "3.1", "described", n=24, seed=1000, n_random=2)


def test_steering_the_planted_head_names_the_described_object_and_random_heads_do_not(vsm_steering):
    _, result = vsm_steering
    s = result.summary()
    assert s["identity_exact"] and s["clean_accuracy"] == 1.0 and s["clean_efficacy"] == 0.0
    assert s["n_counted"] == 24 and s["efficacy"] >= 0.85
    assert s["random_heads_n"] == 48 and s["random_heads_efficacy"] <= 0.1
    assert s["efficacy_interval"][0] > s["random_heads_efficacy_interval"][1]  # the intervals do not overlap
    assert "3.1" not in {h for draw in s["random_heads"] for h in draw}


def test_outcomes_and_gaze_equal_a_hand_computation(vsm_steering):
    vlm, result = vsm_steering
    examples = list(scene_description(24, 1000, **_kwargs(vlm)).examples)
    by_id = {e.id: e for e in examples}
    for r in result.records.itertuples():
        example = by_id[r.example]
        names_target = score(replace(example, answer=r.target_name), r.output)[0]
        assert (r.outcome == "target") == names_target
        assert r.target_name in example.prompt and r.answer_name == example.objects[example.fields["target"]].name
    # gaze of 3.1 from a plain pattern capture at the last prompt position
    batch = vlm.prepare([e.image for e in examples], [e.prompt for e in examples])
    pattern = vlm.run(batch, sites="blocks.3.attn.hook_pattern").cache["blocks.3.attn.hook_pattern"][:, 1, -1]
    shares = []
    for row, (example, ti) in enumerate(zip(examples, batch.index)):
        obj = ti.positions_covering(example.objects[example.fields["target"]].box)
        image = ti.image_positions
        shares.append(float(pattern[row, obj].sum() / pattern[row, image].sum()))
    gaze = result.gaze.set_index(["layer", "head"])
    assert gaze.loc[(3, 1), "gaze"] == pytest.approx(np.mean(shares), abs=1e-5)
    assert gaze.loc[(3, 1), "n"] == 24
    assert gaze["gaze"].sub(gaze["chance"]).idxmax() in {(3, 1), (5, 2)}  # a planted head gazes most


def _kwargs(vlm):
    from vlmbind.analysis.evaluation import training_defaults

    kwargs = training_defaults(vlm, "scene", {})
    kwargs.setdefault("n_objects", 3)
    return kwargs


def test_targets_are_laid_where_they_say():
    canvas = Canvas(image_size=168, grid=6)
    examples = list(scene_description(6, 3, n_objects=3, canvas=canvas).examples)
    described = scene_targets(examples, "described", canvas, seed=0)
    for example, target in zip(examples, described):
        assert target.obj != example.fields["target"] and example.objects[target.obj].name in example.prompt
    assert [t is None for t in scene_targets(examples, "object:3", canvas, 0)] == [True] * 6
    o = examples[0].objects[1]
    by_cell = scene_targets(examples[:1], f"cell:{o.row},{o.col}", canvas, 0)[0]
    assert by_cell.obj == 1 and by_cell.box == canvas.cell_box(o.row, o.col)
    by_box = scene_targets(examples[:1], f"box:{o.x - 1},{o.y - 1},{o.x + 1},{o.y + 1}", canvas, 0)[0]
    assert by_box.obj == 1
    empty = [(r, c) for r in range(6) for c in range(6) if (r, c) not in {(p.row, p.col) for p in examples[0].objects}]
    assert scene_targets(examples[:1], f"cell:{empty[0][0]},{empty[0][1]}", canvas, 0)[0].obj is None
    with pytest.raises(InputError, match="outside the stimulus grid"):
        scene_targets(examples[:1], "cell:6,0", canvas, 0)
    for bad in ("object:-1", "object:1.5", "cell:1", "box:3,3,1,1", "near:red square", ""):
        with pytest.raises(InputError, match="steering target"):
            check_steer_target(bad)


def test_command_writes_its_tables_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "steer"
    assert cli.main(["steer", "--model", "organism-vsm", "--heads", "3.1", "--to", "object:0", "--n", "6",
                     "--random-draws", "1", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["to"] == "object:0" and summary["n_scenes"] == 6
    saved = SteerResult.load(out)
    assert {"arms.csv", "steering.csv", "gaze.csv", "steering.html", "gaze.html", "summary.json"} <= {
        p.name for p in out.iterdir()}
    steered = saved.records[saved.records["arm"] == "steered"]
    assert set(steered["target"]) == {0}
    # object 0 is the answer's own object in some scenes: those are not counted
    assert summary["n_counted"] == int((steered["target_name"] != steered["answer_name"]).sum())
    for argv in (["--heads", "3.9"], ["--heads", "3.1", "--to", "cell:9"], ["--heads", "x"],
                 ["--heads", "3.1", "--random-draws", "-1"]):
        assert cli.main(["steer", "--model", "organism-vsm", *argv, "--out", str(tmp_path / "bad")]) == 2
        assert not (tmp_path / "bad").exists()


def test_point_to_answer_steering_scores_the_first_point_written(organism_p2a):
    """On a search trace the outcome is the first point: the steered object's grid point (x = column, y = row),
    the expected first point, or another; a distractor is never the object the answer points at first."""
    from vlmbind.stimuli.points import parse_points

    result = steer(organism_p2a, "2.0", task="search", n=6, seed=3, n_random=1)
    assert result.task == "search" and result.to == "distractor" and result.summary()["identity_exact"]
    for r in result.records.itertuples():
        written = parse_points(r.output)
        first = f"({round(written[0][0])}, {round(written[0][1])})" if written else None
        expected = "target" if first == r.target_name else "original" if first == r.answer_name else "other"
        assert r.outcome == expected
        assert r.counted == (isinstance(r.target_name, str) and r.target_name != r.answer_name)
    assert result.records["counted"].any()
    assert SteerResult.load(_saved(result)).task == "search"
    with pytest.raises(InputError, match="names no object"):
        steer(organism_p2a, "2.0", "described", task="count", n=2)
    with pytest.raises(InputError, match="task must be one of"):
        steer(organism_p2a, "2.0", task="query", n=2)


def _saved(result):
    import tempfile
    from pathlib import Path

    out = Path(tempfile.mkdtemp()) / "steer"
    result.save(out, figure=False)
    return out
