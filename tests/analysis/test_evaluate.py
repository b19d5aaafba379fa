"""vb.evaluate and vlmbind eval: scoring rules per task, per-count accuracy, saved answers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers import get_tiny, shared_organism

import vlmbind as vb
from vlmbind.analysis.evaluation import evaluate, score
from vlmbind.stimuli import Canvas

S = vb.stimuli


class ScriptedVLM:
    """Answers each prompt from a script keyed by example order: a stand-in whose outputs we control."""

    name, active_prompt_format = "scripted", "raw"

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.adapter = SimpleNamespace(tokenizer=get_tiny("tiny-qwen2_5_vl").adapter.tokenizer,
                                       resized_size=lambda inputs, image_id: None)
        self.calls = []

    def point_frames(self, frame=None):
        return vb.stimuli.answers.frames_for({"tuple": "canvas"})

    def prepare(self, images, prompts, chat=False):
        self.calls.append(list(prompts))
        return SimpleNamespace(n=len(prompts), inputs={})

    def generate(self, batch, max_new_tokens):
        out, self.outputs = self.outputs[: batch.n], self.outputs[batch.n :]
        return out, {}


@pytest.mark.parametrize("task,make,right,wrong", [
    ("scene", lambda: S.scene_description(4, 0), lambda e: e.answer + " ,", lambda e: "red " + e.answer.split()[1]),
    ("query", lambda: S.binding_query(4, 0), lambda e: e.answer + " .", lambda e: "xyz"),
    ("search", lambda: S.visual_search(4, 0, n_objects=(1, 9), canvas=Canvas(image_size=224, grid=3), regime="p2a"),
     lambda e: e.answer, lambda e: e.answer.replace("yes", "NO").replace("no", "yes").replace("NO", "no")),
    ("count", lambda: S.counting(4, 0, objects=(2, 5), canvas=Canvas(image_size=224, grid=3), regime="p2a"),
     lambda e: e.answer, lambda e: e.answer.rsplit(" ", 1)[0] + " 99"),
])
def test_scoring_rules(task, make, right, wrong):
    ds = make()
    for e in ds:
        assert score(e, right(e))[0], (task, e.answer)
        assert not score(e, wrong(e))[0], (task, e.answer, wrong(e))
        assert not score(e, "")[0]


def test_accuracy_and_per_count_from_scripted_answers(tmp_path):
    ds = S.counting(10, 0, objects=(2, 4), canvas=Canvas(image_size=224, grid=3))
    outputs = [e.answer if i % 2 == 0 else "0" for i, e in enumerate(ds)]
    vlm = ScriptedVLM(outputs)
    result = evaluate(vlm, ds, batch_size=3)
    assert [len(c) for c in vlm.calls] == [3, 3, 3, 1]
    assert result.accuracy == 0.5 and result.n == 10
    expected = {}
    for i, e in enumerate(ds):
        expected.setdefault(len(e.objects), []).append(i % 2 == 0)
    assert result.per_count == {k: {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in sorted(expected.items())}
    result.save(tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["accuracy"] == 0.5 and saved["n"] == 10
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [a["output"] for a in answers] == outputs


def test_real_model_outputs_are_what_generate_returns():
    vlm = get_tiny("tiny-qwen2_5_vl")
    ds = S.binding_query(3, 0)
    result = evaluate(vlm, ds)
    batch = vlm.prepare(ds.images, ds.prompts)
    texts, _ = vlm.generate(batch, max_new_tokens=max(len(vlm.adapter.tokenizer(e.answer)["input_ids"]) + 4
                                                      for e in ds))
    assert [r["output"] for r in result.records] == texts


def test_empty_or_unanswered_data_sets_are_errors():
    with pytest.raises(vb.InputError, match="empty"):
        evaluate(ScriptedVLM([]), [])
    ds = S.scene_description(2, 0)
    ds.examples[1].answer = ""
    with pytest.raises(vb.InputError, match="no expected answer"):
        evaluate(ScriptedVLM(["a", "b"]), ds)


def test_eval_command(tmp_path, capsys):
    from vlmbind.cli import main

    out = tmp_path / "ev"
    code = main(["eval", "--model", "tiny-qwen2_5_vl", "--task", "query", "--n", "4", "--out", str(out), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n"] == 4 and 0 <= summary["accuracy"] <= 1
    assert (out / "answers.jsonl").read_text().count("\n") == 4
    assert main(["eval", "--model", "tiny-qwen2_5_vl", "--task", "query", "--n", "0", "--out", str(out)]) == 2


def test_eval_search_on_an_organism_follows_its_training_object_range(tmp_path, capsys):
    # the search generator's own default range (up to 50 objects) does not fit organism-p2a's 6 x 6 grid
    from vlmbind.cli import main

    out = tmp_path / "s"
    assert main(["eval", "--model", "organism-p2a", "--task", "search", "--n", "3", "--out", str(out), "--json"]) == 0
    records = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    low, high = shared_organism("organism-p2a").training["task_options"]["search"]["objects"]
    assert all(low <= r["n_objects"] <= high for r in records)
    # P2A points of a model vlmbind trained are canvas cells, recorded beside the answer
    pointed = [r for r in records if r["points_raw"]]
    assert pointed and all(r["point_frame"] == "canvas" and r["points"] == r["points_raw"] for r in pointed)


def test_a_checkpoint_of_a_family_gets_stimuli_at_its_family_size():
    """A Qwen2.5-VL whose processor keeps the checkpoints' pixel bounds sees its stimuli at the family's size, with
    the image tokens its processor gives that size: a 448 px square inside the bounds, in tokens of patch x merge."""
    from vlmbind.analysis.evaluation import stimulus_defaults
    from vlmbind.engine.vlm import VLM
    from vlmbind.stimuli import scene_pairs
    from vlmbind.tiny.qwen import build_qwen_vl

    model, processor = build_qwen_vl("qwen2_5_vl", 0, processor_defaults=True)
    vlm = VLM(model, processor, name="qwen2_5_vl-processor-defaults", source="test")
    pixels = processor.image_processor
    bounds, token = pixels.size, pixels.patch_size * pixels.merge_size

    def image_tokens(image_size):
        kwargs, canvas = stimulus_defaults(vlm, "scene", {"n_objects": 3}, image_size)
        clean = scene_pairs(1, "id_retrieval", 0, **kwargs)[0].clean
        assert clean.image.size == (canvas["image_size"],) * 2
        return canvas, len(vlm.prepare(clean.image, clean.prompt).index[0].image_positions)

    canvas, tokens = image_tokens(None)
    assert canvas == {"image_size": 448, "grid": [3, 3], "image_size_from": "family default"}
    assert 448 % token == 0 and bounds.shortest_edge <= 448 * 448 <= bounds.longest_edge
    assert tokens == (448 // token) ** 2
    # the size vlmbind drew at before: a quarter of the tokens
    canvas, tokens = image_tokens(224)
    assert canvas["image_size_from"] == "--image-size" and tokens == (224 // token) ** 2


def test_an_organism_keeps_its_training_canvas_unless_told_otherwise():
    from vlmbind.analysis.evaluation import stimulus_defaults, training_defaults

    vlm = shared_organism("organism-p2a")
    kwargs, canvas = stimulus_defaults(vlm, "scene", {"n_objects": 3})
    assert kwargs == training_defaults(vlm, "scene", {"n_objects": 3})
    assert canvas == {"image_size": 168, "grid": [vlm.training["grid"]] * 2, "image_size_from": "training record"}
    kwargs, canvas = stimulus_defaults(vlm, "count", {}, 336)
    assert kwargs["canvas"].image_size == 336 and kwargs["regime"] == vlm.training["regime"]
    assert canvas["image_size_from"] == "--image-size"
    # a task drawn on no canvas of vlmbind's has none to size
    assert stimulus_defaults(get_tiny("tiny-qwen2_5_vl"), "colorshape", {}) == ({}, None)
