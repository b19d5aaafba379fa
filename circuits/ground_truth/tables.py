"""The README's tables, rendered from the saved results of ``run.py`` (never typed by hand).

    python circuits/ground_truth/tables.py           # rewrite the README between its table markers
    python circuits/ground_truth/tables.py --check   # exit 1 when the README and the results disagree
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
import readme_tables  # noqa: E402  (circuits/readme_tables.py, shared by the circuits' tables)

from vlmbind.analysis.ablation import wilson_interval  # noqa: E402  (the intervals the ablations report)
from vlmbind.analysis.benchmark import BenchmarkResult  # noqa: E402  (the benchmark's saved table)

RESULTS = HERE / "results"
README = HERE / "README.md"
# the object counts and entropies of the per-setting tables (3 objects were held out of training)
SETTINGS = [(objects, entropy) for objects in (2, 3, 4) for entropy in ("high", "low")]
NEEDED_BELOW = 0.9  # a head whose ablation alone leaves less than this share of the answers is listed as needed
MODE_NAMES = {"zero": "zero", "mean": "mean", "role_mean": "role-mean", "image_attention": "image-attention"}


def _cell(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _interval(share: float, n: int, digits: int = 2) -> str:
    low, high = wilson_interval(share, n)
    return f"[{low:.{digits}f}, {high:.{digits}f}]"


def _rate(value, n) -> str:
    """A share over ``n`` examples with its 95% Wilson interval: ``0.98 [0.92, 1.00]``."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:.2f} {_interval(float(value), int(n))}"


def _share(figure: dict) -> str:
    """A saved ``{"rate", "ci95", "n"}`` figure as ``0.23 [0.20, 0.27]``."""
    low, high = figure["ci95"]
    return f"{figure['rate']:.2f} [{low:.2f}, {high:.2f}]"


def read_table(path: Path) -> pd.DataFrame:
    """``table.csv`` with head lists and ranks kept as text ("3.2" is a head, not a number)."""
    return pd.read_csv(path, dtype={"heads": str, "ranks": str, "top_heads": str, "reference": str,
                                    "planted_score": str})


def _same_layers(arm: dict) -> str:
    if "random_same_layers" not in arm:
        return "-"
    return f"{_cell(arm['random_same_layers']['value'])}, {_cell(arm['random_same_layers_min']['value'])}"


def validation_tables(table: pd.DataFrame) -> str:
    """``vlmbind validate``'s figures for every model, from ``table.csv``: mediation, ablation, edit, probes."""
    rows = table.to_dict(orient="records")
    models = list(dict.fromkeys(r["model"] for r in rows))
    out = ["Head-level mediation (exact, attribution, integrated gradients) against the reference heads: rank of each "
           "reference head among all heads, recall@k, AUROC over all heads, and the smallest reference mean score "
           "over the largest |score| of any other head; scores are mean ± standard error over the n pairs, in "
           "logits.", "",
           "| model | reference | condition | method | heads | score ± se | max other \\|score\\| | ranks | recall@k | "
           "AUROC | ratio | top heads | n | s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "mediation":
            out.append(f"| {r['model']} | {_cell(r['reference'])} | {r['condition']} | {r['method']} | "
                       f"{_cell(r['heads'])} | {_cell(r['planted_score'])} | {_cell(r['unplanted_max_abs'], 3)} | "
                       f"{_cell(r['ranks'])} | "
                       f"{_cell(r['recall_at_k'])} | {_cell(r['auroc'], 3)} | {_cell(r['ratio'], 2)} | "
                       f"{r['top_heads']} | {int(r['n'])} | {_cell(r['seconds'], 1)} |")
    out += ["", "Scene-description accuracy with heads ablated (top-k: each condition's k best exact heads together; "
            "random-k: drawn from the other heads, mean and lowest over seeds; same layers: one head drawn from each "
            "top-k head's layer instead, same seeds; bottom-k: smallest |score|; 95% Wilson intervals over the n "
            "scenes in brackets):", "",
            "| model | mode | clean | top-k | random-k mean | random-k lowest | same layers mean, lowest | bottom-k "
            "| n |",
            "|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for mode in dict.fromkeys(r["condition"] for r in rows if r["model"] == model and r["part"] == "ablation"):
            arm = {r["method"]: r for r in rows if r["model"] == model and r["part"] == "ablation"
                   and r["condition"] == mode}
            n = int(arm["clean"]["n"])
            out.append(f"| {model} | {mode} | {_rate(arm['clean']['value'], n)} | {_rate(arm['top']['value'], n)} | "
                       f"{_cell(arm['random']['value'])} ({int(arm['random']['seeds'])} seeds) | "
                       f"{_cell(arm['random_min']['value'])} | {_same_layers(arm)} | "
                       f"{_rate(arm['bottom']['value'], n)} | {n} |")
    edits = [r for r in rows if r["part"] == "edit"]
    if edits:
        out += ["", "Position-ID edit at the reference ID-selection heads, every alpha (efficacy: the answer switches "
                "to the object at the target cell; control: the same edit towards an empty cell's ID; random: a "
                "push of the edit's size in a random direction per head; best: the highest efficacy; 95% Wilson "
                "intervals over the n scenes in brackets):", "",
                "| model | heads | alpha | efficacy | control | random | n |", "|---|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['heads']} | {r['method'].split()[1]}"
                f"{' (best)' if r['condition'].endswith('(best)') else ''} | {_rate(r['value'], r['n'])} | "
                f"{_rate(r['control'], r['n'])} | {_rate(r.get('random_control'), r['n'])} | {int(r['n'])} |"
                for r in edits]
    probes = [r for r in rows if r["part"] == "probe"]
    if probes:
        out += ["", "Linear probes on each reference head's last-token output (held-out scenes; chance = the majority "
                "class; 95% Wilson interval over the n held-out scenes in brackets):", "",
                "| model | head | target | accuracy | chance | n |", "|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['heads']} | {r['condition']} | {_rate(r['value'], r['n'])} | "
                f"{_cell(r['chance'])} | "
                f"{int(r['n'])} |" for r in probes]
    return "\n".join(out)


def edit_chance_table(results: Path = RESULTS, model: str = "organism-vsm") -> str:
    """The planted organism's edit at its best alpha per head set, beside the empty-cell control's chance rate (its
    answers that name a described object, over the described objects), from ``validation.json``."""
    out = [f"{model}'s edit at the best alpha of each head set, beside the empty-cell control, the share of the "
           "control's answers that name a described object, and the rate at which it names the target by chance "
           "(that share over the two described objects):", "",
           "| heads | best alpha | efficacy | control | control names a described object | control's chance rate | "
           "random direction | n |", "|---|---|---|---|---|---|---|---|"]
    for e in json.loads((results / model / "validation.json").read_text())["summary"]["edit_by_heads"]:
        out.append(f"| {e['heads']} | {e['alpha']:g} | {_rate(e['efficacy'], e['n'])} | "
                   f"{_rate(e['control'], e['n'])} | {_rate(e['control_described'], e['n'])} | "
                   f"{e['control_chance']:.2f} | {_rate(e['random_control'], e['n'])} | {e['n']} |")
    return "\n".join(out)


def single_heads_table(document: dict) -> str:
    """Per model and mode, the heads whose ablation alone leaves under 0.90 of the answers."""
    first = document["results"][0]
    out = [f"Scene description with one head ablated alone, on the validation's {first['n']} ablation scenes "
           f"(seed {first['seed']} + 2): the heads that leave under {NEEDED_BELOW:.2f} of the answers (Wilson 95%), "
           "planted heads marked *:", "",
           "| model | mode | clean | heads needed alone: accuracy [95%] | heads that are not |",
           "|---|---|---|---|---|"]
    for r in document["results"]:
        planted = {h for heads in (r["planted"] or {}).values() for h in heads}
        for mode, rows in r["modes"].items():
            needed = sorted((h for h, a in rows.items() if a < NEEDED_BELOW), key=lambda h: rows[h])
            cells = ", ".join(f"{h}{'*' if h in planted else ''}: {rows[h]:.2f} {_interval(rows[h], r['n'])}"
                              for h in needed) or "none"
            out.append(f"| {r['model']} | {mode} | {r['clean']:.2f} | {cells} | {len(rows) - len(needed)} of "
                       f"{len(rows)} |")
    return "\n".join(out)


def scene_accuracy_table(document: dict) -> str:
    first = document["results"][0]
    out = [f"Scene description on {first['n']} fresh scenes per setting (seed {first['seed']}; 3 objects were held "
           "out of training), accuracy [Wilson 95%]:", "",
           "| model | " + " | ".join(f"{k} {e}" for k, e in SETTINGS) + " |", "|---|" + "---|" * len(SETTINGS)]
    for r in document["results"]:
        cells = {(x["objects"], x["entropy"]): x for x in r["settings"]}
        out.append(f"| {r['model']} | " + " | ".join(
            f"{cells[s]['accuracy']:.2f} {_interval(cells[s]['accuracy'], cells[s]['n'])}" for s in SETTINGS) + " |")
    return "\n".join(out)


def interchange_table(document: dict) -> str:
    """Interchange accuracy per variable and setting, and strictness: the unplanted heads interchanged alone."""
    out = ["Interchange accuracy of the planted heads (interchanged together at the variable's positions) on "
           f"{document['results'][0]['n_pairs']} fresh pairs per setting (seed {document['results'][0]['seed']}; "
           "3 objects were held out of training): per setting, the lowest setting and all settings pooled, beside "
           "the rate at which the unpatched model already gives the counterfactual answer; and, over all settings "
           "pooled, the largest share of answers that one unplanted "
           "head changes when interchanged alone at every prompt position (strictness asks <= 0.02); intervals are "
           "Wilson 95%:", "",
           "| model | variable | heads | 2 high | 2 low | 3 high | 3 low | 4 high | 4 low | lowest setting [95%] | "
           "all settings [95%] | unpatched (max) | worst unplanted head [95%] | heads above 0.02 | pooled n |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in document["results"]:
        for variable, v in r["variables"].items():
            cells = {(x["objects"], x["entropy"]): x for x in v["settings"]}
            accs = " | ".join(f"{cells[s]['interchange_accuracy']:.2f}" for s in SETTINGS)
            unpatched = max(x["unpatched"] for x in v["settings"])
            low = min(v["settings"], key=lambda x: x["interchange_accuracy"])
            worst = v["unplanted_changes_max"]
            n = sum(x["n"] for x in v["settings"])
            pooled = sum(x["interchange_accuracy"] * x["n"] for x in v["settings"]) / n
            out.append(f"| {r['model']} | {variable} | {' '.join(r['planted'][variable])} | {accs} | "
                       f"{low['interchange_accuracy']:.2f} {_interval(low['interchange_accuracy'], low['n'])} | "
                       f"{pooled:.3f} {_interval(pooled, n, 3)} | "
                       f"{unpatched:.2f} | {v['unplanted_worst_head']} ({worst:.3f} "
                       f"{_interval(worst, v['n_pooled'], 3)}) | "
                       f"{len(v['unplanted_heads_above_0.02'])} of {len(v['unplanted_changes'])} | {v['n_pooled']} |")
    return "\n".join(out)


def interchange_alone_table(document: dict) -> str:
    """A variable's planted heads interchanged one at a time."""
    out = ["Where a variable has several planted heads, each interchanged alone (same pairs and positions), "
           "interchange accuracy per setting and over all settings [Wilson 95%]:", "",
           "| model | variable | head alone | 2 high | 2 low | 3 high | 3 low | 4 high | 4 low | all settings [95%] |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in document["results"]:
        for variable, v in r["variables"].items():
            if not all("alone" in x for x in v["settings"]):
                continue
            cells = {(x["objects"], x["entropy"]): x for x in v["settings"]}
            n = sum(x["n"] for x in v["settings"])
            for head in r["planted"][variable]:
                accs = " | ".join(f"{cells[s]['alone'][head]:.2f}" for s in SETTINGS)
                pooled = sum(x["alone"][head] * x["n"] for x in v["settings"]) / n
                out.append(f"| {r['model']} | {variable} | {head} | {accs} | {pooled:.3f} {_interval(pooled, n, 3)} |")
    return "\n".join(out)


def random_k_table(record: dict) -> str:
    """Random-k ablation over many draws: the mean with its standard error, the lowest draw, and the draws split by
    how many of layer 0's heads they take."""
    first = next(iter(record["modes"].values()))["random"]
    n = record["n_eval"]
    out = [f"Random-k ablation of {record['model']} over {first['draws']} draws of {len(record['planted'])} heads "
           f"from the unplanted ones (uniform, seeds 0-{first['draws'] - 1}), on validate's ablation scenes "
           f"({record['scenes']}): the planted heads ablated together [Wilson 95%], the random sets' mean accuracy ± "
           "standard error over draws, the lowest draw, and the mean over the draws that take at most one of layer "
           "0's four heads and over those that take two or more (draws in parentheses):", "",
           "| mode | planted heads ablated | random-k mean ± se | lowest draw | at most one layer-0 head | "
           "two or more layer-0 heads | n |", "|---|---|---|---|---|---|---|"]
    for mode, m in record["modes"].items():
        r = m["random"]
        few, many = r["at_most_one_layer0_head"], r["two_or_more_layer0_heads"]
        out.append(f"| {MODE_NAMES.get(mode, mode)} | {_rate(m['top'], n)} | {r['mean']:.2f} ± {r['se']:.2f} "
                   f"({r['draws']}) | {r['lowest']:.2f} | {_cell(few['mean'])} ({few['draws']}) | "
                   f"{_cell(many['mean'])} ({many['draws']}) | {n} |")
    return "\n".join(out)


def edit_geometry_table(record: dict) -> str:
    """Where the empty-cell control lands, per head set: on the described object nearer the empty cell, and on the
    target by where the empty cell lies relative to it."""
    out = [f"The position-ID edit and its empty-cell control at alpha {record['alpha']:g} on {record['n_eval']} "
           f"scenes of validate's seed {record['seed']} ({record['objects']} objects, {record['entropy']} entropy; "
           "validate's 64 are the first of them), share of the scenes [Wilson 95%] unless the column says otherwise: "
           "the control's answers that name a described object and, of those, the one nearer the empty cell (scenes "
           "where both are equally near left out), and the control naming the target when the target is the nearer "
           "object or the other one is, and when the empty cell shares the target's row, its column or neither:", "",
           "| heads | edit efficacy | control names the target | control names a described object | of those, the "
           "nearer one | target when it is nearer | target when the other is nearer | same row | same column | "
           "neither | n |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for heads, b in record["by_heads"].items():
        line = b["control_names_t_by_line_through_t"]
        out.append(f"| {heads} | {_share(b['edit_efficacy'])} | {_share(b['control_names_t'])} | "
                   f"{_share(b['control_names_described'])} | {_share(b['described_answers_on_nearest'])} "
                   f"(of {b['described_answers_on_nearest']['n']}) | {_share(b['names_t_when_t_nearest'])} | "
                   f"{_share(b['names_t_when_other_nearest'])} | {_share(line['same_row'])} | "
                   f"{_share(line['same_column'])} | {_share(line['neither'])} | {b['edit_efficacy']['n']} |")
    distances = sorted({int(d) for b in record["by_heads"].values() for d in b["control_names_t_by_distance_to_t"]})
    out += ["", "The control naming the target by the distance from the empty cell to the target (grid cells, "
            "rounded up), share [Wilson 95%] and the scenes at that distance:", "",
            "| heads | " + " | ".join(str(d) for d in distances) + " |", "|---|" + "---|" * len(distances)]
    for heads, b in record["by_heads"].items():
        by = b["control_names_t_by_distance_to_t"]
        out.append(f"| {heads} | " + " | ".join(f"{_share(by[str(d)])} ({by[str(d)]['n']})" if str(d) in by else "-"
                                             for d in distances) + " |")
    return "\n".join(out)


def alpha_sweep_table(record: dict) -> str:
    """The edit and both controls per alpha, on the seed the alpha was chosen on and on the confirming seed."""
    choose, confirm = record["choose"], record["confirm"]
    out = [f"The position-ID edit at {record['heads']} ({record['model']}, {record['objects']} objects, "
           f"{record['entropy']} entropy, {record['positions']} positions) on a fine alpha grid, {choose['n_eval']} "
           f"scenes per alpha: an alpha was chosen on seed {choose['seed']} by a rule fixed before the run "
           f"({record['rule']}: {record['chosen_alpha']:g}) and measured again, with alpha 1, on seed "
           f"{confirm['seed']}; share of the scenes whose answer names the target, the other described object or an "
           "object absent from the scene [Wilson 95%]:", "",
           "| seed | alpha | edit: target | edit: other described | control: target | control: other described | "
           "control: absent | random direction: target | n |", "|---|---|---|---|---|---|---|---|---|"]
    for part in (choose, confirm):
        for alpha, arms in part["by_alpha"].items():
            edit, control, random = arms["edit"], arms["control"], arms["random_direction"]
            chosen = " (chosen)" if float(alpha) == record["chosen_alpha"] else ""
            out.append(f"| {part['seed']} | {alpha}{chosen} | {_share(edit['t'])} | "
                       f"{_share(edit['other_described'])} | {_share(control['t'])} | "
                       f"{_share(control['other_described'])} | {_share(control['absent'])} | "
                       f"{_share(random['t'])} | {part['n_eval']} |")
    return "\n".join(out)


def _model(result: dict) -> str:
    """A model's name in a table, with the model whose planted heads or edges it is scored against."""
    return result["model"] + (f" (against {result['reference']})" if result["reference"] else "")


def edges_table(document: dict, results: Path = RESULTS) -> str:
    """The declared edges against every head-to-head edge: their ranks, recall@k and AUROC per method, and, from
    each model's saved circuit, the declared edges' path-patching scores with their intervals beside the largest
    |score| of any other head-to-head edge."""
    keys = [(e["sender"], e["receiver"], e["channel"]) for e in document["declared"]]
    out = ["| model | method | declared ranks | of edges | recall@3 | AUROC | top 4 edges | pairs | seconds |",
           "|---|---|---|---|---|---|---|---|---|"]
    scores = ["| model | " + " | ".join(f"{s} -> {r} ({c})" for s, r, c in keys) + " | largest other, absolute |",
              "|---|" + "---|" * (len(keys) + 1)]
    for result in document["results"]:
        model = _model(result)
        for row in result["rows"]:
            out.append(f"| {model} | {row['method'].replace('_', ' ')} | {' '.join(map(str, row['declared_ranks']))} "
                       f"| {row['edges']} | {_cell(row['recall_at_k'])} | {_cell(row['auroc'], 3)} | "
                       f"{', '.join(row['top_edges'])} | {row['n_pairs']} | {row['seconds']:.0f} |")
        frame = pd.read_csv(results / result["model"] / "circuit" / "edges.csv",
                            dtype={"sender": str, "receiver": str})
        frame = frame[frame["receiver"] != "logits"]
        is_declared = [k in keys for k in zip(frame["sender"], frame["receiver"], frame["channel"])]
        found = frame[is_declared].set_index(["sender", "receiver", "channel"])
        cells = [f"{found.loc[k, 'score']:+.2f} [{found.loc[k, 'ci_low']:+.2f}, {found.loc[k, 'ci_high']:+.2f}]"
                 for k in keys]
        other = frame[[not d for d in is_declared]]["score"].abs().max()
        scores.append(f"| {model} | " + " | ".join(cells) + f" | {other:.3f} |")
    return "\n".join(out) + "\n\n" + "\n".join(scores)


def faithfulness_table(document: dict, results: Path = RESULTS) -> str:
    """Per model, the faithfulness of exact path patching's top edges (CPR, CMD) and of the declared circuit (its
    edges and the direct edge of the head they end at), the logit difference of the full model and of the empty
    circuit and their difference (f's denominator) with its interval; then each model's curve, f of the top-k edges
    per fraction kept, from its saved circuit."""
    out = ["| model | declared circuit f | CPR (1 best) | CMD (0 best) | m full | m empty | m full - m empty "
           "| ablation | pairs | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    curves = {}
    for result in document["results"]:
        exact = next((r for r in result["rows"] if r["method"] == "exact"), None)
        f = exact.get("faithfulness") if exact else None
        if not f:
            continue
        d = f["declared"]
        out.append(f"| {_model(result)} | {d['f']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] | {f['cpr']:.3f} "
                   f"[{f['cpr_ci'][0]:.3f}, {f['cpr_ci'][1]:.3f}] | {f['cmd']:.3f} [{f['cmd_ci'][0]:.3f}, "
                   f"{f['cmd_ci'][1]:.3f}] | {f['m_full']:+.2f} | {f['m_empty']:+.2f} | {f['full_minus_empty']:+.2f} "
                   f"[{f['full_minus_empty_ci'][0]:+.2f}, {f['full_minus_empty_ci'][1]:+.2f}] | {f['ablation']} | "
                   f"{f['n']} | {f['seconds']:.0f} |")
        curves[_model(result)] = pd.read_csv(results / result["model"] / "circuit" / "faithfulness.csv")
    if not curves:
        return "\n".join(out)
    first = next(iter(curves.values()))
    top = first[first["circuit"] == "top"]
    rows = ["| fraction kept | edges | " + " | ".join(f"f, {m}" for m in curves) + " |",
            "|---|---|" + "---|" * len(curves)]
    for i, (fraction, edges) in enumerate(zip(top["fraction"], top["edges"])):
        cells = []
        for curve in curves.values():
            r = curve[curve["circuit"] == "top"].iloc[i]
            cells.append(f"{r['f']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]")
        rows.append(f"| {fraction:g} | {edges} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\n" + "\n".join(rows)


ATP_NAMES = {"atp": "AtP", "atp_magnitude": "AtP, magnitude", "atp_qk_fix": "AtP* QK fix alone (signed)",
             "atp_star": "AtP* (QK fix and GradDrop)"}


def atp_star_table(document: dict) -> str:
    """AtP and its fixes against the planted ID-selection heads, per model."""
    heads = " ".join(document["heads"])
    out = [f"| model | method | ranks of {heads} | AUROC | scores of {heads} | largest other, absolute | pairs | seconds |",
           "|---|---|---|---|---|---|---|---|"]
    for result in document["results"]:
        model = _model(result)
        for r in result["rows"]:
            out.append(f"| {model} | {ATP_NAMES[r['method']]} | {' '.join(map(str, r['planted_ranks']))} | "
                       f"{_cell(r['auroc'], 3)} | {' '.join(f'{v:+.3f}' for v in r['planted_scores'])} | "
                       f"{r['unplanted_max_abs']:.3f} | {result['n_pairs']} | {r['seconds']:.0f} |")
    return "\n".join(out)


def _interval_of(value, interval) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def steering_table(document: dict) -> str:
    """Steering each planted head (and the ID-selection pair) to a described object: how often the answer names it,
    beside as many random heads, and where the head stands by gaze."""
    roles = {h: role for role, heads in document["planted"].items() for h in heads}
    out = ["| model | heads steered | planted as | names the described object | random heads, same push | "
           "still names the missing object | gaze (rank of 28) | scenes | seconds |",
           "|---|---|---|---|---|---|---|---|---|"]
    for result in document["results"]:
        model = _model(result)
        for r in result["rows"]:
            heads = r["heads"]
            role = " + ".join(sorted({roles.get(h, "-") for h in heads}))
            gaze = ", ".join(f"{r['gaze'][h]:.2f} ({r['gaze_ranks'][h]})" for h in heads)
            out.append(f"| {model} | {' '.join(heads)} | {role} | "
                       f"{_interval_of(r['efficacy'], r['efficacy_interval'])} | "
                       f"{_interval_of(r['random_heads_efficacy'], r['random_heads_efficacy_interval'])} "
                       f"(n={r['random_heads_n']}) | {_rate(r['steered_original'], r['n_counted'])} | {gaze} | "
                       f"{r['n_counted']} | {r['seconds']:.0f} |")
    return "\n".join(out)


def steering_points_table(document: dict) -> str:
    """The heads that gaze most at the pointed object, steered to a distractor while the first point is written."""
    out = ["| model | task | heads steered | gaze | first point moves to the distractor | random heads, same push | "
           "first point still the expected one | unsteered: first point right | displays | seconds |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for result in document["results"]:
        planted = set(result.get("planted", []))
        for r in result["rows"]:
            gaze = ", ".join(f"{r['gaze'][h]:.2f}" for h in r["heads"])
            named = " ".join(f"{h} (planted)" if h in planted else h for h in r["heads"])
            out.append(f"| {result['model']} | {result.get('task', 'search')} | {named} | {gaze} | "
                       f"{_interval_of(r['efficacy'], r['efficacy_interval'])} | "
                       f"{_interval_of(r['random_heads_efficacy'], r['random_heads_efficacy_interval'])} "
                       f"(n={r['random_heads_n']}) | {_rate(r['steered_original'], r['n_counted'])} | "
                       f"{_rate(r['clean_accuracy'], r['n_counted'])} | {r['n_counted']} | {r['seconds']:.0f} |")
    return "\n".join(out)


def lens_table(document: dict) -> str:
    """Per model and layer, the share of objects whose colour (shape) word is the top of its pool at the object's own
    image tokens, beside the same readout at background tokens (95% Wilson intervals)."""
    out = ["| model | layer | colour at the object | colour at background | shape at the object | "
           "shape at background | chance |", "|---|---|---|---|---|---|---|"]
    for result in document["results"]:
        rows = {(r["layer"], r["feature"]): r for r in result["decodable"]}
        layers = list(dict.fromkeys(r["layer"] for r in result["decodable"]))
        for layer in layers:
            cells = []
            for feature in ("colour", "shape"):
                r = rows[(layer, feature)]
                cells += [f"{r['share']:.2f} [{r['low']:.2f}, {r['high']:.2f}]",
                          f"{r['background_share']:.2f} [{r['background_low']:.2f}, {r['background_high']:.2f}]"]
            chance = rows[(layer, "colour")]["chance"]
            out.append(f"| {result['model']} ({result['n_objects']} objects) | {layer} | {' | '.join(cells)} | "
                       f"{chance:.2f} |")
    return "\n".join(out)


def _signed(row: dict, key: str) -> str:
    value, low, high = row.get(key), row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if value is None:
        return "-"
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def relevancy_table(document: dict) -> str:
    """Per map: deletion and insertion AUC and their paired differences to random maps, the knockout of its top
    cells against random cells, and its image mass on the object asked about against the other objects."""
    out = ["| model | map | deletion AUC (lower is better) | minus random | insertion AUC (higher is better) | "
           "minus random | knockout: answers changed, minus random | mass on the asked object, minus the others | "
           "n |", "|---|---|---|---|---|---|---|---|---|"]
    for result in document["results"]:
        for r in result["scores"]:
            if r["method"] == "random":
                out.append(f"| {result['model']} | random | {r['deletion_auc']:.3f} | - | {r['insertion_auc']:.3f} | "
                           f"- | {r['knockout_changed']:.2f} | - | {r['n']} |")
                continue
            out.append(f"| {result['model']} | {r['method']} | {r['deletion_auc']:.3f} | "
                       f"{_signed(r, 'deletion_vs_random')} | {r['insertion_auc']:.3f} | "
                       f"{_signed(r, 'insertion_vs_random')} | {_signed(r, 'knockout_changed_vs_random')} | "
                       f"{_signed(r, 'target_vs_other')} | {r['n']} |")
    return "\n".join(out)


def search_accuracy_table(document: dict) -> str:
    """Per organism and task: the answer's accuracy and the whole trace's (every point and the answer) on fresh
    displays, with 95% Wilson intervals."""
    out = ["| model | task | objects | answer right | whole trace right | displays |", "|---|---|---|---|---|---|"]
    for result in document["results"]:
        for task, r in result["tasks"].items():
            objects = r["objects"] if isinstance(r["objects"], (int, str)) else f"{min(r['objects'])}-{max(r['objects'])}"
            out.append(f"| {result['model']} | {task} | {objects} | {_rate(r['answer_accuracy'], r['n'])} | "
                       f"{_rate(r['trace_accuracy'], r['n'])} | {r['n']} |")
    return "\n".join(out)


def search_interchange_table(document: dict) -> str:
    """Per organism: the share of fresh pointing pairs whose patched point moves to the source's object with the
    planted search heads interchanged at its two steps (by pair kind), and the largest share of answers one other
    head changes when interchanged alone there (95% Wilson intervals)."""
    out = [f"| model | heads interchanged | pairs | point moved to the source's object | largest share one other head "
           "changes (head) |", "|---|---|---|---|---|"]
    for result in document["results"]:
        worst = result["unplanted_changes_max"]
        for kind, r in result["interchange"].items():
            last = f"{_rate(worst['share'], worst['n'])} ({worst['head']})" if kind == "all" else ""
            out.append(f"| {result['model']} | {' '.join(result['heads'])} | {kind} | {_rate(r['moved'], r['n'])} "
                       f"(n={r['n']}) | {last} |")
    return "\n".join(out)


def search_single_heads_table(document: dict) -> str:
    """Per organism: whole-trace counting accuracy with each head zero-ablated alone, the heads below
    :data:`NEEDED_BELOW` listed (95% Wilson intervals)."""
    out = ["| model | clean | planted heads ablated alone | other heads the traces need (accuracy) | every other "
           "head, lowest | displays |", "|---|---|---|---|---|---|"]
    for result in document["results"]:
        single = result["single_heads"]
        n, zero, planted = single["n"], single["zero"], set(document["planted"])
        mine = ", ".join(f"{h}: {_rate(zero[h], n)}" for h in document["planted"])
        others = {h: v for h, v in zero.items() if h not in planted}
        needed = ", ".join(f"{h} ({v:.2f})" for h, v in sorted(others.items(), key=lambda kv: kv[1])
                           if v < NEEDED_BELOW * single["clean"]) or "none"
        rest = min((v for h, v in others.items() if v >= NEEDED_BELOW * single["clean"]), default=float("nan"))
        out.append(f"| {result['model']} | {_rate(single['clean'], n)} | {mine} | {needed} | {_cell(rest)} | {n} |")
    return "\n".join(out)


def position_probe_table(document: dict) -> str:
    """Per model and decoder layer, the held-out accuracy of linear probes of every image token's grid row and
    column (chance 1/6)."""
    out = ["| model | after layer | row | column | image tokens held out |", "|---|---|---|---|---|"]
    for r in document["position_probes"]:
        where = "input" if r["layer"] == 0 else str(r["layer"] - 1)
        out.append(f"| {r['model']} | {where} | {r['row']:.2f} | {r['column']:.2f} | {r['n_test']} |")
    return "\n".join(out)


def tracking_table(results: Path = RESULTS) -> str:
    """Per search organism (the benchmark's validations): the head whose centroid tracks the written points best,
    and the planted head's RMSE, rank and share of points within half a cell (95% Wilson interval)."""
    out = ["| model | lowest RMSE (head) | planted head | its RMSE (rank) | centroid within half a cell of the point | "
           "points |", "|---|---|---|---|---|---|"]
    for name in ("organism-search", "organism-search-natural"):
        summary = json.loads((results / "benchmark" / name / "validation.json").read_text())["summary"]["tracking"]
        for r in summary["reference"]:
            low, high = r["within_ci"]
            out.append(f"| {name} | {summary['best_rmse']:.2f} ({summary['best_head']}) | {r['head']} | "
                       f"{r['rmse']:.2f} ({r['rank']}) | {r['within_half_cell']:.2f} [{low:.2f}, {high:.2f}] | "
                       f"{r['n_points']} |")
    return "\n".join(out)


def benchmark_table(results: Path = RESULTS) -> str:
    """``vlmbind benchmark --table results/benchmark``, compact (one row per method, one column per organism: the
    README's and docs/ground_truth.md's) and in full."""
    saved = BenchmarkResult.load(results / "benchmark")
    return saved.compact_markdown() + "\n\n" + saved.markdown()


def _load(name: str, results: Path) -> dict:
    return json.loads((results / name).read_text())


def render(results: Path = RESULTS) -> str:
    return "\n\n".join([
        "### What `vlmbind validate` reports", validation_tables(read_table(results / "table.csv")),
        edit_chance_table(results),
        "### Scene description, with single heads ablated", scene_accuracy_table(_load("scene_accuracy.json", results)),
        single_heads_table(_load("single_heads.json", results)),
        "### Interchange and strictness", interchange_table(_load("interchange.json", results)),
        interchange_alone_table(_load("interchange.json", results)),
        "### Random-k over many draws", random_k_table(_load("random_k_draws.json", results)),
        "### Where the edit's empty-cell control lands",
        edit_geometry_table(_load("edit_control_geometry.json", results)),
        alpha_sweep_table(_load("edit_alpha_sweep.json", results)),
        "### Edges: path patching against the planted pipeline", edges_table(_load("edges.json", results), results),
        "### Faithfulness of the planted circuit and of the top edges",
        faithfulness_table(_load("edges.json", results), results),
        "### AtP and AtP* on the ID-selection heads", atp_star_table(_load("atp_star.json", results)),
        "### Attention steering of the planted heads", steering_table(_load("steering.json", results)),
        "### Steering the heads that look at the pointed object (Point-to-Answer traces)",
        steering_points_table(_load("steering_points.json", results)),
        "### The logit lens over the image grid", lens_table(_load("lens.json", results)),
        "### Relevancy maps on organism-p2a's query task", relevancy_table(_load("relevancy.json", results)),
        "### organism-search: pointing accuracy", search_accuracy_table(_load("search.json", results)),
        "### organism-search: interchange and strictness at the point steps",
        search_interchange_table(_load("search.json", results)),
        search_single_heads_table(_load("search.json", results)),
        "### organism-search: attention-centroid tracking", tracking_table(results),
        "### Where the image tokens' grid cell is readable (linear probes)",
        position_probe_table(_load("search.json", results)),
        "### The benchmark: every method on every planted organism and its twin", benchmark_table(results)])


def main(argv: list[str] | None = None) -> int:
    return readme_tables.main(README, RESULTS, render, "circuits/ground_truth/tables.py", argv)


if __name__ == "__main__":
    sys.exit(main())
