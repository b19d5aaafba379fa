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


def test_generated_text_keeps_internvl_grounding_markers():
    from vlmbind.tiny.common import build_tokenizer

    tok = build_tokenizer(["<|im_end|>", "<ref>", "</ref>", "<box>", "</box>"], eos_token="<|im_end|>")
    text = "<ref>red circle</ref><box>[[100, 200, 300, 400]]</box>"
    ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert decode_generated(tok, ids) == text
    assert "<box>" not in tok.decode(ids, skip_special_tokens=True)  # the plain decode loses them: not vacuous
