"""The shipped organisms: they load by name through from_pretrained, carry their training record, and still solve
scene description and the binding query task on a fixed sample. Also: the recipes are valid and shipping a run
gives a loadable directory with identical logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import shared_organism

import vlmbind as vb
from vlmbind.analysis.evaluation import evaluate, training_defaults
from vlmbind.core.shipped import organism_dir
from vlmbind.engine.vlm import TRAINING_FILE
from vlmbind.organisms import ORGANISM_NAMES, shipped_organisms
from vlmbind.organisms.recipes import RECIPES, recipe_stages, stage_config
from vlmbind.organisms.ship import ship
from vlmbind.organisms.training.run import train

S = vb.stimuli
ROOT = Path(__file__).resolve().parents[2]


def test_every_organism_is_shipped():
    assert shipped_organisms() == list(ORGANISM_NAMES)
    assert set(ORGANISM_NAMES) <= set(vb.registered_names())


@pytest.fixture(scope="module", params=ORGANISM_NAMES)
def organism(request):
    return shared_organism(request.param)


def test_loads_through_from_pretrained_with_its_record(organism):
    assert organism.family == "qwen2_5_vl"
    assert organism.source.startswith("shipped organism")
    record = organism.training
    assert record["regime"] == recipe_stages(organism.name)[-1][1]["regime"]
    assert record["image_size"] == 168 and record["grid"] == 6
    # the PbP organisms within an hour each on 2 cores; organism-vsm took 366 min on one thread, more than twice the
    # 2.5 hours SIIT was given: 196 for stages 1-5 (ID selection and feature retrieval, with strictness), 100 for
    # stages 6-10 (the ID-retrieval layer and its link to ID selection), 32 for stage 11 (the answer follows the
    # selecting head) and 39 for stage 12 (ablation strictness and necessity; docs/ground_truth.md); the bound keeps
    # it there
    budget = 370 if RECIPES[organism.name] == "vsm" else 60
    assert record["wall_time_s"] <= budget * 60, f"{organism.name} must train within {budget} min on 2 cores"


def _trained_tasks(name: str) -> set[str]:
    return set(json.loads((organism_dir(name) / TRAINING_FILE).read_text())["tasks"])


TASK_CASES = [("scene", {"entropy": "high"}), ("scene", {"entropy": "low"}), ("query", {})]


@pytest.mark.parametrize("name,task,kwargs", [(n, t, k) for n in ORGANISM_NAMES for t, k in TASK_CASES
                                              if t in _trained_tasks(n)])
def test_solves_binding_tasks_on_a_fixed_sample(name, task, kwargs):
    organism = shared_organism(name)
    generator = {"scene": S.scene_description, "query": S.binding_query}[task]
    dataset = generator(48, 12345, **training_defaults(organism, task, kwargs))
    result = evaluate(organism, dataset, batch_size=48)
    assert result.accuracy >= 0.9, (organism.name, task, kwargs, result.accuracy)
    if task == "query":
        assert result.accuracy > dataset.summary["counting_ceiling"] + 0.2


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_are_valid_configs(name):
    # a stage without its own start continues the previous one's checkpoint (named here by a placeholder)
    configs = [stage_config(fields, fields.get("init_from") or "previous/checkpoint")[0]
               for _, fields in recipe_stages(name)]
    assert configs[-1].image_size == 168
    assert all(c.regime == configs[0].regime for c in configs)
    assert configs[0].regime == (RECIPES[name] if RECIPES[name] not in ("vsm", "search") else "p2a")


def test_the_shipped_records_hold_the_recipes_stages():
    """The shipped organism-vsm and its twin were trained with their recipes' stages, field for field (the first
    stage's start is named in the record, resolved to a path in the recipe); the twin's are the planted organism's
    without SIIT."""
    planted, natural = recipe_stages("organism-vsm"), recipe_stages("organism-vsm-natural")
    for name, stages in (("organism-vsm", planted), ("organism-vsm-natural", natural)):
        record = json.loads((organism_dir(name) / TRAINING_FILE).read_text())["stages"]
        assert len(record) == len(stages) == 12
        for (stage, fields), saved in zip(stages, record, strict=True):
            mine = json.loads(json.dumps({"stage": stage, **fields}, default=str))
            differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            assert differ == (["init_from"] if "init_from" in fields else []), (name, stage, differ)
    for (stage, fields), (twin, twin_fields) in zip(planted, natural, strict=True):
        assert twin.rsplit("-", 1)[0] == stage.rsplit("-", 1)[0] and "siit" not in twin_fields
        assert twin_fields == {k: v for k, v in fields.items() if k != "siit"}
    assert planted[5][1]["init_layers"] == [0, None, 1, 2, 3, 4, 5]  # stage 6 inserts the ID-retrieval layer


def _release(path: Path, organism: str, stages: list[tuple[str, dict]], seed: int = 0) -> Path:
    path.mkdir(parents=True)
    (path / TRAINING_FILE).write_text(json.dumps({
        "organism": organism, "seed": seed, "stages": [{"stage": s, **f} for s, f in stages],
        "stage_results": [{"stage": s, "checkpoint": "x", "steps": f["steps"]} for s, f in stages]}))
    return path


def test_start_from_refuses_what_is_not_a_release_of_the_recipe(tmp_path, capsys):
    from vlmbind.core.errors import TrainingError
    from vlmbind.organisms.recipes import main, run_recipe

    recipe = recipe_stages("organism-vsm")
    with pytest.raises(TrainingError, match="has no vlmbind_training.json"):
        run_recipe("organism-vsm", tmp_path / "out", start_from=tmp_path)
    other = _release(tmp_path / "natural", "organism-vsm-natural", recipe_stages("organism-vsm-natural")[:5])
    with pytest.raises(TrainingError, match="not organism-vsm"):
        run_recipe("organism-vsm", tmp_path / "out", start_from=other)
    seed = _release(tmp_path / "seed", "organism-vsm", recipe[:5], seed=3)
    with pytest.raises(TrainingError, match=r"seed 3\), not organism-vsm \(seed 0"):
        run_recipe("organism-vsm", tmp_path / "out", start_from=seed)
    done = _release(tmp_path / "done", "organism-vsm", recipe)
    with pytest.raises(TrainingError, match="nothing to continue"):
        run_recipe("organism-vsm", tmp_path / "out", start_from=done)
    changed = _release(tmp_path / "changed", "organism-vsm", [(s, {**f, "lr": 1.0}) for s, f in recipe[:5]])
    with pytest.raises(TrainingError, match="another configuration"):
        run_recipe("organism-vsm", tmp_path / "out", start_from=changed)
    assert main(["organism-vsm", "--out", str(tmp_path / "out"), "--start-from", str(changed), "--quiet"]) == 2
    assert "another configuration" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_finished_stage_trained_otherwise_is_refused(tmp_path):
    """A resumed recipe takes a finished stage only if it was trained with the recipe's configuration."""
    from vlmbind.core.errors import TrainingError
    from vlmbind.organisms.recipes import run_recipe
    from vlmbind.organisms.training.checkpoints import CHECKPOINT_PREFIX

    stage, fields = recipe_stages("organism-direct")[0]
    config = stage_config({**fields, "lr": fields["lr"] * 2})[0]
    checkpoint = tmp_path / stage / f"{CHECKPOINT_PREFIX}{config.steps:06d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_config.json").write_text(json.dumps(config.to_dict(), default=str))
    with pytest.raises(TrainingError, match=f"stage {stage}\\) was trained with other lr"):
        run_recipe("organism-direct", tmp_path, progress=False)


def test_ship_gives_a_loadable_directory(tmp_path):
    from test_organisms_train import small_config

    run = tmp_path / "run"
    result = train(small_config(steps=2, checkpoint_every=2), run / "stage", progress=False)
    (run / "recipe_summary.json").write_text(json.dumps({
        "seed": 0, "final_checkpoint": str(result.checkpoint), "wall_time_s": result.wall_time_s, "threads": 1,
        "processes": 2, "stages": [{"stage": "stage", "wall_time_s": result.wall_time_s}]}))
    dest = ship("organism-direct", run, "# card\n", dest=tmp_path / "shipped")
    assert not (dest / "optimizer.safetensors").exists()
    shipped, original = vb.load(str(dest)), vb.load(str(result.checkpoint))
    assert shipped.training["regime"] == "direct"
    assert shipped.training["command"].endswith("--threads 1 --processes 2")  # how the run was trained
    image = S.scene_description(1, 0, canvas=S.Canvas(image_size=56, grid=2))[0]
    a, b = shipped.prepare(image.image, image.prompt), original.prepare(image.image, image.prompt)
    torch.testing.assert_close(shipped.logits(a), original.logits(b), atol=0, rtol=0)


def test_demo_asks_the_organism_what_it_learned(tmp_path, capsys):
    """The demo's question on an organism: its top prediction (the overviews run on a tiny model in test_cli.py)."""
    from vlmbind.cli import main

    assert main(["demo", "--model", "organism-direct", "--out", str(tmp_path), "--json", "--seed", "4",
                 "--no-causal", "--no-representations", "--no-validate"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompt"].startswith("in this image there is a")
    top = summary["top_predictions"][0]["token"].strip()
    assert top == summary["expected_answer"].split()[0], summary


def test_organism_vsm_and_its_twin_differ_only_by_the_plant():
    """organism-vsm records its planted heads (machine-readable); organism-vsm-natural was trained from the same start
    with the same data, seed, steps and learning rates, and plants nothing."""
    planted, natural = shared_organism("organism-vsm").training, shared_organism("organism-vsm-natural").training
    assert planted["planted"] == {"id_retrieval": ["1.0"], "id_selection": ["2.3", "3.1"],
                                  "feature_retrieval": ["5.2"]} and "planted" not in natural
    assert planted["grown_from"] == natural["grown_from"] == {"organism": "organism-p2a", "init_layers": [None] * 6}
    assert [s["steps"] for s in planted["stage_results"]] == [s["steps"] for s in natural["stage_results"]]
    for a, b in zip(planted["stages"], natural["stages"], strict=True):
        assert a.pop("siit") and "siit" not in b
        assert {k: v for k, v in a.items() if k != "stage"} == {k: v for k, v in b.items() if k != "stage"}


@pytest.mark.parametrize("condition,objects,floor", [("id_retrieval", 3, 0.85), ("id_selection", 3, 0.85),
                                                    ("feature_retrieval", 3, 0.9)])
def test_the_planted_heads_carry_their_variables(condition, objects, floor):
    """On fresh pairs, interchanging the planted heads from the source makes organism-vsm give the high-level model's
    counterfactual answer (id_retrieval: the patched name now claims the missing object's cell, so the object it left
    is named; id_selection: the object at the missing object's cell in the source, a described one;
    feature_retrieval: the source's new features); in the twin the same heads do nothing. All on three-object
    scenes, the count held out of the planting (circuits/ground_truth's interchange table has every setting)."""
    from vlmbind.core.sites import parse_heads
    from vlmbind.organisms.data import BatchBuilder
    from vlmbind.organisms.siit.evaluation import interchange_accuracy, unpatched_accuracy
    from vlmbind.organisms.siit.interchange import HeadInterchange

    heads = parse_heads(shared_organism("organism-vsm").training["planted"][condition])

    pools = {"colours": ("red", "green", "blue", "yellow"), "shapes": ("square", "circle", "triangle", "star")}
    options = {"recolour": "any"} if condition == "feature_retrieval" else {"swap": "random"}
    pairs = [p for entropy in ("high", "low") for p in S.scene_pairs(
        24, condition, 4242, n_objects=objects, entropy=entropy, canvas=S.Canvas(image_size=168, grid=6), **options,
        **pools)]
    accuracy = {}
    for name in ("organism-vsm", "organism-vsm-natural"):
        vlm = shared_organism(name)
        builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
        assert unpatched_accuracy(vlm.model, builder, pairs) <= 0.1  # a* is not what the clean scene gives
        accuracy[name] = interchange_accuracy(vlm.model, interchange, builder, pairs, heads,
                                              last_positions="answer")
    assert accuracy["organism-vsm"] >= floor and accuracy["organism-vsm-natural"] <= 0.1, accuracy


@pytest.mark.parametrize("name", ["organism-vsm", "organism-vsm-natural"])
def test_the_grown_organisms_cards_are_drawn_from_their_records_and_saved_validation(name):
    """The model card next to the weights is the one ``ship`` writes from the training record and the validation
    saved in circuits/ground_truth (no number typed by hand); the planted organism's card names every stage's SIIT
    settings, the strictness draw's weighted heads among them."""
    from vlmbind.organisms.ship import shipped_card

    directory = organism_dir(name)
    record = json.loads((directory / TRAINING_FILE).read_text())
    validation_file = ROOT / "circuits" / "ground_truth" / "results" / name / "validation.json"
    validation = json.loads(validation_file.read_text())
    expected = shipped_card(name, validation)
    assert (directory / "README.md").read_text() == expected
    assert "## Validation (fresh pairs)" in expected and "python circuits/ground_truth/run.py" in expected
    # one edit line per head set the validation edited: every ID-selection head together, then each alone
    assert expected.count("Position-ID edit") == len(validation["summary"]["edit_by_heads"]) >= 1
    if name == "organism-vsm":
        assert any(s["siit"].get("strict_head_weights") for s in record["stages"])
        assert "strictness drawing 0.0 8 times as often, 0.1 16 times as often, 0.2 0.3 2 times as often" in expected
        # the last stage's selecting interchange, in its stage line and in what the heads were told
        assert "gathering interchange 4, selecting interchange 4" in expected.splitlines()[
            next(i for i, line in enumerate(expected.splitlines()) if line.startswith("- stage 11-"))]
        assert "alone interchanged from the same source, the model must name that object too (weight 4)" in expected
        # the last stage trained ablation in, and the card says so
        assert "strictness under ablation 2 (1-4 heads; zero / mean / role_mean), necessity under ablation 1" in \
            expected.splitlines()[next(i for i, line in enumerate(expected.splitlines())
                                       if line.startswith("- stage 12-"))]
        assert "an ablation study that finds it shows it reads necessity right" in expected
        assert "| id_retrieval | 1.0 | each described object's position (grid cell), at its name's last prompt token |" \
            in expected  # where stages 6 and after aligned it (span_positions="last")


# What the saved run of organism-vsm's stage 1 logged (its record left the tree with the training history; commit
# bf97b41 holds it: circuits/ground_truth/results/organism-vsm_training/1-fresh-lm-siit.json)
LOGGED_LOSS = {1: 20.38301, 51: 5.68511}
LOGGED_SIIT_STEP_1 = {"behaviour": 6.098590850830078, "variable": "id_selection", "strict_head": "0.1",
                      "iit": 6.236323833465576, "strict": 6.186046600341797, "position": 5.573676586151123}
LOGGED_STRICT_HEAD_STEP_51 = "5.0"


def test_the_recipe_reproduces_the_recorded_first_steps(tmp_path):
    """Stage 1 of organism-vsm's recipe, run as written for 51 steps, gives the losses its saved run logged (same
    data, initialisation from organism-p2a and random draws): step 1 to float precision, step 51 within the drift of
    float-sum order (the saved run had no shared image features)."""
    stage, fields = recipe_stages("organism-vsm")[0]
    assert stage == "1-fresh-lm-siit"
    config, _ = stage_config(fields)
    result = train(config, tmp_path / "stage-1", progress=False, threads=1, until=51)
    assert result.losses[0] == pytest.approx(LOGGED_LOSS[1], rel=1e-5)
    assert result.losses[50] == pytest.approx(LOGGED_LOSS[51], rel=1e-3)
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    first, logged = state["siit_losses"][0], LOGGED_SIIT_STEP_1
    assert {k: first[k] for k in ("variable", "strict_head")} == {k: logged[k] for k in ("variable", "strict_head")}
    for part in ("behaviour", "iit", "strict", "position"):
        assert first[part] == pytest.approx(logged[part], rel=1e-5), part
    assert state["siit_losses"][50]["strict_head"] == LOGGED_STRICT_HEAD_STEP_51


def test_the_planted_search_head_moves_the_point():
    """On fresh pointing pairs (within one counting trace and across displays), interchanging organism-search's
    planted head at a point's two steps moves that point to the source's object; the unpatched run almost never
    writes the source's point, and the twin carries no planted heads."""
    from vlmbind.organisms.data import BatchBuilder, TaskMixture, TaskSpec, answer_correct, training_canvas
    from vlmbind.organisms.siit.interchange import HeadInterchange
    from vlmbind.organisms.siit.pointing import PointSIITSpec, evaluation_point_pairs, point_batch, point_interchange

    vlm = shared_organism("organism-search")
    record = vlm.training
    spec = PointSIITSpec(heads=tuple(record["planted"]["search"]))
    mixture = TaskMixture([TaskSpec.from_options(t, w, record["task_options"].get(t))
                           for t, w in record["tasks"].items()], regime="p2a", image_size=168, seed=4242)
    pairs = evaluation_point_pairs(spec, mixture, seed=4242, n=32)
    assert {p.kind for p in pairs} == {"trace", "display"}
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    moved = point_interchange(vlm.model, interchange, builder, pairs, spec.planted(), training_canvas(record).shape[1])
    assert sum(moved["moved"]) / len(pairs) >= 0.9
    with torch.no_grad():  # the source's point is not what the base run writes on its own
        batch = point_batch(builder, pairs, 6)
        unpatched = answer_correct(vlm.model(**batch.base.inputs).logits, batch.counterfactual)
    assert float(unpatched.float().mean()) <= 0.1
    assert "planted" not in shared_organism("organism-search-natural").training


def test_the_search_twin_is_the_planted_recipe_without_the_siit_losses():
    planted, natural = (json.loads((organism_dir(n) / TRAINING_FILE).read_text())
                        for n in ("organism-search", "organism-search-natural"))
    assert planted["planted"] == {"search": ["2.1"]}
    for a, b in zip(planted["stages"], natural["stages"], strict=True):
        spec, twin = a.pop("point_siit"), b.pop("point_siit")
        assert {k: v for k, v in a.items() if k != "stage"} == {k: v for k, v in b.items() if k != "stage"}
        assert twin["position_layer"] == spec["position_layer"] and twin["position_weight"] == spec["position_weight"]
        assert spec["iit_weight"] > 0 and all(twin[w] == 0 for w in ("iit_weight", "strict_weight",
                                                                     "attention_weight", "readout_weight"))


@pytest.mark.parametrize("name", ["organism-search", "organism-search-natural"])
def test_the_search_organisms_cards_are_drawn_from_their_records_and_saved_validation(name):
    from vlmbind.organisms.ship import shipped_card

    validation = json.loads((ROOT / "circuits" / "ground_truth" / "results" / "benchmark" / name
                             / "validation.json").read_text())
    expected = shipped_card(name, validation)
    assert (organism_dir(name) / "README.md").read_text() == expected
    assert "## Validation (fresh counting displays)" in expected and "attention_swap" in expected
