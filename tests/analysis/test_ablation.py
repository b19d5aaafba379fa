"""The ablation study picks the right heads for each arm, ablates them while evaluating, and validates its input."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from helpers import get_tiny, shared_organism

import vlmbind as vb
from vlmbind.analysis.ablation import ablation_study

S = vb.stimuli
CRITICAL = {(1, 2), (3, 0)}


class HeadSensitiveVLM:
    """Answers correctly unless a critical head is ablated: a stand-in whose ground truth we know."""

    name, n_layers, n_heads, active_prompt_format = "fake", 4, 4, "raw"

    def __init__(self):
        self.adapter = SimpleNamespace(tokenizer=get_tiny("tiny-qwen2_5_vl").adapter.tokenizer,
                                       resized_size=lambda inputs, image_id: None)
        self.ablated: set = set()
        self.modes: list = []

    @contextlib.contextmanager
    def ablate(self, heads, mode, renormalize=False, means=None):
        self.ablated, self.modes = set(heads), [*self.modes, mode]
        try:
            yield self
        finally:
            self.ablated = set()

    def point_frames(self, frame=None):
        return S.answers.frames_for({"tuple": "canvas"})

    def prepare(self, images, prompts, chat=False):
        return SimpleNamespace(n=len(prompts), images=images, inputs={})

    def generate(self, batch, max_new_tokens):
        broken = bool(self.ablated & CRITICAL)
        return [("zzz" if broken else self.answers[id(im)]) for im in batch.images], {}


def _scores(order):
    rows = [{"layer": l, "head": h, "score": float(len(order) - i)} for i, (l, h) in enumerate(order)]
    return pd.DataFrame(rows)


def test_arms_ablate_the_right_heads():
    ds = S.binding_query(12, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    others = [(l, h) for l in range(4) for h in range(4) if (l, h) not in CRITICAL]
    order = [(1, 2), (3, 0), *others]  # the critical heads score highest
    result = ablation_study(vlm, ds, _scores(order), k=2, mode="zero", seeds=(0, 1, 2))
    arms = {a["arm"]: a for a in result.arms if a["arm"] != "random"}
    assert arms["top"]["heads"] == ["1.2", "3.0"]
    assert sorted(arms["bottom"]["heads"]) == sorted(f"{l}.{h}" for l, h in others[-2:])
    assert result.accuracy("clean") == 1.0
    assert result.accuracy("top") == 0.0
    assert result.accuracy("bottom") == result.accuracy("clean")
    for arm in (a for a in result.arms if a["arm"] == "random"):
        hit = {tuple(int(x) for x in h.split(".")) for h in arm["heads"]} & CRITICAL
        assert (arm["accuracy"] == 0.0) == bool(hit)
    assert vlm.modes == ["zero"] * 5


def test_bad_inputs():
    vlm, ds = get_tiny("tiny-qwen2_5_vl"), S.binding_query(2, 0)
    full = _scores([(l, h) for l in range(4) for h in range(4)])
    with pytest.raises(vb.InputError, match="mode"):
        ablation_study(vlm, ds, full, mode="half")
    with pytest.raises(vb.InputError, match="each of the model's"):
        ablation_study(vlm, ds, full.iloc[:5])
    with pytest.raises(vb.InputError, match="k = 9"):
        ablation_study(vlm, ds, full, k=9)


def test_on_the_organism_top_heads_hurt_more_than_bottom_heads():
    """Feature-retrieval scores rank organism-p2a's heads by what they do for scene description: the top-5 break it,
    the 5 smallest |score| barely touch it. (Its id_selection scores separate no head from zero, and ablating the
    5 smallest of them still costs about 0.4: a bottom arm means something only where the scores do.)"""
    vlm = shared_organism("organism-p2a")
    trained = dict(canvas=S.Canvas(image_size=168, grid=6), colours=("red", "green", "blue", "yellow"),
                   shapes=("square", "circle", "triangle", "star"))
    scores = vb.locate(vlm, S.scene_pairs(8, "feature_retrieval", 0, n_objects=3, **trained))
    result = ablation_study(vlm, S.scene_description(64, 1, **trained), scores, k=5, seeds=(0, 1, 2))
    assert result.accuracy("clean") == 1.0
    assert result.bottom_by == "abs"
    assert result.accuracy("top") < 0.3 and result.accuracy("bottom") > 0.9
    assert result.accuracy("random") > 0.9


def test_ablate_command(tmp_path, capsys):
    import json

    from vlmbind.cli import main

    loc = tmp_path / "loc"
    assert main(["locate", "--model", "tiny-qwen2_5_vl", "--condition", "id_selection", "--n-pairs", "1",
                 "--out", str(loc)]) == 0
    capsys.readouterr()
    out = tmp_path / "abl"
    assert main(["ablate", "--model", "tiny-qwen2_5_vl", "--task", "query", "--scores", str(loc / "scores.csv"),
                 "--top-k", "2", "--seeds", "2", "--n", "4", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [a["arm"] for a in summary["arms"]] == ["clean", "top", "random", "random", "random_same_layers",
                                                   "random_same_layers", "bottom"]
    assert json.loads((out / "results.json").read_text())["k"] == 2
    assert main(["ablate", "--model", "tiny-qwen2_5_vl", "--task", "query", "--heads", "1.2,9.9", "--n", "2",
                 "--out", str(out)]) == 2
    assert "9.9" in capsys.readouterr().err


def test_random_arm_from_the_rest_and_bottom_by_magnitude():
    """``random_from="rest"`` never draws a top-k head; the default ``bottom_by="abs"`` takes the smallest |score|,
    not the most negative score."""
    ds = S.binding_query(6, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    heads = [(l, h) for l in range(4) for h in range(4)]
    rows = [{"layer": l, "head": h, "score": 0.5} for l, h in heads]
    for row in rows:
        if (row["layer"], row["head"]) in CRITICAL:
            row["score"] = 10.0
        if (row["layer"], row["head"]) == (0, 0):
            row["score"] = -9.0  # strongly negative: involved, never "bottom" by magnitude
        if (row["layer"], row["head"]) in ((2, 2), (2, 3)):
            row["score"] = 0.01
    frame = pd.DataFrame(rows)
    result = ablation_study(vlm, ds, frame, k=2, mode="zero", seeds=tuple(range(8)), random_from="rest")
    for arm in (a for a in result.arms if a["arm"] == "random"):
        assert not {tuple(int(x) for x in h.split(".")) for h in arm["heads"]} & CRITICAL
        assert arm["accuracy"] == 1.0
    bottom = next(a for a in result.arms if a["arm"] == "bottom")
    assert bottom["heads"] == ["2.2", "2.3"]
    assert result.bottom_by == "abs" and "smallest |score|" in result.text()  # the default, recorded and said
    signed = ablation_study(vlm, ds, frame, k=2, mode="zero", seeds=(0,), bottom_by="score")
    assert "0.0" in next(a for a in signed.arms if a["arm"] == "bottom")["heads"]
    assert "lowest score" in signed.text()
    old = {k: v for k, v in signed.summary().items() if k != "bottom_by"}
    assert type(result).from_dict(old).bottom_by == "score"  # saved before it was recorded: the lowest scores
    with pytest.raises(vb.InputError, match="random_from"):
        ablation_study(vlm, ds, frame, k=2, mode="zero", random_from="others")
    with pytest.raises(vb.InputError, match="bottom_by"):
        ablation_study(vlm, ds, frame, k=2, mode="zero", bottom_by="size")


def test_default_random_pool_is_outside_the_top_k_and_arms_carry_intervals():
    """By default random-k never draws a top-k head; each arm has a Wilson interval (closed form) and the random
    arm a t-interval over its seeds, printed seed by seed."""
    ds = S.binding_query(10, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    others = [(l, h) for l in range(4) for h in range(4) if (l, h) not in CRITICAL]
    result = ablation_study(vlm, ds, _scores([(1, 2), (3, 0), *others]), k=2, mode="zero", seeds=tuple(range(6)))
    assert result.random_from == "rest"
    randoms = result.random_seeds()
    assert len(randoms) == 6 and all(a["accuracy"] == 1.0 for a in randoms)
    assert all(not {tuple(int(x) for x in h.split(".")) for h in a["heads"]} & CRITICAL for a in randoms)
    iv = result.intervals()
    # Wilson for 0 / 10 and 10 / 10 in closed form: [0, z^2 / (n + z^2)] and [n / (n + z^2), 1]
    z2 = 1.959963984540054 ** 2
    assert iv["top"]["low"] == pytest.approx(0.0, abs=1e-12)
    assert iv["top"]["high"] == pytest.approx(z2 / (10 + z2), rel=1e-6)
    assert iv["clean"]["low"] == pytest.approx(10 / (10 + z2), rel=1e-6)
    assert iv["random"] == {"accuracy": 1.0, "low": 1.0, "high": 1.0, "seeds": 6, "lowest": 1.0, "highest": 1.0,
                            "n": 10}
    # seeds that disagree: the t-interval by hand
    mixed = vb.analysis.ablation.AblationResult.from_dict(result.summary() | {"arms": [
        *[a for a in result.arms if a["arm"] != "random"],
        *({"arm": "random", "seed": s, "heads": ["0.0", "0.1"], "accuracy": acc, "n": 10}
          for s, acc in enumerate((0.2, 0.6, 0.7)))]})
    r = mixed.intervals()["random"]
    half = 4.302652729911275 * np.std([0.2, 0.6, 0.7], ddof=1) / np.sqrt(3)
    assert r["accuracy"] == pytest.approx(0.5) and r["low"] == pytest.approx(max(0, 0.5 - half))
    assert r["high"] == pytest.approx(min(1, 0.5 + half)) and (r["lowest"], r["highest"]) == (0.2, 0.7)
    text = mixed.text()
    assert "seed 0 0.200, seed 1 0.600, seed 2 0.700" in text and "over 3 seeds" in text
    fig = mixed.figure()
    assert fig.data[0].error_y.array is not None and "random mean 0.500" in fig.data[1].name
    # results saved before the pool was recorded read as drawn from all heads
    old = result.summary()
    del old["random_from"]
    assert vb.analysis.ablation.AblationResult.from_dict(old).random_from == "all"


def test_random_arm_from_the_top_k_layers():
    """``random_from="same_layers"`` draws, per top-k head, another head of the same layer (never a top-k head, never
    one twice), the same draw for a seed wherever the top heads share layers; the fake model, broken only by its
    critical heads, keeps every answer under those draws. A layer with no head to spare is a named error."""
    from vlmbind.analysis.ablation import same_layer_heads

    ds = S.binding_query(6, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    others = [(l, h) for l in range(4) for h in range(4) if (l, h) not in CRITICAL]
    result = ablation_study(vlm, ds, _scores([(1, 2), (3, 0), *others]), k=2, mode="zero", seeds=tuple(range(6)),
                            random_from="same_layers")
    draws = [[tuple(int(x) for x in h.split(".")) for h in a["heads"]] for a in result.random_seeds()]
    assert all([l for l, _ in d] == [1, 3] and not set(d) & CRITICAL and a["accuracy"] == 1.0
               for d, a in zip(draws, result.random_seeds()))
    assert len({tuple(d) for d in draws}) > 1 and "from the top-k's layers" in result.text()
    assert same_layer_heads([(1, 2), (3, 0)], 4, 5) == same_layer_heads([(1, 2), (3, 0)], 4, 5)
    two = same_layer_heads([(2, 0), (2, 1)], 4, 0)  # two top heads in one layer: two other heads of it
    assert sorted(two) in ([(2, 2), (2, 3)],) and len(set(two)) == 2
    with pytest.raises(vb.InputError, match="layer 2 has no head outside the top-k left"):
        same_layer_heads([(2, 0), (2, 1), (2, 2)], 4, 0)


def test_more_random_pools_share_one_study():
    """``also_random_from`` adds ``random_<pool>`` arms on the same seeds, with the draws a study of that pool alone
    makes, while the clean, top and bottom arms run once; a bad pool is named."""
    ds = S.binding_query(6, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    others = [(l, h) for l in range(4) for h in range(4) if (l, h) not in CRITICAL]
    scores = _scores([(1, 2), (3, 0), *others])
    both = ablation_study(vlm, ds, scores, k=2, mode="zero", seeds=(0, 1, 2), also_random_from=("same_layers",))
    alone = ablation_study(vlm, ds, scores, k=2, mode="zero", seeds=(0, 1, 2), random_from="same_layers")
    rest = ablation_study(vlm, ds, scores, k=2, mode="zero", seeds=(0, 1, 2))
    assert [a["arm"] for a in both.arms].count("clean") == 1 and both.random_from == "rest"
    assert [a["heads"] for a in both.arms if a["arm"] == "random_same_layers"] == \
        [a["heads"] for a in alone.arms if a["arm"] == "random"]
    assert both.random_seeds() == rest.random_seeds()  # the main random arm is untouched
    with pytest.raises(vb.InputError, match="random_from must be one of"):
        ablation_study(vlm, ds, scores, k=2, mode="zero", also_random_from=("layers",))


def test_every_random_arm_is_reported_with_its_interval(tmp_path):
    """A ``random_<pool>`` arm gets what the ``random`` arm gets: its mean and t-interval over seeds (equal to the
    main arm of a study of that pool alone), its accuracy in the summary, a line of seeds in the text, its mean
    across its bars in the figure, and a results.json that loads and saves back byte for byte."""
    ds = S.binding_query(6, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    others = [(l, h) for l in range(4) for h in range(4) if (l, h) not in CRITICAL]
    scores = _scores([(1, 2), (3, 0), *others])
    both = ablation_study(vlm, ds, scores, k=2, mode="zero", seeds=(0, 1, 2), also_random_from=("same_layers",))
    alone = ablation_study(vlm, ds, scores, k=2, mode="zero", seeds=(0, 1, 2), random_from="same_layers")
    assert both.random_arms() == ["random", "random_same_layers"]
    assert both.intervals()["random_same_layers"] == alone.intervals()["random"]
    assert both.summary()["accuracy"]["random_same_layers"] == alone.accuracy("random")
    line = next(x for x in both.text().splitlines() if x.startswith("random_same_layers"))
    seeds = ", ".join(f"seed {a['seed']} {a['accuracy']:.3f}" for a in alone.random_seeds())
    assert line == f"random_same_layers (from the top-k's layers): {seeds}"
    iv = both.intervals()["random_same_layers"]
    assert f"random_same_layers {iv['accuracy']:.3f} [{iv['low']:.2f}, {iv['high']:.2f}] over 3 seeds" in both.text()
    assert [t.name.split(" mean")[0] for t in both.figure().data[1:]] == ["random", "random_same_layers"]
    both.save(tmp_path)
    before = (tmp_path / "results.json").read_bytes()
    vb.analysis.ablation.AblationResult.load(tmp_path).save(tmp_path)
    assert (tmp_path / "results.json").read_bytes() == before


def test_same_layers_short_of_heads_is_refused_before_any_arm_runs(monkeypatch):
    """Three top heads in a four-head layer leave one to match them: ``same_layers`` (as the main pool or an extra
    one) is refused before anything is evaluated; two top heads there can be matched."""
    from vlmbind.analysis import ablation

    assert ablation.layers_short_of_heads([(2, 0), (2, 1), (2, 2), (3, 0)], 4) == [2]
    assert ablation.layers_short_of_heads([(2, 0), (2, 1), (3, 0)], 4) == []
    monkeypatch.setattr(ablation, "evaluate", lambda *a, **k: pytest.fail("an arm was evaluated"))
    ds = S.binding_query(2, 0)
    others = [(l, h) for l in range(4) for h in range(4) if l != 2]
    scores = _scores([(2, 0), (2, 1), (2, 2), (2, 3), *others])
    for pools in ({"random_from": "same_layers"}, {"also_random_from": ("same_layers",)}):
        with pytest.raises(vb.InputError, match="layer 2 has no head outside the top-k left"):
            ablation_study(HeadSensitiveVLM(), ds, scores, k=3, mode="zero", **pools)


def _heads(arm):
    return {tuple(int(x) for x in h.split(".")) for h in arm["heads"]}


def test_top_k_of_half_the_heads_is_accepted_and_one_more_is_refused():
    """k may be as large as half the heads (the top and bottom arms then split the model without overlap): 8 of the
    fake model's 4 x 4 heads runs, 9 is refused."""
    ds = S.binding_query(2, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    order = [(l, h) for l in range(4) for h in range(4)]
    result = ablation_study(vlm, ds, _scores(order), k=8, mode="zero", seeds=(0,), bottom_by="score")
    arms = {a["arm"]: _heads(a) for a in result.arms}
    assert result.k == 8 and arms["top"] == set(order[:8]) and arms["bottom"] == set(order[8:])
    with pytest.raises(vb.InputError, match="k = 9"):
        ablation_study(vlm, ds, _scores(order), k=9, mode="zero", seeds=(0,))


def test_random_arm_never_draws_a_top_k_head_not_even_the_kth():
    """Random-k comes from the heads outside the whole top-k, its k-th head included. With k = 8 of 16 heads that
    pool is exactly the other 8, so every seed draws all of them; with k = 2, many seeds together draw each of the 14
    other heads and neither of the top two."""
    ds = S.binding_query(2, 0)
    vlm = HeadSensitiveVLM()
    vlm.answers = {id(e.image): e.answer for e in ds}
    order = [divmod(int(i), 4) for i in np.random.default_rng(5).permutation(16)]
    half = ablation_study(vlm, ds, _scores(order), k=8, mode="zero", seeds=tuple(range(5)))
    assert [_heads(a) for a in half.random_seeds()] == [set(order[8:])] * 5
    two = ablation_study(vlm, ds, _scores(order), k=2, mode="zero", seeds=tuple(range(60)))
    assert set().union(*(_heads(a) for a in two.random_seeds())) == set(order[2:])


def test_random_arm_interval_is_a_t_interval_with_the_sample_standard_deviation():
    """Four seeds at 0.4, 0.5, 0.6 and 0.5: mean 0.5, sample standard deviation sqrt(0.02 / 3) (ddof 1) and
    t(0.975, 3 df) = 3.182446305284263 (tables), so the 95% interval is 0.5 -+ 3.18245 * 0.0816497 / 2, about
    [0.370, 0.630]: inside [0, 1], so nothing is clipped."""
    fixed = [{"arm": arm, "seed": None, "heads": ["0.0"], "accuracy": 0.5, "n": 10}
             for arm in ("clean", "top", "bottom")]
    seeds = [{"arm": "random", "seed": s, "heads": ["1.1"], "accuracy": acc, "n": 10}
             for s, acc in enumerate((0.4, 0.5, 0.6, 0.5))]
    result = vb.analysis.ablation.AblationResult("m", "query", "zero", 1, False, arms=[*fixed, *seeds])
    half = 3.182446305284263 * np.sqrt(0.02 / 3) / 2
    r = result.intervals()["random"]
    assert r["accuracy"] == pytest.approx(0.5)
    assert (r["low"], r["high"]) == (pytest.approx(0.5 - half, abs=1e-12), pytest.approx(0.5 + half, abs=1e-12))
