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
from vlmbind.analysis.circuits import Circuit, circuit, class_positions, declared_edges, edge_rank_metrics
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
    assert [r["method"] for r in rows] == ["exact", "eap", "eap_ig", "node_product"]
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
    # the estimates are reported beside exact path patching on their top edges, which it scores as above
    estimate = circuit(vlm, pairs, method="eap", verify_top=3).to_frame()
    checked = estimate[estimate["exact_score"].notna()]
    assert len(checked) == 3 and list(checked["rank"]) == [1, 2, 3]
    keys = list(zip(frame["sender"], frame["receiver"], frame["channel"]))
    for row in checked.itertuples():
        assert row.exact_score == pytest.approx(frame["score"][keys.index((row.sender, row.receiver, row.channel))],
                                                abs=1e-4)
    twin = shared_organism("organism-vsm-natural")
    found = circuit(twin, organism_pairs(twin, 1))
    twin_frame = found.to_frame()
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
    frame = pd.read_csv(out / "edges.csv", dtype={"sender": str, "receiver": str})
    assert set(frame["channel"]) == {"q", "v", "logits"} and len(frame) == 3 + 2 * 3
    assert set(frame["sender_at"]) == {"text"} and (frame["n"] == 2).all()
    # an interrupted run's checkpoint is refused without --resume, and with other arguments
    (out / "circuit.partial.safetensors").write_bytes(b"")
    assert main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err
    (out / "circuit.partial.safetensors").unlink()
    assert main(["circuit", "--model", "tiny-qwen2_vl", "--condition", "attention_swap"]) == 2
