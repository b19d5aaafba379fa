"""The circuits' READMEs show tables rendered from their saved results, their prose quotes only numbers those tables
print, and the saved results back the claims the prose makes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

CIRCUITS = Path(__file__).resolve().parents[1] / "circuits"
RENDERED = ("search_heads", "position_ids", "p2a_vs_direct", "binding_information")


def _tables(circuit: str):
    spec = importlib.util.spec_from_file_location(f"{circuit}_tables", CIRCUITS / circuit / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("circuit", RENDERED[:3])
def test_readme_tables_are_the_rendered_results(circuit):
    tables = _tables(circuit)
    text = tables.README.read_text()
    assert tables.readme_tables.block(text) == tables.render(), f"run python circuits/{circuit}/tables.py"


@pytest.mark.parametrize("circuit", RENDERED[:2])
def test_prose_quotes_only_numbers_the_tables_print(circuit):
    tables = _tables(circuit)
    rt = tables.readme_tables
    text = tables.README.read_text()
    quoted = rt.quoted_numbers(rt.prose(text))
    assert quoted, "the prose quotes no number"
    missing = sorted(quoted - rt.quoted_numbers(tables.render()))
    assert not missing, f"numbers in {circuit}'s README that no rendered table holds: {missing}"


def test_every_circuit_readme_is_rendered_from_results():
    """A new circuit gets a tables.py too: no README table typed by hand."""
    readmes = {p.parent.name for p in CIRCUITS.glob("*/README.md")}
    assert readmes - {"ground_truth"} <= set(RENDERED), sorted(readmes - set(RENDERED))


def test_search_heads_results_back_the_claims():
    results = CIRCUITS / "search_heads" / "results"
    ablation = json.loads((results / "ablation_count" / "results.json").read_text())
    assert ablation["random_from"] == "rest" and ablation["intervals"]["random"]["seeds"] >= 5
    randoms = [a["accuracy"] for a in ablation["arms"] if a["arm"] == "random"]
    iv = ablation["intervals"]
    assert iv["top"]["high"] < min(randoms) and iv["top"]["high"] < iv["bottom"]["low"]
    scores = pd.read_csv(results / "attention_swap" / "scores.csv")
    best = scores.sort_values("score", ascending=False).iloc[0]
    assert (best["layer"], best["head"], bool(best["significant"])) == (2, 2, False)  # the prose says so
    track = json.loads((results / "track_search" / "summary.json").read_text())
    baseline = _tables("search_heads").centre_baseline(json.loads((results / "track_search" / "centroids.json")
                                                                  .read_text()))
    assert track["rmse_mean"][track["valley_layer"]] < baseline


def test_position_ids_results_back_the_claims():
    results = CIRCUITS / "position_ids" / "results"
    for condition in ("id_selection", "id_retrieval"):
        assert not pd.read_csv(results / condition / "scores.csv")["significant"].any()
    fr = pd.read_csv(results / "feature_retrieval" / "scores.csv").sort_values("score", ascending=False)
    assert (fr.iloc[0]["layer"], fr.iloc[0]["head"]) == (0, 3) and bool(fr.iloc[0]["significant"])
    summary = json.loads((results / "summary.json").read_text())
    assert all(r["flipped"] == 0 for r in summary["last_token_test"])
    edit = json.loads((results / "edit" / "results.json").read_text())
    assert max(r["efficacy"] for r in edit["rows"] if r["arm"] == "edit") <= 0.1


def test_the_id_selection_attempt_backs_what_the_docs_say():
    """docs/ground_truth.md's account of the ID-selection plant, against its saved evaluation record and scores."""
    results = CIRCUITS / "ground_truth" / "results" / "id_selection_attempt"
    record = json.loads((results / "evals.json").read_text())
    final = record["evals"][-1]
    assert record["step"] == final["step"] == 2000 and record["eval_pairs_per_variable"] == 32
    ids, fr = final["siit"]["id_selection"], final["siit"]["feature_retrieval"]
    assert ids["interchange_accuracy"] == 1.0 and ids["counterfactual_unpatched"] == 0.0
    assert ids["unaligned_changes_max"] == 0.0 and round(fr["unaligned_changes_max"], 2) == 0.38
    assert round(fr["interchange_accuracy"], 2) == 0.97 and final["selection"]["accuracy"] == 1.0
    assert round(final["selection"]["attention_mass"], 2) == 1.0
    by_step = {e["step"]: e["siit"]["id_selection"] for e in record["evals"]}
    assert (round(by_step[750]["interchange_accuracy"], 2), round(by_step[750]["counterfactual_unpatched"], 2)) == \
        (0.44, 0.19)
    readout_only = record["readout_only_run_V3"]  # "left its loss at ln 36"
    assert abs(readout_only["selection_loss_last_20"] - readout_only["chance_loss_ln_36"]) < 0.05
    text = (CIRCUITS.parent / "docs" / "ground_truth.md").read_text()
    for condition, head, score in (("id_selection", (2, 1), "+12.3"), ("feature_retrieval", (4, 2), "+22.9")):
        scores = pd.read_csv(results / f"locate_{condition}" / "scores.csv")
        best = scores.sort_values("score", ascending=False).iloc[0]
        assert (best["layer"], best["head"]) == head and f"{best['score']:+.1f}" == score and score in text
        if condition == "id_selection":
            assert scores["significant"].sum() == 1 and bool(best["significant"])
            assert f"[{best['ci_low']:.2f}, {best['ci_high']:.2f}]" in text


def test_the_from_scratch_replicate_backs_what_the_docs_say():
    """The recipe's second from-scratch run: its recorded wall time and the figures the docs quote from its record."""
    runs = CIRCUITS / "ground_truth" / "results" / "organism-vsm_training"
    record = json.loads((runs / "32-two-process-replicate-attempt.json").read_text())
    recipe = record["recipe"]
    assert recipe["processes"] == 2 and recipe["threads"] == 1 and len(recipe["stages"]) == 12
    assert abs(recipe["wall_time_s"] - sum(s["wall_time_s"] for s in recipe["stages"])) < 1e-6
    minutes = f"{recipe['wall_time_s'] / 60:.1f}"
    docs = (CIRCUITS.parent / "docs" / "ground_truth.md").read_text()
    readme = (CIRCUITS / "ground_truth" / "README.md").read_text()
    assert minutes == "145.9" and f"**{minutes} min**" in docs and f"{minutes} min" in readme
    stage_minutes = ", ".join(f"{s['wall_time_s'] / 60:.1f}" for s in recipe["stages"])
    assert stage_minutes.replace(", 15.2", " and 15.2") in docs
    retrieval = {(s["objects"], s["entropy"]): s["interchange_accuracy"]
                 for s in record["interchange"]["variables"]["id_retrieval"]["settings"]}
    assert (round(retrieval[(3, "high")], 2), round(retrieval[(4, "high")], 2)) == (0.84, 0.91)
    assert max(v["unplanted_changes_max"] for v in record["interchange"]["variables"].values()) <= 1 / 384 + 1e-12
    summary = json.loads((runs / "32-validation" / "validation.json").read_text())["summary"]
    ablation = summary["ablation"]
    assert all(mode["top"] == 0.0 for mode in ablation.values())
    assert round(ablation["mean"]["random"], 2) == 0.87 and round(ablation["mean"]["random_min"], 2) == 0.45
    assert (round(summary["edit"]["efficacy"], 2), round(summary["edit"]["random_control"], 2)) == (0.97, 0.0)


def test_the_edit_control_geometry_backs_what_the_docs_say():
    record = json.loads((CIRCUITS / "ground_truth" / "results" / "edit_control_geometry.json").read_text())
    assert record["model"] == "organism-vsm" and record["n_eval"] == 512 and record["positions"] == "answer"
    both = record["by_heads"]["2.3 3.1"]

    def quoted(figure):
        low, high = figure["ci95"]
        return f"{figure['rate']:.2f} [{low:.2f}, {high:.2f}]"

    docs = (CIRCUITS.parent / "docs" / "ground_truth.md").read_text()
    readme = (CIRCUITS / "ground_truth" / "README.md").read_text()
    for figure in ("control_names_t", "described_answers_on_nearest"):
        assert quoted(both[figure]) in docs and quoted(both[figure]) in readme
    for figure in ("names_t_when_t_nearest", "names_t_when_other_nearest", "edit_efficacy"):
        assert quoted(both[figure]) in readme
    lines = both["control_names_t_by_line_through_t"]
    for line in ("same_row", "same_column", "neither"):
        assert quoted(lines[line]) in docs and quoted(lines[line]) in readme
    assert lines["neither"]["ci95"][1] < min(lines["same_row"]["ci95"][0], lines["same_column"]["ci95"][0])
    distance = {int(k): v["rate"] for k, v in both["control_names_t_by_distance_to_t"].items()}
    assert [f"{distance[k]:.2f}" for k in (1, 3, 4, 6)] == ["0.70", "0.08", "0.08", "0.43"]
    assert "0.70 at\n  one cell to 0.08 at three and four" in readme and "0.43, at five to six" in readme
    top = (CIRCUITS.parent / "README.md").read_text()
    assert f"({both['control_names_t']['rate']:.2f} on {record['n_eval']}\nscenes)" in top
    # the landing follows the grid: the nearer described object more often than a coin flip would give
    assert both["described_answers_on_nearest"]["ci95"][0] > 0.5
    assert both["names_t_when_t_nearest"]["ci95"][0] > both["names_t_when_other_nearest"]["ci95"][1]


def test_the_edit_alpha_sweep_backs_what_the_docs_say():
    record = json.loads((CIRCUITS / "ground_truth" / "results" / "edit_alpha_sweep.json").read_text())
    assert record["model"] == "organism-vsm" and record["heads"] == "2.3 3.1" and record["positions"] == "answer"
    choose, confirm = record["choose"]["by_alpha"], record["confirm"]["by_alpha"]
    assert record["choose"]["seed"] != record["confirm"]["seed"] and record["choose"]["n_eval"] == 512

    def quoted(figure):
        low, high = figure["ci95"]
        return f"{figure['rate']:.2f} [{low:.2f}, {high:.2f}]"

    def flat(text):
        return " ".join(text.split())

    docs = flat((CIRCUITS.parent / "docs" / "ground_truth.md").read_text())
    readme = flat((CIRCUITS / "ground_truth" / "README.md").read_text())
    top = flat((CIRCUITS.parent / "README.md").read_text())
    # the rule as the script states it: the largest efficacy minus control on the choose seed, ties to the smaller
    margins = {float(a): arms["edit"]["t"]["rate"] - arms["control"]["t"]["rate"] for a, arms in choose.items()}
    best = max(margins.values())
    assert record["chosen_alpha"] == min(a for a, m in margins.items() if m == best) == 0.9
    assert set(confirm) == {"0.9", "1"}
    for alpha in ("0.6", "0.7", "0.8", "1"):
        edit, control = choose[alpha]["edit"]["t"], choose[alpha]["control"]["t"]
        assert f"{quoted(edit)} and {quoted(control)}" in docs
    for alpha in ("0.7", "0.8"):
        assert f"{quoted(choose[alpha]['edit']['t'])} and {quoted(choose[alpha]['control']['t'])}" in readme
    assert (f"alpha 0.7: {choose['0.7']['edit']['t']['rate']:.2f} and {choose['0.7']['control']['t']['rate']:.2f}"
            in top)
    # no alpha meets both targets, and the control cannot tell the target from the other described object
    assert not any(arms["edit"]["t"]["rate"] >= 0.79 and arms["control"]["t"]["rate"] <= 0.10
                   for arms in list(choose.values()) + list(confirm.values()))
    for arms in choose.values():
        t, other = arms["control"]["t"], arms["control"]["other_described"]
        assert t["ci95"][0] <= other["rate"] <= t["ci95"][1]
        assert arms["edit"]["other_described"]["rate"] <= 0.03
        assert sum(v["rate"] for v in arms["control"].values()) == pytest.approx(1.0)
    at1 = choose["1"]
    assert f"{at1['control']['t']['rate']:.2f}, {quoted(at1['control']['other_described'])} and {quoted(at1['control']['absent'])}" in docs
    assert quoted(at1["edit"]["other_described"]) in docs and quoted(at1["edit"]["other_described"]) in readme
    assert quoted(at1["control"]["other_described"]) in readme
    # the same call as edit_control_geometry.py at alpha 1 on the same seed: the same answers
    geometry = json.loads((CIRCUITS / "ground_truth" / "results" / "edit_control_geometry.json").read_text())
    assert geometry["seed"] == record["choose"]["seed"] and geometry["alpha"] == 1.0
    assert geometry["by_heads"]["2.3 3.1"]["answers"] == at1
    chosen = confirm["0.9"]
    for figure in (chosen["edit"]["t"], chosen["control"]["t"]):
        assert quoted(figure) in docs and quoted(figure) in readme
    assert quoted(chosen["random_direction"]["t"]) in docs


def test_random_k_over_many_draws_backs_what_the_docs_say():
    results = CIRCUITS / "ground_truth" / "results"
    shipped = json.loads((results / "random_k_draws.json").read_text())["modes"]
    replicate = json.loads((results / "organism-vsm_training" / "32-random-k-draws.json").read_text())["modes"]
    readme = (CIRCUITS / "ground_truth" / "README.md").read_text()
    docs = (CIRCUITS.parent / "docs" / "ground_truth.md").read_text()
    for mode, name in (("zero", "zero"), ("mean", "mean"), ("role_mean", "role-mean"),
                       ("image_attention", "image-attention")):
        random = shipped[mode]["random"]
        assert random["draws"] == 100 and len(shipped[mode]["draws"]) == 100
        assert f"{random['mean']:.2f} ± {random['se']:.2f} ({name})" in readme.replace("\n  ", " ")
        assert random["mean"] >= 0.90 and shipped[mode]["top"] <= 0.02  # the target, over 100 draws
        # the draws that take two or more layer-0 heads are the ones that break the task
        assert random["two_or_more_layer0_heads"]["mean"] < random["at_most_one_layer0_head"]["mean"]
        assert min(a["accuracy"] for a in shipped[mode]["draws"]) == random["lowest"]
    assert f"{min(m['random']['lowest'] for m in shipped.values()):.2f}" == "0.09" and "as low as 0.09" in readme
    mean = replicate["mean"]["random"]
    assert f"{mean['mean']:.2f} ± {mean['se']:.2f}" == "0.90 ± 0.02" and "0.90 ± 0.02 there" in readme
    assert "0.90 ± 0.02 there, and the shipped organism 0.92 ± 0.02" in docs.replace("\n", " ")
