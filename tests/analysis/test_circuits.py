"""Circuits: position classes name the positions they say; organism-vsm's declared edges come first among all
head-to-head edges on its id_selection pairs and its twin's are nothing; a node-only ranking cannot tell the planted
channel; results save, load and export like every result; the command writes them and refuses what it cannot do."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from helpers import get_tiny, shared_organism

import vlmbind as vb
from vlmbind.analysis.circuits import (
    Circuit,
    Faithfulness,
    circuit,
    class_positions,
    declared_edges,
    edge_rank_metrics,
    faithfulness_curve,
)
from vlmbind.analysis.evaluation import stimulus_defaults
from vlmbind.analysis.mediation import aligned_scene_pair
from vlmbind.analysis.validate import score_edges
from vlmbind.app.commands import main
from vlmbind.core.results import detect
from vlmbind.organisms.siit.spec import implied_edges

S = vb.stimuli


def organism_pairs(vlm, n: int, seed: int = 1000):
    kwargs, _ = stimulus_defaults(vlm, "scene", {"n_objects": 3, "entropy": "high"})
    return S.make_pairs("id_selection", n, seed, **kwargs)


def test_position_classes_name_their_positions():
    vlm = get_tiny("tiny-qwen2_vl")
    pair = S.scene_pairs(1, "id_retrieval", 0, n_objects=3)[0]
    clean, _, patch, _, _ = aligned_scene_pair(vlm, pair)
    index = clean.index[0]
    image = np.flatnonzero(index.roles == "image")
    assert image.size and np.array_equal(class_positions(index, "image", patch), image)
    text = class_positions(index, "text", patch)
    assert np.array_equal(np.union1d(text, image), np.arange(clean.seq_len)) and not np.intersect1d(text, image).size
    assert class_positions(index, "last", patch).tolist() == [clean.seq_len - 1]
    assert np.array_equal(class_positions(index, "patch", patch), np.sort(patch)) and patch.size >= 1
    name = pair.patch["text"]
    assert np.array_equal(class_positions(index, f"span:{name}", patch), index.span(name))
    box = (0.0, 0.0, 60.0, 60.0)
    covering = class_positions(index, "box:0,0,60,60", patch)
    assert np.array_equal(covering, np.sort(index.positions_covering(box))) and set(covering) <= set(image)
    with pytest.raises(vb.SpanNotFoundError, match="'zebra' does not occur in the prompt"):
        class_positions(index, "span:zebra", patch)
    with pytest.raises(vb.InputError, match="covers no|names no position"):
        class_positions(index, "box:2000,2000,2100,2100", patch)
    with pytest.raises(vb.InputError, match="not a position class"):
        class_positions(index, "names", patch)


def test_the_declared_edges_follow_from_the_planted_pipeline():
    vlm = shared_organism("organism-vsm")
    declared = declared_edges(vlm.training)
    assert declared == implied_edges(vlm.training["siit"])
    assert [(e["sender"], e["receiver"], e["channel"]) for e in declared] == \
        [("1.0", "2.3", "v"), ("2.3", "3.1", "q"), ("3.1", "5.2", "q")]
    # the edges join the planted heads of consecutive stages: retrieval -> gathering -> selecting -> features
    planted = vlm.training["planted"]
    assert {e["sender"] for e in declared} <= {*planted["id_retrieval"], *planted["id_selection"]}
    assert {e["receiver"] for e in declared} <= {*planted["id_selection"], *planted["feature_retrieval"]}


def test_path_patching_finds_the_planted_pipeline_and_nothing_in_the_twin():
    vlm = shared_organism("organism-vsm")
    declared = declared_edges(vlm.training)
    pairs = organism_pairs(vlm, 2)
    node = vb.locate(vlm, pairs).scores
    rows, found = score_edges(vlm, declared, pairs, node_scores=np.abs(node))
    exact, product = rows[0], rows[-1]
    assert [r["method"] for r in rows] == ["exact", "eap", "eap_ig", "atp_star", "node_product"]
    # AtP* recomputes the receivers' saturated patterns that EAP linearises: the declared edges come first again
    assert set(rows[3]["declared_ranks"]) == {1, 2, 3}
    assert exact["declared_ranks"] == sorted(exact["declared_ranks"]) or set(exact["declared_ranks"]) == {1, 2, 3}
    assert set(exact["declared_ranks"]) == {1, 2, 3} and exact["auroc"] == 1.0 and exact["edges"] == 1008
    frame = found.to_frame()
    heads_only = frame[frame["receiver"] != "logits"]
    assert heads_only["score"].iloc[2] > 50 * heads_only["score"].iloc[3:].abs().max()
    # the same heads through another channel carry nothing: the channel is part of what is found
    wrong = heads_only[(heads_only["sender"] == "2.3") & (heads_only["receiver"] == "3.1")
                       & (heads_only["channel"] != "q")]
    assert len(wrong) == 2 and wrong["score"].abs().max() < 0.1
    # a ranking that knows nodes only puts the planted heads' edges first but cannot tell the channel
    assert product["recall_at_k"] < 1.0 and exact["recall_at_k"] == 1.0
    # the planted circuit (its three edges and 5.2's direct edge) keeps the model's behaviour with every other edge
    # patched; the top one or two edges keep nothing (the pipeline is a chain: every link is needed)
    faithful = exact["faithfulness"]
    assert faithful["declared"]["edges"] == ["1.0 -> 2.3 (v)", "2.3 -> 3.1 (q)", "3.1 -> 5.2 (q)", "5.2 -> logits"]
    assert faithful["declared"]["f"] > 0.9 and faithful["m_empty"] - faithful["m_full"] > 5  # empty: a* wins
    curve = found.faithfulness.to_frame()
    top = curve[curve["circuit"] == "top"]
    assert list(top["edges"][:3]) == [1, 2, 5] and (top["f"][:2].abs() < 0.1).all() and top["f"].iloc[2] > 0.9
    assert 0.8 < faithful["cpr"] <= 1.2 and faithful["cmd"] < 0.3 and faithful["defined"]
    # the estimates are reported beside exact path patching on their top edges, which it scores as above
    estimate = circuit(vlm, pairs, method="eap", verify_top=3, faithfulness=False).to_frame()
    checked = estimate[estimate["exact_score"].notna()]
    assert len(checked) == 3 and list(checked["rank"]) == [1, 2, 3]
    keys = list(zip(frame["sender"], frame["receiver"], frame["channel"]))
    for row in checked.itertuples():
        assert row.exact_score == pytest.approx(frame["score"][keys.index((row.sender, row.receiver, row.channel))],
                                                abs=1e-4)
    twin = shared_organism("organism-vsm-natural")
    found = circuit(twin, organism_pairs(twin, 1), declared=declared)
    twin_frame = found.to_frame()
    # in the twin, every head-to-head and direct edge patched at once barely moves the answer: its behaviour is not
    # carried by these edges, so no circuit of them can be faithful (f would be a ratio of noise)
    assert abs(found.faithfulness.summary()["full_minus_empty"]) < 1
    keys = {(e["sender"], e["receiver"], e["channel"]) for e in declared}
    mine = twin_frame[[k in keys for k in zip(twin_frame["sender"], twin_frame["receiver"], twin_frame["channel"])]]
    assert len(mine) == 3 and mine["score"].abs().max() < 0.05


def test_a_circuit_saves_loads_and_exports(tmp_path):
    vlm = get_tiny("tiny-qwen2_vl")
    pairs = S.scene_pairs(3, "id_selection", 0, n_objects=3)
    found = circuit(vlm, pairs, heads="0.1,1.2,2.0,3.3", sender_at="text", receiver_at="last")
    naive = circuit(vlm, pairs, heads="0.1,1.2,2.0,3.3", sender_at="text", receiver_at="last", method="naive")
    np.testing.assert_allclose(found.per_pair, naive.per_pair, atol=1e-5)
    assert np.abs(found.per_pair).max() > 1e-3
    assert len(found.edges) == 4 + 3 * (3 + 2 + 1)  # direct edges, and q / k / v into every later chosen head
    found.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"edges.csv", "circuit.html", "summary.json"}
    assert detect(tmp_path) is Circuit
    loaded = Circuit.load(tmp_path)
    pd.testing.assert_frame_equal(loaded.to_frame(), found.to_frame(), check_dtype=False)
    assert loaded.edges == [e for e in found.top(len(found.edges))]
    frame = found.to_frame()
    scores = found.per_pair.mean(0)
    assert frame["score"].tolist() == sorted(scores.tolist(), reverse=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["n"] == 3 and summary["sender_at"] == "text" and summary["edges"] == len(found.edges)
    figure = found.figure()
    assert len([t for t in figure.data if t.mode == "lines" and t.x[0] is not None]) == min(20, len(found.edges))
    # the faithfulness curve: saved, loaded and exported with the edges; every fraction keeps int(fraction * edges)
    assert {"faithfulness.csv", "faithfulness.html"} <= {p.name for p in tmp_path.iterdir()}
    curve = found.faithfulness.to_frame()
    assert list(curve["edges"]) == [int(f * len(found.edges)) for f in curve["fraction"]]
    assert curve["f"].iloc[-1] == 1.0  # every edge kept is the model itself
    pd.testing.assert_frame_equal(loaded.faithfulness.to_frame(), curve, check_dtype=False)
    assert loaded.faithfulness.summary() == json.loads((tmp_path / "summary.json").read_text())["faithfulness"]
    figures, tables = loaded.exports()
    assert set(figures) == {"circuit", "faithfulness"} and set(tables) == {"edges.csv", "faithfulness.csv"}
    assert "CPR" in figures["faithfulness"]().data[1].name


def test_faithfulness_and_its_areas_are_the_closed_form_ones():
    """f = (m(circuit) - m(empty)) / (m(full) - m(empty)) over pair means; CPR and CMD are trapezoid areas over
    log10(fraction) mapped to [0, 1]: fractions 0.01, 0.1, 1 sit at 0, 0.5, 1."""
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.1, size=(6, 3))
    noise -= noise.mean(0)  # the pair means are exactly the chosen ones
    curve = Faithfulness(fractions=[0.01, 0.1, 1.0], counts=[1, 10, 100], circuits=np.array([1.0, 2.0, 2.0]) + noise,
                         empty=np.zeros(6), full=np.full(6, 2.0), n_edges=100)
    frame = curve.to_frame()
    np.testing.assert_allclose(frame["f"], [0.5, 1.0, 1.0])
    assert (frame["ci_low"] <= frame["f"]).all() and (frame["f"] <= frame["ci_high"]).all()
    assert frame["ci_high"].iloc[0] > frame["ci_low"].iloc[0]
    summary = curve.summary()
    assert summary["cpr"] == pytest.approx(0.5 * (0.5 + 1.0) / 2 + 0.5 * 1.0)
    assert summary["cmd"] == pytest.approx(0.5 * (0.5 + 0.0) / 2)
    assert summary["cpr_ci"][0] <= summary["cpr"] <= summary["cpr_ci"][1]


def test_mean_ablation_over_one_pair_is_patching_and_bad_settings_are_refused():
    vlm = get_tiny("tiny-qwen2_vl")
    pairs = S.scene_pairs(2, "id_selection", 0, n_objects=3)
    found = circuit(vlm, pairs[:1], heads="0.1,1.2,2.0,3.3", sender_at="text", receiver_at="last")
    mean = circuit(vlm, pairs[:1], heads="0.1,1.2,2.0,3.3", sender_at="text", receiver_at="last", ablation="mean")
    np.testing.assert_allclose(mean.faithfulness.circuits, found.faithfulness.circuits, atol=1e-6)
    assert np.ptp(found.faithfulness.circuits) > 1e-3
    with pytest.raises(vb.InputError, match="ablation"):
        circuit(vlm, pairs, heads="0.1,1.2", ablation="zero")
    from vlmbind.analysis.circuits import _task

    tasks = [_task(vlm, p, "raw", "text", "last", [0, 1, 2, 3]) for p in pairs]
    tasks[1].sender_positions = tasks[1].sender_positions[1:]
    with pytest.raises(vb.InputError, match="position by position"):
        faithfulness_curve(vlm, tasks, found.edges, found.scores, ablation="mean")
    with pytest.raises(vb.InputError, match="fractions"):
        faithfulness_curve(vlm, tasks, found.edges, found.scores, fractions=[0.5])


def test_edge_rank_metrics_are_the_closed_form_ones():
    frame = pd.DataFrame({"sender": ["0.0", "0.0", "1.0", "0.1", "0.0"], "receiver": ["1.0", "1.0", "2.0", "1.1",
                                                                                      "logits"],
                          "channel": ["q", "v", "q", "k", "logits"], "score": [3.0, 1.0, 2.0, 0.5, 9.0]})
    declared = [{"sender": "0.0", "receiver": "1.0", "channel": "v"}, {"sender": "1.0", "receiver": "2.0",
                                                                      "channel": "q"}]
    metrics = edge_rank_metrics(frame, declared)
    # head-to-head edges only, by score: 0.0->1.0 q (3), 1.0->2.0 q (2), 0.0->1.0 v (1), 0.1->1.1 k (0.5)
    assert metrics["declared_ranks"] == [3, 2] and metrics["edges"] == 4 and metrics["recall_at_k"] == 0.5
    assert metrics["auroc"] == pytest.approx(0.5)  # declared {1, 2} vs {3, 0.5}: 2 of 4 orderings right


def test_the_command_writes_a_circuit_and_resumes_only_its_own_run(tmp_path, capsys):
    out = tmp_path / "c"
    argv = ["circuit", "--model", "tiny-qwen2_vl", "--condition", "id_selection", "--n-pairs", "2", "--heads",
            "0.1,1.2,3.3", "--from", "text", "--to", "last", "--channels", "q,v", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "tiny-qwen2_vl, id_selection, 2 pairs, exact path patching, text -> last" in text
    assert "faithfulness of the top edges (patch ablation, n = 2): CPR" in text
    assert (out / "faithfulness.csv").is_file()
    frame = pd.read_csv(out / "edges.csv", dtype={"sender": str, "receiver": str})
    assert set(frame["channel"]) == {"q", "v", "logits"} and len(frame) == 3 + 2 * 3
    assert set(frame["sender_at"]) == {"text"} and (frame["n"] == 2).all()
    # an interrupted run's checkpoint is refused without --resume, and with other arguments
    (out / "circuit.partial.safetensors").write_bytes(b"")
    assert main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err
    (out / "circuit.partial.safetensors").unlink()
    assert main(["circuit", "--model", "tiny-qwen2_vl", "--condition", "attention_swap"]) == 2
