"""Scene description, its counterfactual pairs, and the binding query task: pixels, metadata, invariants, ceilings."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from helpers import get_tiny

from vlmbind.engine.alignment import check_alignment
from vlmbind.stimuli.core import BACKGROUND, COLOURS, Canvas, PairAlignmentError, StimulusError, render
from vlmbind.stimuli.query import answer_distribution, binding_query, pair_features
from vlmbind.stimuli.scenes import (
    CONDITIONS,
    PairSet,
    scene_description,
    scene_pairs,
)

CANVAS = Canvas(image_size=224, grid=3)


# ------------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------------
def cell_slice(canvas: Canvas, row: int, col: int) -> tuple[slice, slice]:
    x0, y0, x1, y1 = canvas.cell_box(row, col)
    return slice(round(y0), round(y1)), slice(round(x0), round(x1))


def check_pixels(example, canvas: Canvas = CANVAS) -> None:
    """Each object's colour dominates its box, its cell holds exactly its own drawing, and nothing else is drawn."""
    img = np.asarray(example.image)
    assert img.shape == (canvas.image_size, canvas.image_size, 3)
    covered = np.zeros(img.shape[:2], dtype=bool)
    assert len({(o.row, o.col) for o in example.objects}) == len(example.objects), "two objects share a cell"
    for o in example.objects:
        x0, y0, x1, y1 = (int(v) for v in o.box)
        box = img[y0:y1, x0:x1].reshape(-1, 3)
        non_bg = [tuple(p) for p in box if tuple(p) != BACKGROUND]
        assert non_bg, f"{o.name} drew nothing"
        assert Counter(non_bg).most_common(1)[0][0] == COLOURS[o.colour], f"{o.name} has the wrong colour"
        # the object alone stays inside its own cell, and the scene's cell is exactly that drawing (shape checked)
        alone = np.asarray(render(canvas, [o]))
        ys, xs = cell_slice(canvas, o.row, o.col)
        outside = (alone != 255).any(-1)
        outside[ys, xs] = False
        assert not outside.any(), f"{o.name} spills out of its cell"
        np.testing.assert_array_equal(img[ys, xs], alone[ys, xs])
        covered[ys, xs] = True
    assert (img[~covered] == 255).all(), "pixels drawn outside every object's cell"


def expected_scene_prompt(example) -> str:
    listed = " , ".join(f"a {example.objects[i].name}" for i in example.fields["described"])
    return f"in this image there is {listed} and a"


def files_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------------------------
# scene description
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entropy", ["high", "low"])
def test_scene_description_metadata_and_pixels(entropy):
    ds = scene_description(12, seed=3, entropy=entropy, n_objects=(2, 4))
    assert ds.task == "scene" and len(ds) == 12
    assert ds.params["canvas"] == CANVAS.to_dict() and ds.params["entropy"] == entropy
    sizes = set()
    for e in ds:
        n = len(e.objects)
        sizes.add(n)
        assert 2 <= n <= 4 and e.fields["n_objects"] == n and e.fields["entropy"] == entropy
        assert sorted([*e.fields["described"], e.fields["target"]]) == list(range(n))
        assert e.prompt == expected_scene_prompt(e)
        assert e.answer == e.objects[e.fields["target"]].name
        assert e.objects[e.fields["target"]].name not in e.prompt
        assert re.fullmatch(r"[a-z ,]+", e.prompt) and "  " not in e.prompt
        names = [o.name for o in e.objects]
        assert len(set(names)) == n, "conjunctions repeat"
        colours, shapes = [o.colour for o in e.objects], [o.shape for o in e.objects]
        if entropy == "high":
            assert len(set(colours)) == n and len(set(shapes)) == n
        else:
            assert len(set(colours)) < n or len(set(shapes)) < n, "a low-entropy scene shares no feature"
        check_pixels(e)
    assert sizes == {2, 3, 4}
    assert sum(ds.summary["n_objects_counts"].values()) == 12


def test_scene_two_objects_prompt_form():
    e = scene_description(1, seed=0, n_objects=2)[0]
    first = e.objects[e.fields["described"][0]]
    assert e.prompt == f"in this image there is a {first.name} and a"
    assert e.answer == e.objects[e.fields["target"]].name and len(e.answer.split()) == 2


def test_scene_low_entropy_four_objects_is_a_full_two_by_two():
    for e in scene_description(5, seed=1, n_objects=4, entropy="low"):
        colours, shapes = Counter(o.colour for o in e.objects), Counter(o.shape for o in e.objects)
        assert sorted(colours.values()) == [2, 2] and sorted(shapes.values()) == [2, 2]


def test_scene_custom_pools_are_respected():
    ds = scene_description(10, seed=2, n_objects=3, colours=["red", "blue", "green"],
                           shapes=["circle", "square", "star"])
    for e in ds:
        assert {o.colour for o in e.objects} == {"red", "blue", "green"}
        assert {o.shape for o in e.objects} == {"circle", "square", "star"}


def test_scene_larger_n_keeps_first_examples():
    small, large = scene_description(4, seed=9), scene_description(8, seed=9)
    for a, b in zip(small, large):
        assert a.prompt == b.prompt and a.objects == b.objects and a.image.tobytes() == b.image.tobytes()
    other = scene_description(4, seed=10)
    assert [e.objects for e in other] != [e.objects for e in small]


@pytest.mark.parametrize(
    "make",
    [
        lambda d: scene_description(6, seed=4, entropy="low").save(d),
        lambda d: scene_pairs(5, "id_retrieval", seed=4).save(d),
        lambda d: scene_pairs(5, "feature_retrieval", seed=4, entropy="low").save(d),
        lambda d: binding_query(6, seed=4).save(d),
    ],
    ids=["scene", "pairs_id", "pairs_feature", "query"],
)
def test_same_seed_same_bytes(tmp_path, make):
    make(tmp_path / "a")
    make(tmp_path / "b")
    a, b = files_bytes(tmp_path / "a"), files_bytes(tmp_path / "b")
    assert a.keys() == b.keys() and len(a) > 3
    assert a == b


# ------------------------------------------------------------------------------------------------------------------
# counterfactual pairs
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entropy", ["high", "low"])
@pytest.mark.parametrize("condition", CONDITIONS)
def test_pair_invariants(condition, entropy):
    ps = scene_pairs(10, condition, seed=5, entropy=entropy)
    clean_ref = scene_description(10, seed=5, entropy=entropy, n_objects=(3, 4))
    assert ps.condition == condition and len(ps) == 10
    for p, ref in zip(ps, clean_ref):
        c, f = p.clean, p.counterfactual
        # the clean scenes are the scene-description task's, under every condition
        assert c.objects == ref.objects and c.prompt == ref.prompt and c.image.tobytes() == ref.image.tobytes()
        assert c.prompt == f.prompt and c.id == f"{p.id}-clean" and f.id == f"{p.id}-cf"
        described, t = c.fields["described"], c.fields["target"]
        j = described[-1]
        assert p.answer == c.answer == c.objects[t].name
        assert p.answer != p.answer_counterfactual
        words, words_cf = p.answer.split(), p.answer_counterfactual.split()
        k = p.first_difference
        assert words[:k] == words_cf[:k] and words[k] != words_cf[k]
        if condition == "feature_retrieval":
            assert p.patch == {"kind": "last"}
            rec = f.fields["recoloured"]
            assert rec["object"] == t and rec["from"] == c.objects[t].colour
            assert rec["to"] not in {o.colour for o in c.objects}
            for i, (a, b) in enumerate(zip(c.objects, f.objects)):
                if i == t:
                    assert b == replace(a, colour=rec["to"])
                else:
                    assert a == b
            assert p.answer_counterfactual == f"{rec['to']} {c.objects[t].shape}" and k == 0
            assert f.answer == p.answer_counterfactual
        else:
            assert f.fields["swapped"] == [j, t]
            oj, ot, fj, ft = c.objects[j], c.objects[t], f.objects[j], f.objects[t]
            assert (fj.colour, fj.shape, fj.row, fj.col, fj.x, fj.y) == \
                (oj.colour, oj.shape, ot.row, ot.col, ot.x, ot.y)
            assert (ft.colour, ft.shape, ft.row, ft.col, ft.x, ft.y) == \
                (ot.colour, ot.shape, oj.row, oj.col, oj.x, oj.y)
            assert all(a == b for i, (a, b) in enumerate(zip(c.objects, f.objects)) if i not in (j, t))
            assert p.answer_counterfactual == oj.name and f.answer == p.answer
            assert k == (0 if oj.colour != ot.colour else 1)
            if condition == "id_retrieval":
                assert p.patch["kind"] == "span" and p.patch["text"] == oj.name and p.patch["object"] == j
                assert c.prompt.endswith(f"a {oj.name} and a")
            else:
                assert p.patch == {"kind": "last"}
        check_pixels(c)
        check_pixels(f)
    assert sum(ps.summary["first_difference_counts"].values()) == 10


def test_low_entropy_swaps_can_first_differ_at_the_shape():
    ps = scene_pairs(40, "id_selection", seed=0, entropy="low")
    firsts = Counter(p.first_difference for p in ps)
    assert firsts[0] > 0 and firsts[1] > 0
    assert ps.summary["first_difference_counts"] == {"colour": firsts[0], "shape": firsts[1]}


def test_pairset_roundtrip(tmp_path):
    ps = scene_pairs(4, "id_retrieval", seed=6, entropy="low")
    out = ps.save(tmp_path / "pairs")
    names = sorted(p.name for p in (out / "images").iterdir())
    assert names == sorted(f"{p.id}-{side}.png" for p in ps for side in ("clean", "cf"))
    assert len((out / "pairs.jsonl").read_text().splitlines()) == 4 and not (out / "meta.jsonl").exists()
    back = PairSet.load(out)
    assert back.condition == "id_retrieval" and back.seed == 6 and back.params == ps.params
    assert back.summary == ps.summary
    for a, b in zip(ps, back):
        assert (a.id, a.patch, a.answer, a.answer_counterfactual, a.first_difference) == \
            (b.id, b.patch, b.answer, b.answer_counterfactual, b.first_difference)
        for x, y in ((a.clean, b.clean), (a.counterfactual, b.counterfactual)):
            assert x.objects == y.objects and x.prompt == y.prompt and x.answer == y.answer and x.fields == y.fields
            assert x.image.tobytes() == y.image.tobytes()
    assert [e.id for e in back.clean] == [f"{p.id}-clean" for p in ps]
    assert [e.id for e in back.counterfactual] == [f"{p.id}-cf" for p in ps]
    scene_description(2, seed=0).save(tmp_path / "scene")
    with pytest.raises(StimulusError, match="not scene_pairs"):
        PairSet.load(tmp_path / "scene")


# ------------------------------------------------------------------------------------------------------------------
# alignment on real processors
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-llava"])
@pytest.mark.parametrize("condition", ["id_retrieval", "feature_retrieval"])
def test_check_alignment_positions(name, condition):
    vlm = get_tiny(name)
    ps = scene_pairs(3, condition, seed=7, n_objects=(2, 4))
    al = check_alignment(vlm, ps)
    assert len(al) == 3 and al.clean.seq_len == al.counterfactual.seq_len
    tok = vlm.adapter.tokenizer
    for r, (p, pos) in enumerate(zip(ps, al.positions)):
        ids = al.clean.inputs["input_ids"][r]
        assert (ids == al.counterfactual.inputs["input_ids"][r]).all()
        if p.patch["kind"] == "span":
            assert tok.decode(ids[pos]).strip() == p.patch["text"]
            assert pos.max() < al.clean.index[r].last_position  # the described object, not the last token
        else:
            assert pos.tolist() == [al.clean.index[r].last_position]
            assert tok.decode(ids[pos]).strip() == "a"


def test_check_alignment_with_chat_template():
    ps = scene_pairs(2, "id_retrieval", seed=8)
    al = check_alignment(get_tiny("tiny-qwen2_5_vl"), ps, chat=True)
    tok = get_tiny("tiny-qwen2_5_vl").adapter.tokenizer
    for r, (p, pos) in enumerate(zip(ps, al.positions)):
        assert tok.decode(al.clean.inputs["input_ids"][r][pos]).strip() == p.patch["text"]


def test_check_alignment_span_is_the_described_occurrence():
    """A prompt prefix repeating the object's words must not move the span off the described object."""
    p = scene_pairs(1, "id_retrieval", seed=9)[0]
    text = p.patch["text"]
    prompt = f"the {text} . {p.clean.prompt}"
    p = replace(p, clean=replace(p.clean, prompt=prompt), counterfactual=replace(p.counterfactual, prompt=prompt))
    vlm = get_tiny("tiny-llava")
    al = check_alignment(vlm, [p])
    ti, pos = al.clean.index[0], al.positions[0]
    assert vlm.adapter.tokenizer.decode(al.clean.inputs["input_ids"][0][pos]).strip() == text
    assert pos.min() > ti.span(text, occurrence=0).max()


def test_check_alignment_names_the_misaligned_pair():
    ps = scene_pairs(3, "id_selection", seed=7)
    bad = replace(ps[1], counterfactual=replace(ps[1].counterfactual,
                                                image=ps[1].counterfactual.image.resize((448, 224))))
    # Qwen's dynamic resolution turns a 2:1 image into another grid: other image-token count and sequence length
    with pytest.raises(PairAlignmentError, match=r"pair-00001.*sequence length.*image-token count"):
        check_alignment(get_tiny("tiny-qwen2_5_vl"), [ps[0], bad, ps[2]])
    # a counterfactual prompt of its own may change words, not the token count
    longer = replace(ps[2], counterfactual=replace(ps[2].counterfactual,
                                                   prompt=ps[2].counterfactual.prompt.replace(" a ", " a big ", 1)))
    with pytest.raises(PairAlignmentError, match=r"pair-00002.*sequence length"):
        check_alignment(get_tiny("tiny-llava"), [ps[0], longer])
    words = replace(ps[2], counterfactual=replace(ps[2].counterfactual,
                                                  prompt=ps[2].counterfactual.prompt.replace(" a ", " the ", 1)))
    aligned = check_alignment(get_tiny("tiny-llava"), [ps[0], words])
    cf_text = aligned.counterfactual.index[1].text
    assert " the " in cf_text and cf_text != aligned.clean.index[1].text


# ------------------------------------------------------------------------------------------------------------------
# binding query
# ------------------------------------------------------------------------------------------------------------------
def enumerate_distribution(objects, query: str, given: str) -> dict[str, Fraction]:
    """Independent of the generator: every bijection between the scene's colours and shapes (as listed in the
    objects, raster order), keeping those with distinct conjunctions."""
    colours, shapes = [o.colour for o in objects], [o.shape for o in objects]
    counts, total = Counter(), 0
    for perm in itertools.permutations(shapes):
        pairs = list(zip(colours, perm))
        if len(set(pairs)) < len(pairs):
            continue
        total += 1
        counts.update(s if query == "shape" else c for c, s in pairs if (c if query == "shape" else s) == given)
    return {v: Fraction(k, total) for v, k in counts.items()}


def test_binding_query_prompts_and_answers():
    ds = binding_query(40, seed=1)
    assert ds.task == "query"
    for e in ds:
        q, given, t = e.fields["query"], e.fields["given"], e.fields["target"]
        obj = e.objects[t]
        if q == "shape":
            assert e.prompt == f"the {given} object is a" and obj.colour == given and e.answer == obj.shape
            assert [o.colour for o in e.objects].count(given) == 1
        else:
            assert e.prompt == f"what colour is the {given} ? it is" and obj.shape == given
            assert e.answer == obj.colour and [o.shape for o in e.objects].count(given) == 1
        assert len({o.name for o in e.objects}) == len(e.objects)
        check_pixels(e)
    assert set(ds.summary["query_counts"]) == {"shape", "colour"} and min(ds.summary["query_counts"].values()) > 5


def test_binding_query_ceiling_is_exact():
    ds = binding_query(150, seed=2)
    total = Fraction(0)
    for e in ds:
        q, given = e.fields["query"], e.fields["given"]
        exact = enumerate_distribution(e.objects, q, given)
        assert e.fields["counting_distribution"] == {v: float(p) for v, p in sorted(exact.items())}
        ceiling = max(exact.values())
        assert e.fields["counting_ceiling_fraction"] == f"{ceiling.numerator}/{ceiling.denominator}"
        assert e.fields["counting_ceiling"] == float(ceiling) < 1
        assert len(exact) >= 2 and exact.get(e.answer, 0) > 0  # the counts do not determine the answer
        total += ceiling
    mean = total / len(ds)
    assert ds.summary["counting_ceiling_fraction"] == f"{mean.numerator}/{mean.denominator}"
    assert ds.summary["counting_ceiling"] == float(mean)
    assert ds.summary["counting_ceiling_max"] < 1
    assert 0.55 < ds.summary["counting_ceiling"] < 0.68


def test_counting_strategy_monte_carlo_matches_exact_ceiling():
    """Simulate the counting-only strategy on re-paired scenes: it sees the multisets and the query, answers the
    most probable value, and the generator's own pairing step draws the binding."""
    ds = binding_query(6, seed=3)
    rng = np.random.default_rng(123)
    draws = 3000
    for e in ds:
        q, given = e.fields["query"], e.fields["given"]
        colours, shapes = [o.colour for o in e.objects], [o.shape for o in e.objects]
        dist = e.fields["counting_distribution"]
        guess = max(dist, key=dist.get)
        answers = Counter()
        for _ in range(draws):
            perm = pair_features(rng, colours, shapes)
            pairs = [(colours[k], shapes[perm[k]]) for k in range(len(colours))]
            answers.update(s if q == "shape" else c for c, s in pairs if (c if q == "shape" else s) == given)
        assert sum(answers.values()) == draws
        for v in set(answers) | set(dist):
            p = dist.get(v, 0.0)
            assert abs(answers[v] / draws - p) < 4 * np.sqrt(p * (1 - p) / draws) + 1e-9, (v, answers, dist)
        accuracy = answers[guess] / draws
        assert abs(accuracy - e.fields["counting_ceiling"]) < 0.04 and accuracy < 0.9


def test_answer_distribution_rejects_repeated_conjunctions():
    # red must take two distinct shapes, so blue gets the remaining square: determined
    assert answer_distribution(["red", "red", "blue"], ["square", "square", "circle"], "shape", "blue") == \
        {"square": Fraction(1)}
    assert answer_distribution(["red", "blue", "green"], ["square", "square", "circle"], "shape", "red") == \
        {"circle": Fraction(1, 3), "square": Fraction(2, 3)}


def test_binding_query_single_kind_and_values():
    ds = binding_query(10, seed=4, query="colour", answer_values=2, n_objects=3)
    for e in ds:
        assert e.fields["query"] == "colour" and len({o.colour for o in e.objects}) == 2
        assert e.fields["counting_ceiling_fraction"] == "2/3"
    assert ds.summary["counting_ceiling_fraction"] == "2/3"


# ------------------------------------------------------------------------------------------------------------------
# bad parameters
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: scene_description(2, n_objects=4, canvas=Canvas(image_size=224, grid=1)), r"4 objects do not fit"),
        (lambda: scene_pairs(2, "id_selection", n_objects=4, canvas=Canvas(image_size=224, grid=1)), r"grid=2"),
        (lambda: binding_query(2, n_objects=4, canvas=Canvas(image_size=224, grid=1)), r"do not fit"),
        (lambda: scene_description(2, entropy="medium"), r"'medium'.*\('high', 'low'\)"),
        (lambda: scene_description(2, colours=["red", "bleu", "green", "cyan"]), r"'bleu'.*'blue'"),
        (lambda: binding_query(2, shapes=["circle", "sqare", "star", "cross"]), r"'sqare'.*'square'"),
        (lambda: scene_pairs(2, "id_retrival"), r"'id_retrival'.*'id_retrieval'"),
        (lambda: scene_description(2, n_objects=1), r"at least 2"),
        (lambda: scene_description(2, n_objects=(4, 2)), r"empty"),
        (lambda: scene_description(2, n_objects=4, colours=["red", "blue", "green"]), r"4 distinct colours"),
        (lambda: scene_pairs(2, "feature_retrieval", n_objects=3, colours=["red", "blue", "green"]),
         r"unused colour"),
        (lambda: scene_pairs(2, "feature_retrieval", n_objects=4, entropy="low", colours=["red", "blue"]),
         r"3 colours"),
        (lambda: binding_query(2, n_objects=7, canvas=Canvas(image_size=224, grid=3)), r"n_objects <= 6"),
        (lambda: binding_query(2, query="size"), r"'size'"),
        (lambda: binding_query(2, answer_values=1), r"answer_values"),
        (lambda: binding_query(-1), r"non-negative"),
    ],
)
def test_bad_params_raise(call, message):
    with pytest.raises(StimulusError, match=message):
        call()
