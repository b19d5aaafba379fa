"""IsSameObject in a model's world: scenes with multi-token objects and a duplicated class, the class baselines and
the clustered interval, checked on planted token representations (identity present / only the class present), and
the on-demand ColorShape splits that keep FBP-sized captures out of memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import shared_organism

import vlmbind as vb
from vlmbind.analysis.binding import colorshape_splits
from vlmbind.analysis.same_object import class_rules, same_object_probes
from vlmbind.core.errors import InputError
from vlmbind.probes import ProbeConfig, pairwise_probe
from vlmbind.probes.pairwise import _clustered_se
from vlmbind.stimuli.colorshape import ColorShapeSplits, balanced_color_shape
from vlmbind.stimuli.core import StimulusError
from vlmbind.stimuli.same_object import same_object_scenes

FAST = ProbeConfig(lr=1e-2, batch_size=256, seed=0, max_epochs=80)


def test_scenes_hold_a_duplicate_and_each_object_covers_its_2x2_tokens():
    vlm = shared_organism("organism-p2a")
    data = same_object_scenes(6, 0, split="test")
    for ex in data:
        classes = [(o.colour, o.shape) for o in ex.objects]
        assert classes.count(tuple(ex.fields["duplicate"].split())) >= 2
    acts = vb.capture(vlm, data, ["blocks.0.hook_resid_post"])
    for i in range(len(acts)):
        owner = acts.token_objects(i)
        assert np.array_equal(np.bincount(owner[owner >= 0]), np.full(4, 4))  # 4 objects x 4 tokens
    other = same_object_scenes(6, 0, split="train")
    assert [ex.answer for ex in other] != [ex.answer for ex in data]  # splits are separate streams
    with pytest.raises(StimulusError, match="token_span"):
        same_object_scenes(2, token_span=4)
    with pytest.raises(StimulusError, match="n_objects"):
        same_object_scenes(2, n_objects=10)


def _planted(n_images: int, identity: bool, seed: int = 0):
    """Tokens of 4 objects x 4 tokens, two objects of one class: each token is its class vector plus (identity) a
    per-object random vector, plus noise."""
    rng = np.random.default_rng(seed)
    d, per = 24, 4
    class_vec = rng.normal(size=(16, d))
    tokens, owner, colour, shape = [], [], [], []
    for _ in range(n_images):
        classes = [rng.integers(16)] * 2 + list(rng.integers(16, size=2))
        obj_vec = rng.normal(size=(4, d)) if identity else np.zeros((4, d))
        t = np.concatenate([class_vec[c] + obj_vec[k] + 0.1 * rng.normal(size=(per, d))
                            for k, c in enumerate(classes)])
        tokens.append(t)
        owner.append(np.repeat(np.arange(4), per))
        colour.append(np.repeat(np.array(classes) // 4, per))
        shape.append(np.repeat(np.array(classes) % 4, per))
    table = {"object": np.array(owner), "colour": np.array(colour), "shape": np.array(shape),
             "row": np.tile(np.arange(16) // 4, (n_images, 1)), "col": np.tile(np.arange(16) % 4, (n_images, 1))}
    split = np.array(["train"] * (n_images // 2) + ["val"] * (n_images // 4) + ["test"] * (n_images // 4))
    return torch.as_tensor(np.array(tokens), dtype=torch.float32), table, split


@pytest.mark.parametrize("identity", [True, False])
def test_a_probe_beats_the_class_baselines_only_where_objects_are_told_apart(identity):
    tokens, table, split = _planted(112, identity)
    baselines, references = class_rules(table)
    klass = table["colour"] * 4 + table["shape"]
    res = pairwise_probe(tokens, table["object"], split, token_class=klass, family="diag_quadratic", config=FAST,
                         baselines=baselines, references=references)
    assert set(res.baselines) == {"same_colour", "same_shape"} and "same_class_adjacent" in res.references
    assert res.strongest_baseline == "same_class"  # a duplicate in every image: class beats colour and shape
    assert res.baseline_same_class < 0.95
    if identity:
        assert res.accuracy > 0.93 and res.margin > 3 * res.margin_se
    else:  # identical objects are indistinguishable: nothing to gain over the class rule
        assert res.margin < 2 * res.margin_se + 0.01


def test_twin_objects_keep_the_duplicated_class_and_a_twin_probe_needs_more_than_class():
    from vlmbind.analysis.same_object import twin_objects

    tokens, table, split = _planted(112, True)
    klass = table["colour"] * 4 + table["shape"]
    twins = twin_objects(table, klass)
    for i in range(len(twins)):
        kept = twins[i] >= 0
        # one class, of at least two objects, every token of it kept: where only objects 0 and 1 share a class
        # (_planted's duplicate), that class
        assert len(set(klass[i][kept])) == 1 and len(set(twins[i][kept])) >= 2
        np.testing.assert_array_equal(kept, klass[i] == klass[i][kept][0])
        if len(set(klass[i])) == 3:
            assert set(twins[i][kept]) == {0, 1}
    for identity, told in ((True, True), (False, False)):
        tokens, table, split = _planted(112, identity)
        res = pairwise_probe(tokens, twin_objects(table, klass), split, family="diag_quadratic", config=FAST)
        assert res.baseline_not_same == pytest.approx(0.5)
        # the twins share their class vector: only the per-object vector (identity) tells them apart
        assert (res.margin > 5 * res.margin_se and res.accuracy > 0.8) if told else res.accuracy < 0.6


def test_object_parts_and_the_no_place_twin_rule_on_the_organism_scenes():
    from vlmbind.analysis.same_object import different_part_rule, object_parts, token_tables
    from vlmbind.probes.pairwise import sample_pairs

    vlm = shared_organism("organism-p2a")
    acts = vb.capture(vlm, same_object_scenes(4, 0, split="test"), ["blocks.0.hook_resid_post"])
    table = token_tables(acts)
    parts = object_parts(table)
    for i in range(4):
        for k in range(4):  # each object's 2 x 2 tokens: its parts 0..3 in raster order
            own = table["object"][i] == k
            assert sorted(parts[i][own]) == [0, 1, 2, 3]
            top = table["row"][i][own].min()
            assert set(parts[i][own & (table["row"][i] == top)]) == {0, 1}
        assert (parts[i][table["object"][i] < 0] == -1).all()
    # on balanced pairs of two twins' tokens the rule is right on every same pair and on 4 of the 16 others
    twins = np.where(table["object"] < 2, table["object"], -1)
    pairs, same = sample_pairs(torch.as_tensor(twins), balance=True, max_pairs_per_image=None, seed=0)
    right = different_part_rule(table)(pairs) == same
    assert right[same].all() and right[~same].mean() == pytest.approx(0.25)


def test_position_readout_finds_a_planted_place_code_and_not_a_missing_one():
    from vlmbind.analysis.same_object import position_readout

    _, table, split = _planted(40, True)
    plain = np.random.default_rng(1).normal(size=(40, 16, 24)).astype(np.float32)
    told = position_readout(plain, table, split)
    assert told["row_readout"] < told["row_chance"] + 0.15 and told["col_readout"] < told["col_chance"] + 0.15
    placed = plain.copy()
    placed[..., 0], placed[..., 1] = table["row"], table["col"]
    told = position_readout(placed, table, split)
    assert told["row_readout"] > 0.95 and told["col_readout"] > 0.95 and told["col_chance"] == 0.25


def test_clustered_standard_error_matches_the_ratio_estimator_by_hand():
    rng = np.random.default_rng(0)
    cluster = np.repeat(np.arange(20), rng.integers(2, 9, size=20))
    diff = rng.normal(size=len(cluster)) + cluster * 0.05
    ids, sizes = np.unique(cluster, return_counts=True)
    sums = np.array([diff[cluster == i].sum() for i in ids])
    mean = diff.mean()
    by_hand = np.sqrt(20 / 19 * np.sum((sums - mean * sizes) ** 2)) / sizes.sum()
    assert _clustered_se(diff, cluster) == pytest.approx(by_hand, rel=1e-12)
    tokens, table, split = _planted(40, True)
    with pytest.raises(InputError, match="one bool per pair"):
        pairwise_probe(tokens, table["object"], split, config=FAST, baselines={"bad": lambda p: np.zeros(3)})


def test_same_object_probes_on_the_organism_save_a_table_with_its_peak(tmp_path):
    vlm = shared_organism("organism-p2a")
    result = same_object_probes(vlm, ["vision.blocks.0.hook_resid_post", "blocks.3.hook_resid_post"], n_train=12,
                                n_val=4, n_test=8, families=("diag_quadratic",),
                                config=ProbeConfig(epochs=3, lr=1e-2, batch_size=256))
    frame = result.frame
    assert list(frame["site"]) == ["vision.blocks.0.hook_resid_post", "blocks.3.hook_resid_post"]
    for column in ("baseline_same_class", "baseline_same_colour", "baseline_same_shape",
                   "reference_same_class_adjacent", "margin", "margin_se", "strongest_baseline", "row_readout",
                   "col_readout", "row_chance", "col_chance", "twin_accuracy", "twin_not_same", "twin_different_part",
                   "twin_margin", "twin_margin_se",
                   "twin_pairs_test"):
        assert frame[column].notna().all(), column
    np.testing.assert_allclose(frame["margin"], frame["accuracy"] - frame.apply(
        lambda r: r[f"baseline_{r['strongest_baseline']}"], axis=1))
    assert (frame["row_chance"] < 0.5).all() and (frame["row_readout"] <= 1).all()
    result.save(tmp_path / "first")
    loaded = type(result).load(tmp_path / "first")
    assert loaded.model == "organism-p2a" and len(loaded.frame) == 2
    loaded.save(tmp_path / "again")
    for name in ("same_object.csv", "same_object.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "first" / name).read_bytes(), name


def test_on_demand_splits_equal_the_generated_ones_and_capture_the_same():
    lazy = ColorShapeSplits((3, 2, 2), seed=4, world="organism")
    eager, labels = colorshape_splits(3, 2, 2, 4, "organism")
    assert len(lazy) == 7 and list(lazy.labels()) == list(labels) == ["train"] * 3 + ["val"] * 2 + ["test"] * 2
    for k, split, i in ((0, "train", 0), (4, "val", 1), (6, "test", 1)):
        ref = balanced_color_shape(i + 1, 4, split=split, world="organism").examples[i]
        assert lazy[k].to_record() == ref.to_record() == eager[k].to_record()
        assert lazy[k].image.tobytes() == ref.image.tobytes()
    vlm = shared_organism("organism-p2a")
    a = vb.capture(vlm, lazy, ["projector.hook_out"])
    b = vb.capture(vlm, eager, ["projector.hook_out"])
    torch.testing.assert_close(torch.as_tensor(a.pooled("projector.hook_out")),
                               torch.as_tensor(b.pooled("projector.hook_out")), rtol=0, atol=0)


def test_pairwise_probes_on_one_token_objects_point_to_the_same_object_scenes():
    from vlmbind.analysis.binding import probe_sites

    examples, split = colorshape_splits(4, 2, 2, 0, "organism")
    acts = vb.capture(shared_organism("organism-p2a"), examples, ["blocks.1.hook_resid_post"])
    with pytest.raises(InputError, match="same_object_probes"):
        probe_sites(acts, split, families=("pairwise",), world="organism", config=FAST)
