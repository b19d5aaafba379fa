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
from vlmbind.results import detect


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
    assert arms == {"clean", "top", "random", "bottom"}
    top = next(a for a in result.ablation if a["arm"] == "top")["heads"].split()
    for a in result.ablation:
        if a["arm"] == "random":
            assert not set(a["heads"].split()) & set(top)
    assert {p["target"] for p in result.probes} == {"cell", "colour", "shape"}
    assert {p["head"] for p in result.probes} == {"1.0", "2.3"}
    assert result.edit and {r["arm"] for r in result.edit} == {"edit", "control"}
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
    rows = {(r["condition"], r["method"]): r for r in vsm.methods}
    for condition in ("id_selection", "feature_retrieval"):  # exact and IG rank both planted heads first
        for method in ("exact", "integrated_gradients"):
            assert rows[(condition, method)]["planted_ranks"] == [1] and rows[(condition, method)]["auroc"] == 1.0
        assert rows[(condition, "exact")]["ratio"] >= 5
    # "attribution finds 4.2 but ranks 2.1 last for id_selection, with a negative score"
    assert rows[("feature_retrieval", "attribution")]["planted_ranks"] == [1]
    assert rows[("id_selection", "attribution")]["planted_ranks"] == [vsm_heads(vsm)]
    assert rows[("id_selection", "attribution")]["planted_min"] < 0
    assert all(c["max_abs_difference"] < 1e-3 for c in vsm.naive_check.values())
    arms = vsm.ablation_summary()
    assert set(arms) == {"image_attention", "zero", "mean", "role_mean"}
    assert all(a["top"] <= 0.40 and a["random"] >= 0.9 and a["bottom"] >= 0.9 for a in arms.values())
    assert not any(h.startswith("0.") for a in vsm.ablation if a["arm"] == "random" for h in a["heads"].split())
    for other in (twin, ValidationResult.load(results / "organism-p2a")):  # global means break more random draws
        lowest = {mode: a["random_min"] for mode, a in other.ablation_summary().items()}
        assert lowest["mean"] < lowest["role_mean"] and lowest["mean"] < lowest["zero"], (other.model, lowest)
    probes = {(p["head"], p["target"]): p["accuracy"] for p in vsm.probes}
    assert probes[("2.1", "cell")] >= 0.9 and min(probes[("2.1", t)] for t in ("colour", "shape")) >= 0.9
    twin_probes = {(p["head"], p["target"]): p["accuracy"] for p in twin.probes}
    assert twin_probes[("2.1", "cell")] <= 0.1 and twin_probes[("2.1", "colour")] >= 0.8
    twin_rows = {(r["condition"], r["method"]): r for r in twin.methods}
    assert twin_rows[("id_selection", "exact")]["unplanted_max_abs"] < 0.05  # near zero: no ID pipeline
    edit = vsm.edit_summary()
    # "VSM's figure with its control at or below 0.10, at alpha 1 and at alpha 2"
    assert edit["efficacy"] >= 0.79 and edit["control"] <= 0.10 and vsm.params["edit_positions"] == "answer"
    at = {(r["alpha"], r["arm"]): r["efficacy"] for r in vsm.edit}
    assert at[(2 * edit["alpha"], "edit")] >= 0.79 and at[(2 * edit["alpha"], "control")] <= 0.10
    assert at[(4 * edit["alpha"], "edit")] < 0.5  # "beyond that the edit overshoots"

    runner = _ground_truth_script("interchange")
    document = json.loads((results / "interchange.json").read_text())
    readme = (results.parent / "README.md").read_text()
    assert runner.BEGIN + "\n" + runner.markdown(document) + "\n" + runner.END in readme
    planted = next(r for r in document["results"] if r["model"] == "organism-vsm")["variables"]
    cells = {(x["objects"], x["entropy"]): x["interchange_accuracy"] for x in planted["id_selection"]["settings"]}
    assert min(cells.values()) >= 0.9  # "ID selection on nearly all, the held-out three-object scenes among them"
    assert planted["id_selection"]["unplanted_heads_above_0.02"] == []  # strictness holds on id_selection pairs
    above = planted["feature_retrieval"]["unplanted_heads_above_0.02"]
    assert len(above) == 2 and all(h.startswith("0.") for h in above)  # "two layer-0 heads still do"
    assert min(x["interchange_accuracy"] for x in planted["feature_retrieval"]["settings"]) >= 0.95


def test_the_strictness_breakers_act_through_the_selection_as_saved():
    """selection_inputs.json: its heads are the interchange table's strictness breakers, with the table's changed
    shares; re-measured here for head 0.1 it gives the saved figures; the README shows its table; and it says what
    the docs say: where a layer-0 head changes the answer, 2.1 stops attending to the missing object and the new
    colour is a described object's, never a colour only the source has."""
    from pathlib import Path

    results = Path(__file__).parent.parent / "circuits" / "ground_truth" / "results"
    runner = _ground_truth_script("selection_inputs")
    saved = json.loads((results / "selection_inputs.json").read_text())
    table = next(r for r in json.loads((results / "interchange.json").read_text())["results"]
                 if r["model"] == "organism-vsm")["variables"]["feature_retrieval"]
    assert sorted(saved["heads"]) == table["unplanted_heads_above_0.02"]
    for head, entry in saved["heads"].items():
        assert entry["changed"] == pytest.approx(table["unplanted_changes"][head], abs=1e-12)
        assert entry["patched_colour"]["source_colour"] == 0
        assert entry["patched_colour"]["described_colour"] >= 0.6 * entry["n_changed"]
        for reader in ("2.1", "4.2"):
            changed, unchanged = (entry["attention_on_missing"][reader][g] for g in ("changed", "unchanged"))
            assert changed["plain"] > 0.85 and changed["patched"] < 0.3 and unchanged["patched"] > 0.85
    readme = (results.parent / "README.md").read_text()
    assert runner.BEGIN + "\n" + runner.markdown(saved) + "\n" + runner.END in readme
    again = runner.measure(saved["model"], ["0.1"], recorded_planted("organism-vsm"), saved["n_pairs"] // 6,
                           saved["seed"])
    assert again["heads"]["0.1"]["n_changed"] == saved["heads"]["0.1"]["n_changed"]
    assert again["heads"]["0.1"]["patched_colour"] == saved["heads"]["0.1"]["patched_colour"]
    for reader, groups in saved["heads"]["0.1"]["attention_on_missing"].items():
        for group, values in groups.items():
            assert again["heads"]["0.1"]["attention_on_missing"][reader][group]["patched"] == \
                pytest.approx(values["patched"], abs=1e-4)


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
    tokens, the prompt's other tokens, the last prompt token), bad positions are named, and the shipped organism-vsm
    (stage 5's last checkpoint) gives the figures saved in checkpoint_checks.json for that checkpoint."""
    from pathlib import Path

    import torch

    from vlmbind.errors import TrainingError
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
                        "checkpoint_checks.json").read_text())["checks"]["stage-5-1000"]["answer_changes_by_position"]
    with torch.no_grad():
        plain = vlm.model(**batch.base.inputs, use_cache=False).logits[:, :-1].argmax(-1)
        answer = batch.base.labels[:, 1:] != IGNORE_INDEX
        for head in ("0.0", "0.1"):
            l, h = (int(x) for x in head.split("."))
            for where, mask in masks.items():
                patched = interchange_logits(vlm.model, interchange, batch, [(l, h)], mask)[:, :-1].argmax(-1)
                by_hand = float(np.mean(((plain != patched) & answer).any(1).tolist()))
                measured = answer_changes(vlm.model, interchange, builder, pairs, [(l, h)], positions=where,
                                          batch_size=len(pairs))
                assert measured == by_hand == saved[head][where], (head, where, measured, by_hand)
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
