"""Reading real answers: the corpus of realistic replies per family and format, frames and their conversion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from answer_corpus import CANVAS, FAMILIES, FORMATS, RESIZED, entries

from vlmbind.adapters.base import ADAPTERS
from vlmbind.analysis.evaluation import score
from vlmbind.core.tokens import decode_generated
from vlmbind.stimuli import Canvas
from vlmbind.stimuli.answers import (
    FRAMES,
    UnknownFrameError,
    answer_words,
    frames_for,
    read_count,
    read_scene,
    strip_points,
    to_canvas,
)
from vlmbind.stimuli.points import pointing_spans


def _family_frames(family: str) -> dict:
    adapter = next(a for a in ADAPTERS.values() if a.family == family)
    return frames_for(adapter.point_frames)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_corpus_readings(family, fmt):
    corpus = entries(family, fmt)
    assert len(corpus) >= 30
    frames = _family_frames(family)
    wrong = []
    for entry in corpus:
        task, expected, output, reading, correct = entry[:5]
        example = SimpleNamespace(task=task, answer=expected)
        got_correct, got_reading = score(example, output)
        if (got_reading, got_correct) != (reading, correct):
            wrong.append((output, (got_reading, got_correct), (reading, correct)))
        if len(entry) == 6:
            cells = entry[5]
            spans = pointing_spans(output)
            if cells is None:
                with pytest.raises(UnknownFrameError, match="--point-frame"):
                    to_canvas(spans, frames, CANVAS, resized_size=RESIZED.get(family))
                continue
            points = to_canvas(spans, frames, CANVAS, resized_size=RESIZED.get(family))
            assert len(points) == len(cells), output
            np.testing.assert_allclose(np.reshape(points, (-1, 2)), np.reshape(cells, (-1, 2)), atol=0.05)
    assert not wrong, wrong


def test_every_frame_converts_the_same_point():
    # the centre of cell (column 2, row 1) on a 200 px canvas with a 4 x 4 grid is pixel (125, 75)
    canvas = Canvas(image_size=200, grid=4)
    written = {"canvas": (2, 1), "pixels": (125, 75), "permille": (625, 375), "percent": (62.5, 37.5),
               "resized": (125 * 392 / 200, 75 * 392 / 200)}
    assert set(written) == set(FRAMES)
    for frame, (x, y) in written.items():
        spans = pointing_spans(f"({x}, {y})")
        got = to_canvas(spans, {"tuple": frame}, canvas, resized_size=(392, 392))
        np.testing.assert_allclose(got, [(2.0, 1.0)], atol=1e-9, err_msg=frame)
    # a non-square image (what a user's photo is): frames scale each axis by its own side
    spans = pointing_spans("(500, 500)")
    got = to_canvas(spans, {"tuple": "permille"}, canvas, image_size=(400, 100))
    np.testing.assert_allclose(got, [(1.5, 1.5)])


def test_unknown_frames_refuse():
    spans = pointing_spans('```json\n[{"point_2d": [10, 20]}]\n```')
    with pytest.raises(UnknownFrameError, match=r"point_2d.*--point-frame"):
        to_canvas(spans, frames_for({}), CANVAS)
    with pytest.raises(UnknownFrameError, match="processed image size"):
        to_canvas(spans, frames_for({"json": "resized"}), CANVAS)
    with pytest.raises(Exception, match="unknown coordinate frame 'inches'"):
        frames_for({"json": "inches"})


def test_formats_are_named_and_boxes_are_one_point():
    text = ('<|box_start|>(100,200),(300,400)<|box_end|> (1, 2) {"bbox_2d": [0, 0, 10, 20]} '
            '<point x="10" y="20">a</point> <points coords="1 1 5 6">b</points>')
    spans = pointing_spans(text)
    assert [s.format for s in spans] == ["box", "tuple", "json", "molmo", "molmo2"]
    assert [s.points for s in spans] == [[(200, 300)], [(1, 2)], [(5, 10)], [(10, 20)], [(5, 6)]]
    # the label inside a JSON object and the coordinates never count
    assert read_count('[{"point_2d": [112, 40], "label": "circle 3"}] There are two.') == 2
    assert "112" not in strip_points('[{"point_2d": [112, 40]}]')


def test_readers_never_raise_on_hostile_text():
    for text in [None, "", "{" * 5000, "(" * 5000 + "1, 2", "total " * 2000, "<|box_start|>" * 1000]:
        assert read_count(text) is None or isinstance(read_count(text), int)
        read_scene(text)
        answer_words(text)


def test_scene_with_the_data_sets_own_words():
    assert read_scene("A teal blob.", ["teal"], ["blob"]) == "teal blob"
    assert score(SimpleNamespace(task="scene", answer="teal blob"), "Teal blob!") == (True, "teal blob")


def test_generated_text_keeps_qwen_pointing_markers():
    from vlmbind.tiny import real

    tok = real.real_tokenizer("qwen2_vl")
    text = "<|object_ref_start|>red circle<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>"
    ids = tok(text + "<|im_end|><|endoftext|>", add_special_tokens=False)["input_ids"]
    assert decode_generated(tok, ids) == text
    assert tok.decode(ids, skip_special_tokens=True) != text  # the plain decode loses the box: the test is not vacuous



def test_internvl_grounding_boxes_are_read_as_their_centres():
    # InternVL answers a grounding request with <ref>label</ref><box>[[x0, y0, x1, y1], ...]</box>, per-mille
    text = ("There are two: <ref>red circle</ref><box>[[100, 200, 300, 400]]</box> and "
            "<ref>blue star</ref><box>[[500, 500, 700, 900], [0,0,10,20]]</box>.")
    spans = pointing_spans(text)
    assert [s.format for s in spans] == ["internvl", "internvl"]
    assert [s.points for s in spans] == [[(200, 300)], [(600, 700), (5, 10)]]
    for span in spans:  # each box's own characters, for tracking a point's generation step
        assert [text[a:b] for a, b in span.parts] == [t for t in
                                                     ("[100, 200, 300, 400]", "[500, 500, 700, 900]", "[0,0,10,20]")
                                                     if t in text[span.start:span.end]]
    assert read_scene(text) == "red circle" and read_count(text) == 2
    assert "<ref>" not in strip_points(text) and "[[" not in strip_points(text)
    # its frame is part of the format: per-mille of the image, on every family
    canvas = Canvas(image_size=200, grid=4)
    got = to_canvas(pointing_spans("<box>[[600, 350, 650, 400]]</box>"), frames_for({}), canvas)
    np.testing.assert_allclose(got, [(2.0, 1.0)], atol=1e-9)
    # incomplete boxes are skipped, never raised on
    assert pointing_spans("<box>[[1, 2, 3]]</box>")[0].points == []
    assert pointing_spans("<box>[[1, 2, 3, 4]]") == [] and pointing_spans("<box>" * 2000 + "[[") == []


def test_glm_boxes_are_read_as_their_centres():
    # GLM-4.1V / GLM-4.6V answer a grounding request with <|begin_of_box|>[x0, y0, x1, y1]<|end_of_box|>, per-mille,
    # one box or a list of them
    text = ("The red circle is at <|begin_of_box|>[100, 200, 300, 400]<|end_of_box|>, the stars at "
            "<|begin_of_box|>[[500, 500, 700, 900], [0,0,10,20]]<|end_of_box|>. There are 3.")
    spans = pointing_spans(text)
    assert [s.format for s in spans] == ["glm", "glm"]
    assert [s.points for s in spans] == [[(200, 300)], [(600, 700), (5, 10)]]
    assert [text[a:b] for s in spans for a, b in s.parts] == ["[100, 200, 300, 400]", "[500, 500, 700, 900]",
                                                              "[0,0,10,20]"]
    assert read_count(text) == 3 and "begin_of_box" not in strip_points(text) and "[" not in strip_points(text)
    # its frame is part of the format: per-mille of the image, on every family
    canvas = Canvas(image_size=200, grid=4)
    got = to_canvas(pointing_spans("<|begin_of_box|>[600, 350, 650, 400]<|end_of_box|>"), frames_for({}), canvas)
    np.testing.assert_allclose(got, [(2.0, 1.0)], atol=1e-9)
    # incomplete boxes are skipped, never raised on
    assert pointing_spans("<|begin_of_box|>[1, 2, 3]<|end_of_box|>")[0].points == []
    assert pointing_spans("<|begin_of_box|>[1, 2, 3, 4]") == [] and pointing_spans("<|begin_of_box|>" * 2000) == []


def test_generated_text_keeps_glm_grounding_markers():
    from vlmbind.tiny.common import build_tokenizer

    tok = build_tokenizer(["<|user|>", "<|begin_of_box|>", "<|end_of_box|>"], eos_token="<|user|>")
    text = "<|begin_of_box|>[100, 200, 300, 400]<|end_of_box|>"
    ids = tok(text + "<|user|>", add_special_tokens=False)["input_ids"]
    assert decode_generated(tok, ids) == text
    assert "<|begin_of_box|>" not in tok.decode(ids, skip_special_tokens=True)  # the plain decode loses them


def test_generated_text_keeps_internvl_grounding_markers():
    from vlmbind.tiny.common import build_tokenizer

    tok = build_tokenizer(["<|im_end|>", "<ref>", "</ref>", "<box>", "</box>"], eos_token="<|im_end|>")
    text = "<ref>red circle</ref><box>[[100, 200, 300, 400]]</box>"
    ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert decode_generated(tok, ids) == text
    assert "<box>" not in tok.decode(ids, skip_special_tokens=True)  # the plain decode loses them: not vacuous


@pytest.mark.parametrize("text", [
    "There are a total of 2 red shapes and the total is 3.",
    "A total of 2 are red; 3 objects in total.",
    "Total: 1 circle and 2 squares, a total of 3.",
    "The answer is 1. Let me recount: the answer is 3.",
    "A total of 2 squares, so in total 3.",  # "so in total" is no count: "total 3" still marks one
])
def test_count_reads_the_last_marked_total(text):
    """A reply that states a running total and then a final one is read at the final one (the last marked total):
    every text here marks 3 last and a smaller number before it."""
    assert read_count(text) == 3


@pytest.mark.parametrize("text, count", [
    ("2.5", None),
    ("There are 3.5 objects.", None),
    ("About 2.5 per row; 4 objects.", 4),
    ("Each is 0.5 wide; there are two.", 2),
    ("A total of 2.5 objects.", None),  # a marked total is a count only when it is whole
    ("2.5 in total", None),
    ("The answer is 2.5.", None),
    ("The answer is 2.5, so 4 in total.", 4),
])
def test_a_decimal_is_never_a_count(text, count):
    """``2.5`` is neither the count 2 nor 5: a decimal is skipped and the first whole number (or none) is read."""
    assert read_count(text) == count


def test_non_square_images_scale_x_by_width_and_y_by_height_in_every_frame():
    """Points on a non-square image, processed to a non-square size, on a grid with more columns than rows: each
    axis is scaled by its own side. Worked by hand for the centre of cell (column 2, row 1):

    canvas 200 px, grid 2 rows x 4 cols -> cells 50 px wide, 100 px tall -> canvas pixel (125, 150);
    original image (width 400, height 100) -> pixel (125 * 400 / 200, 150 * 100 / 200) = (250, 75);
    per-mille (250 / 400, 75 / 100) * 1000 = (625, 750); percent (62.5, 75);
    resized to (width 320, height 60) -> (250 * 320 / 400, 75 * 60 / 100) = (200, 45).
    """
    canvas = Canvas(image_size=200, grid=(2, 4))
    written = {"canvas": (2, 1), "pixels": (250, 75), "permille": (625, 750), "percent": (62.5, 75),
               "resized": (200, 45)}
    assert set(written) == set(FRAMES)
    for frame, (x, y) in written.items():
        got = to_canvas(pointing_spans(f"({x}, {y})"), {"tuple": frame}, canvas, image_size=(400, 100),
                        resized_size=(320, 60))
        np.testing.assert_allclose(got, [(2.0, 1.0)], atol=1e-9, err_msg=frame)
    # the formats that carry their own frame: a Molmo tag (percent) and a Qwen2-VL box (per-mille, its centre)
    text = '<point x="62.5" y="75">a</point> <|box_start|>(600,700),(650,800)<|box_end|>'
    got = to_canvas(pointing_spans(text), frames_for({}), canvas, image_size=(400, 100))
    np.testing.assert_allclose(got, [(2.0, 1.0), (2.0, 1.0)], atol=1e-9)
