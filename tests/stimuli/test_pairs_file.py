"""``pairs.jsonl``: the pairs format vlmbind writes and reads and a person writes by hand; every row is checked and an
error names the file, the line and the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import get_tiny, write_hand_pairs

import vlmbind as vb
from vlmbind.engine.alignment import check_alignment
from vlmbind.stimuli.pairs import PairsFileError, load_pairs


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def rewrite(path, edit, line: int = 0):
    records = rows(path)
    edit(records[line])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_hand_written_pairs_read_as_counterfactual_pairs(tmp_path):
    path = write_hand_pairs(tmp_path / "mine", 3)
    pairs = vb.stimuli.load_pairs(tmp_path / "mine")
    assert pairs.condition == "colour_swap" and len(pairs) == 3
    assert pairs.params == {"source": str(path.resolve())}
    p = pairs[1]
    assert (p.id, p.answer, p.answer_counterfactual, p.patch) == ("p1", "square", "circle", {"kind": "last"})
    assert p.clean.prompt == p.counterfactual.prompt == "the red object is a"
    assert p.counterfactual.answer == "circle"  # answer_on_counterfactual defaults to a*
    assert p.clean.image.size == (224, 224) and p.clean.image.tobytes() != p.counterfactual.image.tobytes()
    assert load_pairs(path)[2].clean.image.tobytes() == pairs[2].clean.image.tobytes()  # the file itself


def test_generated_pairs_round_trip_through_the_file(tmp_path):
    generated = vb.stimuli.scene_pairs(3, "id_retrieval", 4)
    generated.save(tmp_path / "gen")
    line = rows(tmp_path / "gen" / "pairs.jsonl")[0]
    assert line["clean_image"] == "images/pair-00000-clean.png" and line["patch"]["text"]
    back = load_pairs(tmp_path / "gen")
    assert back.params == generated.params and back.summary == generated.summary
    for a, b in zip(generated, back):
        assert (a.patch, a.first_difference, a.counterfactual.answer) == (b.patch, b.first_difference,
                                                                           b.counterfactual.answer)
        assert a.clean.objects == b.clean.objects and a.counterfactual.fields == b.counterfactual.fields


@pytest.mark.parametrize("edit,field,message", [
    (lambda r: r.pop("answer"), "answer", "missing"),
    (lambda r: r.update(answer_counterfatual="x"), "answer_counterfatual", "Did you mean 'answer_counterfactual'"),
    (lambda r: r.update(answer_counterfactual="square"), "answer_counterfactual", "equals 'answer'"),
    (lambda r: r.update(prompt=""), "prompt", "non-empty string"),
    (lambda r: r.update(clean_image="img/nothing.png"), "clean_image", "does not exist"),
    (lambda r: r.update(patch="first"), "patch", "is not one of"),
    (lambda r: r.update(patch={"box": [0, 0, 300, 50]}), "patch", r"not inside the clean image \(224 x 224"),
    (lambda r: r.update(patch={"box": [0, 0, 50]}), "patch", "a box patch is"),
    (lambda r: r.update(patch={"text": "red", "occurrence": "last"}), "patch", "an int occurrence"),
    (lambda r: r.update(patch={"positions": [3, 3]}), "patch", "repeat"),
    (lambda r: r.update(condition="colour swap"), "condition", "must be a name"),
    (lambda r: r.update(meta=[1]), "meta", "JSON object"),
])
def test_a_bad_row_names_the_file_the_line_and_the_field(tmp_path, edit, field, message):
    path = write_hand_pairs(tmp_path / "mine", 3)
    rewrite(path, edit, line=1)
    with pytest.raises(PairsFileError, match=rf"pairs.jsonl line 2, field '{field}': .*{message}"):
        load_pairs(path)


def test_file_level_errors(tmp_path):
    path = write_hand_pairs(tmp_path / "mine", 3)
    rewrite(path, lambda r: r.update(id="p0"), line=2)
    with pytest.raises(PairsFileError, match="line 3, field 'id': 'p0' repeats line 1"):
        load_pairs(path)
    rewrite(path, lambda r: r.update(id="p2", condition="shape_swap"), line=2)
    with pytest.raises(PairsFileError, match=r"conditions \['colour_swap', 'shape_swap'\]; choose one"):
        load_pairs(path)
    assert [p.id for p in load_pairs(path, "shape_swap")] == ["p2"]
    with pytest.raises(PairsFileError, match="no pair of condition 'colour_swp'.*Did you mean 'colour_swap'"):
        load_pairs(path, "colour_swp")
    path.write_text('{"id": "p0"\n')
    with pytest.raises(PairsFileError, match="line 1: not JSON"):
        load_pairs(path)
    path.write_text('"a string"\n')
    with pytest.raises(PairsFileError, match="line 1: a JSON str, not an object"):
        load_pairs(path)
    path.write_bytes(json.dumps({"id": "é"}).encode("utf-16"))
    with pytest.raises(PairsFileError, match="UTF-16 text, not UTF-8; save it as UTF-8"):
        load_pairs(path)
    with pytest.raises(vb.stimuli.StimulusError, match="holds no pairs.jsonl"):
        load_pairs(tmp_path)


def test_patch_forms_give_the_positions_they_name(tmp_path):
    """last, a text span, a pixel box (the image tokens whose cells overlap it, from the processor's grid) and
    explicit positions (negative from the end), on a real processor."""
    vlm = get_tiny("tiny-qwen2_vl")
    path = write_hand_pairs(tmp_path / "mine", 4)
    forms = ["last", {"text": "red object"}, {"box": [30, 40, 90, 100]}, {"positions": [0, -1]}]
    for line, form in enumerate(forms):
        rewrite(path, lambda r, form=form: r.update(patch=form), line=line)
    pairs = load_pairs(path)
    aligned = check_alignment(vlm, pairs)
    index = aligned.clean.index
    last, span, box, explicit = aligned.positions
    assert last.tolist() == [index[0].last_position]
    assert vlm.adapter.tokenizer.decode(index[1].input_ids[span]).strip() == "red object"
    # the box: image tokens in the grid's cells that overlap x 30..90, y 40..100 (28-pixel cells on a 224 image)
    grid = index[2].grid()
    assert grid.shape == (8, 8)
    rows_, cols = range(40 // 28, -(-100 // 28)), range(30 // 28, -(-90 // 28))
    assert box.tolist() == sorted(int(grid.positions[r, c]) for r in rows_ for c in cols)
    real = np.flatnonzero(index[3].roles != "pad")
    assert explicit.tolist() == [int(real[0]), int(real[-1])]


def test_a_counterfactual_prompt_of_its_own_lines_up_by_token_count(tmp_path):
    vlm = get_tiny("tiny-qwen2_vl")
    path = write_hand_pairs(tmp_path / "mine", 2)
    rewrite(path, lambda r: r.update(counterfactual_prompt="the blue object is a", patch={"text": "red"}))
    pairs = load_pairs(path)
    assert pairs[0].counterfactual.prompt == "the blue object is a"
    aligned = check_alignment(vlm, pairs)
    assert "blue" in aligned.counterfactual.index[0].text and "red" in aligned.clean.index[0].text
    rewrite(path, lambda r: r.update(counterfactual_prompt="the big blue object is a"))
    with pytest.raises(vb.stimuli.PairAlignmentError, match="p0.*sequence length"):
        check_alignment(vlm, load_pairs(path))


def test_a_box_covering_no_token_and_positions_outside_are_named(tmp_path):
    vlm = get_tiny("tiny-qwen2_vl")
    path = write_hand_pairs(tmp_path / "mine", 1)
    rewrite(path, lambda r: r.update(patch={"positions": [5000]}))
    with pytest.raises(vb.stimuli.StimulusError, match="pair 'p0': patch positions \\[5000\\] are outside"):
        check_alignment(vlm, load_pairs(path))
