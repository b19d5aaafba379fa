"""``task.jsonl``: a researcher's own task (image, prompt, answer, accepted answers, a scorer), read and checked row
by row; the scorers read answers as a person would."""

from __future__ import annotations

import json

import pytest
from helpers import write_hand_pairs, write_hand_task

import vlmbind as vb
from vlmbind.analysis.evaluation import score
from vlmbind.stimuli.answers import SCORERS, score_text
from vlmbind.stimuli.user import TaskFileError, load_task


@pytest.mark.parametrize("scorer,output,expected,ok", [
    ("starts_with", "Square, and a blue circle", ["square"], True),
    ("starts_with", "a red square", ["red square"], True),
    ("starts_with", "the circle", ["square"], False),
    ("exact", "Square.", ["square"], True),
    ("exact", "square and more", ["square"], False),
    ("first_word", "**Box** it is", ["square", "box"], True),
    ("first_word", "it is a box", ["box"], False),
    ("contains", "I think it is a red square here", ["red square"], True),
    ("contains", "a red circle and a square", ["red square"], False),
    ("number", "There are **seven** objects", ["7"], True),
    ("number", "3 red, 4 blue, so in total 7", ["7"], True),
    ("number", "7.5 objects", ["7"], False),
])
def test_scorers(scorer, output, expected, ok):
    assert score_text(scorer, output, expected)[0] is ok


def test_every_scorer_is_tested():
    tested = {"starts_with", "exact", "first_word", "contains", "number"}
    assert set(SCORERS) == tested


def test_a_task_file_reads_as_examples_its_scorer_judges(tmp_path):
    path = write_hand_task(tmp_path / "mine", 3, accept=["box"], scorer="first_word")
    data = vb.stimuli.load_task(tmp_path / "mine")
    assert data.task == "user" and len(data) == 3 and data.params == {"source": str(path.resolve())}
    e = data[1]
    assert (e.id, e.prompt, e.answer, e.fields["accept"], e.fields["scorer"]) == (
        "q1", "the red object is a", "square", ["box"], "first_word")
    assert score(e, "box, red") == (True, "box red")
    assert score(e, "red box") == (False, "red box")
    assert load_task(path)[1].image.tobytes() == e.image.tobytes()  # the file itself reads too


def test_a_pairs_folder_reads_as_the_task_of_its_clean_inputs(tmp_path):
    write_hand_pairs(tmp_path / "mine", 2)
    data = load_task(tmp_path / "mine")
    assert [e.id for e in data] == ["p0-clean", "p1-clean"] and data[0].answer == "square"


@pytest.mark.parametrize("edit,field,message", [
    (lambda r: r.pop("image"), "image", "missing"),
    (lambda r: r.update(scorer="fuzzy"), "scorer", "'fuzzy' is not one of starts_with"),
    (lambda r: r.update(scorer="first-word"), "scorer", "Did you mean 'first_word'"),
    (lambda r: r.update(accept="box"), "accept", "list of non-empty strings"),
    (lambda r: r.update(anwser="x"), "anwser", "Did you mean 'answer'"),
    (lambda r: r.update(image="img/none.png"), "image", "does not exist"),
])
def test_a_bad_task_row_names_the_file_the_line_and_the_field(tmp_path, edit, field, message):
    path = write_hand_task(tmp_path / "mine", 2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    edit(records[1])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(TaskFileError, match=rf"task.jsonl line 2, field '{field}': .*{message}"):
        load_task(path)


def test_a_count_reply_that_only_lists_points_is_read_as_their_number():
    from vlmbind.analysis.evaluation import EvalResult, counted_points

    example = vb.stimuli.Example("c0", None, [], "how many?", "(1, 2) (3, 4) (5, 0) 3", "count")
    assert score(example, "(1, 2) (3, 4) (5, 0)") == (True, 3)
    assert score(example, "(1, 2) (3, 4)") == (False, 2)
    assert score(example, "(1, 2) (3, 4) so 3") == (True, 3)  # a number, when written, is the count
    assert score(example, "I cannot tell") == (False, None)
    assert counted_points(example, "(1, 2) (3, 4) (5, 0)", 3) and not counted_points(example, "(1, 2) 3", 3)
    records = [{"id": "c0", "n_objects": 3, "correct": True, "count_read_from": "points"},
               {"id": "c1", "n_objects": 3, "correct": False}]
    result = EvalResult(model="m", task="count", records=records)
    assert result.summary()["counts_read_from_points"] == 1
    assert "counts_read_from_points" not in EvalResult(model="m", task="count", records=records[1:]).summary()
