"""Head-level mediation: the score formula (naive and exact) against an independent nnsight computation, identity
pairs score exactly zero, and results save as the contract says."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import get_tiny, shared_organism

import vlmbind as vb
from vlmbind.analysis import HeadScores, answer_token_ids, locate
from vlmbind.engine.alignment import check_alignment

S = vb.stimuli


@pytest.mark.parametrize("method", ["naive", "exact"])
@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-gemma3"])
@pytest.mark.parametrize("condition", ["id_retrieval", "feature_retrieval"])
def test_scores_equal_an_nnsight_computation(name, condition, method):
    vlm = get_tiny(name)
    pairs = S.scene_pairs(2, condition, 0, n_objects=3)
    scores = locate(vlm, pairs, layers=[1, 2], method=method)
    assert np.all(scores.per_pair[:, [0, 3]] == 0)  # layers not asked for
    nn_model = vlm.nnsight()
    a_ = vlm.adapter
    tok = a_.tokenizer
    for i, pair in enumerate(pairs):
        prefix, a, a_star = answer_token_ids(tok, pair.answer, pair.answer_counterfactual)
        assert prefix == []  # high entropy: the colours differ
        aligned = check_alignment(vlm, [pair])
        pos, d = aligned.positions[0], a_.d_head
        for layer, head in [(1, 0), (2, 3)]:
            path = a_.o_proj_path(layer)
            with torch.no_grad(), nn_model.trace(**aligned.counterfactual.inputs, use_cache=False):
                z_cf = vlm.nnsight_module(nn_model, path).input.save()
            with torch.no_grad(), nn_model.trace(**aligned.clean.inputs, use_cache=False):
                clean_logits = nn_model.output.logits.save()
            with torch.no_grad(), nn_model.trace(**aligned.clean.inputs, use_cache=False):
                x = vlm.nnsight_module(nn_model, path).input
                for p in pos.tolist():
                    x[:, p, head * d:(head + 1) * d] = z_cf[:, p, head * d:(head + 1) * d]
                patched = nn_model.output.logits.save()
            ref = float((patched[0, -1, a_star] - patched[0, -1, a]) - (clean_logits[0, -1, a_star]
                                                                         - clean_logits[0, -1, a]))
            assert scores.per_pair[i, layer, head] == pytest.approx(ref, abs=1e-6)
    assert np.abs(scores.per_pair).max() > 1e-5, "effects must be non-zero for the comparison to mean anything"


@pytest.mark.parametrize("method", ["naive", "exact", "attribution"])
def test_identity_pairs_score_zero(method):
    vlm = get_tiny("tiny-qwen2_5_vl")
    pairs = [replace(p, counterfactual=replace(p.counterfactual, image=p.clean.image))
             for p in S.scene_pairs(2, "id_selection", 1, n_objects=3)]
    scores = locate(vlm, pairs, method=method)
    assert np.all(scores.per_pair == 0)


def test_shared_answer_prefix_is_appended():
    vlm = get_tiny("tiny-qwen2_5_vl")
    tok = vlm.adapter.tokenizer
    prefix, a, a_star = answer_token_ids(tok, "red square", "red circle")
    assert tok.decode(prefix).strip() == "red" and a != a_star
    with pytest.raises(vb.InputError, match="no differing token"):
        answer_token_ids(tok, "red square", "red square")
    pairs = [p for p in S.scene_pairs(40, "id_selection", 0, n_objects=(3, 4), entropy="low")
             if p.first_difference == 1][:1]
    assert pairs, "low-entropy pairs that share the colour exist"
    scores = locate(vlm, pairs, layers=[3])
    assert np.abs(scores.per_pair[0, 3]).max() > 0


def test_results_table_and_files(tmp_path):
    per_pair = np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4)
    hs = HeadScores("id_selection", "naive", "m", per_pair, pair_ids=["p0", "p1"])
    frame = hs.to_frame()
    assert list(frame.columns) == ["layer", "head", "score", "stderr", "n", "ci_low", "ci_high", "p_value", "q_value",
                                   "significant"] and len(frame) == 12
    assert frame.loc[(frame["layer"] == 2) & (frame["head"] == 3), "score"].item() == (11 + 23) / 2
    assert hs.top(2) == [(2, 3), (2, 2)]
    assert hs.stderr[0, 0] == pytest.approx(np.std([0, 12], ddof=1) / np.sqrt(2))
    hs.save(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["top_heads"][0] == "2.3"
    assert (tmp_path / "scores.csv").read_text().startswith("layer,head,score,stderr,n")
    assert (tmp_path / "heatmap.html").stat().st_size > 1000


def test_bad_calls():
    vlm = get_tiny("tiny-qwen2_5_vl")
    with pytest.raises(vb.InputError, match="unknown method"):
        locate(vlm, S.scene_pairs(1, "id_selection", 0), method="fast")
    with pytest.raises(vb.InputError, match="at least one"):
        locate(vlm, [])
    mixed = [*S.scene_pairs(1, "id_selection", 0), *S.scene_pairs(1, "id_retrieval", 0)]
    with pytest.raises(vb.InputError, match="mix conditions"):
        locate(vlm, mixed)


def test_locate_command(tmp_path, capsys):
    from vlmbind.cli import main

    out = tmp_path / "loc"
    assert main(["locate", "--model", "tiny-qwen2_5_vl", "--condition", "id_selection", "--n-pairs", "2",
                 "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n"] == 2 and summary["method"] == "exact" and len(summary["top_heads"]) == 10
    frame = __import__("pandas").read_csv(out / "scores.csv")
    assert len(frame) == 16 and set(frame["n"]) == {2}
    assert main(["locate", "--model", "tiny-qwen2_5_vl", "--condition", "id_selection", "--n-pairs", "0",
                 "--out", str(out)]) == 2


def test_killed_locate_resumes_to_an_identical_scores_csv(tmp_path):
    """kill -9 a `vlmbind locate` run once it has written part of its checkpoint, resume it, and compare with an
    uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = ["locate", "--model", "organism-p2a", "--condition", "feature_retrieval", "--n-pairs", "12",
            "--method", "naive", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "vlmbind.cli"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run([*cmd, *args, "--out", str(ref)], check=True, capture_output=True, env=env)
    proc = subprocess.Popen([*cmd, *args, "--out", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    checkpoint = run / "locate.partial.safetensors"
    deadline = time.time() + 120
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists() and not (run / "scores.csv").exists(), "the run must be killed part-way"
    # without --resume the interrupted run is refused, not overwritten
    again = subprocess.run([*cmd, *args, "--out", str(run)], capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "--resume" in again.stderr.strip().splitlines()[-1]
    subprocess.run([*cmd, *args, "--out", str(run), "--resume"], check=True, capture_output=True, env=env)
    assert (run / "scores.csv").read_bytes() == (ref / "scores.csv").read_bytes()
    assert not checkpoint.exists()


def test_checkpoint_of_another_run_is_refused(tmp_path):
    vlm = get_tiny("tiny-qwen2_5_vl")
    pairs = S.scene_pairs(2, "id_selection", 0, n_objects=3)
    path = tmp_path / "c.safetensors"
    from vlmbind.analysis.mediation import save_checkpoint, pairs_digest

    save_checkpoint(path, {"model": "other", "method": "exact", "condition": "id_selection", "layers": [0, 1, 2, 3],
                            "pairs": [p.id for p in pairs]}, np.zeros((1, 4, 4)))
    with pytest.raises(vb.InputError, match="another run"):
        locate(vlm, pairs, checkpoint=path)
    full = locate(vlm, pairs)
    partial = tmp_path / "p.safetensors"
    key = {"model": vlm.name, "method": "exact", "condition": "id_selection", "layers": [0, 1, 2, 3],
           "pairs": [p.id for p in pairs], "content": pairs_digest(pairs), "prompt_format": "chat"}
    save_checkpoint(partial, key, full.per_pair[:1])
    with pytest.raises(vb.InputError, match="prompt_format differ"):  # the tiny model prompts raw by default
        locate(vlm, pairs, checkpoint=partial)
    save_checkpoint(partial, {**key, "prompt_format": "raw"}, full.per_pair[:1])
    resumed = locate(vlm, pairs, checkpoint=partial)
    np.testing.assert_array_equal(resumed.per_pair, full.per_pair)
    assert not partial.exists()


def test_head_uncertainty_matches_scipy_and_a_plain_bootstrap():
    from scipy import stats

    from vlmbind.analysis.mediation import head_uncertainty

    rng = np.random.default_rng(3)
    per_pair = rng.normal(size=(12, 3, 4)) * 0.1
    per_pair[:, 2, 1] += 1.0  # one real head
    per_pair[:, 0, 0] = 0.0  # a head that never moves
    u = head_uncertainty(per_pair, n_boot=4000, seed=0)
    t = stats.ttest_1samp(per_pair[:, 1, 2], 0.0)
    assert u["p_value"][1, 2] == pytest.approx(t.pvalue, rel=1e-12)
    p = u["p_value"].ravel()
    assert np.allclose(u["q_value"].ravel(), stats.false_discovery_control(p, method="bh"))
    assert u["p_value"][0, 0] == 1.0 and not u["significant"][0, 0]
    assert u["significant"][2, 1] and u["significant"].sum() <= 2
    # the interval of the real head is a plain bootstrap's, to Monte-Carlo error
    boots = [per_pair[rng.integers(0, 12, 12), 2, 1].mean() for _ in range(4000)]
    assert u["ci_low"][2, 1] == pytest.approx(np.percentile(boots, 2.5), abs=0.02)
    assert u["ci_high"][2, 1] == pytest.approx(np.percentile(boots, 97.5), abs=0.02)
    assert (u["ci_low"] <= per_pair.mean(0)).all() and (per_pair.mean(0) <= u["ci_high"]).all()
    assert np.array_equal(head_uncertainty(per_pair, n_boot=4000, seed=0)["ci_low"], u["ci_low"])  # seeded


def test_rankings_say_which_heads_are_significant_and_when_none_is(tmp_path):
    rng = np.random.default_rng(0)
    half = rng.normal(size=(4, 2, 3)) * 0.01  # 8 pairs: enough that "not evidence" is the data's verdict
    noise = HeadScores("id_selection", "exact", "m", np.concatenate([half, -half]))  # every mean exactly 0
    assert noise.significant_top() == [] and "not evidence" in noise.significance_note()
    assert "significance_note" in noise.summary() and noise.summary()["significant_heads"] == []
    half = rng.normal(size=(4, 2, 3)) * 0.01
    real = np.concatenate([half, -half])  # zero-mean noise everywhere ...
    real[:, 1, 2] += 1.0  # ... and one head that moves the logit
    strong = HeadScores("id_selection", "exact", "m", real)
    assert strong.significant_top() == [(1, 2)] and strong.significance_note() is None
    assert strong.ranking_text(2).startswith("1.2* (+1.")
    strong.save(tmp_path)
    loaded = HeadScores.load(tmp_path)
    assert loaded.significant_top() == [(1, 2)]
    np.testing.assert_array_equal(loaded.uncertainty()["ci_high"], strong.uncertainty()["ci_high"])
    html = (tmp_path / "heatmap.html").read_text()
    assert "rings: significant (1 of 6 heads)" in html and "95% percentile bootstrap" in json.dumps(strong.summary())


def test_a_scene_task_is_built_in_the_models_prompt_format_as_locate_builds_it():
    """``scene_task`` and ``aligned_scene_pair`` follow the model's prompt format unless told, as ``locate`` does:
    a script that builds its own tasks scores the prompts locate scores."""
    from vlmbind.analysis.mediation import scene_task
    from vlmbind.engine.patching import naive_diffs

    vlm = get_tiny("tiny-qwen2_5_vl")
    pair = vb.stimuli.scene_pairs(1, "id_selection", 0, n_objects=3)[0]
    raw = scene_task(vlm, pair, [0], "raw").batch.inputs["input_ids"]
    chat = scene_task(vlm, pair, [0], "chat").batch.inputs["input_ids"]
    assert raw.shape != chat.shape or not torch.equal(raw, chat)
    assert torch.equal(scene_task(vlm, pair, [0]).batch.inputs["input_ids"], raw)  # a tiny model's default: raw
    try:
        vlm.use_prompt_format("chat")
        assert torch.equal(scene_task(vlm, pair, [0]).batch.inputs["input_ids"], chat)
        per_pair = locate(vlm, [pair], method="naive", layers=[0], verify_top=0).per_pair[0, 0]
        clean, patched = naive_diffs(vlm, scene_task(vlm, pair, [0]), [(0, h) for h in range(vlm.n_heads)])
        np.testing.assert_allclose(per_pair, patched - clean, atol=1e-5)
    finally:
        vlm.use_prompt_format(None)


def test_the_95_percent_interval_is_the_2_5_and_97_5_percentiles_of_the_bootstrap():
    """Three pairs scoring 0, 1 and 10: a resample of three pairs has sum 0 with probability 1/27 (three times the
    0) and sum 30 with probability 1/27 (three times the 10), and the next sums are 1 (3/27) and 21 (3/27). So 3.7%
    of the bootstrap means lie at each end: the 2.5th percentile is mean 0 and the 97.5th mean 10, while a 90%
    interval (5th and 95th percentiles) would be [1/3, 7]."""
    from vlmbind.analysis.mediation import head_uncertainty

    per_pair = np.array([0.0, 1.0, 10.0]).reshape(3, 1, 1)
    for seed in (0, 1, 2):
        u = head_uncertainty(per_pair, n_boot=20000, seed=seed)
        assert (u["ci_low"][0, 0], u["ci_high"][0, 0]) == (0.0, 10.0), seed


def test_significance_is_decided_by_the_benjamini_hochberg_q_not_the_raw_p():
    """Six heads: one far from 0, one at p = 0.026 (significant alone, but not once six heads are tested: its BH q
    is 0.026 * 6 / 2 = 0.079) and four whose pairs average exactly 0. The q values are computed here by hand."""
    from scipy import stats

    from vlmbind.analysis.mediation import head_uncertainty

    columns = [[5.0, 5.1, 4.9, 5.05, 4.95, 5.0], [1.0, 2.0, 0.5, 1.5, 0.2, 0.3], [1.0, -1.0, 2.0, -2.0, 0.5, -0.5],
               [0.3, -0.3, 0.1, -0.1, 0.2, -0.2], [2.0, -2.0, 1.0, -1.0, 0.0, 0.0], [0.1, -0.1, 0.4, -0.4, 1.0, -1.0]]
    per_pair = np.array(columns).T.reshape(6, 2, 3)
    p = np.array([stats.ttest_1samp(c, 0.0).pvalue for c in columns])
    order = np.argsort(p)
    m, q, running = len(p), np.empty(len(p)), 1.0
    for rank in range(m, 0, -1):  # q_(i) = min over j >= i of p_(j) * m / j
        running = min(running, p[order[rank - 1]] * m / rank)
        q[order[rank - 1]] = running
    assert p[1] < 0.05 <= q[1] and q[0] < 0.05  # one head the correction removes, one it keeps
    u = head_uncertainty(per_pair)
    np.testing.assert_allclose(u["q_value"].ravel(), q, rtol=1e-9)
    assert u["significant"].ravel().tolist() == (q < 0.05).tolist()
    assert HeadScores("id_selection", "exact", "m", per_pair).significant_top() == [(0, 0)]


def test_tied_zero_variance_heads_are_reported_as_ties_and_never_significant():
    """Two heads that score the same nonzero value on every pair (zero variance, tied) are not evidence: no head is
    significant, the note says why, and the ranking names the tie instead of ordering it by head index."""
    rng = np.random.default_rng(0)
    per_pair = rng.normal(0, 0.05, (12, 2, 3))
    per_pair[:, 0, 1] = per_pair[:, 1, 2] = 0.8
    scores = HeadScores("id_selection", "exact", "m", per_pair.copy())
    u = scores.uncertainty()
    assert not u["significant"].any() and u["p_value"][0, 1] == u["p_value"][1, 2] == 1.0
    assert u["zero_variance"][0, 1] and u["zero_variance"][1, 2] and u["zero_variance"].sum() == 2
    assert scores.significant_top() == [] and "2 head(s) score the same nonzero value" in scores.significance_note()
    assert scores.ties(5) == [["0.1", "1.2"]] and scores.summary()["tied_top_heads"] == [["0.1", "1.2"]]
    assert scores.ranking_text(3).endswith("; tied: 0.1 = 1.2")
    per_pair[:, 1, 2] += rng.normal(0, 1e-3, 12)  # no longer tied, no longer constant: ordinary evidence again
    varied = HeadScores("id_selection", "exact", "m", per_pair)
    assert varied.ties(5) == [] and "tied_top_heads" not in varied.summary() and varied.significant_top() == [(1, 2)]


def _one_strong_head(n_pairs: int, shift: float = 10.0, seed: int = 0) -> np.ndarray:
    """``n_pairs`` pairs of small noise on 2 x 3 heads, and head 1.2 moving the logit by about ``shift`` on every
    pair (a large, consistent effect: the t-test's p is tiny at any n)."""
    rng = np.random.default_rng(seed)
    per_pair = rng.normal(0, 0.01, (n_pairs, 2, 3))
    per_pair[:, 1, 2] += shift + rng.normal(0, 0.1, n_pairs)
    return per_pair


def _exact_sign_flip_p(values: np.ndarray) -> float:
    """Two-sided exact sign-flip p of the mean of ``values``: the share of the 2**n sign patterns whose |mean| is at
    least the observed one."""
    import itertools

    observed = abs(values.mean())
    flips = [abs((values * np.array(signs)).mean()) >= observed - 1e-12
             for signs in itertools.product((1, -1), repeat=len(values))]
    return sum(flips) / len(flips)


def test_the_fewest_pairs_for_significance_is_where_an_exact_sign_flip_test_can_reach_p_below_the_level():
    from vlmbind.analysis.mediation import MIN_PAIRS_FOR_SIGNIFICANCE, SIGNIFICANCE

    expected = min(n for n in range(1, 64) if 2 / 2**n < SIGNIFICANCE)
    assert MIN_PAIRS_FOR_SIGNIFICANCE == expected == 6
    # the smallest p the exact test gives (every pair's sign agreeing) is 2 / 2**n: 0.0625 at 5 pairs, 0.03125 at 6
    assert _exact_sign_flip_p(np.arange(1.0, 6.0)) == 2 / 2**5 >= SIGNIFICANCE
    assert _exact_sign_flip_p(np.arange(1.0, 7.0)) == 2 / 2**6 < SIGNIFICANCE


def test_no_head_is_significant_on_fewer_pairs_than_the_test_can_support(tmp_path):
    """Five pairs of a large, consistent effect: the t-test's p and the BH q are tiny, but no head is called
    significant and the note names the six pairs needed; with six such pairs the head is significant."""
    five = HeadScores("id_selection", "exact", "m", _one_strong_head(5))
    u = five.uncertainty()
    assert u["p_value"][1, 2] < 1e-6 and u["q_value"][1, 2] < 0.05  # p and q are what they are ...
    assert not u["significant"].any() and five.significant_top() == []  # ... but nothing is called significant
    note = five.significance_note()
    assert note == ("5 pairs: too few to call any head significant (at least 6 are needed: with n pairs an exact "
                    "sign-flip test cannot reach p < 0.05 below 6); rerun with --n-pairs 6 or more")
    assert five.significance_text() == note and five.summary()["significance_note"] == note
    assert five.summary()["significant_heads"] == []
    frame = five.to_frame()
    assert not frame["significant"].any() and frame["q_value"].min() < 0.05
    assert "*" not in five.ranking_text(3)

    six = HeadScores("id_selection", "exact", "m", _one_strong_head(6))
    assert six.significant_top() == [(1, 2)] and six.significance_note() is None
    assert six.significance_text() == "significant (BH q < 0.05, sign of the mean): +1.2"

    # a table saved by a version without the minimum (significant on 5 pairs) is not believed when loaded
    five.save(tmp_path)
    table = (tmp_path / "scores.csv").read_text()
    (tmp_path / "scores.csv").write_text(table.replace(",False", ",True"))
    loaded = HeadScores.load(tmp_path)
    assert loaded.n == 5 and loaded.table["significant"].all() and loaded.significant_top() == []
    assert loaded.significance_note() == note

    from_file = HeadScores("id_selection", "exact", "m", _one_strong_head(3), pairs_file="/data/pairs.jsonl")
    assert from_file.significance_note().startswith("3 pairs: too few")
    assert from_file.significance_note().endswith("; add pairs to /data/pairs.jsonl (6 or more)")


def test_significant_heads_are_listed_with_the_sign_of_their_mean():
    per_pair = _one_strong_head(8)
    per_pair[:, 0, 1] -= 3.0 + np.random.default_rng(1).normal(0, 0.1, 8)  # a head that pushes the other way
    scores = HeadScores("id_selection", "exact", "m", per_pair)
    assert scores.significant_top() == [(1, 2), (0, 1)] and scores.scores[0, 1] < 0
    assert scores.significance_text() == "significant (BH q < 0.05, sign of the mean): +1.2, -0.1"
    assert scores.significance_text(1) == "significant (BH q < 0.05, sign of the mean): +1.2 and 1 more"
    estimate = HeadScores("id_selection", "integrated_gradients", "m", per_pair)
    assert estimate.significance_text().startswith("significant by the ig estimate (BH q < 0.05, sign of the mean)")


def test_an_estimates_ranking_shows_each_head_beside_its_exact_score_ranked_by_the_exact_score(tmp_path):
    """Head 1.2 has the largest estimate but a small exact score, head 0.1 the reverse: the ranking lists 0.1 first,
    each with its estimate and exact mean and interval as the summary and the saved table hold them, and the
    unverified heads after, with no exact score."""
    rng = np.random.default_rng(0)
    per_pair = rng.normal(0, 0.01, (8, 2, 3))
    per_pair[:, 1, 2] += 5.0
    per_pair[:, 0, 1] += 1.0
    verified = np.full(per_pair.shape, np.nan)
    verified[:, 1, 2] = 0.5 + rng.normal(0, 0.1, 8)
    verified[:, 0, 1] = 18.0 + rng.normal(0, 1.0, 8)
    scores = HeadScores("id_selection", "integrated_gradients", "m", per_pair, verified=verified)
    text = scores.ranking_text(3)
    u, summary = scores.uncertainty(), scores.summary()
    entries = {e["head"]: e for e in summary["verified"]}
    shown = []
    for head in ("0.1", "1.2"):
        l, h = map(int, head.split("."))
        e = entries[head]
        low, high = e["exact_ci"]
        assert low < e["exact"] < high
        shown.append(f"{head}{'*' if u['significant'][l, h] else ''} (ig {e['integrated_gradients']:+.3f} "
                     f"[{u['ci_low'][l, h]:+.3f}, {u['ci_high'][l, h]:+.3f}], exact {e['exact']:+.3f} "
                     f"[{low:+.3f}, {high:+.3f}])")
    assert text.startswith(", ".join(shown) + ", ")  # by exact score: 0.1 first though 1.2's estimate is larger
    third = scores.top(3)[2]
    assert text.endswith(f"{third[0]}.{third[1]} (ig {scores.scores[third]:+.3f} [{u['ci_low'][third]:+.3f}, "
                         f"{u['ci_high'][third]:+.3f}], exact not verified)")
    assert "exact mean" in scores.ranking_legend() and "ig estimate" in scores.ranking_legend()
    # the numbers shown are the saved ones
    scores.save(tmp_path)
    loaded = HeadScores.load(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["verified"] == json.loads(json.dumps(
        summary["verified"]))
    assert loaded.ranking_text(3) == text
    # an exact method's ranking is unchanged: mean and interval only
    plain = HeadScores("id_selection", "exact", "m", per_pair)
    assert "exact" not in plain.ranking_text(3) and plain.ranking_legend() == "mean [95% interval], * significant"


def test_locate_prints_an_estimate_beside_its_exact_score_as_saved(tmp_path, capsys):
    """`vlmbind locate --method integrated_gradients --verify-top 4` on organism-vsm (planted heads 2.3 and 3.1):
    the printed text holds, for each planted head, the estimate and the exact score with its interval exactly as
    summary.json's `verified` entries hold them, and the verified heads in order of their exact scores."""
    import re

    from vlmbind.cli import main

    out = tmp_path / "ig"
    assert main(["locate", "--model", "organism-vsm", "--condition", "id_selection", "--method",
                 "integrated_gradients", "--n-pairs", "8", "--verify-top", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    frame = __import__("pandas").read_csv(out / "scores.csv")
    entries = {e["head"]: e for e in summary["verified"]}
    assert {"2.3", "3.1"} <= set(entries)
    for head in ("2.3", "3.1"):
        e = entries[head]
        low, high = e["exact_ci"]
        pattern = (rf"\b{re.escape(head)}\*? \(ig {re.escape(format(e['integrated_gradients'], '+.3f'))} "
                   rf"\[[^]]+\], exact {re.escape(format(e['exact'], '+.3f'))} "
                   rf"\[{re.escape(format(low, '+.3f'))}, {re.escape(format(high, '+.3f'))}\]\)")
        assert re.search(pattern, text), (head, text)
    others = [e["exact"] for head, e in entries.items() if head not in ("2.3", "3.1")]
    assert min(entries["2.3"]["exact"], entries["3.1"]["exact"]) > max(others)  # the planted heads lead
    by_exact = sorted(entries, key=lambda head: -entries[head]["exact"])
    ranking = text.splitlines()[1].split("): ", 1)[1]  # the ranking alone (the header holds the seconds)
    positions = [re.search(rf"(?<![\d.]){re.escape(head)}\*? \(", ranking).start() for head in by_exact]
    assert positions == sorted(positions), text
    significance = text.splitlines()[2]
    for head in summary["significant_heads"]:
        l, h = map(int, head.split("."))
        score = frame.loc[(frame["layer"] == l) & (frame["head"] == h), "score"].item()
        assert f"{'-' if score < 0 else '+'}{head}" in significance
    if not summary["significant_heads"]:
        assert significance.strip() == summary["significance_note"]


def test_locate_scores_only_the_chosen_heads_and_counts_heads_as_it_goes(tmp_path, capsys):
    from vlmbind.app.commands import main

    vlm = get_tiny("tiny-qwen2_vl")
    pairs = vb.stimuli.scene_pairs(2, "id_selection", 0, n_objects=3)
    every = vb.locate(vlm, pairs)
    some = vb.locate(vlm, pairs, heads="1.0,2.3", layers=[1, 2, 3])
    assert some.scored_heads == ["1.0", "2.3"] and every.scored_heads is None
    for l, h in ((1, 0), (2, 3)):
        np.testing.assert_allclose(some.per_pair[:, l, h], every.per_pair[:, l, h], atol=1e-5)
    assert np.count_nonzero(some.per_pair) == np.count_nonzero(every.per_pair[:, [1, 2], [0, 3]])
    with pytest.raises(vb.InputError, match="lies in the layers"):
        vb.locate(vlm, pairs, heads="0.1", layers=[2])
    for method in ("naive", "exact"):  # one step per head and pair
        vb.locate(vlm, pairs, method=method, layers=[3], progress=True)
        assert "8/8" in capsys.readouterr().err.replace(" ", "")
    out = tmp_path / "l"
    assert main(["locate", "--model", "tiny-qwen2_vl", "--condition", "id_selection", "--n-pairs", "2", "--layers",
                 "2-3", "--heads", "2.3,3.1,0.0", "--out", str(out)]) == 0
    assert "scored 2 of 16 heads (--layers / --heads)" in capsys.readouterr().out
    assert vb.HeadScores.load(out).scored_heads == ["2.3", "3.1"]


def test_atp_star_finds_the_id_selection_heads_attp_misses_and_says_which_fix_does_it():
    """On organism-vsm, AtP ranks the planted ID-selection heads last; AtP* puts them first. The QK fix alone (signed)
    recovers 3.1, whose effect passes through 5.2's saturated query, but not 2.3, whose effect passes through two
    saturated softmaxes in turn; GradDrop's magnitudes lift 2.3 (as the magnitude of AtP alone would)."""
    from vlmbind.analysis.evaluation import stimulus_defaults
    from vlmbind.analysis.mediation import scene_task
    from vlmbind.engine.patching import atp_star_diffs

    vlm = shared_organism("organism-vsm")
    scenes, _ = stimulus_defaults(vlm, "scene", {"n_objects": 3})
    pairs = vb.stimuli.make_pairs("id_selection", 2, 1000, **scenes)
    star = vb.locate(vlm, pairs, method="atp_star", verify_top=2)
    assert set(star.top(2)) == {(2, 3), (3, 1)}
    assert set(vb.locate(vlm, pairs, method="attribution", verify_top=0).top(26)).isdisjoint({(2, 3), (3, 1)})
    heads = [(2, 3), (3, 1)]
    qk = np.array([np.subtract(*reversed(atp_star_diffs(vlm, scene_task(vlm, p, range(vlm.n_layers)), heads,
                                                        grad_drop=False))) for p in pairs]).mean(0)
    assert qk[1] > 1.0 and qk[0] < 0
