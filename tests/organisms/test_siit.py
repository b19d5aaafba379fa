"""SIIT for organisms: the interchange is vlmbind's own patch (checked against ``PatchHeads`` through ``VLM.logits``),
the identity interchange is exact, patch positions are the CMA pairs' positions, and the spec round-trips through the
training config (a behaviour-only config is unchanged)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields, replace

import numpy as np
import pytest
import torch
from helpers import shared_organism
from safetensors.torch import load_file

import vlmbind as vb
from vlmbind.core.errors import TrainingError
from vlmbind.engine.alignment import check_alignment
from vlmbind.organisms.data import BatchBuilder, answer_unlikelihood, training_canvas
from vlmbind.organisms.siit.interchange import HeadInterchange, ablated_logits, interchange_logits
from vlmbind.organisms.siit.losses import siit_losses
from vlmbind.organisms.siit.pairs import draw_pairs, interchange_batch, patch_positions
from vlmbind.organisms.siit.pointing import POINT_LOSSES
from vlmbind.organisms.siit.spec import LOSS_NEEDS, SIIT_LOSSES, SIIT_STREAM, LossNeeds, SIITSpec
from vlmbind.organisms.training.config import TrainConfig
from vlmbind.organisms.training.step import LOGGED_LOSSES
from vlmbind.stimuli import Canvas, scene_pairs

POOLS = {"colours": ("red", "green", "blue", "yellow"), "shapes": ("square", "circle", "triangle", "star")}


@pytest.fixture(scope="module")
def organism():
    vlm = shared_organism("organism-p2a")
    canvas = training_canvas(vlm.training)
    return vlm, BatchBuilder(vlm.processor), canvas


@pytest.mark.parametrize("condition", ["id_retrieval", "id_selection", "feature_retrieval"])
def test_patch_positions_are_the_pairs_positions(organism, condition):
    vlm, builder, canvas = organism
    objects = 3 if condition == "feature_retrieval" else (3, 4)  # a spare colour for the recolouring
    for pair in scene_pairs(6, condition, 3, n_objects=objects, canvas=canvas, **POOLS):
        aligned = check_alignment(vlm, [pair])  # one row: no padding, so processor and builder positions agree
        assert patch_positions(builder, pair) == [int(p) for p in aligned.positions[0]], pair.id


def test_interchange_equals_patch_heads_through_the_vlm(organism):
    """The trainer's hook on a right-padded builder batch gives the logits of vlmbind's PatchHeads on the
    processor's batch, for heads of two layers at the pair's position."""
    vlm, builder, canvas = organism
    pair = scene_pairs(1, "feature_retrieval", 5, n_objects=3, canvas=canvas, **POOLS)[0]
    heads = [(2, 1), (3, 0), (3, 2)]
    batch = interchange_batch(builder, [pair], "counterfactual")
    ours = interchange_logits(vlm.model, HeadInterchange(vlm.model, vlm.processor), batch, heads, batch.positions)
    aligned = check_alignment(vlm, [pair])
    pos = aligned.positions[0]
    z = vlm.capture(aligned.counterfactual, [f"blocks.{l}.attn.hook_z" for l in (2, 3)])
    patches = [vb.PatchHeads(layer=l, heads=[h], positions=list(pos),
                             values=z[f"blocks.{l}.attn.hook_z"][:, pos][:, :, [h]]) for l, h in heads]
    reference = vlm.logits(aligned.clean, patches)[0]
    last = aligned.clean.index[0].last_position
    torch.testing.assert_close(ours[0, last], reference[last], rtol=0, atol=1e-4)
    plain = vlm.logits(aligned.clean)[0, last]
    assert (reference[last] - plain).abs().max() > 1e-3  # the patch did something


def test_the_identity_interchange_is_exact(organism):
    vlm, builder, canvas = organism
    pairs = scene_pairs(3, "id_selection", 1, n_objects=(3, 4), canvas=canvas, **POOLS)
    batch = interchange_batch(builder, pairs, "clean")
    batch.source = batch.base  # the source is the base itself
    interchange = HeadInterchange(vlm.model, vlm.processor)
    with torch.no_grad():
        plain = vlm.model(**batch.base.inputs, use_cache=False).logits
        patched = interchange_logits(vlm.model, interchange, batch, [(0, 0), (3, 3)], batch.prompt_mask)
    assert torch.equal(plain, patched)
    assert not any(m._forward_pre_hooks for m in vlm.model.modules())  # every hook removed


def test_spec_round_trips_through_the_config_and_behaviour_configs_are_unchanged():
    plain = TrainConfig(image_size=112, tasks={"scene": 1.0}, task_options={"scene": {"objects": [3, 3], **{
        k: list(v) for k, v in POOLS.items()}}})
    assert "siit" not in plain.to_dict()
    planted = TrainConfig.from_dict({**plain.to_dict(), "siit": {"alignments": {"id_selection": ["2.1"]},
                                                                   "objects": [3, 3]}})
    assert planted.siit.planted == {"id_selection": ["2.1"]}
    assert planted.siit.colours == POOLS["colours"]  # the scene task's pools by default
    assert TrainConfig.from_dict(planted.to_dict()) == planted
    assert (2, 1) not in planted.siit.unaligned(4, 4) and len(planted.siit.unaligned(4, 4)) == 15


@pytest.mark.parametrize("siit, match", [
    ({"alignments": {}}, "empty"),
    ({"alignments": {"id_selecton": ["1.0"]}}, "unknown SIIT variable"),
    ({"alignments": {"id_selection": ["9.0"]}}, "do not exist"),
    ({"alignments": {"id_selection": ["x"]}}, "LAYER.HEAD"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_positions": "some"}, "strict_positions"),
    ({"alignments": {"id_selection": ["1.0"]}, "colour": ["red"]}, "unknown siit fields"),
    ({"alignments": {"feature_retrieval": ["1.0"]}, "objects": [4, 4], "colours": ["red", "green", "blue", "yellow"],
      "recolour": "unused"}, "feature_retrieval.*unused colour"),
    ({"alignments": {"id_selection": ["1.0"]}, "swap": "first"}, "siit.swap"),
    ({"alignments": {"id_selection": ["1.0"]}, "recolour": "some"}, "siit.recolour"),
    ({"alignments": {"id_selection": ["1.0"]}, "objects": [3, 3], "skip_objects": [3]}, "leaves no object count"),
    ({"alignments": {"id_selection": ["1.0"]}, "position_layer": 4}, "position_layer 4 does not exist"),
    ({"alignments": {"id_selection": ["1.0"]}, "position_layer": -2}, "position_layer must be"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_head_weights": {"1.0": 2}}, "which is aligned"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_head_weights": {"0.1": 0}}, r"must be a number > 0"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_head_weights": {"9.1": 2}}, "heads.*9.1.*do not exist"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_head_weights": {"x": 2}}, "strict_head_weights: "),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_head_weights": ["0.1"]}, "must map 'layer.head'"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_sampling": "some"}, "strict_sampling must be one of"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_sampling": "all", "strict_head_weights": {"0.1": 2}},
     "applies to strict_sampling 'individual'"),
    ({"alignments": {"id_selection": ["1.0"]}, "single_loss": "no"}, "single_loss must be True or False"),
    ({"alignments": {"id_selection": ["1.0"]}, "interchanged_selection_weight": 1.0}, "align both variables"),
    ({"alignments": {"id_selection": ["1.0"]}, "interchanged_selection_weight": -1}, "must be a number >= 0"),
    ({"alignments": {"feature_retrieval": ["1.0"]}, "strict_selection_weight": 1.0}, "align id_selection"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_selection_weight": 1.0, "strict_weight": 0},
     "set strict_weight above 0"),
    ({"alignments": {"id_selection": ["1.0"]}, "strict_selection_weight": True}, "must be a number >= 0"),
])
def test_bad_specs_are_named(siit, match):
    with pytest.raises(TrainingError, match=match):
        TrainConfig(image_size=112, tasks={"scene": 1.0}, siit=siit)


def _needs_met(loss: str) -> dict:
    """A spec whose ``loss`` weight is 1 with everything the table says that weight needs."""
    needs = LOSS_NEEDS[loss]
    spec = {"alignments": {"id_selection": ["1.0", "0.1"], "id_retrieval": ["0.2"]}, f"{loss}_weight": 1.0}
    if needs.aggregation:
        spec["aggregation_heads"] = ("0.1",)
    if needs.source_grad:
        spec["source_grad"] = True
    if needs.after:
        spec[needs.after] = 1.0
    return spec


@pytest.mark.parametrize("loss", list(LOSS_NEEDS))
def test_each_loss_weight_is_checked_against_what_the_table_says_it_needs(loss):
    """Every loss weight of the spec has its row in the table, every loss the trainer logs is one of them (or one of
    the pointing SIIT's), and the one loop refuses a weight above 0 that lacks any one of the things its row asks for,
    saying what the loss reads."""
    assert {f.name for f in fields(SIITSpec) if f.name.endswith("_weight")} == {f"{l}_weight" for l in LOSS_NEEDS}
    assert set(LOGGED_LOSSES) == {*SIIT_LOSSES, *POINT_LOSSES, "position", "behaviour"}
    needs, spec = LOSS_NEEDS[loss], _needs_met(loss)
    assert SIITSpec(**spec).weight(loss) == 1.0
    if needs.after:  # its last check; every other unmet need below is named before it
        spec = {**spec, needs.after: 0.0}
        with pytest.raises(TrainingError, match=re.escape(f"set siit.{needs.after} above 0")):
            SIITSpec(**spec)
    broken = []
    if needs.variables:
        kept = {v: h for v, h in spec["alignments"].items() if v != needs.variables[0]}
        broken.append({**spec, "alignments": kept or {"feature_retrieval": ["1.2"]}, "aggregation_heads": ()})
    if needs.aggregation:
        broken.append({**spec, "aggregation_heads": ()})
    for flag, off in (("iit", {"iit_weight": 0.0}), ("source_grad", {"source_grad": False}),
                      ("strict", {"strict_weight": 0.0})):
        if getattr(needs, flag):
            broken.append({**spec, **off})
    # a new kind of need gets a case here
    assert {f.name for f in fields(LossNeeds)} == {"reads", "variables", "aggregation", "iit", "source_grad", "strict",
                                                   "after"}
    for fields_ in broken:
        with pytest.raises(TrainingError, match=re.escape(f"siit.{loss}_weight > 0 {needs.reads}")):
            SIITSpec(**fields_)
    with pytest.raises(TrainingError, match=f"siit.{loss}_weight must be a number >= 0"):
        SIITSpec(**{**spec, f"{loss}_weight": -0.5})


def test_strictness_draws_unaligned_heads_by_their_weights():
    """Without weights the draw is the uniform one the shipped recipes were trained with (same generator calls, same
    heads); with weights each unaligned head comes up in proportion to its weight, aligned heads never."""
    uniform = SIITSpec(alignments={"id_selection": ["1.0"]})
    free = uniform.unaligned(2, 4)
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    assert [uniform.draw_strict_head(a, 2, 4) for _ in range(50)] == [free[int(b.integers(len(free)))]
                                                                       for _ in range(50)]
    weighted = SIITSpec(alignments={"id_selection": ["1.0"]}, strict_head_weights={"0.1": 5, "1.3": 2})
    assert weighted.to_dict()["strict_head_weights"] == {"0.1": 5.0, "1.3": 2.0}
    assert SIITSpec.from_value(weighted.to_dict()) == weighted
    rng = np.random.default_rng(0)
    draws = [weighted.draw_strict_head(rng, 2, 4) for _ in range(12000)]
    expected = {h: {(0, 1): 5, (1, 3): 2}.get(h, 1) / 12 for h in free}  # 5 unlisted heads at 1, plus 5 and 2
    assert (1, 0) not in draws
    for head, share in expected.items():
        assert abs(draws.count(head) / len(draws) - share) < 0.015, (head, draws.count(head) / len(draws), share)


def test_strictness_can_interchange_several_unaligned_heads_at_once():
    """``sample_all`` takes each unaligned head with probability 1/2 (never an aligned one, never none), ``all``
    takes every unaligned head, and ``individual`` is the one-head draw; the spec round-trips either way."""
    spec = SIITSpec(alignments={"id_selection": ["1.0"], "feature_retrieval": ["1.2"]}, strict_sampling="sample_all")
    free = spec.unaligned(2, 4)
    rng = np.random.default_rng(0)
    draws = [spec.draw_strict_heads(rng, 2, 4) for _ in range(4000)]
    assert all(draw and set(draw) <= set(free) and len(set(draw)) == len(draw) for draw in draws)
    for head in free:
        assert abs(sum(head in d for d in draws) / len(draws) - 0.5) < 0.03, head
    assert SIITSpec.from_value(spec.to_dict()) == spec and spec.to_dict()["strict_sampling"] == "sample_all"
    assert replace(spec, strict_sampling="all").draw_strict_heads(rng, 2, 4) == free
    single = SIITSpec(alignments={"id_selection": ["1.0"]})
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert [single.draw_strict_heads(a, 2, 4) for _ in range(20)] == [[single.draw_strict_head(b, 2, 4)]
                                                                      for _ in range(20)]
    assert "strict_sampling" not in single.to_dict() and "single_loss" not in single.to_dict()


def _planting_config(**overrides):
    fields = dict(
        image_size=112, tasks={"scene": 1.0},
        task_options={"scene": {"objects": [3, 3], "colours": ["red", "green", "blue", "yellow", "purple", "orange"],
                                "shapes": ["square", "circle", "triangle"]}},
        model={"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vision_depth": 1, "vision_hidden": 32,
               "vision_heads": 2},
        steps=160, batch_size=16, lr=2e-3, warmup=20, eval_every=160, eval_size=32, checkpoint_every=80, seed=0,
        siit={"alignments": {"feature_retrieval": ["1.1"]}, "pairs": 4, "objects": [3, 3]},
    )
    return TrainConfig(**{**fields, **overrides})


@pytest.mark.parametrize("readouts, separate", [(False, False), (True, False), (True, True)])
def test_siit_training_logs_its_parts_and_resumes_exactly(tmp_path, readouts, separate):
    """A run with SIIT logs each step's variable, interchanged unaligned head and loss parts, evaluates interchange
    accuracy beside the unpatched rate of the counterfactual answer, and a run stopped at step 20 and resumed ends
    with the weights and losses of the uninterrupted run (also with the trained position and ID-selection readouts,
    whose weights and optimizer states travel beside the checkpoint). With ``single_loss=False`` and several heads
    in the strictness loss each training step is three optimiser steps (IIT, strictness, behaviour), and resumes
    as exactly."""
    from vlmbind.organisms.model import build_organism
    from vlmbind.organisms.training.checkpoints import load_weights
    from vlmbind.organisms.training.run import train

    siit = {"alignments": {"feature_retrieval": ["1.1"]}, "pairs": 4, "objects": [3, 3]}
    if readouts:
        siit.update(alignments={"feature_retrieval": ["1.1"], "id_selection": ["1.0", "0.3"],
                                "id_retrieval": ["0.2"]}, aggregation_heads=["0.3"], position_layer=0,
                    position_readout="trained", selection_weight=1.0, selection_attention_weight=1.0,
                    retrieval_attention_weight=1.0, interchanged_selection_weight=1.0, source_grad=True,
                    gather_interchange_weight=1.0, gather_selection_weight=1.0, selecting_interchange_weight=1.0)
    if separate:
        siit.update(single_loss=False, strict_sampling="sample_all", strict_selection_weight=float(readouts),
                    retrieval_readout_weight=float(readouts), gather_readout_weight=float(readouts),
                    ablation_strict_weight=float(readouts))
    config = _planting_config(steps=40, eval_every=40, checkpoint_every=20, eval_size=8, siit=siit,
                              attn_implementation="eager")
    result = train(config, tmp_path / "run", progress=False, threads=1)
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    parts = state["siit_losses"]
    assert len(parts) == 40 and {p["variable"] for p in parts} == set(siit["alignments"])
    aligned = {h for heads in siit["alignments"].values() for h in heads}
    assert all(math.isfinite(p["iit"]) and math.isfinite(p["strict"]) for p in parts)
    assert all(not set(p["strict_head"].split(",")) & aligned for p in parts)
    widest = max(len(p["strict_head"].split(",")) for p in parts)
    assert widest > 1 if separate else widest == 1
    adam_steps = {float(t) for k, t in load_file(str(result.checkpoint / "optimizer.safetensors")).items()
                  if k.endswith("/step")}
    assert adam_steps == {40.0 * (3 if separate else 1)}
    assert len({p["strict_head"] for p in parts}) > 1  # a different unaligned head is interchanged over the steps
    logged = result.evals[-1]["siit"]["feature_retrieval"]
    assert set(logged) == {"interchange_accuracy", "counterfactual_unpatched", "unaligned_changes",
                           "unaligned_changes_max"}
    if readouts:
        assert all(math.isfinite(p["position"]) for p in parts) and parts[-1]["position"] < parts[0]["position"]
        assert 0.0 <= result.evals[-1]["position_code_accuracy"] <= 1.0
        assert (result.checkpoint / "position_probe.safetensors").is_file()
        # the selection readout and attention are loss parts on the id_selection steps only, the retrieval
        # attention on the id_retrieval steps
        for name, variable in (("selection", "id_selection"), ("selection_attention", "id_selection"),
                               ("retrieval_attention", "id_retrieval"), ("interchanged_selection", "id_retrieval"),
                               ("gather_interchange", "id_selection"), ("gather_selection", "id_selection"),
                               ("selecting_interchange", "id_selection")):
            assert all((name in p) == (p["variable"] == variable) for p in parts)
            assert all(math.isfinite(p[name]) for p in parts if name in p)
        # every step has a strictness run; the retrieval readout is read on the id_retrieval steps, the gathered
        # positions on the id_selection ones
        assert all(math.isfinite(p["strict_selection"]) if separate else "strict_selection" not in p for p in parts)
        for name, variable in (("retrieval_readout", "id_retrieval"), ("gather_readout", "id_selection")):
            assert all((name in p) == (separate and p["variable"] == variable) for p in parts)
        for name, file in (("retrieval", "retrieval_probe"), ("aggregation", "gather_probe")):
            assert ("accuracy" in result.evals[-1][name]) == separate
            assert (result.checkpoint / f"{file}.safetensors").is_file() == separate
        readout = result.evals[-1]["selection"]
        assert 0.0 <= readout["accuracy"] <= 1.0 and 0.0 < readout["attention_mass"] <= 1.0
        # strictness under ablation (with the strictness step): 1 to 5 (as many as are aligned) unaligned heads,
        # zeroed or mean-ablated
        assert all(("ablated" in p) == separate for p in parts)
    if separate:
        ablated = [p["ablated"].split(":") for p in parts]
        assert {mode for mode, _ in ablated} == {"zero", "mean"}
        assert all(not set(heads.split(",")) & aligned and 1 <= len(heads.split(",")) <= 5 for _, heads in ablated)
        assert len({len(heads.split(",")) for _, heads in ablated}) > 1
        assert all(math.isfinite(p["ablation_strict"]) for p in parts)
        for name in ("aggregation", "retrieval"):
            assert 0.0 < result.evals[-1][name]["attention_mass"] <= 1.0
        assert 0.0 <= result.evals[-1]["aggregation"]["interchange_accuracy"] <= 1.0
        assert (result.checkpoint / "selection_probe.safetensors").is_file()

    stopped = train(config, tmp_path / "resumed", progress=False, threads=1, until=20)
    assert stopped.step == 20
    resumed = train(config, tmp_path / "resumed", progress=False, threads=1, resume=True)
    assert resumed.losses == result.losses
    size = config.model.to_dict()
    first, _ = build_organism(seed=1, image_size=112, **size)
    second, _ = build_organism(seed=2, image_size=112, **size)
    load_weights(first, result.checkpoint)
    load_weights(second, resumed.checkpoint)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_random_swaps_and_any_recolouring_keep_the_pairs_meaningful():
    """Training pairs: the swapped object is any described one (so a* cannot be read off the prompt's order), the
    id_retrieval span is that object's name, and a feature-retrieval source gives the target a conjunction no object
    of the clean scene has (so a* cannot be guessed from the clean scene); VSM's pairs stay as they were."""
    listed_positions = set()
    for condition in ("id_retrieval", "id_selection"):
        for pair in scene_pairs(40, condition, 5, n_objects=(3, 4), swap="random", **POOLS):
            j, t = pair.counterfactual.fields["swapped"]
            described = pair.clean.fields["described"]
            assert t == pair.clean.fields["target"] and j in described
            listed_positions.add(described.index(j))
            oj, ot = pair.clean.objects[j], pair.clean.objects[t]
            cj, ct = pair.counterfactual.objects[j], pair.counterfactual.objects[t]
            assert (cj.row, cj.col, ct.row, ct.col) == (ot.row, ot.col, oj.row, oj.col)
            assert pair.answer_counterfactual == oj.name
            if condition == "id_retrieval":
                prompt, text = pair.clean.prompt, pair.patch["text"]
                starts = [i for i in range(len(prompt)) if prompt.startswith(text, i)]
                start = starts[pair.patch["occurrence"]]
                assert text == oj.name and prompt[:start].count(" a ") == described.index(j) + 1
    assert listed_positions == {0, 1, 2}
    shapes_changed = 0
    for pair in scene_pairs(40, "feature_retrieval", 5, n_objects=(3, 4), recolour="any", entropy="low", **POOLS):
        new = pair.counterfactual.objects[pair.clean.fields["target"]]
        assert pair.answer_counterfactual == new.name
        assert new.name not in {o.name for o in pair.clean.objects}
        shapes_changed += new.shape != pair.clean.objects[pair.clean.fields["target"]].shape
    assert shapes_changed > 0
    vsm = scene_pairs(10, "id_selection", 5, n_objects=(3, 4), **POOLS)
    assert all(p.counterfactual.fields["swapped"][0] == p.clean.fields["described"][-1] for p in vsm)
    assert "swap" not in vsm.params
    with pytest.raises(vb.stimuli.StimulusError, match="swap"):
        scene_pairs(2, "id_selection", 0, swap="first")


def test_skipped_object_counts_are_never_drawn():
    from vlmbind.organisms.siit.pairs import draw_pairs
    from vlmbind.organisms.siit.spec import SIITSpec

    spec = SIITSpec(alignments={"id_selection": ["1.0"]}, pairs=4, objects=(2, 4), skip_objects=(3,), **POOLS)
    counts = {len(p.clean.objects) for step in range(12)
              for p in draw_pairs(spec, "id_selection", seed=0, stream=2, step=step, canvas=Canvas(image_size=168, grid=6))}
    assert counts == {2, 4}


def test_evaluation_pairs_cover_every_setting_the_spec_trains_on():
    """A training step draws one object count and entropy; the evaluation set spreads its pairs over all of them
    (an evaluation set drawn like one step once covered two-object, low-entropy scenes only)."""
    from collections import Counter

    from vlmbind.organisms.siit.pairs import evaluation_pairs
    from vlmbind.organisms.siit.spec import SIITSpec

    spec = SIITSpec(alignments={"id_selection": ["1.0"]}, objects=(2, 4), skip_objects=(3,),
                    entropies=("high", "low"), **POOLS)
    canvas = Canvas(image_size=168, grid=6)
    pairs = evaluation_pairs(spec, "id_selection", seed=0, canvas=canvas, n=32)
    assert Counter((len(p.clean.objects), p.clean.fields["entropy"]) for p in pairs) == {
        (2, "high"): 8, (2, "low"): 8, (4, "high"): 8, (4, "low"): 8}
    assert [p.id for p in pairs] == [p.id for p in evaluation_pairs(spec, "id_selection", seed=0, canvas=canvas,
                                                                       n=32)]
    assert len(evaluation_pairs(spec, "id_selection", seed=0, canvas=canvas, n=6)) == 6


@pytest.mark.parametrize("layer", [-1, 0])
def test_the_position_code_is_read_where_position_layer_says(tmp_path, layer):
    """The first step's logged position loss is the trained readout's loss (fresh, from the run's seed) on the
    image tokens of the decoder's input (-1: the embeddings the vision tower gives) or after decoder layer 0,
    computed here from the untrained model on step 0's batch, and not the other layer's."""
    from vlmbind.organisms.model import build_organism
    from vlmbind.organisms.siit.readouts import PositionProbe
    from vlmbind.organisms.training.run import train

    siit = {"alignments": {"feature_retrieval": ["1.1"]}, "pairs": 2, "objects": [3, 3], "position_layer": layer,
            "position_readout": "trained"}
    config = _planting_config(steps=1, eval_every=0, checkpoint_every=1, siit=siit)
    result = train(config, tmp_path / "run", progress=False, threads=1)
    logged = json.loads((result.checkpoint / "trainer_state.json").read_text())["siit_losses"][0]["position"]
    model, processor = build_organism(seed=config.seed, image_size=config.image_size, **config.model.to_dict())
    builder = BatchBuilder(processor)
    batch = builder(config.mixture().batch(0, config.batch_size))
    probe = PositionProbe(config.model.hidden, 16, config.seed)
    with torch.no_grad():
        hidden = model(**batch.inputs, use_cache=False, output_hidden_states=True).hidden_states
        losses = {l: float(probe.loss(hidden[l + 1], batch.inputs["input_ids"], builder.image_token_id))
                  for l in (-1, 0)}
    assert logged == pytest.approx(losses[layer], abs=1e-6)
    assert abs(logged - losses[-1 - layer]) > 2e-5  # the other layer's loss is not it


def test_growing_an_organism_keeps_its_function_exactly():
    """``init_layers`` copies the source's layers where listed and adds identity layers elsewhere: the grown model's
    logits equal the source's exactly; a source layer that does not exist is a named error."""
    from vlmbind.core.shipped import organism_dir
    from vlmbind.organisms.data import TaskMixture, TaskSpec
    from vlmbind.organisms.model import build_organism
    from vlmbind.organisms.training.checkpoints import load_weights

    source, processor = build_organism(seed=0, image_size=168)
    load_weights(source, organism_dir("organism-p2a"))
    grown, _ = build_organism(seed=3, image_size=168, layers=6)
    load_weights(grown, organism_dir("organism-p2a"), [0, 1, None, 2, 3, None])
    mixture = TaskMixture([TaskSpec.from_options("scene", 1.0, {"objects": [2, 4], **POOLS})], regime="p2a",
                          image_size=168, seed=0)
    batch = BatchBuilder(processor)(mixture.batch(0, 3))
    with torch.no_grad():
        assert torch.equal(source(**batch.inputs).logits, grown(**batch.inputs).logits)
    assert not torch.equal(grown.model.language_model.layers[2].self_attn.q_proj.weight,
                           grown.model.language_model.layers[1].self_attn.q_proj.weight)
    with pytest.raises(TrainingError, match="no decoder layer 7"):
        load_weights(grown, organism_dir("organism-p2a"), [0, 1, 2, 3, 7, None])
    with pytest.raises(TrainingError, match="init_layers"):
        TrainConfig(image_size=112, model={"layers": 6}, init_layers=[0, 1, 2, 3, None, None])


def test_position_code_loss_reads_cells_through_the_fixed_readout():
    from vlmbind.organisms.siit.readouts import position_code_accuracy, position_code_loss, position_readout

    cells, hidden = 4, 16
    readout = position_readout(hidden, cells)
    assert torch.equal(readout, position_readout(hidden, cells))  # fixed, not trained
    ids = torch.tensor([[9, 5, 5, 5, 5, 1], [5, 5, 5, 5, 2, 2]])
    states = torch.zeros(2, 6, hidden)
    for row in range(2):
        cols = (ids[row] == 5).nonzero().flatten()
        for cell, p in enumerate(cols):
            states[row, p] = 3.0 * readout[:, cell]
    assert position_code_accuracy(states, ids, 5, cells) == 1.0
    coded = float(position_code_loss(states, ids, 5, cells))
    shuffled = float(position_code_loss(states.flip(1), ids.flip(1), 5, cells))
    assert coded < 0.5 < shuffled
    with pytest.raises(TrainingError, match="not a multiple"):
        position_code_loss(states, ids, 5, 3)


def test_last_token_variables_can_be_interchanged_at_the_answer_positions(organism):
    """``last_positions="answer"``: a last-token pair patches the last prompt token and every position that predicts
    an answer token (the colour word's position predicts the shape); span pairs keep their span."""
    vlm, builder, canvas = organism
    pairs = list(scene_pairs(3, "feature_retrieval", 3, n_objects=3, canvas=canvas, **POOLS))
    prompt_only = interchange_batch(builder, pairs, "counterfactual")
    answer = interchange_batch(builder, pairs, "counterfactual", "answer")
    for r in range(len(pairs)):
        answer_tokens = torch.nonzero(answer.base.labels[r] != -100).flatten().tolist()
        assert prompt_only.positions[r] == [answer_tokens[0] - 1]
        assert answer.positions[r] == [t - 1 for t in answer_tokens]
    spans = list(scene_pairs(3, "id_retrieval", 3, n_objects=3, canvas=canvas, **POOLS))
    assert interchange_batch(builder, spans, "counterfactual", "answer").positions == \
        interchange_batch(builder, spans, "counterfactual").positions
    with pytest.raises(TrainingError, match="last_positions"):
        TrainConfig(image_size=112, tasks={"scene": 1.0},
                    siit={"alignments": {"id_selection": ["1.0"]}, "last_positions": "all"})


def test_selection_readout_reads_the_missing_objects_cell_from_the_aligned_heads():
    """The ID-selection readout's target is the missing object's cell in the source scene, which for a swap pair is
    the swapped described object's cell in the base; its features are the aligned heads' slices at each row's patch
    positions, in head order."""
    from vlmbind.organisms.siit.pairs import target_cells
    from vlmbind.organisms.siit.readouts import SelectionProbe

    canvas = Canvas(image_size=168, grid=6)
    pairs = list(scene_pairs(12, "id_selection", 3, n_objects=(2, 4), canvas=canvas, swap="random", **POOLS))
    source, base = target_cells(pairs, canvas), target_cells(pairs, canvas, "clean")
    for p, s, b in zip(pairs, source.tolist(), base.tolist()):
        j, t = p.counterfactual.fields["swapped"]
        assert s == p.clean.objects[j].row * 6 + p.clean.objects[j].col
        assert b == p.clean.objects[t].row * 6 + p.clean.objects[t].col != s

    d_head = 4
    probe = SelectionProbe([(2, 1), (0, 3)], d_head, 36, seed=0)
    stored = {2: torch.randn(2, 7, 16), 0: torch.randn(2, 7, 16)}
    positions = [[6], [4, 5]]
    features = probe.features(stored, positions)
    expected = torch.stack([torch.cat([stored[2][r, q, 4:8], stored[0][r, q, 12:16]])
                            for r, q in ((0, 6), (1, 4), (1, 5))])
    assert torch.equal(features, expected)
    targets = torch.tensor([7, 30])
    with torch.no_grad():
        probe.linear.weight.zero_()
        probe.linear.bias.zero_()
        probe.linear.bias[30] = 5.0
    assert probe.accuracy(stored, positions, targets) == pytest.approx(2 / 3)  # the second row counts twice
    assert float(probe.loss(stored, positions, targets).detach()) > 0


def test_the_gather_readout_reads_the_described_objects_cells():
    """The gathered-positions target is the described objects' cells in the source scene (for a swap pair, the
    swapped object now sits at the missing object's base cell); the probe's loss is binary cross-entropy summed over
    the cells (the closed form) and a row counts as read only when its positive logits are exactly the described
    cells."""
    from vlmbind.organisms.siit.pairs import described_cells
    from vlmbind.organisms.siit.readouts import GatherProbe

    canvas = Canvas(image_size=168, grid=6)
    pairs = list(scene_pairs(12, "id_selection", 3, n_objects=(2, 4), canvas=canvas, swap="random", **POOLS))
    source, base = described_cells(pairs, canvas), described_cells(pairs, canvas, "clean")
    for p, s, b in zip(pairs, source, base):
        j, t = p.counterfactual.fields["swapped"]
        cell = {k: o.row * 6 + o.col for k, o in enumerate(p.clean.objects)}
        want = {cell[k] for k in p.clean.fields["described"] if k != j} | {cell[t]}
        assert set(torch.nonzero(s).flatten().tolist()) == want
        assert set(torch.nonzero(b).flatten().tolist()) == {cell[k] for k in p.clean.fields["described"]}

    probe = GatherProbe([(1, 3)], 4, 36, seed=0)
    stored = {1: torch.randn(2, 7, 16)}
    positions = [[6], [4, 5]]
    targets = torch.zeros(2, 36)
    targets[0, [2, 9]] = 1.0
    targets[1, 30] = 1.0
    with torch.no_grad():
        probe.linear.weight.zero_()
        probe.linear.bias.fill_(-3.0)
        probe.linear.bias[[2, 9]] = 3.0
    assert probe.accuracy(stored, positions, targets) == pytest.approx(1 / 3)  # row 0 read, row 1 (twice) not
    logits = probe.linear.bias.detach()
    rows = torch.stack([targets[0], targets[1], targets[1]])
    sig = torch.sigmoid(logits)[None]
    expected = -(rows * torch.log(sig) + (1 - rows) * torch.log(1 - sig)).sum(-1).mean()
    assert float(probe.loss(stored, positions, targets).detach()) == pytest.approx(float(expected), rel=1e-6)


def test_the_gathering_interchange_reuses_the_source_run_exactly(organism):
    """The gathering interchange patches the aggregation heads from the source run the IIT loss already made: the
    logits equal a fresh interchange of those heads alone, patching the base's own values is the identity (exactly),
    and the selection it asks for is the swapped object's base cell, where the source's names leave no claim."""
    from vlmbind.organisms.siit.interchange import patched_logits
    from vlmbind.organisms.siit.pairs import described_cells, target_cells

    vlm, builder, canvas = organism
    pairs = list(scene_pairs(4, "id_selection", 7, n_objects=(2, 4), canvas=canvas, swap="random", **POOLS))
    batch = interchange_batch(builder, pairs, "counterfactual", "answer")
    interchange = HeadInterchange(vlm.model, vlm.processor)
    with torch.no_grad():
        interchange_logits(vlm.model, interchange, batch, [(2, 1), (1, 3)], batch.positions)
        source_values = dict(interchange.stored)
        reused = patched_logits(vlm.model, interchange, batch, [(1, 3)], batch.positions, source_values)
        assert interchange.stored.keys() == source_values.keys()  # left as the IIT loss's readouts need them
        fresh = interchange_logits(vlm.model, interchange, batch, [(1, 3)], batch.positions)
        plain = vlm.model(**batch.base.inputs, use_cache=False).logits
        with interchange.capture([1]):
            vlm.model(**batch.base.inputs, use_cache=False)
        own = patched_logits(vlm.model, interchange, batch, [(1, 3)], batch.positions, dict(interchange.stored))
    assert torch.equal(reused, fresh)
    assert torch.equal(own, plain)
    assert not torch.allclose(reused, plain)  # the patch does something
    with pytest.raises(TrainingError, match="no stored source values for layers \\[3\\]"):
        patched_logits(vlm.model, interchange, batch, [(3, 0)], batch.positions, source_values)
    unclaimed, gathered = target_cells(pairs, canvas), described_cells(pairs, canvas)
    for p, cell, claimed in zip(pairs, unclaimed.tolist(), gathered):
        j, t = p.counterfactual.fields["swapped"]
        o = p.clean.objects[j]
        assert cell == o.row * canvas.shape[1] + o.col and p.answer_counterfactual == o.name
        base_cells = {q.row * canvas.shape[1] + q.col for q in p.clean.objects}
        assert base_cells - set(torch.nonzero(claimed).flatten().tolist()) == {cell}


def test_the_selecting_interchange_is_the_selecting_heads_interchanged_alone(organism):
    """On an id_selection step the selecting-interchange loss is the answer loss of the base run with the selecting
    heads alone (not the aggregation heads) interchanged from the step's source run: equal to a fresh interchange of
    those heads on the step's own pairs, and unlike the loss of the aggregation heads alone."""
    from vlmbind.organisms.data import answer_loss
    from vlmbind.organisms.siit.losses import siit_losses
    from vlmbind.organisms.siit.pairs import draw_pairs
    from vlmbind.organisms.siit.spec import SIIT_STREAM

    vlm, builder, canvas = organism
    spec = SIITSpec(alignments={"id_selection": ["1.3", "2.1"]}, aggregation_heads=("1.3",), pairs=3,
                    objects=(3, 4), strict_weight=0.0, selecting_interchange_weight=1.0, swap="random")
    assert spec.selecting_heads() == [(2, 1)]
    interchange = HeadInterchange(vlm.model, vlm.processor)
    with torch.no_grad():
        out = siit_losses(vlm.model, interchange, builder, spec, seed=0, step=5, canvas=canvas, parts=("iit",))
        pairs = draw_pairs(spec, "id_selection", seed=0, stream=SIIT_STREAM, step=5, canvas=canvas)
        batch = interchange_batch(builder, pairs, "counterfactual", spec.last_positions, spec.span_positions)
        fresh = HeadInterchange(vlm.model, vlm.processor)
        alone = answer_loss(interchange_logits(vlm.model, fresh, batch, [(2, 1)], batch.positions), batch.base.labels)
        gatherer = answer_loss(interchange_logits(vlm.model, fresh, batch, [(1, 3)], batch.positions),
                               batch.base.labels)
    assert out["variable"] == "id_selection" and out["gather_interchange"] is None
    assert float(out["selecting_interchange"]) == pytest.approx(float(alone), rel=1e-5)
    assert float(alone) != pytest.approx(float(gatherer), rel=1e-3)
    assert spec.to_dict()["selecting_interchange_weight"] == 1.0
    assert "selecting_interchange_weight" not in SIITSpec(alignments={"id_selection": ["2.1"]}).to_dict()


@pytest.mark.parametrize("mode", ["zero", "mean", "role_mean"])
def test_ablation_strictness_ablates_like_vlmbinds_ablation(organism, mode):
    """The ablation-strictness run is vlmbind's own head ablation (``AblateHeads``) of the same scenes: zeroed, or
    each head set to its mean over the rows' non-padding positions, or over those of its token role (taken here by a
    plain ``o_proj`` pre-hook and the processor's token roles); on two right-padded rows of different length, each
    row's prompt gives the logits of the processor's batch."""
    vlm, builder, canvas = organism
    pairs = scene_pairs(2, "id_selection", 4, n_objects=(3, 4), canvas=canvas, **POOLS)
    rows = interchange_batch(builder, pairs, "clean").base
    keep = rows.inputs["attention_mask"].bool()
    assert not keep.all()  # the shorter row is padded
    heads = [(1, 2), (3, 0), (3, 3)]
    d = vlm.adapter.d_head
    with torch.no_grad():
        ours = ablated_logits(vlm.model, HeadInterchange(vlm.model, vlm.processor), rows, heads, mode)
        seen = {}
        hooks = [vlm.adapter.o_proj_module(l).register_forward_pre_hook(
            lambda _m, args, l=l: seen.__setitem__(l, args[0])) for l in (1, 3)]
        vlm.model(**rows.inputs, use_cache=False)
        for h in hooks:
            h.remove()
        for r, pair in enumerate(pairs):
            aligned = check_alignment(vlm, [pair])
            n = aligned.clean.index[0].last_position + 1
            assert torch.equal(aligned.clean.inputs["input_ids"][0, :n], rows.inputs["input_ids"][r, :n])
            roles = np.stack([vlm.adapter.roles(ids, m) for ids, m in
                              zip(rows.inputs["input_ids"].numpy(), rows.inputs["attention_mask"].numpy())])

            def means(l, where):
                return torch.stack([seen[l][where][:, h * d:(h + 1) * d].mean(0) for ll, h in heads if ll == l])

            ablate = [vb.AblateHeads(layer=l, heads=[h for ll, h in heads if ll == l], mode=mode,
                                     means=None if mode == "zero" else means(l, keep) if mode == "mean" else
                                     {role: means(l, torch.as_tensor(roles == role)) for role in set(roles[keep.numpy()])})
                      for l in (1, 3)]
            reference = vlm.logits(aligned.clean, ablate)[0, :n]
            plain = vlm.logits(aligned.clean)[0, :n]
            torch.testing.assert_close(ours[r, :n], reference, rtol=0, atol=1e-4)
            assert (reference - plain).abs().max() > 1e-2  # the ablation did something
    with pytest.raises(TrainingError, match="ablation mode must be one of"):
        ablated_logits(vlm.model, HeadInterchange(vlm.model, vlm.processor), rows, heads, "image_attention")
    if mode == "role_mean":  # the roles differ in their means, so this is not the global mean again
        assert {"image", "text"} <= set(roles[keep.numpy()])
        mean = ablated_logits(vlm.model, HeadInterchange(vlm.model, vlm.processor), rows, heads, "mean")
        assert (mean - ours).abs().max() > 1e-2


def test_answer_unlikelihood_is_minus_log_one_minus_p():
    """Closed form on hand-made logits: per answer token ``-log(1 - softmax(logits)[label])``, padding ignored."""
    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[-100, 2, 0]])
    p = torch.softmax(logits, -1)
    expected = (-torch.log(1 - p[0, 0, 2]) - torch.log(1 - p[0, 1, 0])) / 2
    assert float(answer_unlikelihood(logits, labels)) == pytest.approx(float(expected), rel=1e-6)
    assert float(answer_unlikelihood(logits, labels, "token")) == pytest.approx(float(expected), rel=1e-6)
    sure = torch.tensor([[[0.0, 0.0, 30.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    assert float(answer_unlikelihood(sure, torch.tensor([[-100, 2, -100]]))) > 10  # sure of the answer: large
    assert float(answer_unlikelihood(sure, torch.tensor([[-100, 0, -100]]))) < 1e-6  # the answer given ~no mass


def test_ablation_necessity_ablates_one_aligned_variable_and_keeps_earlier_draws(organism):
    """The necessity loss draws after every other draw (older recipes train as they did), ablates all the heads of
    one aligned variable in one of the configured modes, and equals the unlikelihood of the base answer under
    ``ablated_logits`` of those heads."""
    from vlmbind.organisms.siit.pairs import step_rng

    base = SIITSpec(alignments={"id_selection": ["2.1", "3.0"], "feature_retrieval": ["3.2"]}, strict_weight=1.0,
                    ablation_strict_weight=1.0)
    needing = replace(base, ablation_necessity_weight=1.0, ablation_strict_modes=("zero", "role_mean"))
    seen = set()
    for step in range(30):
        a, b = step_rng(0, 1, step), step_rng(0, 1, step)
        assert base.draw_strict_heads(a, 4, 4) == needing.draw_strict_heads(b, 4, 4)
        assert len(base.draw_ablated_heads(a, 4, 4)[0]) == len(needing.draw_ablated_heads(b, 4, 4)[0])
        variable, heads, mode = needing.draw_necessary_heads(b)
        assert heads == needing.heads(variable) and mode in ("zero", "role_mean")
        seen.add((variable, mode))
    assert len(seen) == 4
    assert needing.to_dict()["ablation_strict_modes"] == ["zero", "role_mean"]
    assert needing.to_dict()["ablation_necessity_weight"] == 1.0
    assert "ablation_strict_modes" not in base.to_dict() and "ablation_necessity_weight" not in base.to_dict()
    assert SIITSpec.from_value(needing.to_dict()) == needing
    with pytest.raises(TrainingError, match="ablation_strict_modes must be distinct modes"):
        replace(base, ablation_strict_modes=("zero", "image_attention"))
    with pytest.raises(TrainingError, match="ablation_strict_modes must be distinct modes"):
        replace(base, ablation_strict_modes="zero")  # a list of modes, not one
    with pytest.raises(TrainingError, match="ablation_necessity_weight must be a number >= 0"):
        replace(base, ablation_necessity_weight=-1.0)

    vlm, builder, canvas = organism
    spec = replace(needing, alignments={"id_selection": ["2.1"], "feature_retrieval": ["3.2"]}, pairs=2,
                   objects=(3, 4))
    interchange = HeadInterchange(vlm.model, vlm.processor)
    with torch.no_grad():
        out = siit_losses(vlm.model, interchange, builder, spec, seed=0, step=3, canvas=canvas, parts=("strict",))
        mode, listed = out["necessity_ablated"].split(":")
        heads = [tuple(int(x) for x in h.split(".")) for h in listed.split(",")]
        assert heads in (spec.heads("id_selection"), spec.heads("feature_retrieval"))
        pairs = draw_pairs(spec, out["variable"], seed=0, stream=SIIT_STREAM, step=3, canvas=canvas)
        rows = interchange_batch(builder, pairs, "clean", spec.last_positions, spec.span_positions).base
        expected = answer_unlikelihood(ablated_logits(vlm.model, interchange, rows, heads, mode), rows.labels)
    assert float(out["ablation_necessity"]) == pytest.approx(float(expected), rel=1e-5)


def test_ablation_strictness_draws_after_the_interchange_strictness():
    """Adding the ablation loss leaves every earlier draw of a step as it was (old recipes train as they did), and
    draws at most as many heads as are aligned (or ``ablation_strict_heads``), never an aligned one."""
    from vlmbind.organisms.siit.pairs import step_rng

    base = SIITSpec(alignments={"id_selection": ["2.1", "3.0"]}, strict_weight=1.0)
    ablating = replace(base, ablation_strict_weight=1.0)
    for step in range(20):
        a, b = step_rng(0, 1, step), step_rng(0, 1, step)
        assert base.draw_strict_heads(a, 4, 4) == ablating.draw_strict_heads(b, 4, 4)
        heads, mode = ablating.draw_ablated_heads(b, 4, 4)
        assert 1 <= len(heads) <= 2 and not {(2, 1), (3, 0)} & set(heads) and mode in ("zero", "mean")
    wide = replace(ablating, ablation_strict_heads=6)
    assert max(len(wide.draw_ablated_heads(np.random.default_rng(s), 4, 4)[0]) for s in range(40)) == 6
    assert wide.to_dict()["ablation_strict_heads"] == 6 and "ablation_strict_weight" not in base.to_dict()
    with pytest.raises(TrainingError, match="ablation_strict_heads must be an int >= 0"):
        replace(base, ablation_strict_heads=-1)


def test_selection_attention_is_read_at_the_target_objects_token():
    """The attention loss reads each aligned head's pattern at the row's patch positions on the image token of the
    row's target cell (image tokens in raster order); a perfectly attending head has loss 0."""
    from vlmbind.organisms.siit.losses import attention_on_targets, selection_attention_loss
    from vlmbind.organisms.siit.pairs import target_tokens

    ids = torch.tensor([[1, 9, 9, 9, 9, 2, 3], [1, 2, 9, 9, 9, 9, 3]])
    tokens = target_tokens(ids, 9, torch.tensor([2, 0]))
    assert tokens.tolist() == [3, 2]
    with pytest.raises(TrainingError, match="only 4 image tokens"):
        target_tokens(ids, 9, torch.tensor([4, 0]))
    patterns = {1: torch.full((2, 2, 7, 7), 1 / 7)}
    patterns[1][0, 1, 6] = torch.nn.functional.one_hot(torch.tensor(3), 7).float()
    patterns[1][1, 1, [5, 6]] = torch.nn.functional.one_hot(torch.tensor(2), 7).float()
    positions = [[6], [5, 6]]
    assert attention_on_targets(patterns, [(1, 1)], positions, tokens).tolist() == [1.0, 1.0, 1.0]
    assert float(selection_attention_loss(patterns, [(1, 1)], positions, tokens)) == pytest.approx(0.0, abs=1e-6)
    assert float(selection_attention_loss(patterns, [(1, 0)], positions, tokens)) == pytest.approx(math.log(7))


def test_span_variables_can_be_interchanged_at_the_names_last_token():
    """``span_positions="last"`` keeps, of an id_retrieval pair's span, its last token (the shape word, which
    decodes to the object's shape), leaves last-token pairs as they were, and moves the aggregation target to each
    described name's last token; a bad value is named."""
    from vlmbind.organisms.data import BatchBuilder
    from vlmbind.organisms.siit.pairs import described_name_tokens

    vlm = shared_organism("organism-p2a")
    builder = BatchBuilder(vlm.processor)
    canvas = Canvas(image_size=168, grid=6)
    pairs = list(scene_pairs(8, "id_retrieval", 3, n_objects=(2, 4), canvas=canvas, swap="random", **POOLS))
    pairs += list(scene_pairs(2, "id_selection", 4, n_objects=3, canvas=canvas, **POOLS))
    names = interchange_batch(builder, pairs, "counterfactual", "answer")
    last = interchange_batch(builder, pairs, "counterfactual", "answer", span_positions="last")
    ids = names.base.inputs["input_ids"]
    for p, r, full, kept in zip(pairs, ids, names.positions, last.positions):
        if p.patch["kind"] == "span":
            assert len(full) >= 2 and kept == full[-1:]
            shape = p.clean.objects[p.patch["object"]].shape
            assert builder.tokenizer.decode(r[kept]).strip() == shape
        else:
            assert kept == full
    retrieval = pairs[:8]
    for p, r, everything, ends in zip(retrieval, ids, described_name_tokens(builder, retrieval),
                                      described_name_tokens(builder, retrieval, "last")):
        assert len(ends) == len(p.clean.fields["described"]) and set(ends) < set(everything)
        shapes = sorted(p.clean.objects[k].shape for k in p.clean.fields["described"])
        assert sorted(builder.tokenizer.decode(r[q]).strip() for q in ends) == shapes
    with pytest.raises(TrainingError, match="span_positions must be one of"):
        interchange_batch(builder, pairs[:1], "clean", span_positions="first")
    with pytest.raises(TrainingError, match="siit.span_positions"):
        SIITSpec(alignments={"id_retrieval": ["0.2"]}, span_positions="shape")
    spec = SIITSpec(alignments={"id_retrieval": ["0.2"]}, span_positions="last")
    assert SIITSpec.from_value(spec.to_dict()) == spec and "span_positions" not in SIITSpec(
        alignments={"id_retrieval": ["0.2"]}).to_dict()


def test_retrieval_and_aggregation_targets():
    """An id_retrieval pair's target is the patched described object's cell in the source (the missing object's
    cell in the base); the aggregation target is every described object's name tokens; attention on a set of
    positions is summed, so a head spread evenly over 7 positions with 2 targets has loss ln(7/2)."""
    from vlmbind.organisms.data import BatchBuilder
    from vlmbind.organisms.siit.losses import attention_on_targets, selection_attention_loss
    from vlmbind.organisms.siit.pairs import described_name_tokens, patched_cells, target_cells

    vlm = shared_organism("organism-p2a")
    builder = BatchBuilder(vlm.processor)
    canvas = Canvas(image_size=168, grid=6)
    pairs = list(scene_pairs(8, "id_retrieval", 3, n_objects=(2, 4), canvas=canvas, swap="random", **POOLS))
    patched, missing = patched_cells(pairs, canvas), target_cells(pairs, canvas, "clean")
    for p, cell, base in zip(pairs, patched.tolist(), missing.tolist()):
        j = p.patch["object"]
        assert cell == base and p.counterfactual.objects[j].name == p.clean.objects[j].name
    with pytest.raises(TrainingError, match="patches no described object"):
        patched_cells(list(scene_pairs(1, "id_selection", 3, canvas=canvas, **POOLS)), canvas)
    rows = builder([(p.clean.image, p.clean.prompt, p.answer) for p in pairs]).inputs["input_ids"]
    for p, r, positions in zip(pairs, rows, described_name_tokens(builder, pairs)):
        text = builder.tokenizer.decode(r[positions])
        assert all(p.clean.objects[k].name in text for k in p.clean.fields["described"])
        assert p.answer not in text
    patterns = {0: torch.full((1, 1, 7, 7), 1 / 7)}
    assert attention_on_targets(patterns, [(0, 0)], [[6]], [[2, 4]]).tolist() == [pytest.approx(2 / 7)]
    assert float(selection_attention_loss(patterns, [(0, 0)], [[6]], [[2, 4]])) == pytest.approx(math.log(7 / 2))


def test_the_interchanged_runs_selection_target_and_patterns():
    """The interchanged-run selection target of an id_retrieval pair is the patched object's own cell in the base
    (where the missing object sits in the source); asking for the interchanged run's patterns leaves its logits and
    the source run's stored values as they were, and the patterns are HF's eager ``output_attentions`` of the
    interchanged base run."""
    from vlmbind.organisms.data import BatchBuilder
    from vlmbind.organisms.siit.pairs import last_prompt_positions, own_cells, target_cells

    vlm = vb.load("organism-vsm")
    vlm.model.set_attn_implementation("eager")
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    canvas = Canvas(image_size=168, grid=6)
    pairs = list(scene_pairs(6, "id_retrieval", 5, n_objects=(2, 4), canvas=canvas, swap="random", **POOLS))
    own, moved = own_cells(pairs, canvas), target_cells(pairs, canvas)
    for p, cell, source_missing in zip(pairs, own.tolist(), moved.tolist()):
        j = p.clean.objects[p.patch["object"]]
        assert cell == j.row * 6 + j.col == source_missing
    with pytest.raises(TrainingError, match="patches no described object"):
        own_cells(list(scene_pairs(1, "id_selection", 3, canvas=canvas, **POOLS)), canvas)
    batch = interchange_batch(builder, pairs, "counterfactual", "answer")
    assert [[int(batch.prompt_mask[r].nonzero().max())] for r in range(len(pairs))] == \
        last_prompt_positions(batch.prompt_mask)
    with torch.no_grad():
        plain = interchange_logits(vlm.model, interchange, batch, [(0, 2)], batch.positions)
        stored = {k: v.clone() for k, v in interchange.stored.items()}
        logits = interchange_logits(vlm.model, interchange, batch, [(0, 2)], batch.positions, base_patterns=[2])
        assert torch.equal(plain, logits) and interchange.stored.keys() == stored.keys()
        assert all(torch.equal(interchange.stored[k], v) for k, v in stored.items())
        with interchange.patch([(0, 2)], batch.positions, stored):
            reference = vlm.model(**batch.base.inputs, use_cache=False, output_attentions=True).attentions[2]
    assert torch.allclose(interchange.base_patterns[2], reference, atol=1e-6)


@pytest.mark.parametrize("variable", ["id_retrieval", "feature_retrieval"])
def test_the_strictness_runs_selection_loss_is_hfs_attention_on_the_bases_missing_object(variable):
    """The strict-selection loss is -log of the selecting head's attention (HF's eager ``output_attentions``, with
    the drawn unaligned head interchanged at every prompt token) from the last prompt token to the image token of
    the base scene's missing object, which on an id_retrieval pair is not the interchanged run's target."""
    from vlmbind.organisms.siit.losses import siit_losses
    from vlmbind.organisms.siit.pairs import draw_pairs
    from vlmbind.organisms.siit.spec import SIIT_STREAM

    vlm = vb.load("organism-vsm")
    vlm.model.set_attn_implementation("eager")
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    canvas = Canvas(image_size=168, grid=6)
    spec = SIITSpec(alignments={"id_retrieval": ["0.2"], "id_selection": ["1.3", "2.1"],
                                "feature_retrieval": ["4.2"]}, aggregation_heads=("1.3",), pairs=3, objects=(3, 4),
                    strict_selection_weight=1.0, swap="random", **POOLS)
    with torch.no_grad():
        for step in range(30):  # the first step that draws the variable
            out = siit_losses(vlm.model, interchange, builder, spec, seed=0, step=step, canvas=canvas,
                              parts=("strict",))
            if out["variable"] == variable:
                break
    assert out["variable"] == variable and out["iit"] is None
    (layer, head), = [tuple(map(int, h.split("."))) for h in out["strict_head"].split(",")]
    pairs = draw_pairs(spec, variable, seed=0, stream=SIIT_STREAM, step=step, canvas=canvas)
    batch = interchange_batch(builder, pairs, "clean", "answer")
    with torch.no_grad():
        with interchange.capture([layer]):
            vlm.model(**batch.source.inputs, use_cache=False)
        with interchange.patch([(layer, head)], batch.prompt_mask, interchange.stored):
            attention = vlm.model(**batch.base.inputs, use_cache=False, output_attentions=True).attentions[2]
    ids = batch.base.inputs["input_ids"]
    expected = []
    for r, p in enumerate(pairs):
        missing = p.clean.objects[p.clean.fields["target"]]
        image = torch.nonzero(ids[r] == builder.image_token_id).flatten()
        last = int(batch.prompt_mask[r].nonzero().max())
        expected.append(float(attention[r, 1, last, image[missing.row * 6 + missing.col]]))
        if variable == "id_retrieval":
            own = p.clean.objects[p.patch["object"]]
            assert (own.row, own.col) != (missing.row, missing.col)
    assert float(out["strict_selection"]) == pytest.approx(float(-torch.log(torch.tensor(expected)).mean()),
                                                           rel=1e-5)


def test_selection_attention_needs_eager_attention(tmp_path):
    from vlmbind.organisms.training.run import train

    siit = {"alignments": {"id_selection": ["1.0"]}, "pairs": 2, "objects": [3, 3], "selection_attention_weight": 1.0,
            "source_grad": True}
    config = _planting_config(steps=2, eval_every=0, checkpoint_every=2, siit=siit, attn_implementation="sdpa")
    with pytest.raises(TrainingError, match="attn_implementation='eager'"):
        train(config, tmp_path / "run", progress=False, threads=1, until=2)


@pytest.mark.parametrize("siit, match", [
    ({"alignments": {"feature_retrieval": ["1.0"]}, "selection_weight": 1.0, "source_grad": True}, "not aligned"),
    ({"alignments": {"id_selection": ["1.0"]}, "selection_weight": 1.0}, "source_grad"),
    ({"alignments": {"id_selection": ["1.0"]}, "selection_weight": 1.0, "source_grad": True, "iit_weight": 0},
     "iit_weight"),
    ({"alignments": {"id_selection": ["1.0"]}, "selection_weight": -1}, "selection_weight must be"),
    ({"alignments": {"id_selection": ["1.0"]}, "retrieval_attention_weight": 1.0, "source_grad": True},
     "id_retrieval is not aligned"),
    ({"alignments": {"id_retrieval": ["0.0"]}, "retrieval_attention_weight": 1.0}, "source_grad"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "aggregation_heads": ["0.2"]}, "not id_selection heads"),
    ({"alignments": {"id_selection": ["1.0"]}, "aggregation_heads": ["1.0"]}, "at least one must read"),
    ({"alignments": {"id_selection": ["1.0"]}, "retrieval_readout_weight": 1.0, "source_grad": True},
     "id_retrieval is not aligned"),
    ({"alignments": {"id_retrieval": ["0.0"]}, "retrieval_readout_weight": 1.0}, "source_grad to true"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "gather_readout_weight": 1.0, "source_grad": True},
     "list the aggregation heads in siit.aggregation_heads"),
    ({"alignments": {"id_selection": ["1.0"]}, "gather_readout_weight": -0.5}, "must be a number >= 0"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "gather_interchange_weight": 1.0},
     "gather_interchange_weight > 0 interchanges the aggregation heads"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "aggregation_heads": ["0.1"], "gather_interchange_weight": 1.0,
      "iit_weight": 0}, "reuses the IIT loss's source run"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "aggregation_heads": ["0.1"], "gather_selection_weight": 1.0},
     "set siit.gather_interchange_weight above 0"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "aggregation_heads": ["0.1"], "gather_interchange_weight": "1"},
     "gather_interchange_weight must be a number >= 0"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "selecting_interchange_weight": 1.0},
     "selecting_interchange_weight > 0 interchanges the selecting heads apart from the aggregation heads"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "aggregation_heads": ["0.1"],
      "selecting_interchange_weight": 1.0, "iit_weight": 0}, "reuses the IIT loss's source run"),
    ({"alignments": {"id_selection": ["1.0", "0.1"]}, "aggregation_heads": ["0.1"],
      "selecting_interchange_weight": -1.0}, "selecting_interchange_weight must be a number >= 0"),
])
def test_bad_selection_readouts_are_named(siit, match):
    with pytest.raises(TrainingError, match=match):
        TrainConfig(image_size=112, tasks={"scene": 1.0}, model={"layers": 2}, siit=siit)
