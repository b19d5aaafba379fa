"""The stimuli core: canvas checks, drawing, data sets on disk, user images, objects mapped to a model's tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import get_tiny
from PIL import Image

from vlmbind.stimuli.core import (
    COLOURS,
    LETTERS,
    SHAPES,
    Canvas,
    Dataset,
    Example,
    StimulusError,
    object_token_positions,
    place,
    render,
)
from vlmbind.stimuli.user import user_images


@pytest.mark.parametrize("shape", SHAPES + LETTERS)
def test_every_shape_draws_only_its_colour_inside_its_box(shape):
    canvas = Canvas(image_size=120, grid=3)
    obj = place(canvas, "purple", shape, 1, 1)
    img = render(canvas, [obj])
    arr = np.asarray(img)
    ink = (arr != 255).any(-1)
    ys, xs = np.nonzero(ink)
    x0, y0, x1, y1 = obj.box
    assert ink.sum() > 0.15 * obj.size**2, "a shape must have substance"
    assert xs.min() >= x0 and xs.max() + 1 <= x1 and ys.min() >= y0 and ys.max() + 1 <= y1  # pixel [x, x+1)
    assert {tuple(p) for p in arr[ink]} == {COLOURS["purple"]}  # no anti-aliasing: one exact colour


def test_shapes_are_distinguishable():
    canvas = Canvas(image_size=64, grid=1)
    masks = {s: (np.asarray(render(canvas, [place(canvas, "red", s, 0, 0)])) != 255).any(-1) for s in SHAPES + LETTERS}
    names = list(masks)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (masks[a] != masks[b]).sum() > 20, (a, b)


def test_canvas_validation():
    with pytest.raises(StimulusError, match="does not fit a cell"):
        Canvas(image_size=100, grid=4, object_size=40)
    with pytest.raises(StimulusError, match="under 4 px"):
        Canvas(image_size=20, grid=8)
    with pytest.raises(StimulusError, match="use grid=3"):
        Canvas(image_size=90, grid=2).check_fits(5)
    assert Canvas(image_size=90, grid=(2, 3)).n_cells == 6


def test_dataset_round_trip_and_atomic_save(tmp_path):
    canvas = Canvas(image_size=96, grid=2)
    objs = [place(canvas, "red", "square", 0, 0), place(canvas, "blue", "L", 1, 1)]
    ds = Dataset("demo", [Example("e0", render(canvas, objs), objs, "the red object is a", "square", "demo",
                                  {"target": 0})], {"canvas": canvas.to_dict()}, seed=3, summary={"note": 1})
    out = ds.save(tmp_path / "ds")
    assert sorted(p.name for p in out.iterdir()) == ["dataset.json", "images", "meta.jsonl"]
    back = Dataset.load(out)
    assert back.prompts == ds.prompts and back.answers == ds.answers and back.seed == 3
    assert back[0].objects == objs and back[0].fields == {"target": 0}
    assert np.array_equal(np.asarray(back[0].image), np.asarray(ds[0].image))
    assert json.loads((out / "dataset.json").read_text())["note"] == 1
    # a failing save leaves the previous data set intact and no temporary directory behind
    class FullDisk:
        def save(self, *args, **kwargs):
            raise OSError("disk full")

    bad = Dataset("demo", [Example("e0", FullDisk(), [], "p", "a", "demo")], {}, seed=0)
    with pytest.raises(OSError, match="disk full"):
        bad.save(out)
    assert Dataset.load(out).prompts == ds.prompts
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(StimulusError, match="not a directory"):
        ds.save(tmp_path / "file")


def test_objects_aligned_with_model_token_grid():
    """On a canvas whose cells coincide with the model's token boxes, each object covers exactly its cell's token."""
    vlm = get_tiny("tiny-qwen2_5_vl")  # 224 px -> 8x8 tokens of 28 px
    canvas = Canvas(image_size=224, grid=8, object_size=20)
    objs = [place(canvas, "red", "circle", 2, 5), place(canvas, "green", "T", 7, 0)]
    batch = vlm.prepare(render(canvas, objs), "the red object is a")
    ti = batch.index[0]
    positions = object_token_positions(ti, objs)
    grid = ti.grids[0]
    assert [p.tolist() for p in positions] == [[grid.positions[2, 5]], [grid.positions[7, 0]]]
    # an object straddling cells covers each token it touches
    big = Canvas(image_size=224, grid=4, object_size=40)
    obj = place(big, "blue", "square", 0, 0)  # centre (28, 28), box 8..48 -> token cells 0..1
    got = object_token_positions(ti, [obj])[0]
    assert sorted(got.tolist()) == sorted(grid.positions[:2, :2].reshape(-1).tolist())


def test_user_images(tmp_path):
    Image.new("RGB", (40, 30), "red").save(tmp_path / "b.png")
    Image.new("L", (20, 20), 128).save(tmp_path / "a.jpg")
    (tmp_path / "notes.txt").write_text("ignored")
    ds = user_images(tmp_path)
    assert [e.fields["source"] for e in ds] == ["a.jpg", "b.png"]
    assert all(e.image.mode == "RGB" for e in ds)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"image": "b.png", "prompt": "what colour ?", "answer": "red", "tag": 1}\n\n')
    ds = user_images(tmp_path, prompts)
    assert len(ds) == 1 and ds[0].answer == "red" and ds[0].fields["tag"] == 1
    for text, match in [('{"image": "zzz.png", "prompt": "p"}', "not in the folder"), ("{oops", "not JSON"),
                        ('{"image": "b.png", "prompt": " "}', "empty"), ('{"image": "b.png"}', "'prompt'")]:
        prompts.write_text(text + "\n")
        with pytest.raises(StimulusError, match=match):
            user_images(tmp_path, prompts)
    (tmp_path / "c.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(StimulusError, match="c.png"):
        user_images(tmp_path)
    with pytest.raises(StimulusError, match="no .png"):
        user_images(tmp_path / "images" if (tmp_path / "images").exists() else _empty(tmp_path))


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d
