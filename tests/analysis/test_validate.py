"""``vlmbind validate``: the rank metrics are the closed-form ones, naive equals exact on the sampled heads, the result
round-trips through its files, and bad reference heads are named errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import shared_organism

import vlmbind as vb
from vlmbind.analysis.validate import ValidationResult, rank_metrics, recorded_planted
from vlmbind.cli import main
from vlmbind.core.results import detect


def test_rank_metrics_are_the_closed_form_ones():
    scores = np.array([[0.1, -0.4, 0.0], [2.0, 0.3, -0.2]])
    top = rank_metrics(scores, [(1, 0)])
    assert top["planted_ranks"] == [1] and top["recall_at_k"] == 1.0 and top["auroc"] == 1.0
    assert top["ratio"] == pytest.approx(2.0 / 0.4)
    # two planted heads, one ranked 2nd, one 5th: recall@2 = 1/2; AUROC = the share of (planted, other) pairs in
    # the right order (Mann-Whitney): 0.3 beats 3 of the 4 others, -0.2 beats 1 (-0.4)
    mixed = rank_metrics(scores, [(1, 1), (1, 2)])
    assert mixed["planted_ranks"] == [2, 5] and mixed["recall_at_k"] == 0.5
    assert mixed["auroc"] == pytest.approx((3 + 1) / 8)
    assert mixed["ratio"] == pytest.approx(-0.2 / 2.0)
    empty = rank_metrics(scores, [])
    assert empty["auroc"] is None and empty["recall_at_k"] is None


def test_validate_on_a_tiny_model_with_given_heads(tmp_path, capsys):
    out = tmp_path / "v"
    code = main(["validate", "--model", "tiny-qwen2_5_vl", "--heads", "id_selection=1.0,2.3", "--n-pairs", "2",
                 "--methods", "exact,naive,attribution", "--naive-heads", "4", "--modes", "zero", "--n-eval", "4",
                 "--ablation-seeds", "2", "--alpha", "1", "--n-estimate", "24", "--n-probe", "16", "--out", str(out),
                 "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["reference"] == "--heads" and summary["heads"] == {"id_selection": ["1.0", "2.3"]}
    result = ValidationResult.load(out)
    assert detect(out) is ValidationResult
    methods = pd.read_csv(out / "methods.csv")
    assert set(methods["method"]) == {"exact", "attribution"} and len(methods) == 6
    scores = pd.read_csv(out / "scores.csv")
    exact = scores[(scores.condition == "id_selection") & (scores.method == "exact")]
    row = next(r for r in result.methods if r["condition"] == "id_selection" and r["method"] == "exact")
    grid = np.zeros((exact["layer"].max() + 1, exact["head"].max() + 1))
    grid[exact["layer"], exact["head"]] = exact["score"]
    again = rank_metrics(grid, [(1, 0), (2, 3)])  # the saved table's scores give the reported metrics
    assert row["planted_ranks"] == again["planted_ranks"] and row["auroc"] == pytest.approx(again["auroc"])
    marked = exact[exact["reference"]]
    assert {f"{l}.{h}" for l, h in zip(marked["layer"], marked["head"])} == {"1.0", "2.3"}
    assert set(result.naive_check) == {"id_retrieval", "id_selection", "feature_retrieval"}
    for check in result.naive_check.values():
        assert check["max_abs_difference"] < 1e-4 and len(check["heads"]) == 4
    assert {"1.0", "2.3"} <= set(result.naive_check["id_selection"]["heads"])
    arms = {a["arm"] for a in result.ablation}
    assert arms == {"clean", "top", "random", "random_same_layers", "bottom"}
    top = next(a for a in result.ablation if a["arm"] == "top")["heads"].split()
    for a in result.ablation:
        if a["arm"] == "random":
            assert not set(a["heads"].split()) & set(top)
    matched = [a for a in result.ablation if a["arm"] == "random_same_layers"]
    assert len(matched) == 2  # one per seed, drawn from the top heads' own layers
    for a in matched:
        assert not set(a["heads"].split()) & set(top)
        assert [h.split(".")[0] for h in a["heads"].split()] == [h.split(".")[0] for h in top]
    summary = result.ablation_summary()["zero"]
    assert summary["random_same_layers"] == pytest.approx(np.mean([a["accuracy"] for a in matched]))
    assert {p["target"] for p in result.probes} == {"cell", "colour", "shape"}
    assert {p["head"] for p in result.probes} == {"1.0", "2.3"}
    assert result.edit and {r["arm"] for r in result.edit} == {"edit", "control", "random_direction"}
    edit = result.edit_summary()
    control, random = (next(r for r in result.edit if r["heads"] == "1.0 2.3" and r["arm"] == arm
                            and r["alpha"] == edit["alpha"]) for arm in ("control", "random_direction"))
    assert edit["random_control"] == random["efficacy"]
    # the chance rate of the control: its answers that name a described object, over the described objects
    assert edit["control_described"] == control["described"] and 0 <= control["described"] <= 1
    assert edit["control_chance"] == pytest.approx(control["described"] / (result.params["n_objects"] - 1))
    assert (out / "validation.html").is_file()


@pytest.mark.parametrize("argv, match", [
    (["--heads", "id_selection=9.0"], "do not exist"),
    (["--heads", "id_selection"], "CONDITION=L.H"),
    (["--heads", "counting=1.0"], "not the conditions validated here"),
    (["--reference", "organism-p2a"], "lists no planted heads"),
    (["--reference", "/nonexistent/model"], "no training record"),
    (["--methods", "exact,magic"], "not among"),
    (["--methods", "naive"], "add exact"),
    (["--alpha", "1,x"], "comma-separated numbers"),
])
def test_bad_references_exit_2_with_a_named_reason(tmp_path, capsys, argv, match):
    code = main(["validate", "--model", "tiny-qwen2_5_vl", *argv, "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert code == 2 and match in err, err
    assert not (tmp_path / "v" / "validation.json").exists()


def test_recorded_planted_reads_a_training_record(tmp_path):
    (tmp_path / "vlmbind_training.json").write_text(json.dumps({"planted": {"id_selection": ["2.1"]}}))
    assert recorded_planted(str(tmp_path)) == {"id_selection": ["2.1"]}
    with pytest.raises(vb.InputError, match="no training record"):
        recorded_planted(str(tmp_path / "missing"))


GROUND_TRUTH = Path(__file__).resolve().parents[2] / "circuits" / "ground_truth"


def _ground_truth():
    """circuits/ground_truth/run.py, the runner, as a module (its ``tables`` is the circuit's tables.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ground_truth_run", GROUND_TRUTH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ground_truth_table_is_the_saved_validations():
    """results/table.csv, which the README's validation tables are drawn from, is what the runner's validate part
    makes of each model's saved validation (its --reuse path), and agrees with each validation.json."""
    run = _ground_truth()
    results = GROUND_TRUTH / "results"
    rows = [r for model in run.PARTS["validate"].models for r in run.headline(ValidationResult.load(results / model))]
    assert pd.DataFrame(rows).to_csv(index=False) == (results / "table.csv").read_text()
    table = run.tables.read_table(results / "table.csv")
    saved_rows = json.loads((results / "table.json").read_text())["rows"]
    assert len(saved_rows) == len(table) and saved_rows[0]["model"] == table.iloc[0]["model"]
    for model in table["model"].unique():
        saved = ValidationResult.load(results / model)
        exact = [r for r in saved.methods if r["method"] == "exact"]
        rows = table[(table["model"] == model) & (table["part"] == "mediation") & (table["method"] == "exact")]
        assert len(rows) == len(exact)
        for r, (_, row) in zip(exact, rows.iterrows()):
            assert row["condition"] == r["condition"] and row["top_heads"] == " ".join(r["top_heads"])
            if r["auroc"] is not None:
                assert row["auroc"] == pytest.approx(r["auroc"])


def vsm_heads(result: ValidationResult) -> int:
    """How many heads the result ranks (the last rank)."""
    return len({(r["layer"], r["head"]) for r in result.scores})


def test_the_ground_truth_results_back_what_its_readme_says():
    """circuits/ground_truth/README.md's prose, against the saved results it is drawn from."""
    results = GROUND_TRUTH / "results"
    vsm = ValidationResult.load(results / "organism-vsm")
    twin = ValidationResult.load(results / "organism-vsm-natural")
    assert vsm.heads == recorded_planted("organism-vsm") and vsm_heads(vsm) == 28
    rows = {(r["condition"], r["method"]): r for r in vsm.methods}
    for condition in ("id_retrieval", "id_selection", "feature_retrieval"):  # exact and IG: every planted head top-k
        for method in ("exact", "integrated_gradients"):
            assert rows[(condition, method)]["recall_at_k"] == 1.0 and rows[(condition, method)]["auroc"] == 1.0
    ratios = {m: min(rows[(c, m)]["ratio"] for c in ("id_retrieval", "id_selection", "feature_retrieval"))
              for m in ("exact", "integrated_gradients")}
    assert (int(ratios["exact"]), round(ratios["integrated_gradients"], 2)) == (26, 8.39)  # "at least 26 times"
    assert rows[("feature_retrieval", "exact")]["ratio"] == ratios["exact"]  # "the smallest, 26.03, is 5.2's"
    assert rows[("feature_retrieval", "integrated_gradients")]["ratio"] == ratios["integrated_gradients"]
    # "finds 5.2 and 1.0 but ranks the ID-selection heads 26th and 28th of 28, with negative scores"
    assert rows[("id_retrieval", "attribution")]["planted_ranks"] == [1]
    assert rows[("id_selection", "attribution")]["planted_ranks"] == [26, 28]
    assert rows[("id_selection", "attribution")]["planted_min"] < 0
    assert rows[("feature_retrieval", "attribution")]["planted_ranks"] == [1]
    assert all(c["max_abs_difference"] < 1e-3 for c in vsm.naive_check.values())
    score = {(r["layer"], r["head"]): r["score"] for r in vsm.scores
             if r["condition"] == "id_selection" and r["method"] == "exact"}
    assert round(score[(2, 3)], 1) == 18.1 and round(score[(3, 1)], 1) == 17.9  # "2.3 ... +18.1 logits, 3.1 +17.9"
    arms = vsm.ablation_summary()
    assert set(arms) == {"image_attention", "zero", "mean", "role_mean"}
    tops = [a["top"] for a in arms.values()]
    assert (round(min(tops), 2), round(max(tops), 2)) == (0.0, 0.02) and all(a["bottom"] >= 0.9 for a in arms.values())
    quoted = {"image_attention": (0.97, 0.86), "role_mean": (0.95, 0.84), "zero": (0.95, 0.86), "mean": (0.94, 0.88)}
    assert {m: (round(a["random"], 2), round(a["random_min"], 2)) for m, a in arms.items()} == quoted
    assert {a["heads"] for a in vsm.ablation if a["arm"] == "random"
            and a["accuracy"] == arms[a["mode"]]["random_min"]} == {"2.1 3.0 4.1 2.0"}  # the lowest in every mode
    # "drawn from the planted heads' own layers ... 0.93 in every mode"; the low same-layer draws take 2.1
    assert {round(a["random_same_layers"], 2) for a in arms.values()} == {0.93}
    lowest = [a for a in vsm.ablation if a["arm"] == "random_same_layers" and a["accuracy"] < 0.9]
    assert lowest and all("2.1" in a["heads"].split() for a in lowest)
    # the twin: its lowest draw takes two layer-0 heads and fails under zero, mean and role_mean; same layers 1.00
    twin_arms = twin.ablation_summary()
    failing = {a["mode"]: a["accuracy"] for a in twin.ablation if a["arm"] == "random"
               and a["heads"] == "6.1 3.1 0.2 0.3"}
    assert {m: round(v, 2) for m, v in failing.items()} == {"image_attention": 0.98, "zero": 0.67, "mean": 0.66,
                                                            "role_mean": 0.5}
    assert all(failing[m] == twin_arms[m]["random_min"] for m in ("zero", "mean", "role_mean"))
    assert all(a["random_same_layers_min"] == 1.0 for a in twin_arms.values())
    probes = {(p["head"], p["target"]): p["accuracy"] for p in vsm.probes}
    chance = {(p["head"], p["target"]): p["chance"] for p in vsm.probes}
    assert probes[("3.1", "cell")] == 1.0 and probes[("2.3", "cell")] < chance[("2.3", "cell")]
    assert min(probes[("5.2", t)] for t in ("colour", "shape")) == 1.0
    twin_probes = {(p["head"], p["target"]): p["accuracy"] for p in twin.probes}
    assert all(twin_probes[(h, "cell")] <= 0.1 for h in ("1.0", "2.3", "3.1", "5.2"))
    assert [round(twin_probes[("2.3", t)], 2) for t in ("colour", "shape")] == [1.0, 0.84]
    twin_rows = {(r["condition"], r["method"]): r for r in twin.methods}
    assert twin_rows[("id_retrieval", "exact")]["unplanted_max_abs"] < 0.0005  # "0.000 for id_retrieval"
    assert round(twin_rows[("id_selection", "exact")]["unplanted_max_abs"], 3) == 0.093  # "at most 0.093 logits"
    assert twin_rows[("feature_retrieval", "exact")]["top_heads"][0] == "2.3"
    twin_score = max(r["score"] for r in twin.scores
                     if r["condition"] == "feature_retrieval" and r["method"] == "exact")
    assert round(twin_score, 3) == 7.871
    # the edit: every reference ID-selection head together, then each alone
    assert vsm.edit_heads() == ["2.3 3.1", "2.3", "3.1"] and vsm.params["edit_positions"] == "answer"
    quoted = {"2.3 3.1": (1, 0.98, 0.14, 0.17, 0.03), "2.3": (8, 0.61, 0.27, 0.29, 0.08),
              "3.1": (2, 0.98, 0.28, 0.26, 0.06)}
    for heads, (alpha, efficacy, control, chance, random) in quoted.items():
        best = vsm.edit_summary(heads)
        assert (best["alpha"], round(best["efficacy"], 2), round(best["control"], 2),
                round(best["control_chance"], 2), round(best["random_control"], 2)) == \
            (alpha, efficacy, control, chance, random)
    assert all(twin.edit_summary(h)["efficacy"] == 0 for h in twin.edit_heads())

    document = json.loads((results / "interchange.json").read_text())
    planted = next(r for r in document["results"] if r["model"] == "organism-vsm")["variables"]
    low = {v: min(x["interchange_accuracy"] for x in planted[v]["settings"]) for v in planted}
    assert round(min(low.values()), 2) == 0.95 and min(low, key=low.get) == "id_retrieval"  # "0.95-1.00"
    lowest = [(x["objects"], x["entropy"]) for x in planted["id_retrieval"]["settings"]
              if x["interchange_accuracy"] == low["id_retrieval"]]
    assert lowest == [(3, "high"), (4, "high")]  # "at three and four high-entropy objects"
    alone = [x["alone"][h] for x in planted["id_selection"]["settings"] for h in ("2.3", "3.1")]
    assert round(min(alone), 2) == 0.95  # "each ID-selection head interchanged alone does too"
    assert all(planted[v]["unplanted_heads_above_0.02"] == [] for v in planted)  # strictness holds
    worst = max(planted, key=lambda v: planted[v]["unplanted_changes_max"])
    assert worst == "feature_retrieval" and planted[worst]["unplanted_changes_max"] * 384 == pytest.approx(1)
    assert max(planted[worst]["unplanted_changes"], key=planted[worst]["unplanted_changes"].get) == "0.0"


def test_single_head_ablation_is_saved_as_the_readme_says():
    """single_heads.json agrees with the validation's clean accuracy, a head re-measured on the runner's scenes gives
    the saved figure, and what the README says of it holds."""
    results = GROUND_TRUTH / "results"
    runner = _ground_truth()
    saved = json.loads((results / "single_heads.json").read_text())
    vsm, twin = (next(r for r in saved["results"] if r["model"] == m) for m in ("organism-vsm", "organism-vsm-natural"))
    clean = ValidationResult.load(results / "organism-vsm").ablation_summary()["zero"]["clean"]
    assert vsm["clean"] == clean and vsm["n"] == 64
    zero, image = vsm["modes"]["zero"], vsm["modes"]["image_attention"]
    # "1.0, 2.3 and 5.2 are each needed alone (0.00 of the answers under zero), 3.1 less (0.77)"
    assert [round(zero[h], 2) for h in ("1.0", "2.3", "5.2", "3.1")] == [0.0, 0.0, 0.0, 0.77]
    assert [round(m["2.1"], 2) for m in (zero, image)] == [0.83, 0.83]  # "2.1 (0.83 in both modes)"
    planted = {h for heads in vsm["planted"].values() for h in heads}
    assert [h for mode in (zero, image) for h, a in mode.items() if h not in planted and a < 0.9] == ["2.1", "2.1"]
    assert all(a >= 0.9 for mode in twin["modes"].values() for a in mode.values())  # "no single head is needed"
    vlm = shared_organism("organism-vsm")
    scenes = runner.validation_scenes(vlm, vsm["n"], vsm["seed"])
    with vlm.ablate([(2, 1)], mode="zero"):
        assert vb.evaluate(vlm, scenes).accuracy == zero["2.1"] < 1


def test_scene_accuracy_is_saved_as_the_readme_shows():
    """scene_accuracy.json: organism-vsm does the task in every setting, and one setting re-measured on the runner's
    scenes gives the saved figure."""
    runner = _ground_truth()
    saved = json.loads((GROUND_TRUTH / "results" / "scene_accuracy.json").read_text())
    vsm = next(r for r in saved["results"] if r["model"] == "organism-vsm")
    assert len(vsm["settings"]) == 6 and round(min(x["accuracy"] for x in vsm["settings"]), 2) == 0.99  # "0.99-1.00"
    assert all(x["n"] == 128 for x in vsm["settings"])
    vlm = shared_organism("organism-vsm")
    held_out = next(x for x in vsm["settings"] if (x["objects"], x["entropy"]) == (3, "high"))
    scenes = runner.setting_scenes(vlm, held_out["n"], vsm["seed"], 3, "high")
    assert vb.evaluate(vlm, scenes).accuracy == held_out["accuracy"]
    with vlm.ablate([(5, 2)], mode="zero"):  # the measurement can fall: without the feature-retrieval head it does
        assert vb.evaluate(vlm, scenes).accuracy < held_out["accuracy"]


def test_the_runner_writes_a_part_elsewhere_as_it_saved_it(tmp_path):
    """A part run with a smaller n into another folder writes the saved file's layout and records the command that
    gives it, and leaves the README alone."""
    runner = _ground_truth()
    readme = (GROUND_TRUTH / "README.md").read_text()
    assert runner.main(["--parts", "scene_accuracy", "--models", "organism-vsm", "--n", "8", "--out",
                        str(tmp_path)]) == 0
    quick = json.loads((tmp_path / "scene_accuracy.json").read_text())
    saved = json.loads((GROUND_TRUTH / "results" / "scene_accuracy.json").read_text())
    assert quick["command"] == "python circuits/ground_truth/run.py --parts scene_accuracy --models organism-vsm --n 8"
    assert saved["command"] == "python circuits/ground_truth/run.py --parts scene_accuracy"
    assert list(quick) == list(saved) and list(quick["results"][0]) == list(saved["results"][0])
    assert [(x["objects"], x["entropy"], x["n"]) for x in quick["results"][0]["settings"]] == \
        [(x["objects"], x["entropy"], 8) for x in saved["results"][0]["settings"]]
    assert (GROUND_TRUTH / "README.md").read_text() == readme
    with pytest.raises(SystemExit):
        runner.main(["--parts", "scene_accuracy,nonsense", "--out", str(tmp_path)])


def test_random_k_draws_give_the_saved_draw_again(tmp_path):
    """The runner's random_k_draws part, one draw in one mode: the same heads and accuracy as the saved first draw,
    and the planted heads ablated together as saved."""
    runner = _ground_truth()
    saved = json.loads((GROUND_TRUTH / "results" / "random_k_draws.json").read_text())
    part = runner.PARTS["random_k_draws"]
    runner.run_random_k_draws(runner.Run(models=list(part.models), n=part.n, seed=part.seed, out=tmp_path,
                                         command="test"), draws=1, modes=("zero",))
    again = json.loads((tmp_path / "random_k_draws.json").read_text())
    assert again["scenes"] == saved["scenes"] and again["planted"] == saved["planted"]
    assert again["modes"]["zero"]["draws"] == saved["modes"]["zero"]["draws"][:1]
    assert again["modes"]["zero"]["top"] == saved["modes"]["zero"]["top"]


def test_the_report_opening_shows_the_saved_validation_with_the_edit_controls_chance():
    """The report's validation section, drawn from organism-vsm's saved validation: every edit head set with its
    control and the control's chance rate, and the ablation table with the random arm from the top-k's layers."""
    from vlmbind.app.report import validation_sections

    result = ValidationResult.load(GROUND_TRUTH / "results" / "organism-vsm")
    page = validation_sections(result, "organism-p2a")
    for heads in result.edit_heads():
        edit = result.edit_summary(heads)
        assert (f"at {heads}: efficacy {edit['efficacy']:.2f} at alpha {edit['alpha']:g}, against "
                f"{edit['control']:.2f} for the empty-cell control, {edit['control_chance']:.2f} of it expected by "
                "chance") in page
    assert "random_same_layers" in page and f"{result.ablation_summary()['mean']['random_same_layers']:.3f}" in page


def test_answer_changes_by_position_matches_hand_built_masks():
    """``answer_changes(positions=image|text|last)`` equals the share computed with a mask built by hand here (image
    tokens, the prompt's other tokens, the last prompt token) for two layer-0 heads and the planted feature-retrieval
    head (whose shares lie between 0 and 1, so the comparison bites), and bad positions are named."""
    import torch

    from vlmbind.core.errors import TrainingError
    from vlmbind.organisms.data import IGNORE_INDEX, BatchBuilder
    from vlmbind.organisms.siit.evaluation import answer_changes
    from vlmbind.organisms.siit.interchange import HeadInterchange, interchange_logits
    from vlmbind.organisms.siit.pairs import interchange_batch

    runner = _ground_truth()
    vlm = shared_organism("organism-vsm")
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    pairs = [p for objects, entropy in runner.tables.SETTINGS
             for p in runner.setting_pairs(vlm, "feature_retrieval", 16, 3000, objects, entropy)]
    batch = interchange_batch(builder, pairs, "clean")
    ids, prompt = batch.base.inputs["input_ids"], batch.prompt_mask
    last = torch.zeros_like(prompt)
    for row in range(len(pairs)):
        last[row, int(torch.nonzero(prompt[row]).max())] = True
    masks = {"image": prompt & (ids == builder.image_token_id), "text": prompt & (ids != builder.image_token_id),
             "last": last}
    with torch.no_grad():
        plain = vlm.model(**batch.base.inputs, use_cache=False).logits[:, :-1].argmax(-1)
        answer = batch.base.labels[:, 1:] != IGNORE_INDEX
        shares = []
        for head in ("0.0", "0.1", vlm.training["planted"]["feature_retrieval"][0]):
            l, h = (int(x) for x in head.split("."))
            for where, mask in masks.items():
                patched = interchange_logits(vlm.model, interchange, batch, [(l, h)], mask)[:, :-1].argmax(-1)
                by_hand = float(np.mean(((plain != patched) & answer).any(1).tolist()))
                measured = answer_changes(vlm.model, interchange, builder, pairs, [(l, h)], positions=where,
                                          batch_size=len(pairs))
                assert measured == by_hand, (head, where, measured)
                shares.append(measured)
    assert any(0 < share < 1 for share in shares) and 0.0 in shares  # a share between 0 and 1, and an inert head
    with pytest.raises(TrainingError, match="positions must be one of"):
        answer_changes(vlm.model, interchange, builder, pairs[:2], [(0, 1)], positions="images")


def test_the_best_edit_is_never_the_unedited_alpha_0():
    """The edit summary picks the alpha with the highest efficacy among the edited ones: alpha 0 adds nothing, so
    its efficacy (answers that already name the object at t) can top every real edit and must still never be
    reported as the best edit. Here alpha 0 scores 0.9, alphas 1 and 2 score 0.5 and 0.7: the best is 2."""
    def rows(heads, efficacies):
        return [{"heads": heads, "alpha": alpha, "arm": arm, "efficacy": eff if arm == "edit" else eff / 4,
                 "described": 0.4, "n": 20}
                for alpha, eff in efficacies.items() for arm in ("edit", "control", "random_direction")]

    result = ValidationResult(model="m", reference="given", heads={"id_selection": ["1.0", "2.3"]},
                              edit=[*rows("1.0 2.3", {0.0: 0.9, 1.0: 0.5, 2.0: 0.7}),
                                    *rows("1.0", {0.0: 0.0, 1.0: 0.0, 2.0: 0.0})],
                              params={"n_objects": 3})
    best = result.edit_summary()
    assert (best["alpha"], best["efficacy"], best["control"], best["random_control"]) == (2.0, 0.7, 0.7 / 4, 0.7 / 4)
    assert best["control_chance"] == pytest.approx(0.4 / 2)
    assert result.edit_summary("1.0")["alpha"] == 1.0  # all tied at 0: the first edited alpha, not 0
