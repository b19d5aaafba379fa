"""Conditions and tasks as code: a file outside the package registers them (``--plugin``), and they run through
``locate``, ``eval`` and ``ablate`` as the built-in ones do; the built-in ones are registered through the same API."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import vlmbind as vb
from vlmbind.cli import main
from vlmbind.stimuli import registry

PLUGIN = str(Path(__file__).parent / "plugins" / "my_conditions.py")


def test_the_built_in_conditions_and_tasks_are_registered_through_the_api():
    assert {"id_retrieval", "id_selection", "feature_retrieval"} <= set(registry.CONDITIONS)
    assert {"scene", "query", "search", "count"} <= set(registry.TASKS)
    assert all(registry.CONDITIONS[c].source == "built in" and registry.CONDITIONS[c].task == "scene"
               for c in ("id_retrieval", "id_selection", "feature_retrieval"))
    assert registry.TASKS["scene"].generate is vb.stimuli.scene_description


def test_a_plugin_condition_makes_pairs_in_python():
    added = vb.stimuli.load_plugin(PLUGIN)
    assert set(added) <= {"condition shape_swap", "task scene_colour"}  # empty when an earlier test loaded it
    pairs = vb.stimuli.make_pairs("shape_swap", 4, 7)
    again = vb.stimuli.make_pairs("shape_swap", 4, 7)
    for p, q in zip(pairs, again):
        assert p.counterfactual.image.tobytes() == q.counterfactual.image.tobytes()  # deterministic from the seed
        target = p.clean.objects[p.clean.fields["target"]]
        new = p.counterfactual.objects[p.clean.fields["target"]]
        assert p.answer == target.name and p.answer_counterfactual == new.name
        assert new.colour == target.colour and new.shape not in {o.shape for o in p.clean.objects}
        assert p.first_difference == 1 and p.patch == {"kind": "last"}
    # the clean scenes are scene_description's, as for the built-in conditions
    scenes = vb.stimuli.scene_description(4, 7, n_objects=(3, 4))
    assert [p.clean.image.tobytes() for p in pairs] == [e.image.tobytes() for e in scenes]


def test_plugin_errors_name_the_file_and_the_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import vlmbind\n\nraise ValueError('no colours')\n")
    with pytest.raises(vb.stimuli.PluginError, match=r"--plugin .*bad.py line 3: ValueError: no colours"):
        vb.stimuli.load_plugin(bad)
    (tmp_path / "syntax.py").write_text("def f(:\n")
    with pytest.raises(vb.stimuli.PluginError, match="syntax.py line 1: SyntaxError"):
        vb.stimuli.load_plugin(tmp_path / "syntax.py")
    twice = tmp_path / "twice.py"
    twice.write_text("from vlmbind.stimuli import register_condition\n\n@register_condition('id_selection')\n"
                     "def mine(example, rng, context):\n    pass\n")
    with pytest.raises(vb.stimuli.PluginError, match="'id_selection' is already registered \\(built in\\)"):
        vb.stimuli.load_plugin(twice)
    with pytest.raises(vb.stimuli.PluginError, match="is not a Python file"):
        vb.stimuli.load_plugin(tmp_path / "missing.py")


def test_a_plugin_condition_runs_through_locate_and_finds_the_planted_feature_head(tmp_path, capsys):
    """organism-vsm's planted feature-retrieval head 5.2 carries the target's colour and shape to the last token: a
    condition written outside the package that changes the target's shape finds it first."""
    out = tmp_path / "loc"
    assert main(["locate", "--model", "organism-vsm", "--condition", "shape_swap", "--plugin", PLUGIN,
                 "--n-pairs", "8", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["condition"] == "shape_swap" and summary["top_heads"][0] == "5.2"
    scores = vb.HeadScores.load(out)
    ranked = np.sort(np.abs(scores.scores).ravel())[::-1]
    assert ranked[0] > 10 * ranked[1]
    assert summary["predictions"]["clean_is_a"] == 8
    # without the plugin the name is unknown, and says how to bring one
    assert main(["locate", "--model", "organism-vsm", "--condition", "shape_swop"]) == 2
    err = capsys.readouterr().err
    assert "--plugin FILE.py" in err and len(err.strip().splitlines()) == 1


def test_a_plugin_task_runs_through_eval_and_ablate(tmp_path, capsys):
    """The plugin's task scores organism-vsm's scenes on the colour word alone: right on every scene, and wrong on
    every scene once the planted feature-retrieval head 5.2 stops reading the image, while random heads change
    nothing."""
    assert main(["eval", "--model", "organism-vsm", "--task", "scene_colour", "--plugin", PLUGIN, "--n", "16",
                 "--out", str(tmp_path / "eval"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["task"] == "scene_colour" and summary["accuracy"] >= 0.9
    records = [json.loads(line) for line in (tmp_path / "eval/answers.jsonl").read_text().splitlines()]
    assert all(r["parsed"] == r["expected"].split()[0] for r in records if r["correct"])  # the plugin's scorer
    assert main(["ablate", "--model", "organism-vsm", "--task", "scene_colour", "--plugin", PLUGIN, "--heads", "5.2",
                 "--n", "16", "--seeds", "2", "--out", str(tmp_path / "ablate"), "--json"]) == 0
    capsys.readouterr()
    arms = json.loads((tmp_path / "ablate/results.json").read_text())["arms"]
    accuracy = {a["arm"]: a["accuracy"] for a in arms}  # random arms: the last seed's
    assert accuracy["top"] <= 0.1 and accuracy["random"] >= 0.9 and accuracy["clean"] >= 0.9


@pytest.mark.parametrize("argv,message", [
    (["eval", "--task", "scene_color"], "--task 'scene_color' is not registered"),
    (["eval", "--task", "scene_colour", "--plugin", PLUGIN, "--objects", "3"], "--objects does not apply to task"),
    (["ablate", "--task", "scene_colour", "--plugin", "nothing.py", "--heads", "5.2"], "is not a Python file"),
])
def test_plugin_task_refusals(argv, message, capsys):
    assert main([argv[0], "--model", "organism-vsm", *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
