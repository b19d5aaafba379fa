"""Position-ID edits: the estimates equal a hand computation, the edit equals a plain o_proj hook (and is the
identity at alpha 0), the bookkeeping is right on a fake model whose answers we know, and the study and the
``vlmbind edit`` command run on the shipped organism."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import vlmbind as vb
from vlmbind.analysis import edits
from vlmbind.analysis.edits import edit_study, entropy_repair
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.analysis.position_ids import check_alphas, estimate_position_ids
from vlmbind.core.errors import TooFewEstimatesError
from vlmbind.engine.decoding import greedy_decode
from vlmbind.engine.interventions import AddToHeadRows

S = vb.stimuli
def _scenes(vlm, n, seed, **kw):
    return list(S.scene_description(n, seed, **training_defaults(vlm, "scene", {"n_objects": 3, **kw})))


def _cell(obj):
    return int(obj.row), int(obj.col)


# ----------------------------------------------------------------------------------------------------------------
# Estimates
# ----------------------------------------------------------------------------------------------------------------
def test_position_ids_equal_a_hand_computed_mean(organism_p2a):
    heads = [(1, 0), (2, 3), (1, 2)]
    examples = _scenes(organism_p2a, 48, 5)
    ids = estimate_position_ids(organism_p2a, examples, "1.0,2.3,1.2", min_count=2, batch_size=len(examples))

    batch = organism_p2a.prepare([e.image for e in examples], [e.prompt for e in examples])
    cache = organism_p2a.capture(batch, ["blocks.1.attn.hook_z", "blocks.2.attn.hook_z"])
    mask = batch.inputs["attention_mask"]
    last = [int(torch.nonzero(mask[r]).max()) for r in range(len(examples))]  # last real token, from the mask
    by_cell: dict = {}
    for r, e in enumerate(examples):
        z = torch.stack([cache[f"blocks.{l}.attn.hook_z"][r, last[r], h] for l, h in heads]).double()
        by_cell.setdefault(_cell(e.objects[e.fields["target"]]), []).append(z)
    kept = sorted(c for c, zs in by_cell.items() if len(zs) >= 2)
    assert ids.heads == heads and ids.cells == kept and ids.vectors.shape == (len(kept), 3, organism_p2a.adapter.d_head)
    assert ids.counts == [len(by_cell[c]) for c in kept]
    assert ids.skipped_cells == {c: len(zs) for c, zs in by_cell.items() if len(zs) < 2}
    assert ids.skipped_cells, "the test needs a cell below min_count"
    assert sum(ids.counts) + ids.n_skipped_examples == len(examples)
    for c in kept:
        assert torch.equal(ids.vector(c), torch.stack(by_cell[c]).mean(0))
    t, o = kept[0], kept[1]
    assert torch.equal(ids.delta(t, o), torch.stack(by_cell[t]).mean(0) - torch.stack(by_cell[o]).mean(0))
    with pytest.raises(vb.InputError, match="no position-ID estimate"):
        ids.vector(next(iter(ids.skipped_cells)))
    # batching changes nothing but float rounding
    small = estimate_position_ids(organism_p2a, examples, heads, min_count=2, batch_size=7)
    assert small.cells == ids.cells and torch.allclose(small.vectors, ids.vectors, atol=1e-5)


def test_bad_heads_and_alphas(organism_p2a):
    examples = _scenes(organism_p2a, 4, 0)
    for heads, match in (("1.0,9.9", "do not exist"), ("x", "LAYER.HEAD"), ("1.0,1.0", "more than once"),
                         ("", "no heads")):
        with pytest.raises(vb.InputError, match=match):
            estimate_position_ids(organism_p2a, examples, heads)
    with pytest.raises(vb.InputError, match="not a number"):
        check_alphas("0,a")
    assert check_alphas("4,1") == [0.0, 1.0, 4.0]
    with pytest.raises(vb.InputError, match="not scene-description"):
        estimate_position_ids(organism_p2a, list(S.binding_query(2, 0)), "1.0")


# ----------------------------------------------------------------------------------------------------------------
# The edit itself
# ----------------------------------------------------------------------------------------------------------------
def test_edit_equals_a_plain_o_proj_hook_and_alpha_zero_is_the_identity(organism_p2a):
    examples = _scenes(organism_p2a, 3, 1)
    batch = organism_p2a.prepare([e.image for e in examples], [e.prompt for e in examples])
    d_head, n_heads = organism_p2a.adapter.d_head, organism_p2a.n_heads
    vec = torch.randn(3, 2, d_head, generator=torch.Generator().manual_seed(0)) * 3
    last = batch.last_positions[:, None]
    clean = organism_p2a.run(batch).logits

    zero = organism_p2a.run(batch, interventions=[AddToHeadRows(layer=1, heads=[0, 3], positions=last, vector=vec,
                                                            alpha=0.0)]).logits
    assert torch.equal(zero, clean)

    edited = organism_p2a.run(batch, interventions=[AddToHeadRows(layer=1, heads=[0, 3], positions=last, vector=vec,
                                                              alpha=2.0)]).logits

    def hook(module, args):  # independent: the o_proj input, head h = columns h*D:(h+1)*D
        x = args[0].clone()
        for r in range(x.shape[0]):
            for j, h in enumerate((0, 3)):
                x[r, int(last[r, 0]), h * d_head:(h + 1) * d_head] += 2.0 * vec[r, j]
        return (x, *args[1:])

    handle = organism_p2a.adapter.o_proj_module(1).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            manual = organism_p2a.model(**organism_p2a.model_inputs(batch), use_cache=False).logits
    finally:
        handle.remove()
    assert torch.allclose(edited, manual, atol=1e-5)
    assert not torch.allclose(edited[:, -1], clean[:, -1], atol=1e-3)
    assert torch.equal(edited[:, :-1], clean[:, :-1])  # only the last position (and nothing before it) moves

    # rows sharing one vector: the same as vlmbind's AddToHeads
    shared = vec[:1].expand(3, -1, -1)
    rows = organism_p2a.run(batch, interventions=[AddToHeadRows(layer=1, heads=[0, 3], positions=last, vector=shared,
                                                            alpha=2.0)]).logits
    ref = organism_p2a.run(batch, interventions=[vb.AddToHeads(layer=1, heads=[0, 3], positions=last, vector=vec[0],
                                                           alpha=2.0)]).logits
    assert torch.equal(rows, ref)
    with pytest.raises(vb.InterventionError, match="per-row vector"):
        organism_p2a.run(batch, interventions=[AddToHeadRows(layer=1, heads=[0, 3], positions=last, vector=vec[:2],
                                                         alpha=1.0)])
    assert n_heads == 4


def test_greedy_decode_matches_generate_and_keeps_the_edit_at_the_prompt_end(organism_p2a):
    examples = _scenes(organism_p2a, 6, 2)
    batch = organism_p2a.prepare([e.image for e in examples], [e.prompt for e in examples])
    texts, _ = organism_p2a.generate(batch, max_new_tokens=3)
    assert greedy_decode(organism_p2a, batch, (), 3) == texts
    seen = []

    class Spy(AddToHeadRows):
        def edit_z(self, z, index):
            seen.append(z.shape[1])
            return super().edit_z(z, index)

    vec = torch.zeros(len(examples), 1, organism_p2a.adapter.d_head)
    spy = Spy(layer=2, heads=[1], positions=batch.last_positions[:, None], vector=vec, alpha=5.0)
    assert greedy_decode(organism_p2a, batch, [spy], 3) == texts
    assert seen == [batch.seq_len, batch.seq_len + 1, batch.seq_len + 2]  # full forwards on the growing sequence


# ----------------------------------------------------------------------------------------------------------------
# Bookkeeping on a fake model whose answers we know
# ----------------------------------------------------------------------------------------------------------------
class _Recorder:
    """Wraps scene_description and estimate_position_ids to remember what the study drew and estimated."""

    def __init__(self, monkeypatch):
        self.by_image, self.ids = {}, []
        real_scenes, real_estimate = S.scene_description, edits.estimate_position_ids

        def scenes(*args, **kwargs):
            data = real_scenes(*args, **kwargs)
            self.by_image.update({id(e.image): e for e in data})
            return data

        def estimate(*args, **kwargs):
            self.ids.append(real_estimate(*args, **kwargs))
            return self.ids[-1]

        monkeypatch.setattr(edits, "scene_description", scenes)
        monkeypatch.setattr(edits, "estimate_position_ids", estimate)


def _base(e):
    """The fake model's unedited answer: right on two examples in three."""
    return e.answer if int(e.id.split("-")[1]) % 3 else "purple blob"


def _injected(interventions, r):
    return torch.cat([torch.as_tensor(i.vector)[r] for i in interventions], 0)  # H D (heads given in layer order)


def test_edit_bookkeeping_on_a_fake_decoder(organism_p2a, monkeypatch):
    rec = _Recorder(monkeypatch)

    pushes = []  # (alpha, example, H D vector) per edited row, in call order: per alpha the arms in EDIT_ARMS order

    def fake_decode(vlm, batch, interventions, max_new_tokens):
        ids, outs = rec.ids[0], []
        for r, images in enumerate(batch.images):
            e = rec.by_image[id(images[0])]
            if interventions:
                pushes.append((interventions[0].alpha, e, _injected(interventions, r)))
            if not interventions or interventions[0].alpha < 1:
                outs.append(" " + _base(e))
                continue
            # a model that obeys position IDs: it names whatever sits at the cell whose ID it now carries
            o = _cell(e.objects[e.fields["target"]])
            moved = ids.vector(o) + _injected(interventions, r)
            c = ids.cells[int(((ids.vectors - moved) ** 2).sum((1, 2)).argmin())]
            there = [x.name for x in e.objects if _cell(x) == c]
            outs.append(" " + (there[0] if there else "nothing here"))
        return outs

    monkeypatch.setattr(edits, "greedy_decode", fake_decode)
    result = edit_study(organism_p2a, "1.0,2.1", [0.5, 1, 3], n_estimate=160, n_eval=30, seed=4, min_count=2,
                        positions="last")  # VSM's edit: one decode per arm, which the fake stands in for
    assert result.alphas == [0.0, 0.5, 1.0, 3.0]
    assert result.n_used + sum(result.skipped.values()) == 30 and result.n_used > 10
    used = [r for r in result.records if r["alpha"] == 0 and r["arm"] == "edit"]
    base_right = np.mean([int(r["id"].split("-")[1]) % 3 != 0 for r in used])
    assert result.clean_accuracy == pytest.approx(base_right) and 0 < base_right < 1
    assert result.clean_names_t == 0.0 and result.alpha0_identical
    ids = rec.ids[0]
    by_id = {e.id: e for e in rec.by_image.values()}
    for r in used:  # t is a described object's estimated cell, c an estimated empty cell
        e = by_id[r["id"]]
        assert tuple(r["o"]) == _cell(e.objects[e.fields["target"]])
        assert tuple(r["t"]) in {_cell(e.objects[k]) for k in e.fields["described"]} and ids.has(tuple(r["t"]))
        assert tuple(r["c"]) not in {_cell(x) for x in e.objects} and ids.has(tuple(r["c"]))
    frame = result.to_frame().set_index(["alpha", "arm"])
    assert (frame["n"] == result.n_used).all()
    for alpha in (0.0, 0.5):
        for arm in ("edit", "control"):
            assert frame.loc[(alpha, arm), "efficacy"] == 0.0
            assert frame.loc[(alpha, arm), "original"] == pytest.approx(base_right)
            assert frame.loc[(alpha, arm), "other"] == pytest.approx(1 - base_right)
    for alpha in (1.0, 3.0):
        assert frame.loc[(alpha, "edit"), "efficacy"] == 1.0 and frame.loc[(alpha, "edit"), "described"] == 1.0
        assert frame.loc[(alpha, "edit"), "changed"] == 1.0
        assert frame.loc[(alpha, "control"), "efficacy"] == 0.0 and frame.loc[(alpha, "control"), "other"] == 1.0
    assert result.efficacy(3) == 1.0 and result.efficacy(3, "control") == 0.0
    # the random-direction control pushes each head as far as the edit does, in a direction of its own
    assert frame.loc[(0.0, "random_direction"), "efficacy"] == 0.0 and result.efficacy(0.5, "random_direction") == 0.0
    n = result.n_used
    assert len(pushes) == len(result.alphas) * len(edits.EDIT_ARMS) * n  # one chunk: every row per alpha and arm
    edit_pushes, random_pushes = pushes[:n], pushes[2 * n:3 * n]
    for (_, e, edit), (_, same, random) in zip(edit_pushes, random_pushes):
        assert e is same
        torch.testing.assert_close(random.norm(dim=-1), edit.norm(dim=-1))
        cosine = (random * edit).sum(-1) / (random.norm(dim=-1) * edit.norm(dim=-1))
        assert (cosine.abs() < 0.99).all()
    # the same directions at every alpha (the last alpha's random block is the last n rows)
    torch.testing.assert_close(torch.stack([p for _, _, p in random_pushes]),
                               torch.stack([p for _, _, p in pushes[-n:]]))


def test_random_directions_are_unit_seeded_and_a_heads_own():
    """Uniform unit vectors, fixed by (seed, example, head): the same head gets the same direction in any head set
    (so ``edit_studies`` equals ``edit_study`` per set), another example or seed another one."""
    a = edits.random_directions(0, 3, [(1, 0), (2, 1)], 32)
    assert a.shape == (2, 32) and a.dtype == torch.float64
    torch.testing.assert_close(a.norm(dim=-1), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(edits.random_directions(0, 3, [(2, 1)], 32)[0], a[1])
    assert not torch.allclose(edits.random_directions(0, 4, [(1, 0)], 32)[0], a[0])
    assert not torch.allclose(edits.random_directions(1, 3, [(1, 0)], 32)[0], a[0])
    # uniform on the sphere: the mean of many draws is near the origin, each coordinate's variance near 1/d
    many = torch.stack([edits.random_directions(0, i, [(0, 0)], 8)[0] for i in range(4000)])
    assert many.mean(0).abs().max() < 0.05 and (many.var(0) - 1 / 8).abs().max() < 0.02


def test_repair_bookkeeping_on_a_fake_decoder(organism_p2a, monkeypatch):
    rec = _Recorder(monkeypatch)

    def fake_decode(vlm, batch, interventions, max_new_tokens):
        high, low = rec.ids
        outs = []
        for r, images in enumerate(batch.images):
            e = rec.by_image[id(images[0])]
            o = _cell(e.objects[e.fields["target"]])
            # repaired only when the correct cell's high-entropy ID is injected with alpha >= 1
            fixed = (interventions and interventions[0].alpha >= 1
                     and torch.allclose(_injected(interventions, r), high.vector(o) - low.vector(o)))
            outs.append(" " + (e.answer if fixed else _base(e)))
        return outs

    monkeypatch.setattr(edits, "greedy_decode", fake_decode)
    result = entropy_repair(organism_p2a, [(1, 0), (2, 1)], [1, 2], n_estimate=160, n_eval=30, seed=4, min_count=2,
                            positions="last")
    high, low = rec.ids
    assert high.n_examples == low.n_examples == 160
    assert result.n_used + sum(result.skipped.values()) == 30
    used = [r for r in result.records if r["alpha"] == 0 and r["arm"] == "repair"]
    assert all(low.has(tuple(r["o"])) and high.has(tuple(r["o"])) for r in used)
    base_right = np.mean([int(r["id"].split("-")[1]) % 3 != 0 for r in used])
    assert result.clean_accuracy == pytest.approx(base_right) and result.alpha0_identical
    assert 0 < result.high_accuracy < 1
    frame = result.to_frame().set_index(["alpha", "arm"])
    assert frame.loc[(0.0, "repair"), "accuracy"] == pytest.approx(base_right)
    for alpha in (1.0, 2.0):
        assert frame.loc[(alpha, "repair"), "accuracy"] == 1.0
        assert frame.loc[(alpha, "repair"), "change"] == pytest.approx(1 - base_right)
        assert frame.loc[(alpha, "control"), "accuracy"] == pytest.approx(base_right)
        assert frame.loc[(alpha, "control"), "change"] == 0.0


# ----------------------------------------------------------------------------------------------------------------
# The organism, end to end
# ----------------------------------------------------------------------------------------------------------------
def test_small_study_on_the_organism(organism_p2a, tmp_path):
    result = edit_study(organism_p2a, "1.0,2.1,2.3", [0, 2, 8], n_estimate=256, n_eval=24, seed=0)
    frame = result.to_frame()
    assert list(zip(frame["alpha"], frame["arm"])) == [(a, arm) for a in (0.0, 2.0, 8.0)
                                                       for arm in ("edit", "control", "random_direction")]
    assert (frame["n"] == result.n_used).all() and result.n_used + sum(result.skipped.values()) == 24
    assert np.allclose(frame[["efficacy", "original", "other"]].sum(1), 1.0)
    assert result.alpha0_identical
    # alpha 0 is the unedited model: its efficacy is the share of clean outputs that already name t
    assert result.efficacy(0) == result.clean_names_t <= 0.1
    assert frame.set_index(["alpha", "arm"]).loc[(0.0, "edit"), "original"] == result.clean_accuracy
    est = result.estimate
    assert sum(est["cells"].values()) + est["skipped_examples"] == 256
    assert set(result.norms) == {"1.0", "2.1", "2.3"} and all(v["z"] > 0 for v in result.norms.values())
    result.save(tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["efficacy"]["0"] == result.efficacy(0) and saved["heads"] == ["1.0", "2.1", "2.3"]
    assert "plotly" in (tmp_path / "curve.html").read_text()[:100000].lower()


def test_several_head_sets_at_once_equal_each_set_alone(organism_p2a):
    """``edit_studies`` (one estimation, one unedited decode) gives each head set what its own ``edit_study`` gives:
    the same rows, records, estimates and norms; a head set that is a subset reads the union's estimate."""
    kwargs = dict(n_estimate=192, n_eval=16, seed=3, min_count=2, positions="last")
    together = edits.edit_studies(organism_p2a, ["2.1,2.3", "2.3", "1.0"], [0, 2, 8], **kwargs)
    for heads, fast in zip(["2.1,2.3", "2.3", "1.0"], together):
        slow = edit_study(organism_p2a, heads, [0, 2, 8], **kwargs)
        assert fast.heads == slow.heads and fast.rows == slow.rows and fast.records == slow.records
        # the per-head norms are reduced over a wider tensor: equal up to float64 rounding
        assert {k: v for k, v in fast.estimate.items() if k != "z_norm"} == \
            {k: v for k, v in slow.estimate.items() if k != "z_norm"}
        assert fast.estimate["z_norm"] == pytest.approx(slow.estimate["z_norm"], rel=1e-12)
        assert fast.norms.keys() == slow.norms.keys()
        for head in fast.norms:
            assert fast.norms[head] == pytest.approx(slow.norms[head], rel=1e-12)
        assert (fast.clean_accuracy, fast.n_used, fast.skipped) == (slow.clean_accuracy, slow.n_used, slow.skipped)
    assert any(r["efficacy"] > 0 for f in together for r in f.rows if r["alpha"] == 8)  # the sets did something
    assert together[0].rows != together[1].rows
    with pytest.raises(vb.InputError, match="head_sets is empty"):
        edits.edit_studies(organism_p2a, [], [1.0], **kwargs)
    ids = edits.estimate_position_ids(organism_p2a, _scenes(organism_p2a, 64, 5), "2.1,2.3", min_count=1)
    with pytest.raises(vb.InputError, match="have no position-ID estimate here"):
        ids.subset([(1, 0)])


# ----------------------------------------------------------------------------------------------------------------
# vlmbind edit
# ----------------------------------------------------------------------------------------------------------------
def _one_error_line(err: str) -> str:
    # transformers draws its own "Loading weights" bar on stderr while the organism loads; everything else counts
    lines = [l for l in err.strip().splitlines() if not l.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("vlmbind: error: ") and "Traceback" not in err
    return lines[0]


def test_edit_command(tmp_path, capsys):
    from vlmbind.cli import main

    scores = tmp_path / "scores.csv"
    order = [(2, 1), (1, 3)] + [(l, h) for l in range(4) for h in range(4) if (l, h) not in ((2, 1), (1, 3))]
    pd.DataFrame([{"layer": l, "head": h, "score": float(16 - i)} for i, (l, h) in enumerate(order)]).to_csv(
        scores, index=False)
    out = tmp_path / "run"
    assert main(["edit", "--model", "organism-p2a", "--scores", str(scores), "--top-k", "2", "--alpha", "0,2",
                 "--n-estimate", "160", "--n-eval", "8", "--repair", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["heads"] == ["2.1", "1.3"] and set(summary["efficacy"]) == {"0", "2"}
    assert summary["repair"]["alphas"] == [0.0, 2.0] and summary["repair"]["alpha0_identical"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["rows"] == summary["rows"] and "repair" in saved
    assert "Plotly.newPlot" in (out / "curve.html").read_text() and (out / "plotly.min.js").stat().st_size > 1e6

    for argv, needle in (
        (["--model", "organism-p2a", "--heads", "1.2,9.9"], "9.9"),
        (["--model", "organism-nope", "--heads", "1.2"], "organism-nope"),
        (["--model", "organism-p2a", "--heads", "1.x"], "1.x"),
        (["--model", "organism-p2a", "--heads", "1.2", "--alpha", "0,big"], "big"),
        (["--model", "organism-p2a", "--scores", str(tmp_path / "none.csv")], "none.csv"),
    ):
        bad = tmp_path / "bad"
        assert main(["edit", *argv, "--n-estimate", "8", "--n-eval", "2", "--out", str(bad)]) == 2
        assert needle in _one_error_line(capsys.readouterr().err)
        assert not bad.exists()


def test_answer_positions_edit_every_position_from_the_prompts_last(organism_p2a):
    examples = _scenes(organism_p2a, 4, 3)
    batch = organism_p2a.prepare([e.image for e in examples], [e.prompt for e in examples])
    d_head = organism_p2a.adapter.d_head
    vec = torch.randn(4, 1, d_head, generator=torch.Generator().manual_seed(1)) * 40
    last = {int(p) for p in batch.last_positions}
    assert len(last) == 1  # left padding: every prompt ends at the same position
    last = last.pop()
    got = edits.edited_decode(organism_p2a, batch, [(3, 1)], vec, 2.0, 3, "answer")

    def hook(module, args):  # independent: every position from the prompt's last to the end of the sequence
        x = args[0].clone()
        x[:, last:, d_head:2 * d_head] += 2.0 * vec[:, 0][:, None]
        return (x, *args[1:])

    handle = organism_p2a.adapter.o_proj_module(3).register_forward_pre_hook(hook)
    try:
        want = greedy_decode(organism_p2a, batch, (), 3)
    finally:
        handle.remove()
    assert got == want
    assert got != greedy_decode(organism_p2a, batch, (), 3)
    assert got != edits.edited_decode(organism_p2a, batch, [(3, 1)], vec, 2.0, 3, "last")  # the answer positions count
    unedited = edits.edited_decode(organism_p2a, batch, [(3, 1)], vec, 0.0, 3, "answer")
    assert unedited == greedy_decode(organism_p2a, batch, (), 3)
    with pytest.raises(vb.InputError, match="positions must be one of"):
        edit_study(organism_p2a, "2.1", [1.0], n_estimate=8, n_eval=2, positions="everywhere")


def test_edits_go_where_validate_puts_them_unless_told(organism_p2a):
    """On a model vlmbind trained the default edit positions are the answer positions (where validate edits and the
    planted IDs are read); on any other model VSM's last prompt position; the choice is recorded."""
    from helpers import get_tiny

    assert edits.default_positions(organism_p2a) == "answer"
    assert edits.default_positions(get_tiny("tiny-qwen2_5_vl")) == "last"
    result = edit_study(organism_p2a, "2.1", [1.0], n_estimate=32, n_eval=4, seed=0, min_count=1)
    assert result.positions == "answer" and result.summary()["positions"] == "answer"



def test_the_scene_check_finds_the_cells_the_estimate_finds(organism_p2a):
    """``estimated_cells`` reads from the scenes alone the cells ``estimate_position_ids`` estimates from the model's
    outputs, which is what lets ``check_estimates`` refuse a too-small n_estimate before any forward pass."""
    from vlmbind.analysis.position_ids import estimated_cells

    examples = _scenes(organism_p2a, 40, 5)
    for min_count in (1, 2, 3):
        try:
            ids = estimate_position_ids(organism_p2a, examples, [(3, 1)], min_count=min_count)
        except TooFewEstimatesError:
            assert estimated_cells(examples, min_count) == set()
        else:
            assert estimated_cells(examples, min_count) == set(ids.cells) != set()


@pytest.mark.parametrize("repair", [False, True])
def test_edit_with_too_few_estimation_scenes_names_n_estimate_and_a_number_that_works(tmp_path, capsys, repair):
    """`vlmbind edit --n-estimate 4` on organism-vsm: exit 2 before any forward pass, one line naming --n-estimate
    and the number to rerun with; the scenes of that number leave examples to edit (and, with --repair, to
    repair), and those of the number before it in the doubling do not."""
    import re

    from helpers import shared_organism

    from vlmbind.analysis.edits import check_estimates
    from vlmbind.cli import main

    out = tmp_path / "edit"
    extra = ["--repair"] if repair else []
    assert main(["edit", "--model", "organism-vsm", "--heads", "2.3,3.1", "--alpha", "0,2", "--n-estimate", "4",
                 "--n-eval", "4", *extra, "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("vlmbind: error: --n-estimate 4 is too few: ") and not out.exists()
    enough = int(re.search(r"rerun with --n-estimate (\d+) ", line).group(1))
    assert enough > 4
    studies = ("edit", "repair") if repair else ("edit",)
    vlm = shared_organism("organism-vsm")
    check_estimates(vlm, n_estimate=enough, n_eval=4, studies=studies)  # the fix works
    with pytest.raises(TooFewEstimatesError) as before:
        check_estimates(vlm, n_estimate=enough // 2, n_eval=4, studies=studies)
    assert before.value.enough == enough
