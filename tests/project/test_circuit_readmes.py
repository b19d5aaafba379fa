"""The circuits' READMEs show tables rendered from their saved results, their prose quotes only numbers those tables
print, and the saved results back the claims the prose makes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pandas as pd
import pytest

CIRCUITS = Path(__file__).resolve().parents[2] / "circuits"
DOCS = CIRCUITS.parent / "docs"
RENDERED = ("search_heads", "position_ids", "p2a_vs_direct", "binding_information", "ground_truth")
# binding_information's tables are checked in test_circuit_binding_information.py
TABLES_CHECKED = ("search_heads", "position_ids", "p2a_vs_direct", "ground_truth")
PROSE_CHECKED = ("search_heads", "position_ids", "ground_truth")


def _tables(circuit: str):
    spec = importlib.util.spec_from_file_location(f"{circuit}_tables", CIRCUITS / circuit / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("circuit", TABLES_CHECKED)
def test_readme_tables_are_the_rendered_results(circuit):
    tables = _tables(circuit)
    text = tables.README.read_text()
    assert tables.readme_tables.block(text) == tables.render(), f"run python circuits/{circuit}/tables.py"


@pytest.mark.parametrize("circuit", PROSE_CHECKED)
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
    assert readmes <= set(RENDERED), sorted(readmes - set(RENDERED))
    assert all((CIRCUITS / c / "tables.py").is_file() for c in readmes)


def test_circuits_hold_findings_without_a_machines_paths():
    """circuits/ keeps findings (no training attempt), and no file there or in docs/ground_truth.md names a path of
    the machine that made it."""
    files = [p for p in CIRCUITS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert files and not [p for p in files if "attempt" in str(p.relative_to(CIRCUITS)).lower()]
    machine = re.compile(r"(?<![\w.])/(root|tmp|work|home)/")
    named = [p for p in [*files, DOCS / "ground_truth.md"] if p.suffix in (".py", ".md", ".json", ".csv", ".txt")
             and machine.search(p.read_text(errors="replace"))]
    assert not named, named


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


def _flat(text: str) -> str:
    return " ".join(text.split())


def _quoted(figure: dict) -> str:
    low, high = figure["ci95"]
    return f"{figure['rate']:.2f} [{low:.2f}, {high:.2f}]"


def test_the_ground_truth_docs_quote_only_the_rendered_results_and_the_cards():
    """docs/ground_truth.md shows no table of its own: every figure it quotes is printed by the ground-truth tables
    (the benchmark's compact table among them) or, for the training times, read from the organisms' training
    records; it stays a page (two planted organisms and the benchmark) and ends naming the commit with the
    history."""
    from vlmbind.core.shipped import organism_dir

    tables = _tables("ground_truth")
    rt = tables.readme_tables
    text = (DOCS / "ground_truth.md").read_text()
    quoted = rt.quoted_numbers(text)
    assert len(quoted) >= 10
    missing = sorted(quoted - rt.quoted_numbers(tables.render()))
    assert not missing, f"numbers in docs/ground_truth.md that no rendered table holds: {missing}"
    minutes = {name: json.loads((organism_dir(name) / "vlmbind_training.json").read_text())["wall_time_s"] / 60
               for name in ("organism-vsm", "organism-vsm-natural")}
    assert (f"{minutes['organism-vsm']:.1f} min on one thread (the twin, {minutes['organism-vsm-natural']:.1f})"
            in _flat(text))
    assert "circuits/ground_truth/README.md" in text and len(text) < 20_000
    last = text.rstrip().splitlines()[-1]
    assert "bf97b41" in last and "`git show bf97b41:docs/ground_truth.md`" in last


def test_the_edit_control_geometry_backs_what_the_docs_say():
    record = json.loads((CIRCUITS / "ground_truth" / "results" / "edit_control_geometry.json").read_text())
    assert record["model"] == "organism-vsm" and record["n_eval"] == 512 and record["positions"] == "answer"
    both = record["by_heads"]["2.3 3.1"]
    docs = _flat((DOCS / "ground_truth.md").read_text())
    readme = _flat((CIRCUITS / "ground_truth" / "README.md").read_text())
    assert f"the control is {_quoted(both['control_names_t'])} (edit {_quoted(both['edit_efficacy'])})" in readme
    assert f"it names the target on {_quoted(both['control_names_t'])}" in docs
    nearest = _quoted(both["described_answers_on_nearest"])
    assert f"{nearest} name the one nearer the empty cell" in readme and f"object on {nearest} of those" in docs
    lines = both["control_names_t_by_line_through_t"]
    assert (f"{_quoted(lines['same_row'])} of the scenes where the empty cell is in the target's row, "
            f"{_quoted(lines['same_column'])} in its column and {_quoted(lines['neither'])} in neither") in readme
    # the landing follows the grid: the row and the column above neither, the nearer described object more often
    # than a coin flip would give, and the target more often where it is the nearer one
    assert lines["neither"]["ci95"][1] < min(lines["same_row"]["ci95"][0], lines["same_column"]["ci95"][0])
    assert both["described_answers_on_nearest"]["ci95"][0] > 0.5
    assert both["names_t_when_t_nearest"]["ci95"][0] > both["names_t_when_other_nearest"]["ci95"][1]
    # "at the chance rate of a fallback": half of the answers that name one of the two described objects
    chance = both["control_names_described"]["rate"] / 2
    assert both["control_names_t"]["ci95"][0] <= chance <= both["control_names_t"]["ci95"][1]
    # validate's own call on 64 scenes, which the README quotes beside its chance rate
    from vlmbind.analysis.ablation import wilson_interval

    validation = json.loads((CIRCUITS / "ground_truth" / "results" / "organism-vsm" / "validation.json").read_text())
    best = validation["summary"]["edit_by_heads"][0]
    assert best["heads"] == "2.3 3.1" and best["alpha"] == record["alpha"] and best["n"] == 64
    low, high = wilson_interval(best["control"], best["n"])
    assert (f"names it on {best['control']:.2f} [{low:.2f}, {high:.2f}], above the 0.1 asked and below its chance "
            f"rate ({best['control_chance']:.2f})") in readme
    assert best["control"] < best["control_chance"]


def test_the_edit_alpha_sweep_backs_what_the_docs_say():
    record = json.loads((CIRCUITS / "ground_truth" / "results" / "edit_alpha_sweep.json").read_text())
    assert record["model"] == "organism-vsm" and record["heads"] == "2.3 3.1" and record["positions"] == "answer"
    choose, confirm = record["choose"]["by_alpha"], record["confirm"]["by_alpha"]
    assert record["choose"]["seed"] != record["confirm"]["seed"] and record["choose"]["n_eval"] == 512
    docs = _flat((DOCS / "ground_truth.md").read_text())
    readme = _flat((CIRCUITS / "ground_truth" / "README.md").read_text())
    # the rule as the runner states it: the largest efficacy minus control on the choose seed, ties to the smaller
    margins = {float(a): arms["edit"]["t"]["rate"] - arms["control"]["t"]["rate"] for a, arms in choose.items()}
    best = max(margins.values())
    assert record["chosen_alpha"] == min(a for a, m in margins.items() if m == best) == 0.9
    assert set(confirm) == {"0.9", "1"}
    at07 = choose["0.7"]
    assert f"(alpha 0.7: {_quoted(at07['edit']['t'])} and {_quoted(at07['control']['t'])})" in readme
    # where the control meets 0.1, the edit is at most what the prose says; it meets 0.1 nowhere on the other seed
    quiet = [arms["edit"]["t"] for arms in choose.values() if arms["control"]["t"]["rate"] <= 0.10]
    strongest = max(quiet, key=lambda figure: figure["rate"])
    assert f"the edit reaches at most {_quoted(strongest)}" in readme and f"the edit above {_quoted(strongest)}" in docs
    assert all(arms["control"]["t"]["rate"] > 0.10 for arms in confirm.values())
    # the control cannot tell the target from the other described object; the edit can
    for arms in choose.values():
        t, other = arms["control"]["t"], arms["control"]["other_described"]
        assert t["ci95"][0] <= other["rate"] <= t["ci95"][1]
        assert arms["edit"]["other_described"]["rate"] <= 0.03
        assert sum(v["rate"] for v in arms["control"].values()) == pytest.approx(1.0)
    at1 = choose["1"]
    assert (f"(alpha 1: {_quoted(at1['control']['other_described'])}) while the edit names it on "
            f"{_quoted(at1['edit']['other_described'])}") in readme
    # the same call as the edit_control_geometry part at alpha 1 on the same seed: the same answers
    geometry = json.loads((CIRCUITS / "ground_truth" / "results" / "edit_control_geometry.json").read_text())
    assert geometry["seed"] == record["choose"]["seed"] and geometry["alpha"] == 1.0
    assert geometry["by_heads"]["2.3 3.1"]["answers"] == at1
    chosen = confirm["0.9"]
    assert (f"edit {_quoted(chosen['edit']['t'])}, control {_quoted(chosen['control']['t'])}, random direction "
            f"{_quoted(chosen['random_direction']['t'])}") in readme
    assert f"({_quoted(chosen['random_direction']['t'])} at the alpha chosen on another seed)" in docs


def test_random_k_over_many_draws_backs_what_the_docs_say():
    record = json.loads((CIRCUITS / "ground_truth" / "results" / "random_k_draws.json").read_text())
    shipped = record["modes"]
    readme = _flat((CIRCUITS / "ground_truth" / "README.md").read_text())
    docs = _flat((DOCS / "ground_truth.md").read_text())
    assert record["planted"] == ["1.0", "2.3", "3.1", "5.2"] and record["n_eval"] == 64
    for mode, name in (("zero", "zero"), ("mean", "mean"), ("role_mean", "role-mean"),
                       ("image_attention", "image-attention")):
        random = shipped[mode]["random"]
        assert random["draws"] == 100 and len(shipped[mode]["draws"]) == 100
        assert not {h for a in shipped[mode]["draws"] for h in a["heads"]} & set(record["planted"])
        assert f"{random['mean']:.2f} ± {random['se']:.2f} ({name})" in readme
        assert random["mean"] >= 0.90 and shipped[mode]["top"] <= 0.02  # the target, over 100 draws
        # the draws that take two or more layer-0 heads are the ones that break the task
        assert random["two_or_more_layer0_heads"]["mean"] < random["at_most_one_layer0_head"]["mean"]
        assert min(a["accuracy"] for a in shipped[mode]["draws"]) == random["lowest"]
    lowest = min(m["random"]["lowest"] for m in shipped.values())
    assert f"as low as {lowest:.2f}" in readme and f"as low as {lowest:.2f}" in docs
    breaking = [shipped[m]["random"]["two_or_more_layer0_heads"] for m in ("zero", "mean", "role_mean",
                                                                            "image_attention")]
    means = [f"{b['mean']:.2f}" for b in breaking]
    assert (f"the {breaking[0]['draws']} draws with two or more layer-0 heads {', '.join(means[:3])} and {means[3]}"
            in readme)
    mean = shipped["mean"]["random"]
    assert f"keeps {mean['mean']:.2f} ± {mean['se']:.2f} under mean ablation" in docs
    by_mean = sorted((m["random"]["mean"], m["random"]["se"]) for m in shipped.values())
    (low, low_se), (high, high_se) = by_mean[0], by_mean[-1]
    assert f"keep {low:.2f} ± {low_se:.2f} to {high:.2f} ± {high_se:.2f} on average" in docs
