"""``vlmbind validate``: the rank metrics are the closed-form ones, naive equals exact on the sampled heads, the result
round-trips through its files, and bad reference heads are named errors (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

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
    (["--heads", "counting=1.0"], "not scene conditions"),
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


def _ground_truth_script(name: str = "run"):
    """A script of circuits/ground_truth/ as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "circuits" / "ground_truth" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ground_truth_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_show_the_saved_ground_truth_table():
    """The tables in circuits/ground_truth/README.md and the project README are the ones drawn from the committed
    results/table.csv (no number typed by hand), and that table agrees with each model's validation.json."""
    run = _ground_truth_script()
    results = run.HERE / "results"
    table = run.read_table(results / "table.csv")
    text = (run.HERE / "README.md").read_text()
    assert run.BEGIN + "\n" + run.markdown_tables(table) + "\n" + run.END in text
    root = (run.HERE.parent.parent / "README.md").read_text()
    assert run.ROOT_BEGIN + "\n" + run.summary_table(table) + "\n" + run.ROOT_END in root
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
    from pathlib import Path

    results = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results"
    vsm = ValidationResult.load(results / "organism-vsm")
    twin = ValidationResult.load(results / "organism-vsm-natural")
    assert vsm.heads == recorded_planted("organism-vsm") and vsm_heads(vsm) == 28
    rows = {(r["condition"], r["method"]): r for r in vsm.methods}
    for condition in ("id_retrieval", "id_selection", "feature_retrieval"):  # exact and IG: every planted head top-k
        for method in ("exact", "integrated_gradients"):
            assert rows[(condition, method)]["recall_at_k"] == 1.0 and rows[(condition, method)]["auroc"] == 1.0
    ratios = {m: min(rows[(c, m)]["ratio"] for c in ("id_retrieval", "id_selection", "feature_retrieval"))
              for m in ("exact", "integrated_gradients")}
    assert (int(ratios["exact"]), round(ratios["integrated_gradients"], 1)) == (26, 8.4)  # "at least 26 times", "8.4"
    assert rows[("feature_retrieval", "exact")]["ratio"] == ratios["exact"]  # "the smallest is 5.2's"
    assert rows[("feature_retrieval", "integrated_gradients")]["ratio"] == ratios["integrated_gradients"]
    # "finds 5.2 and 1.0 but ranks the ID-selection heads 26th and 28th of 28, with negative scores"
    assert rows[("id_retrieval", "attribution")]["planted_ranks"] == [1]
    assert rows[("id_selection", "attribution")]["planted_ranks"] == [26, 28]
    assert rows[("id_selection", "attribution")]["planted_min"] < 0
    assert rows[("feature_retrieval", "attribution")]["planted_ranks"] == [1]
    stage11 = ValidationResult.load(results / "organism-vsm_training" / "stage-11" / "organism-vsm")
    assert {(r["condition"], r["method"]): r for r in stage11.methods}[("id_retrieval", "attribution")][
        "planted_ranks"] == [28]  # "on the eleven-stage release it ranked 1.0 last too"
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
    # "0.93 in every mode (lowest 0.80-0.81, the draws that take 2.1)"; twin 1.00
    matched = [(round(a["random_same_layers"], 2), round(a["random_same_layers_min"], 2)) for a in arms.values()]
    assert {m for m, _ in matched} == {0.93} and (min(w for _, w in matched), max(w for _, w in matched)) == (0.8, 0.81)
    lowest = [a for a in vsm.ablation if a["arm"] == "random_same_layers" and a["accuracy"] < 0.9]
    assert lowest and all("2.1" in a["heads"].split() for a in lowest)
    assert all(a["random_same_layers_min"] == 1.0 for a in twin.ablation_summary().values())
    stage11_arms = stage11.ablation_summary()  # "0.84 and 0.62 on average on the eleven-stage release, lowest 0.42, 0.19"
    assert [(round(stage11_arms[m]["random"], 2), round(stage11_arms[m]["random_min"], 2)) for m in ("zero", "mean")] \
        == [(0.84, 0.42), (0.62, 0.19)]
    # the twin: the draw with two layer-0 heads fails under zero, mean and role_mean; every other draw 0.86-1.00
    twin_random = [a for a in twin.ablation if a["arm"] == "random"]
    failing = [a for a in twin_random if a["heads"] == "6.1 3.1 0.2 0.3"]
    assert {a["mode"]: round(a["accuracy"], 2) for a in failing} == \
        {"image_attention": 0.98, "zero": 0.67, "mean": 0.66, "role_mean": 0.5}
    others = [a["accuracy"] for a in twin_random if a not in failing]
    assert (round(min(others), 2), max(others)) == (0.86, 1.0)
    probes = {(p["head"], p["target"]): p["accuracy"] for p in vsm.probes}
    assert probes[("3.1", "cell")] == 1.0 and probes[("2.3", "cell")] <= 0.05
    assert min(probes[("5.2", t)] for t in ("colour", "shape")) == 1.0
    twin_probes = {(p["head"], p["target"]): p["accuracy"] for p in twin.probes}
    assert all(twin_probes[(h, "cell")] <= 0.1 for h in ("1.0", "2.3", "3.1", "5.2"))
    assert [round(twin_probes[("2.3", t)], 2) for t in ("colour", "shape")] == [1.0, 0.84]
    twin_rows = {(r["condition"], r["method"]): r for r in twin.methods}
    assert twin_rows[("id_retrieval", "exact")]["unplanted_max_abs"] < 0.0005  # "every id_retrieval score is 0.000"
    assert round(twin_rows[("id_selection", "exact")]["unplanted_max_abs"], 2) == 0.09  # "at most 0.09 logits"
    assert twin_rows[("feature_retrieval", "exact")]["top_heads"][0] == "2.3"
    twin_score = max(r["score"] for r in twin.scores if r["condition"] == "feature_retrieval" and r["method"] == "exact")
    assert round(twin_score, 1) == 7.9
    # the edit: every reference ID-selection head together, then each alone
    assert vsm.edit_heads() == ["2.3 3.1", "2.3", "3.1"] and vsm.params["edit_positions"] == "answer"
    quoted = {"2.3 3.1": (1, 0.98, 0.14, 0.17, 0.03), "2.3": (8, 0.61, 0.27, 0.29, 0.08),
              "3.1": (2, 0.98, 0.28, 0.26, 0.06)}
    for heads, (alpha, efficacy, control, chance, random) in quoted.items():
        best = vsm.edit_summary(heads)
        assert (best["alpha"], round(best["efficacy"], 2), round(best["control"], 2),
                round(best["control_chance"], 2), round(best["random_control"], 2)) == \
            (alpha, efficacy, control, chance, random)
    assert [round(r["efficacy"], 2) for r in vsm.edit if r["heads"] == "3.1" and r["arm"] == "edit"
            and r["alpha"] == 1.0] == [0.97]  # "0.97 at alpha 1 and 0.98 at alpha 2"
    best = stage11.edit_summary("3.1")  # docs/ground_truth.md on the eleven-stage release's control
    assert round(best["control"] * 64) == 10 and round(best["control_described"] * 64) == 19  # "10 of the 19"
    both = stage11.edit_summary()
    assert round(both["control"] * 64) == 11 and round(both["control_described"] * 64) == 20  # "11 of 20"
    # "at the best alpha it names the target on 0.00 ... at both ID-selection heads and at 3.1 alone (0.08 at 2.3)"
    assert [round(stage11.edit_summary(h)["random_control"], 2) for h in ("2.3 3.1", "3.1", "2.3")] == [0.0, 0.0, 0.08]
    assert all(vsm.edit_summary(h) == vsm.edit_summary() if h == "2.3 3.1" else True for h in vsm.edit_heads())
    assert all(twin.edit_summary(h)["efficacy"] == 0 for h in twin.edit_heads())
    stage5 = ValidationResult.load(results / "organism-vsm_training" / "stage-5" / "organism-vsm")
    old = stage5.edit_summary()  # "reached 1.00 at alpha 1 with a control of 0.09"
    assert (old["alpha"], old["efficacy"], round(old["control"], 2)) == (1.0, 1.0, 0.09)
    assert {(r["condition"], r["method"]): r for r in stage5.methods}[("id_selection", "attribution")][
        "planted_ranks"] == [vsm_heads(stage5)]

    runner = _ground_truth_script("interchange")
    document = json.loads((results / "interchange.json").read_text())
    readme = (results.parent / "README.md").read_text()
    assert runner.BEGIN + "\n" + runner.markdown(document) + "\n" + runner.END in readme
    planted = next(r for r in document["results"] if r["model"] == "organism-vsm")["variables"]
    low = {v: min(x["interchange_accuracy"] for x in planted[v]["settings"]) for v in planted}
    assert round(min(low.values()), 2) == 0.95 and min(low, key=low.get) == "id_retrieval"  # "0.95-1.00"
    lowest = [(x["objects"], x["entropy"]) for x in planted["id_retrieval"]["settings"]
              if x["interchange_accuracy"] == low["id_retrieval"]]
    assert lowest == [(3, "high"), (4, "high")]  # "at three and four high-entropy objects"
    before = json.loads((results / "organism-vsm_training" / "stage-11" / "interchange.json").read_text())
    before = next(r for r in before["results"] if r["model"] == "organism-vsm")["variables"]
    assert round(min(x["interchange_accuracy"] for v in before.values() for x in v["settings"]), 2) == 0.98
    assert runner.ALONE_BEGIN + "\n" + runner.alone_markdown(document) + "\n" + runner.ALONE_END in readme
    alone = [x["alone"][h] for x in planted["id_selection"]["settings"] for h in ("2.3", "3.1")]
    assert round(min(alone), 2) == 0.95  # "each ID-selection head interchanged alone too (0.95-1.00)"
    assert all(planted[v]["unplanted_heads_above_0.02"] == [] for v in planted)  # strictness holds
    worst = max(planted, key=lambda v: planted[v]["unplanted_changes_max"])
    assert worst == "feature_retrieval" and planted[worst]["unplanted_changes_max"] * 384 == pytest.approx(1)
    assert max(planted[worst]["unplanted_changes"], key=planted[worst]["unplanted_changes"].get) == "0.0"
    assert all(planted[v]["unplanted_changes"][h] == 0 for v in planted for h in ("0.2", "0.3"))


def test_single_head_ablation_is_saved_as_the_readme_says():
    """single_heads.json: the README's table is drawn from it, it agrees with the validation's clean accuracy, a head
    re-measured here gives the saved figure, and what the README says of it holds."""
    from pathlib import Path

    results = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results"
    runner = _ground_truth_script("single_heads")
    saved = json.loads((results / "single_heads.json").read_text())
    readme = (results.parent / "README.md").read_text()
    assert runner.BEGIN + "\n" + runner.markdown(saved) + "\n" + runner.END in readme
    vsm, twin = (next(r for r in saved["results"] if r["model"] == m) for m in ("organism-vsm", "organism-vsm-natural"))
    clean = ValidationResult.load(results / "organism-vsm").ablation_summary()["zero"]["clean"]
    assert vsm["clean"] == clean and vsm["n"] == 64
    zero, image = vsm["modes"]["zero"], vsm["modes"]["image_attention"]
    # "1.0, 2.3 and 5.2 leave 0.00 of the answers under zero, 3.1 0.77"
    assert [round(zero[h], 2) for h in ("1.0", "2.3", "5.2", "3.1")] == [0.0, 0.0, 0.0, 0.77]
    assert [round(m["2.1"], 2) for m in (zero, image)] == [0.83, 0.83]  # "2.1 (0.83 in both modes)"
    planted = {h for heads in vsm["planted"].values() for h in heads}
    assert [h for mode in (zero, image) for h, a in mode.items() if h not in planted and a < 0.9] == ["2.1", "2.1"]
    stage11 = json.loads((results / "organism-vsm_training" / "stage-11" / "single_heads.json").read_text())
    before = next(r for r in stage11["results"] if r["model"] == "organism-vsm")["modes"]["zero"]
    assert [round(before[h], 2) for h in ("0.2", "0.3")] == [0.48, 0.36]  # layer-0 heads needed before stage 12
    assert all(a >= 0.9 for mode in twin["modes"].values() for a in mode.values())  # "no single head is needed"
    vlm = vb.load("organism-vsm")
    scenes = list(runner.scene_description(64, saved["results"][0]["seed"] + 2, **runner.training_defaults(
        vlm, "scene", {"n_objects": runner.held_out_objects(vlm), "entropy": "high"})))
    with vlm.ablate([(2, 1)], mode="zero"):
        assert vb.evaluate(vlm, scenes).accuracy == zero["2.1"] < 1


def test_scene_accuracy_is_saved_as_the_readme_shows():
    """scene_accuracy.json: the README's table is drawn from it, organism-vsm does the task in every setting (the
    issue asks >= 0.97), and one setting re-measured here gives the saved figure."""
    from pathlib import Path

    results = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results"
    runner = _ground_truth_script("scene_accuracy")
    saved = json.loads((results / "scene_accuracy.json").read_text())
    readme = (results.parent / "README.md").read_text()
    assert runner.BEGIN + "\n" + runner.markdown(saved) + "\n" + runner.END in readme
    vsm = next(r for r in saved["results"] if r["model"] == "organism-vsm")
    assert len(vsm["settings"]) == 6 and round(min(x["accuracy"] for x in vsm["settings"]), 2) == 0.99  # "0.99-1.00"
    assert all(x["n"] == 128 for x in vsm["settings"])
    vlm = vb.load("organism-vsm")
    held_out = next(x for x in vsm["settings"] if (x["objects"], x["entropy"]) == (3, "high"))
    kwargs = runner.training_defaults(vlm, "scene", {"n_objects": 3, "entropy": "high"})
    scenes = runner.scene_description(held_out["n"], vsm["seed"] + 7 * 3, **kwargs)
    assert vb.evaluate(vlm, scenes).accuracy == held_out["accuracy"]
    with vlm.ablate([(5, 2)], mode="zero"):  # the measurement can fall: without the feature-retrieval head it does
        assert vb.evaluate(vlm, scenes).accuracy < held_out["accuracy"]


def test_the_strictness_breakers_of_stage_5_acted_through_the_selection_as_saved():
    """The stage-5 record (results/organism-vsm_training/stage-5/): selection_inputs.json's heads are that interchange
    table's strictness breakers, with its changed shares; the README shows its table; and it says what the docs say:
    where a layer-0 head changed the answer, 2.1 stopped attending to the missing object and the new colour was a
    described object's, never a colour only the source had. Re-measured on the shipped organism for head 0.0 (which
    changes one answer of 384 there), the script's pairs give the shipped interchange table's share (the two
    scripts' pairs agree)."""
    from pathlib import Path

    results = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results"
    stage5 = results / "organism-vsm_training" / "stage-5"
    runner = _ground_truth_script("selection_inputs")
    saved = json.loads((stage5 / "selection_inputs.json").read_text())
    table = next(r for r in json.loads((stage5 / "interchange.json").read_text())["results"]
                 if r["model"] == "organism-vsm")["variables"]["feature_retrieval"]
    assert sorted(saved["heads"]) == table["unplanted_heads_above_0.02"] == ["0.0", "0.1"]
    for head, entry in saved["heads"].items():
        assert entry["changed"] == pytest.approx(table["unplanted_changes"][head], abs=1e-12)
        assert entry["patched_colour"]["source_colour"] == 0
        assert entry["patched_colour"]["described_colour"] >= 0.6 * entry["n_changed"]
        for reader in ("2.1", "4.2"):
            changed, unchanged = (entry["attention_on_missing"][reader][g] for g in ("changed", "unchanged"))
            assert changed["plain"] > 0.85 and changed["patched"] < 0.3 and unchanged["patched"] > 0.85
    readme = (results.parent / "README.md").read_text()
    assert runner.BEGIN + "\n" + runner.markdown(saved) + "\n" + runner.END in readme
    shipped = next(r for r in json.loads((results / "interchange.json").read_text())["results"]
                   if r["model"] == "organism-vsm")["variables"]["feature_retrieval"]
    again = runner.measure("organism-vsm", ["0.0"], recorded_planted("organism-vsm"), saved["n_pairs"] // 6,
                           saved["seed"])
    assert again["heads"]["0.0"]["n_changed"] == round(shipped["unplanted_changes"]["0.0"] * 384) == 1


def test_the_id_retrieval_attempts_record_what_the_docs_say():
    """docs/ground_truth.md on the two id_retrieval attempts, against their saved curves: the parts took, the
    interchange accuracy never left ~0, and the patch at the names did not move 2.1's attention."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    first = json.loads((runs / "9-id-retrieval-attempt.json").read_text())
    second = json.loads((runs / "10-interchanged-selection-attempt.json").read_text())
    for run in (first, second):
        assert max(e["siit"]["id_retrieval"]["interchange_accuracy"] for e in run["evals"]) <= 0.05
        after = run["after"]
        for target in ("attention_2.1_on_t", "attention_2.1_on_j"):
            assert abs(after[target]["patched"] - after[target]["unpatched"]) < 0.01
    end = first["evals"][-1]
    assert end["position_code_accuracy"] >= 0.9 and end["aggregation"]["attention_mass"] >= 0.99
    assert round(end["retrieval"]["attention_mass"], 2) == 0.78
    assert first["after"]["attention_2.1_on_t"]["patched"] > 0.99
    assert round(second["evals"][-1]["siit"]["id_selection"]["interchange_accuracy"], 2) == 0.59
    assert round(second["after"]["attention_2.1_on_t"]["patched"], 2) == 0.60
    assert round(second["after"]["attention_2.1_on_j"]["patched"], 2) == 0.22


def test_the_link_by_link_figures_of_the_later_id_retrieval_attempts_are_the_docs():
    """docs/ground_truth.md on attempts 3 and 4 (retrieval_links.py's ``after`` fields and the curves): interchange
    accuracy ~0, 2.1 unmoved by the patch, the layer-0 retrieval head split between lookalikes, and the change that
    reaches the last token."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    third = json.loads((runs / "11-strict-selection-attempt.json").read_text())
    fourth = json.loads((runs / "12-retrieval-readouts-attempt.json").read_text())
    docs = (Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text()
    for run, minutes in ((third, "8.7"), (fourth, "12.9")):
        assert max(e["siit"]["id_retrieval"]["interchange_accuracy"] for e in run["evals"]) <= 0.05
        after = run["after"]
        assert after["n_pairs"] == 64
        for target in ("attention_2.1_on_t", "attention_2.1_on_j"):
            assert abs(after[target]["patched"] - after[target]["unpatched"]) < 0.001
        assert f"{run['wall_time_s'] / 60:.1f}" == minutes and f"({minutes} min)" in docs
    assert third["step"] == 500 and fourth["step"] == 750
    assert [round(third["after"][f"attention_2.1_on_{x}"]["patched"], 2) for x in "tj"] == [0.79, 0.12]
    after, end = fourth["after"], fourth["evals"][-1]
    assert round(end["retrieval"]["accuracy"], 2) == 0.11 and end["aggregation"]["accuracy"] == 0.0
    attention = {k: round(v, 2) for k, v in after["retrieval_attention"].items()}
    assert attention == {"high_first": 0.96, "high_last": 0.94, "low_first": 0.55, "low_last": 0.60}
    assert {k: round(v, 2) for k, v in after["retrieval_attention_on_lookalikes"].items()} == {"first": 0.50,
                                                                                               "last": 0.50}
    assert after["names_with_a_lookalike"] == {"first": 28, "last": 24}
    change = after["relative_change"]
    assert [round(100 * change[k], 1) for k in ("retrieval_output_at_name", "aggregation_output_at_last",
                                                 "residual_into_selection_layer")] == [42.4, 0.7, 0.2]


def test_the_link_runs_are_recorded_as_the_docs_say():
    """docs/ground_truth.md on the link runs: the first link's table rows are their runs' saved figures
    (retrieval_links.py's ``after`` and the training evaluation's readout), and what the docs say of the gathering
    and selection links is what their runs saved."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = (Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| 0.2 (layer 0)") or line.startswith("| 1.0 (a new")]
    assert len(rows) == 3
    for row, name in zip(rows, ("15-retrieval-link-layer0", "16-retrieval-link-layer1",
                                "17-retrieval-link-layer1-last-token")):
        run = json.loads((runs / f"{name}.json").read_text())
        a, cells = run["after"], [c.strip() for c in row.strip("|").split("|")]
        attention, alike = a["retrieval_attention"], a["retrieval_attention_on_lookalikes"]
        last_only = run["config"]["siit"].get("span_positions") == "last"
        first = ("-", "-") if last_only else (f"{attention['high_first']:.2f}", f"{attention['low_first']:.2f}")
        assert cells[2] == f"{run['step']:,} ({run['wall_time_s'] / 60:.1f})"
        assert cells[3] == (f"{first[0]}, {attention['high_last']:.2f} / {first[1]}, {attention['low_last']:.2f}")
        assert cells[4] == f"{alike['last']:.2f} / {alike['last_same_colour']:.2f}"
        assert cells[5] == f"{run['evals'][-1]['retrieval']['accuracy']:.2f}"
        assert a["n_pairs"] == 64 and run["config"]["siit"]["strict_weight"] == 0.0
    layer0, layer1, last = (json.loads((runs / f"{n}.json").read_text())["after"]["retrieval_attention_on_lookalikes"]
                            for n in ("15-retrieval-link-layer0", "16-retrieval-link-layer1",
                                      "17-retrieval-link-layer1-last-token"))
    assert layer0["last"] > 0.4 > layer0["last_same_colour"]  # one word: the one it stands on
    assert layer1["last_same_colour"] > 0.4 > layer1["last"]  # one word: the colour
    assert max(last["last"], last["last_same_colour"]) < 0.1  # both words
    gather = json.loads((runs / "18-gather-link.json").read_text())
    before = json.loads((runs / "17-retrieval-link-layer1-last-token.json").read_text())["after"]["relative_change"]
    after, end = gather["after"], gather["evals"][-1]
    moved = [round(100 * c[k], 1) for c in (before, after["relative_change"])
             for k in ("aggregation_output_at_last", "residual_into_selection_layer")]
    assert moved == [1.9, 0.2, 34.6, 7.2]
    assert f"{gather['wall_time_s'] / 60:.1f} min" in docs and gather["step"] == 1000
    assert round(end["aggregation"]["accuracy"], 2) == 0.06 and round(end["siit"]["id_selection"][
        "interchange_accuracy"], 2) == 0.16
    assert abs(after["attention_3.1_on_t"]["patched"] - after["attention_3.1_on_t"]["unpatched"]) < 0.001
    assert round(after["attention_3.1_on_t"]["patched"], 3) == 0.997
    selection = json.loads((runs / "19-selection-link-attempt.json").read_text())
    after, end = selection["after"], selection["evals"][-1]
    assert f"{selection['wall_time_s'] / 60:.1f} min" in docs and selection["step"] == 800
    assert [round(end["siit"][v]["interchange_accuracy"], 2) for v in ("id_selection", "feature_retrieval",
                                                                       "id_retrieval")] == [0.97, 0.97, 0.0]
    assert round(end["aggregation"]["accuracy"], 2) == 0.12
    assert [round(after["retrieval_attention"][k], 2) for k in ("high_last", "low_last")] == [0.99, 0.95]
    moved = [round(after[f"attention_3.1_on_{x}"][side], 3) for x in "jt" for side in ("unpatched", "patched")]
    assert moved == [0.081, 0.097, 0.841, 0.823] and moved[1] > moved[0]


def test_the_gathering_interchange_runs_are_the_docs_table():
    """docs/ground_truth.md's table of the gathering-interchange runs: every row is its run's saved figures (the last
    training evaluation and retrieval_links.py's ``after``), and the patch at a name now moves the selection."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = (Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text()
    by_number = {path.name.split("-")[0]: path for path in runs.glob("2[0-9]-gathering-*.json")}
    rows = [line for line in docs.splitlines() if line[:5].strip("| ") in by_number and line.count("|") == 12]
    assert len(rows) == len(by_number) >= 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        run = json.loads(by_number[cells[0]].read_text())
        end, after, siit = run["evals"][-1], run["after"], run["evals"][-1]["siit"]
        assert run["config"]["siit"]["gather_interchange_weight"] > 0 and after["n_pairs"] == 64
        expected = [f"{run['config']['lr']:g}", f"{run['step']:,} ({run['wall_time_s'] / 60:.1f})"]
        expected += [f"{siit[v]['interchange_accuracy']:.2f}" for v in ("id_retrieval", "id_selection",
                                                                         "feature_retrieval")]
        expected += [f"{end['aggregation']['interchange_accuracy']:.2f}",
                     f"{end['tasks']['scene/high']['accuracy']:.2f} / {end['tasks']['scene/low']['accuracy']:.2f}"]
        expected += [f"{after[f'attention_3.1_on_{x}']['unpatched']:.3f} -> {after[f'attention_3.1_on_{x}']['patched']:.3f}"
                     for x in "jt"]
        expected.append(f"{100 * after['relative_change']['residual_into_selection_layer']:.1f}%")
        assert cells[1:] == expected
        assert after["attention_3.1_on_j"]["patched"] > 2 * after["attention_3.1_on_j"]["unpatched"]
        assert siit["id_retrieval"]["interchange_accuracy"] >= 0.5 > siit["id_retrieval"]["counterfactual_unpatched"]


def test_the_report_opening_shows_the_saved_validation_with_the_edit_controls_chance():
    """The report's validation section, drawn from organism-vsm's saved validation: every edit head set with its
    control and the control's chance rate, and the ablation table with the random arm from the top-k's layers."""
    from pathlib import Path

    from vlmbind.app.report import validation_sections

    result = ValidationResult.load(Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" /
                                   "organism-vsm")
    page = validation_sections(result, "organism-p2a")
    for heads in result.edit_heads():
        edit = result.edit_summary(heads)
        assert (f"at {heads}: efficacy {edit['efficacy']:.2f} at alpha {edit['alpha']:g}, against "
                f"{edit['control']:.2f} for the empty-cell control, {edit['control_chance']:.2f} of it expected by "
                "chance") in page
    assert "random_same_layers" in page and f"{result.ablation_summary()['mean']['random_same_layers']:.3f}" in page


def test_the_stage_10_release_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on the release before stage 11 (its records kept in results/organism-vsm_training/
    stage-10/): the answer followed the gathering head alone."""
    from pathlib import Path

    stage10 = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training" / \
        "stage-10"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    table = next(r for r in json.loads((stage10 / "interchange.json").read_text())["results"]
                 if r["model"] == "organism-vsm")["variables"]["id_selection"]["settings"]
    alone = {h: sum(x["alone"][h] * x["n"] for x in table) / sum(x["n"] for x in table) for h in ("2.3", "3.1")}
    assert (round(alone["2.3"], 3), round(alone["3.1"], 3)) == (0.977, 0.141)
    assert "2.3 gave the counterfactual answer on 0.977 of the interchange table's pairs, 3.1 on 0.141" in docs
    result = ValidationResult.load(stage10 / "organism-vsm")
    score = {f"{r['layer']}.{r['head']}": r["score"] for r in result.scores
             if r["condition"] == "id_selection" and r["method"] == "exact"}
    assert (round(score["3.1"], 1), round(score["2.3"], 1)) == (1.7, 20.7)
    assert "3.1 scored +1.7 logits under exact mediation against 2.3's +20.7" in docs
    single = next(r for r in json.loads((stage10 / "single_heads.json").read_text())["results"]
                  if r["model"] == "organism-vsm")
    assert single["modes"]["zero"]["3.1"] == single["clean"]  # "ablating 3.1 alone left the answers as they were"


def test_the_longer_gathering_attempt_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on attempt 26 (one more stage from the shipped weights): its saved interchange accuracy by
    setting and its saved validation give the figures the docs quote."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    run = json.loads((runs / "26-longer-stage-10-attempt.json").read_text())
    shipped = ValidationResult.load(runs / "stage-10" / "organism-vsm")  # the release it started from
    longer = ValidationResult.load(runs / "26-validation")
    assert run["step"] == 1500 and f"1,500 more steps, a fresh schedule, {run['wall_time_s'] / 60:.1f} min" in docs
    assert {k: v for k, v in run["config"].items() if k != "init_from"} == \
        {k: v for k, v in json.loads((runs / "24-gathering-interchange-heavier-continued.json").read_text())[
            "config"].items() if k != "init_from"}
    accuracy = run["by_objects"]["accuracy"]
    cells = [a for key in ("id_retrieval@1.0", "id_selection@2.3+3.1", "feature_retrieval@5.2")
             for a in accuracy[key].values()]
    assert run["by_objects"]["n_per_cell"] == 64 and round(min(cells), 2) == 0.97
    alone = accuracy["id_selection@3.1"].values()  # "3.1 alone gives the counterfactual answer on 0.00-0.14"
    assert (round(min(alone), 2), round(max(alone), 2)) == (0.0, 0.14)

    def exact(result, head):
        return next(r["score"] for r in result.scores if r["condition"] == "id_selection" and r["method"] == "exact"
                    and f"{r['layer']}.{r['head']}" == head)

    assert (round(exact(shipped, "3.1"), 1), round(exact(longer, "3.1"), 2)) == (1.7, 0.56)
    rows = {(r["condition"], r["method"]): r for r in longer.methods}
    ratio = rows[("id_selection", "exact")]["ratio"]
    assert f"{ratio:.1f} times" in docs and ratio < 5
    assert rows[("id_selection", "attribution")]["planted_ranks"][1] == 27
    assert rows[("id_retrieval", "attribution")]["planted_ranks"] == [1]
    edit = longer.edit_summary("3.1")
    assert (round(edit["efficacy"], 2), round(edit["control"], 2)) == (0.73, 0.08) and edit["efficacy"] < 0.79
    arms = longer.ablation_summary()
    image = arms["image_attention"]
    assert (round(image["random"], 2), round(image["random_min"], 2)) == (0.99, 0.97)
    others = [arms[m]["random"] for m in ("zero", "mean", "role_mean")]
    assert (round(min(others), 2), round(max(others), 2)) == (0.82, 0.86)
    assert round(min(arms[m]["random_min"] for m in ("zero", "mean", "role_mean")), 2) == 0.34


def test_the_selecting_interchange_attempt_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on attempt 27 (selecting_interchange_weight 4 from the shipped weights): every figure it
    quotes is in the attempt's saved record, validation and interchange table."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    run = json.loads((runs / "27-selecting-interchange-attempt.json").read_text())
    result = ValidationResult.load(runs / "27-validation")
    assert run["config"]["siit"]["selecting_interchange_weight"] == 4.0 and run["step"] == 1500
    assert f"1,500 steps from the shipped weights ({run['wall_time_s'] / 60:.1f} min" in docs
    table = run["interchange"]["variables"]
    assert round(min(x["interchange_accuracy"] for v in table.values() for x in v["settings"]), 2) == 0.98
    alone = [x["alone"]["3.1"] for x in table["id_selection"]["settings"]]
    assert (round(min(alone), 2), round(max(alone), 2)) == (0.98, 1.0)
    assert max(v["unplanted_changes_max"] for v in table.values()) * 384 == pytest.approx(1)
    rows = {(r["condition"], r["method"]): r for r in result.methods}
    score = {f"{r['layer']}.{r['head']}": r["score"] for r in result.scores
             if r["condition"] == "id_selection" and r["method"] == "exact" and r["reference"]}
    assert (round(score["2.3"], 1), round(score["3.1"], 1)) == (20.8, 20.1)
    assert round(rows[("id_selection", "exact")]["ratio"]) == 143
    assert all(rows[(c, m)]["recall_at_k"] == 1.0 for c in ("id_retrieval", "id_selection", "feature_retrieval")
               for m in ("exact", "integrated_gradients"))
    assert rows[("id_retrieval", "attribution")]["planted_ranks"] == [28]
    assert rows[("id_selection", "attribution")]["planted_ranks"] == [24, 28]
    arms = result.ablation_summary()
    quoted = {"image_attention": (1.0, 0.98), "role_mean": (0.9, 0.8)}
    for mode, (mean, lowest) in quoted.items():
        assert (round(arms[mode]["random"], 2), round(arms[mode]["random_min"], 2)) == (mean, lowest)
    assert [round(arms[m]["random"], 2) for m in ("zero", "mean")] == [0.84, 0.62]
    edit = result.edit_summary("3.1")
    assert (edit["alpha"], round(edit["efficacy"], 2), round(edit["control"], 2)) == (1.0, 0.98, 0.16)
    assert round(edit["control"] * 64) == 10


def test_the_ablation_strictness_attempt_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on attempt 28 (ablation_strict_weight 2 from stage 11's weights): the plant held, the
    planted heads became less necessary, and the random sets that fail are the ones that take most of layer 0."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    run = json.loads((runs / "28-ablation-strictness-attempt.json").read_text())
    result = ValidationResult.load(runs / "28-validation")
    assert run["config"]["siit"]["ablation_strict_weight"] == 2.0 and run["step"] == 1500
    assert {k: v for k, v in run["config"]["siit"].items() if k != "ablation_strict_weight"} == \
        json.loads((runs / "27-selecting-interchange-attempt.json").read_text())["config"]["siit"]
    assert f"1,500 steps from stage 11's weights ({run['wall_time_s'] / 60:.1f} min" in docs
    accuracy = run["by_objects"]["accuracy"]
    cells = [a for key in ("id_retrieval@1.0", "id_selection@2.3+3.1", "feature_retrieval@5.2")
             for a in accuracy[key].values()]
    alone = accuracy["id_selection@3.1"].values()
    assert (round(min(cells), 2), round(min(alone), 2), max(alone)) == (0.97, 0.98, 1.0)
    rows = {(r["condition"], r["method"]): r for r in result.methods}
    assert all(rows[(c, "attribution")]["recall_at_k"] == rows[(c, "attribution")]["auroc"] == 1.0
               for c in ("id_retrieval", "id_selection", "feature_retrieval"))
    arms = result.ablation_summary()
    tops = [arms[m]["top"] for m in arms]
    assert (round(min(tops), 2), round(max(tops), 2)) == (0.44, 0.45) and min(tops) > 0.40
    layer0 = [a for a in result.ablation if a["arm"] == "random"
              and sum(h.startswith("0.") for h in a["heads"].split()) >= 3]
    assert {a["heads"] for a in layer0} == {"0.0 0.3 0.1 4.1"}
    failing = {a["mode"]: round(a["accuracy"], 2) for a in layer0}
    assert (failing["zero"], failing["image_attention"]) == (0.03, 0.36)
    others = [a["accuracy"] for a in result.ablation if a["arm"] == "random" and a not in layer0]
    assert (round(min(others), 2), round(max(others), 2)) == (0.83, 1.0)


def test_the_single_head_ablation_attempt_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on attempt 29 (one unaligned head ablated at a time, weight 2, from stage 11's weights):
    the plant held, zero and mean random-k rose, role-mean fell, the planted heads became less necessary."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    run = json.loads((runs / "29-single-head-ablation-strictness-attempt.json").read_text())
    siit = run["config"]["siit"]
    assert (siit["ablation_strict_weight"], siit["ablation_strict_heads"], run["step"]) == (2.0, 1, 1500)
    assert f"1,500 steps from stage 11's weights, {run['wall_time_s'] / 60:.1f} min" in docs
    accuracy = run["by_objects"]["accuracy"]
    assert round(min(a for cells in accuracy.values() for a in cells.values()), 2) == 0.98  # "3.1 alone too"
    arms = ValidationResult.load(runs / "29-validation").ablation_summary()
    shipped = ValidationResult.load(runs / "stage-11" / "organism-vsm").ablation_summary()  # where it started
    quoted = {m: (round(arms[m]["random"], 2), round(shipped[m]["random"], 2)) for m in ("zero", "mean", "role_mean")}
    assert quoted == {"zero": (0.90, 0.84), "mean": (0.88, 0.62), "role_mean": (0.85, 0.90)}
    lows = [arms[m]["random_min"] for m in ("zero", "mean", "role_mean")]
    assert (round(min(lows), 2), round(max(lows), 2)) == (0.58, 0.66)
    tops = [a["top"] for a in arms.values()]
    assert (round(min(tops), 2), round(max(tops), 2)) == (0.22, 0.34)
    edit = ValidationResult.load(runs / "29-validation").edit_summary("3.1")
    assert round(edit["control"], 2) == 0.19 and edit["efficacy"] >= 0.79


def test_the_ablation_necessity_attempt_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on attempt 30 (necessity under ablation at weight 1 beside strictness under ablation one
    head at a time, role-mean drawn too): the planted heads became necessary, the plant and strictness held, random
    sets did worse."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    run = json.loads((runs / "30-ablation-necessity-attempt.json").read_text())
    siit = run["config"]["siit"]
    assert (siit["ablation_strict_weight"], siit["ablation_strict_heads"], siit["ablation_necessity_weight"],
            siit["ablation_strict_modes"], run["step"]) == (2.0, 1, 1.0, ["zero", "mean", "role_mean"], 1500)
    assert f"1,500 steps from stage 11's weights ({run['wall_time_s'] / 60:.1f} min" in docs
    necessity = [x["ablation_necessity"] for x in run["siit_losses_every_50"]]
    assert (f"{np.mean(necessity[:5]):.1f}", f"{np.mean(necessity[-5:]):.2f}") == ("3.2", "0.00")
    accuracy = run["by_objects"]["accuracy"]
    assert round(min(a for cells in accuracy.values() for a in cells.values()), 2) == 0.97
    worst = [v["unplanted_changes_max"] for v in run["interchange"]["variables"].values()]
    assert round(max(worst) * 384) == 1
    result = ValidationResult.load(runs / "30-validation")
    arms = result.ablation_summary()
    tops = [a["top"] for a in arms.values()]
    assert (round(min(tops), 2), round(max(tops), 2)) == (0.0, 0.02)
    assert [round(arms[m]["random"], 2) for m in ("image_attention", "role_mean", "mean", "zero")] == \
        [0.90, 0.88, 0.81, 0.78]
    lows = [a["random_min"] for a in arms.values()]
    assert (round(min(lows), 2), round(max(lows), 2)) == (0.41, 0.77)
    randoms = [a["random"] for a in arms.values()]
    readme = " ".join((runs.parent.parent / "README.md").read_text().split())
    assert f"top-k to {min(tops):.2f}-{max(tops):.2f} but random-k down to {min(randoms):.2f}-{max(randoms):.2f}" in readme
    worst_draw = {a["mode"]: (a["heads"], round(a["accuracy"], 2)) for a in result.ablation if a["arm"] == "random"
                  and a["accuracy"] == arms[a["mode"]]["random_min"]}
    assert worst_draw["zero"] == ("0.3 4.2 3.3 4.3", 0.41) and worst_draw["image_attention"] == ("2.1 0.2 2.0 3.0", 0.77)
    exact = {m["condition"]: m for m in result.methods if m["method"] == "exact"}
    assert all(m["recall_at_k"] == 1.0 for m in exact.values())
    assert round(min(m["ratio"] for m in exact.values()), 1) == 22.6
    attribution = {m["condition"]: m for m in result.methods if m["method"] == "attribution"}
    assert attribution["id_retrieval"]["planted_ranks"] == [1] and attribution["id_selection"]["planted_ranks"] == [26, 27]


def test_the_shipped_ablation_stage_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on attempt 31, shipped as stage 12: its configuration is the recipe's last stage, the
    shipped weights' last evaluation is its own, and the figures the docs quote are in its saved record, validation
    and the shipped training records."""
    from pathlib import Path

    from vlmbind.organisms.recipes import recipe_stages
    from vlmbind.core.shipped import organism_dir

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    run = json.loads((runs / "31-ablation-necessity-heads4-attempt.json").read_text())
    siit = run["config"]["siit"]
    assert recipe_stages("organism-vsm")[-1][0] == "12-ablation-necessity-siit"
    assert (siit["ablation_strict_heads"], siit["ablation_necessity_weight"]) == (4, 1.0)
    assert f"1,500 steps from stage 11's weights ({run['wall_time_s'] / 60:.1f} min; `31-" in docs
    accuracy = run["by_objects"]["accuracy"]
    assert round(min(a for cells in accuracy.values() for a in cells.values()), 2) == 0.95
    assert round(max(v["unplanted_changes_max"] for v in run["interchange"]["variables"].values()) * 384) == 1
    result = ValidationResult.load(runs / "31-validation")
    arms = result.ablation_summary()
    assert (round(min(a["top"] for a in arms.values()), 2), round(max(a["top"] for a in arms.values()), 2)) == (0, 0.02)
    randoms, lows = [a["random"] for a in arms.values()], [a["random_min"] for a in arms.values()]
    assert f"keep {min(randoms):.2f}-{max(randoms):.2f} on average in every mode (lowest " \
        f"{min(lows):.2f}-{max(lows):.2f};" in docs
    edit = result.edit_summary()
    assert f"switches {edit['efficacy']:.2f} of the answers at alpha {edit['alpha']:g}" in docs
    assert f"empty-cell control is {edit['control']:.2f} (its chance rate {edit['control_chance']:.2f})" in docs
    assert f"the random-direction control {edit['random_control']:.2f}" in docs
    planted, twin = (json.loads((organism_dir(n) / "vlmbind_training.json").read_text())
                     for n in ("organism-vsm", "organism-vsm-natural"))
    assert planted["stage_results"][-1]["last_eval"] == run["evals"][-1]  # the shipped weights are the attempt's
    grown = sum(s["wall_time_s"] for s in planted["stage_results"][5:]) / 60
    assert (f"takes {planted['wall_time_s'] / 60:.1f} min on one thread (stages 1-5: 196; 6-12: {grown:.0f}), the "
            f"twin {twin['wall_time_s'] / 60:.1f}") in docs


def test_the_strict_selection_attempt_is_recorded_as_the_docs_say():
    """docs/ground_truth.md on the strict-selection attempt: the check file's shares by object count add up to the
    overall share (32 pairs per count), and the figures the docs quote are the saved ones."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    checks = json.loads((runs / "checkpoint_checks.json").read_text())["checks"]
    curve = json.loads((runs / "13-strict-selection-attempt.json").read_text())
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    for label in ("strict-selection-1000", "stage-5-1000"):
        for head, shares in checks[label]["answer_changes_by_objects"].items():
            assert sum(shares.values()) / 3 == pytest.approx(checks[label]["answer_changes"][head])
    attempt, shipped = checks["strict-selection-1000"], checks["stage-5-1000"]
    overall = [f"{attempt['answer_changes'][h]:.2f}" for h in ("0.1", "0.0")]
    three = [f"{c['answer_changes_by_objects'][h]['3']:.2f}" for c in (attempt, shipped) for h in ("0.1", "0.0")]
    assert overall == ["0.05", "0.02"] and three == ["0.12", "0.06", "0.16", "0.09"]
    assert (f"0.1 went to {overall[0]} and 0.0 to {overall[1]} on the check pairs" in docs
            and f"{three[0]} and {three[1]} of the answers, against {three[2]} and {three[3]}" in docs)
    assert curve["config"]["siit"]["strict_selection_weight"] == 2.0 and f"{curve['wall_time_s'] / 60:.1f} min" in docs


def test_answer_changes_by_position_matches_hand_built_masks_and_the_saved_checks():
    """``answer_changes(positions=image|text|last)`` equals the share computed with a mask built by hand here (image
    tokens, the prompt's other tokens, the last prompt token) for a layer-0 head and the planted feature-retrieval
    head (whose shares lie between 0 and 1, so the comparison bites), bad positions are named, and the shipped
    organism-vsm (stage 12's last checkpoint) gives the figures saved in checkpoint_checks.json for it."""
    from pathlib import Path

    import torch

    from vlmbind.core.errors import TrainingError
    from vlmbind.organisms.data import IGNORE_INDEX, BatchBuilder
    from vlmbind.organisms.siit import HeadInterchange, answer_changes, interchange_batch, interchange_logits
    from vlmbind.stimuli import Canvas

    checks = _ground_truth_script("checkpoint_checks")
    vlm = vb.load("organism-vsm")
    builder, interchange = BatchBuilder(vlm.processor), HeadInterchange(vlm.model, vlm.processor)
    pairs = checks.feature_pairs(Canvas(image_size=168, grid=6))
    batch = interchange_batch(builder, pairs, "clean")
    ids, prompt = batch.base.inputs["input_ids"], batch.prompt_mask
    last = torch.zeros_like(prompt)
    for row in range(len(pairs)):
        last[row, int(torch.nonzero(prompt[row]).max())] = True
    masks = {"image": prompt & (ids == builder.image_token_id), "text": prompt & (ids != builder.image_token_id),
             "last": last}
    saved = json.loads((Path(checks.__file__).parent / "results" / "organism-vsm_training" /
                        "checkpoint_checks.json").read_text())["checks"]["stage-12-shipped"][
                            "answer_changes_by_position"]
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
                assert measured == by_hand == saved.get(head, {}).get(where, by_hand), (head, where, measured)
                shares.append(measured)
    assert any(0 < share < 1 for share in shares) and 0.0 in shares  # a share between 0 and 1, and an inert head
    with pytest.raises(TrainingError, match="positions must be one of"):
        answer_changes(vlm.model, interchange, builder, pairs[:2], [(0, 1)], positions="images")


def test_the_gathering_runs_by_object_count_are_the_docs_figures():
    """docs/ground_truth.md quotes run 24's interchange accuracy by object count and entropy (and 25's at three
    objects) from the ``by_objects`` field of their curve files."""
    from pathlib import Path

    runs = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results" / "organism-vsm_training"
    docs = " ".join((Path(__file__).parent.parent / "docs" / "ground_truth.md").read_text().split())
    by = json.loads((runs / "24-gathering-interchange-heavier-continued.json").read_text())["by_objects"]
    slow = json.loads((runs / "25-gathering-interchange-heavier-slow.json").read_text())["by_objects"]
    assert by["n_per_cell"] == slow["n_per_cell"] == 64

    def cells(acc, k):
        return f"{acc[f'{k}h']:.2f} / {acc[f'{k}l']:.2f}"

    acc = by["accuracy"]
    r, s, f = acc["id_retrieval@1.0"], acc["id_selection@2.3+3.1"], acc["feature_retrieval@5.2"]
    quoted = (f"24 gives id_retrieval {cells(r, 2)} (2 objects, high / low entropy), {cells(r, 3)} (3), "
              f"{cells(r, 4)} (4); id_selection (2.3 and 3.1) {cells(s, 2)}, {cells(s, 3)}, {cells(s, 4)}; "
              f"feature_retrieval {cells(f, 2)}, {cells(f, 3)}, {cells(f, 4)}. 25 is weaker on held-out scenes "
              f"(id_retrieval {cells(slow['accuracy']['id_retrieval@1.0'], 3)} at three objects)")
    assert quoted in docs
    assert min(r.values()) >= 0.9 and min(f.values()) >= 0.95
