"""Search heads planted by SIIT at a Point-to-Answer trace's point steps: the steps are the tokens that predict x
and y, the counterfactual labels are the source point's digits, the identity interchange is exact, the attention
loss reads HF's own attention, and the spec is checked by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import shared_organism

import vlmbind as vb
from vlmbind.core.errors import TrainingError
from vlmbind.organisms.data import IGNORE_INDEX, BatchBuilder
from vlmbind.organisms.processes import RankSplit, part_costs
from vlmbind.organisms.siit.interchange import HeadInterchange, patched_logits
from vlmbind.organisms.siit.pointing import (
    POINT_STREAM,
    PointSIITSpec,
    draw_point_pairs,
    point_batch,
    point_interchange,
    point_losses,
    pointed_attention,
)
from vlmbind.organisms.training.config import TrainConfig

OPTIONS = {"search": {"objects": [1, 6]}, "count": {"objects": [1, 4]}}
SPEC = {"heads": ["2.3"], "pairs": 6, "strict_head_weights": {"2.0": 4.0}}


def config(**point) -> TrainConfig:
    return TrainConfig(regime="p2a", tasks={"search": 0.5, "count": 0.5}, task_options=OPTIONS, image_size=168,
                       model={"layers": 4}, attn_implementation="eager", point_siit={**SPEC, **point})


@pytest.fixture(scope="module")
def organism():
    vlm = shared_organism("organism-p2a")
    return vlm, BatchBuilder(vlm.processor), config().mixture()


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids])


def test_point_steps_predict_each_points_x_and_y_and_the_labels_are_the_sources_digits(organism):
    vlm, builder, mixture = organism
    pairs = draw_point_pairs(config().point_siit, mixture, seed=0, stream=POINT_STREAM, step=3, n=12)
    assert {p.kind for p in pairs} == {"trace", "display"}
    batch = point_batch(builder, pairs, grid=6)
    tok = vlm.processor.tokenizer
    for r, p in enumerate(pairs):
        points = p.base.example.fields["points"]
        # every point's two steps: the next tokens are its x and y digits (the labels are the tokens themselves)
        for (emitting, cell), (x, y) in zip(batch.steps[r], p.source.example.fields["points"]):
            written = [_decode(tok, [batch.source.labels[r, q + 1]]) for q in emitting]
            assert written == [" (", str(x), ",", f" {y}", ")"]
            assert cell == y * 6 + x
        bx, by = batch.base_steps[r]
        assert _decode(tok, [batch.base.labels[r, bx + 1]]).strip() == str(points[p.point][0])
        scored = (batch.counterfactual[r] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert scored == [bx + 1, by + 1]
        sx, sy = p.counterfactual_point
        assert [_decode(tok, [batch.counterfactual[r, q]]).strip() for q in scored] == [str(sx), str(sy)]
        if p.kind == "trace":
            assert p.source is p.base and p.point != p.source_point
        else:
            assert p.source.prompt == p.base.prompt and p.point == p.source_point
            assert p.counterfactual_point != tuple(points[p.point])


def test_pairs_are_a_function_of_the_step(organism):
    _vlm, _builder, mixture = organism
    spec = config().point_siit
    first = draw_point_pairs(spec, mixture, seed=1, stream=POINT_STREAM, step=7)
    again = draw_point_pairs(spec, mixture, seed=1, stream=POINT_STREAM, step=7)
    other = draw_point_pairs(spec, mixture, seed=1, stream=POINT_STREAM, step=8)
    key = [(p.kind, p.base.answer, p.source.answer, p.point, p.source_point) for p in first]
    assert key == [(p.kind, p.base.answer, p.source.answer, p.point, p.source_point) for p in again]
    assert key != [(p.kind, p.base.answer, p.source.answer, p.point, p.source_point) for p in other]


def test_the_identity_interchange_is_exact_and_a_real_one_moves_the_logits(organism):
    vlm, builder, mixture = organism
    pairs = draw_point_pairs(config().point_siit, mixture, seed=0, stream=POINT_STREAM, step=0, n=4)
    batch = point_batch(builder, pairs, grid=6)
    interchange = HeadInterchange(vlm.model, vlm.processor)
    heads = [(2, 3), (1, 0)]
    with torch.no_grad():
        plain = vlm.model(**batch.base.inputs, use_cache=False).logits
        with interchange.capture([1, 2]):
            vlm.model(**batch.base.inputs, use_cache=False)
        identity = point_batch(builder, pairs, grid=6)
        identity.source, identity.source_steps = identity.base, identity.base_steps
        same = patched_logits(vlm.model, interchange, identity, heads, identity.where(),
                              identity.values(interchange.stored))
        with interchange.capture([1, 2]):
            vlm.model(**batch.source.inputs, use_cache=False)
        moved = patched_logits(vlm.model, interchange, batch, heads, batch.where(), batch.values(interchange.stored))
    assert torch.equal(plain, same)
    assert (moved - plain).abs().max() > 1e-3
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in vlm.model.modules())


def test_pointed_attention_is_hfs_attention_on_the_pointed_objects_token():
    vlm = vb.load("organism-p2a", attn_implementation="eager")
    builder, mixture = BatchBuilder(vlm.processor), config().mixture()
    pairs = draw_point_pairs(config().point_siit, mixture, seed=2, stream=POINT_STREAM, step=0, n=3)
    batch = point_batch(builder, pairs, grid=6)
    interchange = HeadInterchange(vlm.model, vlm.processor)
    with torch.no_grad():
        with interchange.capture([2], patterns=True):
            vlm.model(**batch.source.inputs, use_cache=False)
        hf = vlm.model(**batch.source.inputs, use_cache=False, output_attentions=True).attentions[2]
    ours = pointed_attention(interchange.patterns, [(2, 3)], batch, builder.image_token_id)
    ids = batch.source.inputs["input_ids"]
    expected = []
    for r, steps in enumerate(batch.steps):
        image = torch.nonzero(ids[r] == builder.image_token_id).flatten()
        expected += [hf[r, 3, q, image[cell]] for emitting, cell in steps for q in emitting]
    torch.testing.assert_close(ours, torch.stack(expected), rtol=0, atol=1e-6)


def test_the_losses_and_measures_run_on_the_organism_and_leave_no_hook(organism):
    vlm, builder, mixture = organism
    spec = PointSIITSpec(heads=("2.3",), attention_weight=0.0, pairs=4)
    interchange = HeadInterchange(vlm.model, vlm.processor)
    with torch.no_grad():
        out = point_losses(vlm.model, interchange, builder, spec, mixture, seed=0, step=0)
    assert out["point_attention"] is None and out["point_readout"] is None
    assert float(out["point_iit"]) > 0 and float(out["point_strict"]) > 0
    assert out["strict_head"] != "2.3"
    pairs = draw_point_pairs(spec, mixture, seed=0, stream=POINT_STREAM, step=1, n=4)
    measured = point_interchange(vlm.model, interchange, builder, pairs, [(2, 3)], grid=6)
    assert len(measured["moved"]) == len(measured["changed"]) == 4
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in vlm.model.modules())


def test_strictness_draws_unaligned_heads_by_their_weights():
    spec = config().point_siit
    rng = np.random.default_rng(0)
    draws = [spec.draw_unaligned(rng, 4, 4) for _ in range(3000)]
    assert (2, 3) not in draws
    share = draws.count((2, 0)) / len(draws)
    assert share == pytest.approx(4 / 18, abs=0.03)  # 14 heads at weight 1, 2.0 at weight 4


def test_two_processes_split_the_pointing_losses_by_their_cost():
    spec = config().point_siit
    iit, strict, behaviour = part_costs(spec, 16)
    assert (iit, behaviour) == (2.0, 16 / 6) and strict == pytest.approx(4 / 3)
    rows = [list(RankSplit(rank).behaviour_rows(16, spec)) for rank in (0, 1)]
    assert rows[0] + rows[1] == list(range(16)) and len(rows[1]) > len(rows[0])


@pytest.mark.parametrize("change, match", [
    ({"heads": []}, "at least one search head"),
    ({"heads": ["4.0"]}, "outside the model"),
    ({"strict_head_weights": {"9.9": 2.0}}, "outside the model"),
    ({"iit_weight": -1}, "iit_weight"),
    ({"trace_share": 2}, "trace_share"),
    ({"position_layer": 7}, "position_layer"),
    ({"colour": 1}, "unknown point_siit field"),
])
def test_bad_specs_are_named(change, match):
    with pytest.raises(TrainingError, match=match):
        config(**change)


def test_runs_that_cannot_plant_search_heads_are_refused():
    with pytest.raises(TrainingError, match="attn_implementation='eager'"):
        TrainConfig(regime="p2a", tasks={"count": 1.0}, task_options={"count": OPTIONS["count"]},
                    point_siit=SPEC)
    with pytest.raises(TrainingError, match="regime='p2a'"):
        TrainConfig(regime="direct", tasks={"count": 1.0}, attn_implementation="eager", point_siit=SPEC)
    with pytest.raises(TrainingError, match="'search' or 'count'"):
        TrainConfig(regime="p2a", tasks={"scene": 1.0}, attn_implementation="eager", point_siit=SPEC)


def test_the_spec_round_trips_through_the_config():
    c = config(position_layer=1)
    again = TrainConfig.from_dict(c.to_dict())
    assert again == c and again.point_siit.position_layer == 1
    assert "point_siit" not in TrainConfig().to_dict()
