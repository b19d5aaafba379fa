"""Visual search, counting and the point parser: pixels, invariants, determinism, bad parameters, properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import majority_colour
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from scipy import ndimage

from vlmbind.stimuli.core import COLOURS, SHAPES, Canvas, Dataset, StimulusError, render
from vlmbind.stimuli.points import format_points, p2a_text, parse_count, parse_points, parse_yes_no
from vlmbind.stimuli.search import COUNT_SPLITS, SEARCH_SPLITS, counting, visual_search

SMALL_SEARCH = Canvas(image_size=224, grid=8)  # 8x8 cells of 28 px: fast, and still fits 50 objects


def _n_regions(img: Image.Image) -> int:
    """Connected regions of non-white pixels (8-connectivity)."""
    ink = (np.asarray(img) != 255).any(-1)
    return int(ndimage.label(ink, structure=np.ones((3, 3)))[1])


def _check_pixels(ds: Dataset) -> None:
    """Every object has its colour, the objects do not overlap and the image is exactly its metadata drawn."""
    canvas = Canvas(image_size=ds.params["canvas"]["image_size"], grid=tuple(ds.params["canvas"]["grid"]),
                    object_size=ds.params["canvas"]["object_size"])
    for e in ds:
        assert len(e.objects) == e.fields["n_objects"] == _n_regions(e.image)
        cells = [(o.row, o.col) for o in e.objects]
        assert len(set(cells)) == len(cells), "one object per cell"
        for a in e.objects:
            for b in e.objects:
                if a is not b:  # bounding boxes are disjoint
                    assert a.box[2] <= b.box[0] or b.box[2] <= a.box[0] or a.box[3] <= b.box[1] or b.box[3] <= a.box[1]
        for o in e.objects:
            assert majority_colour(e.image, o.box) == COLOURS[o.colour]
        assert np.array_equal(np.asarray(render(canvas, e.objects)), np.asarray(e.image))


# ------------------------------------------------------------------------------------------------------------------
# visual search
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["disjunctive", "conjunctive"])
@pytest.mark.parametrize("regime", ["direct", "p2a"])
def test_search_pixels_targets_and_answers(kind, regime):
    ds = visual_search(16, seed=1, kind=kind, regime=regime, canvas=SMALL_SEARCH)
    assert ds.task == "search" and len(ds) == 16
    _check_pixels(ds)
    target = ("green", "circle") if kind == "disjunctive" else ("green", "L")
    assert {e.prompt for e in ds} == {f"is there a {target[0]} {target[1]} ?"}
    for e in ds:
        f = e.fields
        is_target = [(o.colour, o.shape) == target for o in e.objects]
        assert f["present"] == any(is_target) == (f["answer_direct"] == "yes")
        assert f["targets"] == [j for j, t in enumerate(is_target) if t] and len(f["targets"]) == f["n_targets"]
        assert f["target"] == (f["targets"][0] if f["present"] else None)
        assert f["points"] == [[e.objects[j].col, e.objects[j].row] for j in f["targets"]]
        assert e.answer == (f["answer_p2a"] if regime == "p2a" else f["answer_direct"])
        assert parse_yes_no(e.answer) == f["answer_direct"]
        assert parse_points(f["answer_p2a"]) == [tuple(map(float, p)) for p in f["points"]]
        if not f["present"]:
            assert f["answer_p2a"] == "none no"
        # the target's pixels really are at its grid point: the cell's colour is green
        for x, y in f["points"]:
            o = next(o for o in e.objects if (o.col, o.row) == (x, y))
            assert majority_colour(e.image, o.box) == COLOURS["green"]
    assert {e.fields["present"] for e in ds} == {True, False}


def test_search_distractors_share_exactly_the_right_features():
    conj = visual_search(12, seed=2, kind="conjunctive", n_objects=(20, 50), canvas=SMALL_SEARCH)
    kinds = set()
    for e in conj:
        for j, o in enumerate(e.objects):
            if j in e.fields["targets"]:
                continue
            shared = (o.colour == "green") + (o.shape == "L")
            assert shared == 1, f"distractor {o.name} shares {shared} features with the green L"
            kinds.add(o.name)
        assert e.fields["n_colour_distractors"] == sum(o.name == "red L" for o in e.objects)
        assert e.fields["n_shape_distractors"] == sum(o.name == "green T" for o in e.objects)
    assert kinds == {"red L", "green T"}
    disj = visual_search(6, seed=2, kind="disjunctive", n_objects=(20, 50), canvas=SMALL_SEARCH)
    for e in disj:
        assert {o.name for j, o in enumerate(e.objects) if j not in e.fields["targets"]} == {"red circle"}


def test_search_counts_presence_and_splits():
    ds = visual_search(40, seed=3, n_objects=[2, 7, 50], canvas=SMALL_SEARCH)
    assert {e.fields["n_objects"] for e in ds} == {2, 7, 50}
    assert ds.params["n_objects"] == [2, 7, 50]
    assert sum(ds.summary["object_counts"].values()) == 40
    assert all(e.fields["present"] for e in visual_search(10, n_objects=5, present=1.0, canvas=SMALL_SEARCH))
    assert not any(e.fields["present"] for e in visual_search(10, n_objects=5, present=0.0, canvas=SMALL_SEARCH))
    half = visual_search(200, seed=4, n_objects=(1, 3), canvas=Canvas(image_size=32, grid=2))
    assert 70 <= half.summary["n_present"] <= 130
    train = visual_search(10, n_objects=SEARCH_SPLITS["train"], canvas=SMALL_SEARCH)
    assert {e.fields["n_objects"] for e in train} == {1}
    ood = visual_search(30, n_objects=SEARCH_SPLITS["ood"], canvas=SMALL_SEARCH)
    assert all(2 <= e.fields["n_objects"] <= 50 for e in ood)


def test_search_many_targets_in_raster_order():
    ds = visual_search(12, seed=5, kind="conjunctive", n_objects=(10, 30), n_targets=(2, 6), present=1.0,
                       regime="p2a", canvas=SMALL_SEARCH)
    _check_pixels(ds)
    for e in ds:
        pts = e.fields["points"]
        assert 2 <= len(pts) <= 6 and len(pts) == e.fields["n_targets"]
        assert pts == sorted(pts, key=lambda p: (p[1], p[0])), "raster order: row, then column"
        assert e.answer.endswith(" yes") and parse_points(e.answer) == [tuple(map(float, p)) for p in pts]


# ------------------------------------------------------------------------------------------------------------------
# counting
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("diversity", ["low", "high"])
def test_counting_pixels_points_and_diversity(diversity):
    ds = counting(12, seed=0, diversity=diversity, regime="p2a", canvas=Canvas(image_size=160, grid=5))
    assert ds.task == "count"
    _check_pixels(ds)
    n_colours = []
    for e in ds:
        k = e.fields["n_objects"]
        assert e.prompt == "how many objects are there ?"
        assert e.fields["answer_direct"] == str(k) and parse_count(e.answer) == k == _n_regions(e.image)
        pts = e.fields["points"]
        assert pts == [[o.col, o.row] for o in e.objects]
        assert pts == sorted(pts, key=lambda p: (p[1], p[0])) and len(pts) == k
        assert parse_points(e.answer) == [tuple(map(float, p)) for p in pts]
        assert e.answer == f"{format_points(pts)} {k}"
        if diversity == "low":
            assert len({(o.colour, o.shape) for o in e.objects}) == 1
        assert e.fields["n_colours"] == len({majority_colour(e.image, o.box) for o in e.objects})
        n_colours.append(e.fields["n_colours"])
    assert all(1 <= k <= 20 for k in (e.fields["n_objects"] for e in ds))
    if diversity == "high":
        assert max(n_colours) >= 4
        assert len({o.shape for e in ds for o in e.objects}) == len(SHAPES)


def test_counting_ood_range_and_explicit_values():
    canvas = Canvas(image_size=96, grid=5)
    ood = counting(40, seed=1, objects=COUNT_SPLITS["ood"], canvas=canvas)
    assert {e.fields["n_objects"] for e in ood} == set(range(11, 16))
    same = counting(40, seed=1, objects=range(11, 16), canvas=canvas)
    assert ood.answers == same.answers and ood.params == same.params
    train = counting(30, seed=1, objects=COUNT_SPLITS["train"], canvas=canvas)
    assert {int(a) for a in train.answers} <= set(range(5, 11))
    assert {e.fields["n_objects"] for e in counting(20, objects=[3, 12], canvas=canvas)} == {3, 12}
    pool = counting(10, diversity="high", colours=["red", "blue"], shapes=["L", "T"], objects=8, canvas=canvas)
    assert {o.colour for e in pool for o in e.objects} == {"red", "blue"}
    assert {o.shape for e in pool for o in e.objects} == {"L", "T"}


# ------------------------------------------------------------------------------------------------------------------
# determinism and parameters
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda n, seed: visual_search(n, seed, kind="conjunctive", regime="p2a", canvas=SMALL_SEARCH),
    lambda n, seed: counting(n, seed, diversity="high", regime="p2a", canvas=Canvas(image_size=96, grid=5)),
])
def test_same_seed_same_bytes(make, tmp_path):
    a, b = make(6, 7).save(tmp_path / "a"), make(6, 7).save(tmp_path / "b")
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert len(files) == 6 + 2
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    longer = make(9, 7)  # a larger n keeps the first examples
    assert longer.answers[:6] == make(6, 7).answers
    assert [o.to_dict() for o in longer[5].objects] == [o.to_dict() for o in make(6, 7)[5].objects]
    other = make(6, 8)
    assert [e.objects for e in other] != [e.objects for e in make(6, 7)]
    back = Dataset.load(a)
    assert back.answers == make(6, 7).answers and back[0].fields == make(6, 7)[0].fields


@pytest.mark.parametrize("call, match", [
    (lambda: visual_search(1, n_objects=51), "51 outside 1..50"),
    (lambda: visual_search(1, n_objects=(40, 51)), "51 outside 1..50"),
    (lambda: visual_search(1, n_objects=50, canvas=Canvas(image_size=448, grid=5)), "use grid=8"),
    (lambda: visual_search(1, kind="conjuntive"), "Did you mean 'conjunctive'"),
    (lambda: visual_search(1, regime="pointing"), "unknown regime"),
    (lambda: visual_search(1, present=1.5), "probability"),
    (lambda: visual_search(1, n_objects=0), "0 outside"),
    (lambda: visual_search(1, n_objects=(3, 1)), "lo > hi"),
    (lambda: visual_search(1, n_objects=(1, 2, 3)), "pass a list"),
    (lambda: visual_search(1, n_objects=2, n_targets=3), "lower n_targets"),
    (lambda: visual_search(-1), "n must be"),
    (lambda: counting(1, objects=30), "use grid=6"),
    (lambda: counting(1, objects=[]), "allows no count"),
    (lambda: counting(1, diversity="medium"), "unknown diversity"),
    (lambda: counting(1, colours=["green", "mauve"]), "unknown colour 'mauve'"),
    (lambda: counting(1, shapes=["circel"]), "Did you mean 'circle'"),
])
def test_bad_parameters_raise(call, match):
    with pytest.raises(StimulusError, match=match):
        call()


def test_parameters_are_recorded():
    ds = visual_search(2, seed=9, kind="conjunctive", n_objects=(3, 5), present=0.25, regime="p2a",
                       canvas=SMALL_SEARCH)
    assert ds.seed == 9 and ds.params == {
        "kind": "conjunctive", "n_objects": [3, 4, 5], "present": 0.25, "regime": "p2a", "n_targets": [1],
        "canvas": SMALL_SEARCH.to_dict()}
    assert ds.summary["target"] == {"colour": "green", "shape": "L"}


# ------------------------------------------------------------------------------------------------------------------
# points: formatting and parsing
# ------------------------------------------------------------------------------------------------------------------
def test_parser_reads_every_style_in_order():
    assert parse_points("(1, 2) (3,4) ( 5 ,6 ) 3") == [(1, 2), (3, 4), (5, 6)]
    assert parse_points("(1.5, -2) (.5, 3.) (1e2, 0)") == [(1.5, -2), (0.5, 3), (100, 0)]
    molmo = ('first (9, 9) then <point x="12.5" y="40" alt="dog">dog (7, 7)</point> and '
             '<points x1="1" y1="2" x2="3.5" y2="4" alt="cats">cats</points> last (0, 1)')
    assert parse_points(molmo) == [(9, 9), (12.5, 40), (1, 2), (3.5, 4), (0, 1)]
    assert parse_points('<points x2="3" y2="4" x1="1" y1="2">') == [(1, 2), (3, 4)]  # by index, not attribute order
    molmo2 = 'Counting the <points coords="1 1 073 160 2 173 600;2 1 500 500" alt="boats">the boats</points> is 3.'
    assert parse_points(molmo2) == [(73, 160), (173, 600), (500, 500)]
    assert parse_count(molmo2) == 3
    assert parse_points("(a, b) (1, 2 (3, 4, 5) 42 (6 , ) ((7, 8)") == [(7, 8)]
    assert parse_points('<point x="1">no y</point> <point x="a" y="2"> <point x="1" y="2"') == []
    assert parse_points("(1e999, 2) (nan, 3)") == []
    assert parse_points("none no") == [] and parse_points("") == []


def test_count_and_yes_no():
    assert parse_count("(1, 2) (3, 4) 2") == 2
    assert parse_count("7") == 7 and parse_count("there are 12.") == 12
    assert parse_count("(1, 2) (3, 4)") is None and parse_count("2.5") is None and parse_count("x7 7b") is None
    assert parse_count("3 (1, 2) 5 6") == 6  # the final integer after the points
    assert parse_count("9" * 5000) is None  # too long for int(): not a count, and no exception
    assert parse_yes_no("(2, 5) yes") == "yes" and parse_yes_no("none no") == "no"
    assert parse_yes_no("Yes, there is") == "yes" and parse_yes_no("none") is None
    assert parse_yes_no("no (1, 2) yes no") == "yes"  # the first answer after the points
    assert p2a_text([], "no") == "none no" and p2a_text([(3, 1)], "yes") == "(3, 1) yes"


def test_format_rejects_bad_points():
    assert format_points([]) == "" and format_points([(np.int64(2), np.float32(0.5))]) == "(2, 0.5)"
    for bad in ([(1, 2, 3)], [(1, math.inf)], [(True, 1)], [("1", 2)]):
        with pytest.raises(StimulusError):
            format_points(bad)


_coord = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False))
_points = st.lists(st.tuples(_coord, _coord), max_size=20)


@settings(max_examples=200, deadline=None)
@given(_points)
def test_format_then_parse_is_identity(points):
    text = format_points(points)
    assert parse_points(text) == [(float(x), float(y)) for x, y in points]
    if points:
        assert parse_count(f"{text} {len(points)}") == len(points)


_tricky = st.sampled_from(["(", ")", ",", " ", "1", "2.5", "-", ".", "e", "<point", "<points", ">", "</point>",
                           'x="', 'y="', 'x1="', '"', "coords=", ";", "yes", "no", "\n", "9" * 400])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(_tricky, max_size=60).map("".join)))
def test_parsing_never_raises(text):
    pts = parse_points(text)
    assert all(isinstance(p, tuple) and len(p) == 2 and all(math.isfinite(v) for v in p) for p in pts)
    count, answer = parse_count(text), parse_yes_no(text)
    assert count is None or count >= 0
    assert answer in (None, "yes", "no")


# junk that cannot form a point by itself or next to its neighbours (pieces are joined with spaces)
_junk = st.sampled_from(["the", "yes", "no", "none", "x", "y", "(", ")", "(a, b)", "(1, b)", "42", "3.5",
                         "(1, 2, 3)", "<point", "alt=", "((", "))", ":", "?"])
_small = st.one_of(st.integers(0, 1000), st.floats(0, 1000, allow_nan=False).map(lambda v: round(v, 3)))


@st.composite
def _point_group(draw):
    """One point-bearing piece in a random style and the points it holds."""
    style = draw(st.sampled_from(["plain", "tight", "molmo", "molmo_many"]))
    if style == "molmo_many":
        pts = draw(st.lists(st.tuples(_small, _small), min_size=1, max_size=4))
        attrs = " ".join(f'x{k}="{x}" y{k}="{y}"' for k, (x, y) in enumerate(pts, 1))
        return f'<points {attrs} alt="things">things</points>', pts
    x, y = draw(_small), draw(_small)
    text = {"plain": f"({x}, {y})", "tight": f"({x},{y})", "molmo": f'<point x="{x}" y="{y}" alt="it">it</point>'}
    return text[style], [(x, y)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_junk.map(lambda j: (j, [])), _point_group()), max_size=25))
def test_points_in_junk_are_found_in_order(pieces):
    text = " ".join(t for t, _ in pieces)
    expected = [(float(x), float(y)) for _, pts in pieces for x, y in pts]
    assert parse_points(text) == expected
