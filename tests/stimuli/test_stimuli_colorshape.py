"""BalancedColorShape (exact counts, hash split, codes against pixels) and the single-object RSA set."""

from __future__ import annotations

import hashlib
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmbind.stimuli.colorshape import (
    CS_COLOURS,
    CS_SHAPES,
    all_f_codes,
    balanced_color_shape,
    code_arrays,
    covering_count,
    entropies,
    f_from_o,
    o_code,
    split_codes,
)
from vlmbind.stimuli.core import COLOURS, Dataset, StimulusError
from vlmbind.stimuli.rsa_set import rsa_set

RGB_TO_NAME = {v: k for k, v in COLOURS.items()}


def _majority_colour(arr: np.ndarray, box) -> tuple[int, int, int] | None:
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    px = arr[y0:y1, x0:x1].reshape(-1, 3)
    px = px[(px != 255).any(1)]
    if len(px) == 0:
        return None
    values, counts = np.unique(px, axis=0, return_counts=True)
    return tuple(int(v) for v in values[counts.argmax()])


def _brute_force_covering(rows: int, cols: int) -> np.ndarray:
    """counts[k] = number of k-subsets of the grid covering every row and column, by enumerating all 2^(rows*cols)."""
    masks = np.arange(2 ** (rows * cols), dtype=np.int64)
    bits = (masks[:, None] >> np.arange(rows * cols)) & 1  # [2^m, m]
    grid = bits.reshape(-1, rows, cols)
    ok = grid.any(2).all(1) & grid.any(1).all(1)
    return np.bincount(bits.sum(1)[ok], minlength=rows * cols + 1)


def _bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------------------------
# Counts and entropies
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 3), (3, 3), (3, 4), (4, 4)])
def test_inclusion_exclusion_matches_brute_force(rows, cols):
    brute = _brute_force_covering(rows, cols)
    counted = [covering_count(rows, cols, k) for k in range(rows * cols + 1)]
    assert counted == brute.tolist()
    assert sum(counted) > 0 and counted[max(rows, cols) - 1] == 0  # fewer objects than max(rows, cols) cannot cover


def test_entropies_are_exact_and_match_fbp():
    n = covering_count(6, 6, 18)
    assert n == 8058525440
    assert 0.85 < n / math.comb(36, 18) < 0.92  # the rejection sampler's acceptance rate
    for split, n_f in (("train", 522), ("val", 131), ("test", 131)):
        e = entropies(split)
        assert e["n_f_codes"] == n_f and e["n_o_given_f"] == n and e["n_o"] == n_f * n
        assert e["H_F"] == pytest.approx(math.log2(n_f)) and e["H_O_given_F"] == pytest.approx(math.log2(n))
        assert e["H_O"] == pytest.approx(math.log2(n_f * n))
    # FBP's H(O) = 39.9, H(F) = 7.0 bits are the 131-code splits.
    assert round(entropies("test")["H_O"], 1) == 39.9 and round(entropies("test")["H_F"], 1) == 7.0
    assert round(entropies("train")["H_O"], 1) != 39.9
    with pytest.raises(StimulusError, match="unknown split"):
        entropies("dev")


def test_hash_split_sizes_disjoint_and_deterministic():
    codes = all_f_codes()
    assert len(codes) == len(set(codes)) == 784
    assert all(c[:8].count("1") == 6 and c[8:].count("1") == 6 for c in codes)
    splits = {s: split_codes(s) for s in ("train", "val", "test")}
    assert {s: len(v) for s, v in splits.items()} == {"train": 522, "val": 131, "test": 131}
    assert set(splits["train"]).isdisjoint(splits["val"]) and set(splits["train"]).isdisjoint(splits["test"])
    assert set(splits["val"]).isdisjoint(splits["test"])
    assert set().union(*splits.values()) == set(codes)
    # Recompute the rank independently: sha256 of the bit string, sorted by digest.
    ranked = sorted(codes, key=lambda b: hashlib.sha256(b.encode()).digest())
    assert list(splits["train"]) == ranked[:522] and list(splits["test"]) == ranked[653:]


def test_bit_layout_follows_methods_order():
    assert list(CS_SHAPES) == ["circle", "square", "triangle", "diamond", "pentagon", "hexagon", "cross", "star"]
    assert list(CS_COLOURS) == ["red", "blue", "green", "yellow", "purple", "orange", "cyan", "gray"]
    code = o_code([("blue", "triangle"), ("gray", "star")])
    assert code.index("1") == 1 * 8 + 2 and code.rindex("1") == 63 and code.count("1") == 2
    assert f_from_o(code) == "01000001" + "00100001"


# ------------------------------------------------------------------------------------------------------------------
# Generated images
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cs_val() -> Dataset:
    return balanced_color_shape(12, seed=3, split="val")


def test_codes_against_pixels(cs_val):
    val_codes = set(split_codes("val"))
    for ex in cs_val:
        arr = np.asarray(ex.image)
        assert arr.shape == (256, 256, 3)
        assert len(ex.objects) == 18
        assert len({(o.colour, o.shape) for o in ex.objects}) == 18  # distinct conjunctions
        for o in ex.objects:
            assert o.size == 16
            assert _majority_colour(arr, o.box) == COLOURS[o.colour], (ex.id, o)
        # Every ink pixel belongs to some object's box, and no boxes overlap (boxes taken one pixel wider on the
        # right and bottom, as core's drawing allows: the hexagon touches its box's far edge).
        covered = np.zeros(arr.shape[:2], bool)
        for o in ex.objects:
            x0, y0, x1, y1 = (int(round(v)) for v in o.box)
            assert not covered[y0:y1 + 1, x0:x1 + 1].any(), "objects overlap"
            covered[y0:y1 + 1, x0:x1 + 1] = True
        assert not ((arr != 255).any(-1) & ~covered).any()
        # Colours in the picture are exactly the chosen six.
        ink = {tuple(p) for p in arr[(arr != 255).any(-1)]}
        assert {RGB_TO_NAME[p] for p in ink} == set(ex.fields["colours"])
        f = ex.fields
        assert f["split"] == "val" and f["f_code"] in val_codes
        assert f["o_code"] == o_code(ex.objects) and f["o_code"].count("1") == 18
        assert f_from_o(f["o_code"]) == f["f_code"]  # covering: every chosen colour and shape is used
        assert f["f_bits"] == [int(b) for b in f["f_code"]]
        assert f["colours"] == [c for c, b in zip(CS_COLOURS, f["f_code"][:8]) if b == "1"]
        assert f["shapes"] == [s for s, b in zip(CS_SHAPES, f["f_code"][8:]) if b == "1"]
        assert sorted(f["colours"]) == sorted({o.colour for o in ex.objects})
        assert sorted(f["shapes"]) == sorted({o.shape for o in ex.objects})
        # Answer lists the objects in raster order.
        assert [(o.row, o.col) for o in ex.objects] == sorted((o.row, o.col) for o in ex.objects)
        assert ex.answer == " , ".join(f"{o.colour} {o.shape}" for o in ex.objects)
        assert ex.prompt == "describe the objects in this image :"
    f, o = code_arrays(cs_val)
    assert f.shape == (12, 16) and o.shape == (12, 64)
    assert (o.reshape(-1, 8, 8).any(2) == f[:, :8]).all() and (o.reshape(-1, 8, 8).any(1) == f[:, 8:]).all()
    assert cs_val.summary["entropy_bits"]["val"]["n_f_codes"] == 131
    assert set(cs_val.summary["entropy_bits"]) == {"train", "val", "test"}


def test_splits_use_only_their_codes_and_vary():
    ds = balanced_color_shape(40, seed=0, split="train")
    codes = {e.fields["f_code"] for e in ds}
    assert codes <= set(split_codes("train")) and len(codes) > 30
    assert len({e.fields["o_code"] for e in ds}) == 40
    test = balanced_color_shape(10, seed=0, split="test")
    assert {e.fields["f_code"] for e in test} <= set(split_codes("test"))


def test_shape_frequencies_are_uniform_enough():
    # Each of the 36 chosen conjunctions is drawn with probability 1/2 by symmetry, so each code bit is near its mean.
    ds = balanced_color_shape(150, seed=1, split="train")
    f, o = code_arrays(ds)
    assert np.allclose(f.mean(0), 0.75, atol=0.12)
    present = o.sum() / (f[:, :8].sum(1) * f[:, 8:].sum(1)).sum()
    assert present == pytest.approx(0.5)


def test_colorshape_determinism_and_prefix(tmp_path):
    a = balanced_color_shape(5, seed=7, split="test", jitter=3)
    b = balanced_color_shape(5, seed=7, split="test", jitter=3)
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b")
    longer = balanced_color_shape(8, seed=7, split="test", jitter=3)
    assert [e.to_record() for e in longer.examples[:5]] == [e.to_record() for e in a]
    other = balanced_color_shape(5, seed=8, split="test", jitter=3)
    assert [e.fields["o_code"] for e in other] != [e.fields["o_code"] for e in a]
    loaded = Dataset.load(tmp_path / "a")
    assert [e.fields["o_code"] for e in loaded] == [e.fields["o_code"] for e in a]
    assert np.array_equal(np.asarray(loaded[0].image), np.asarray(a[0].image))
    assert loaded.summary["entropy_bits"]["test"]["n_o_given_f"] == 8058525440


def test_jitter_keeps_objects_in_their_cells():
    ds = balanced_color_shape(6, seed=2, split="val", jitter=7)
    offsets = set()
    for ex in ds:
        for o in ex.objects:
            x0, y0, x1, y1 = o.box
            assert 32 * o.col <= x0 and x1 < 32 * (o.col + 1) and 32 * o.row <= y0 and y1 < 32 * (o.row + 1)
            offsets.add((o.x - (32 * o.col + 16), o.y - (32 * o.row + 16)))
    assert len(offsets) > 10
    # Neighbours' ink never touches: no ink pixel has a differently coloured ink pixel next to it.
    for ex in ds:
        arr = np.asarray(ex.image).astype(int)
        ink = (arr != 255).any(-1)
        right = ink[:, :-1] & ink[:, 1:] & (arr[:, :-1] != arr[:, 1:]).any(-1)
        down = ink[:-1] & ink[1:] & (arr[:-1] != arr[1:]).any(-1)
        assert not right.any() and not down.any()


def test_colorshape_validation():
    with pytest.raises(StimulusError, match="unknown split"):
        balanced_color_shape(2, split="training")
    with pytest.raises(StimulusError, match="grid >= 5"):
        balanced_color_shape(2, grid=4)
    with pytest.raises(StimulusError, match="grid <= 14"):
        balanced_color_shape(2, grid=15)
    with pytest.raises(StimulusError, match=r"jitter=8 .*\[0, 7\]"):
        balanced_color_shape(2, jitter=8)
    with pytest.raises(StimulusError, match="non-negative"):
        balanced_color_shape(-1)
    with pytest.raises(StimulusError, match="not a BalancedColorShape"):
        o_code([("red", "L")])


# ------------------------------------------------------------------------------------------------------------------
# RSA set
# ------------------------------------------------------------------------------------------------------------------
def test_rsa_set_conjunction_counts_and_pixels():
    ds = rsa_set(seed=0, positions_per_conjunction=3)
    assert len(ds) == 48 and ds.task == "rsa"
    per = {}
    for ex in ds:
        f = ex.fields
        per.setdefault((f["colour"], f["shape"]), []).append((f["row"], f["col"]))
        assert len(ex.objects) == 1
        o = ex.objects[0]
        assert (o.colour, o.shape, o.row, o.col) == (f["colour"], f["shape"], f["row"], f["col"])
        assert ex.prompt == "what is in this image ?" and ex.answer == f"{o.colour} {o.shape}"
        arr = np.asarray(ex.image)
        assert arr.shape == (252, 252, 3)
        ink = (arr != 255).any(-1)
        ys, xs = np.nonzero(ink)
        # All ink sits in the object's 28 px cell and has exactly its colour.
        assert xs.min() >= 28 * o.col and xs.max() < 28 * (o.col + 1)
        assert ys.min() >= 28 * o.row and ys.max() < 28 * (o.row + 1)
        assert {tuple(p) for p in arr[ink]} == {COLOURS[o.colour]}
    assert set(per) == {(c, s) for c in ("red", "green", "blue", "purple") for s in ("L", "T", "H", "E")}
    assert all(len(v) == 3 and len(set(v)) == 3 for v in per.values())  # distinct cells per conjunction
    assert len({tuple(v) for v in per.values()}) > 1  # conjunctions get different cells


def test_rsa_letters_are_distinct_in_pixels():
    ds = rsa_set(positions="all")
    assert len(ds) == 16 * 81
    masks = {}
    for ex in ds:
        if ex.fields["row"] == 4 and ex.fields["col"] == 4:
            masks[(ex.fields["colour"], ex.fields["shape"])] = (np.asarray(ex.image) != 255).any(-1)
    assert len(masks) == 16
    for (c1, s1), (c2, s2) in itertools.combinations(masks, 2):
        if c1 == c2:
            assert (masks[(c1, s1)] != masks[(c2, s2)]).sum() > 10  # letters differ in shape
        if s1 == s2:
            assert (masks[(c1, s1)] == masks[(c2, s2)]).all()  # same letter, same mask: only colour differs
    cells = {(e.fields["conjunction"], e.fields["cell"]) for e in ds}
    assert len(cells) == 16 * 81


def test_rsa_determinism_prefix_and_validation(tmp_path):
    a, b = rsa_set(seed=4, positions_per_conjunction=2), rsa_set(seed=4, positions_per_conjunction=2)
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b")
    more = rsa_set(seed=4, positions_per_conjunction=5)
    first = {}
    for ex in more:
        first.setdefault(ex.fields["conjunction"], []).append(ex.fields["cell"])
    for ex in a:
        assert ex.fields["cell"] in first[ex.fields["conjunction"]][:2]  # more positions keep the first ones
    with Image.open(tmp_path / "a" / "images" / f"{a[0].id}.png") as im:
        assert np.array_equal(np.asarray(im.convert("RGB")), np.asarray(a[0].image))
    with pytest.raises(StimulusError, match=r"positions_per_conjunction=82"):
        rsa_set(positions_per_conjunction=82)
    with pytest.raises(StimulusError, match="unknown colour"):
        rsa_set(colours=("red", "mauve"))
    with pytest.raises(StimulusError, match="positions="):
        rsa_set(positions="some")


# ------------------------------------------------------------------------------------------------------------------
# ColorShape worlds: any palette and counts, exact entropies checked by enumeration and by sampling
# ------------------------------------------------------------------------------------------------------------------
def test_world_entropies_equal_brute_force_enumeration():
    import itertools
    import math

    from vlmbind.stimuli.colorshape import ColorShapeWorld, all_f_codes, entropies, f_from_o, split_codes

    small = ColorShapeWorld(name="small", colours=("red", "green", "blue", "yellow"),
                            shapes=("square", "circle", "triangle"), n_colours=2, n_shapes=2, n_objects=3,
                            image_size=112, grid=4, object_size=None)
    codes = all_f_codes(small)
    # enumerate every object code: k-subsets of the 4 x 3 conjunctions, kept when they use exactly 2 + 2 features
    n_o = len(small.colours) * len(small.shapes)
    by_f: dict[str, int] = {}
    for subset in itertools.combinations(range(n_o), small.n_objects):
        bits = "".join("1" if i in subset else "0" for i in range(n_o))
        f = f_from_o(bits, small)
        if f.count("1", 0, 4) == 2 and f.count("1", 4) == 2:
            by_f[f] = by_f.get(f, 0) + 1
    assert sorted(by_f) == sorted(codes) and len(codes) == math.comb(4, 2) * math.comb(3, 2) == 18
    assert len(set(by_f.values())) == 1  # every feature code has the same number of object codes
    splits = {s: set(split_codes(s, small)) for s in ("train", "val", "test")}
    assert sum(map(len, splits.values())) == 18 and not (splits["train"] & splits["test"])
    for split in ("train", "val", "test"):
        h = entropies(split, small)
        n_objects_given_f = next(iter(by_f.values()))
        assert h["n_o_given_f"] == n_objects_given_f
        assert h["H_O"] == pytest.approx(math.log2(len(splits[split]) * n_objects_given_f), abs=1e-12)


def test_world_presets_and_fbp_numbers():
    from vlmbind.stimuli.colorshape import FBP, ORGANISM, entropies

    h = entropies("test", FBP)
    assert (round(h["H_O"], 2), round(h["H_F"], 2), round(h["H_O_given_F"], 2)) == (39.94, 7.03, 32.91)
    assert entropies("test") == h  # FBP is the default
    o = entropies("test", ORGANISM)
    assert ORGANISM.split_sizes == {"train": 10, "val": 3, "test": 3}
    assert o["n_o_given_f"] == 90 and round(o["H_O_given_F"], 2) == 6.49 and round(o["H_O"], 2) == 8.08


def test_organism_world_images_follow_their_codes_and_the_entropy_by_sampling():
    import math

    from vlmbind.stimuli.colorshape import ORGANISM, covering_count, split_codes

    ds = balanced_color_shape(400, 0, split="train", world="organism")
    assert ds.params["world"] == "organism" and ds.params["canvas"]["image_size"] == 168
    codes = set(split_codes("train", ORGANISM))
    seen_o = set()
    for e in ds:
        assert len(e.objects) == 5 and e.fields["f_code"] in codes and len(e.fields["o_code"]) == 16
        assert {o.colour for o in e.objects} == set(e.fields["colours"]) and len(e.fields["colours"]) == 3
        assert {o.shape for o in e.objects} == set(e.fields["shapes"]) and len(e.fields["shapes"]) == 3
        assert len({(o.row, o.col) for o in e.objects}) == 5  # one object per token cell
        seen_o.add(e.fields["o_code"])
    # Monte-Carlo on FBP's preset, too large to enumerate (C(36, 18) = 9.1e9 subsets): the share of uniform 18-subsets
    # of the 6 x 6 conjunctions that use every row and column estimates N / C(36, 18), N = covering_count(6, 6, 18)
    rng = np.random.default_rng(1)
    draws = np.array([len(set((s // 6).tolist())) == 6 and len(set((s % 6).tolist())) == 6
                      for s in (rng.choice(36, size=18, replace=False) for _ in range(20000))])
    expected = covering_count(6, 6, 18) / math.comb(36, 18)
    assert abs(draws.mean() - expected) < 4 * math.sqrt(expected * (1 - expected) / len(draws))
    # 400 images over 10 codes x 90 object sets: nearly every object code is distinct, as a uniform draw gives
    assert len(seen_o) > 300
