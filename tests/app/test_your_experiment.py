"""A researcher's own experiment through the command line: a pairs folder written by hand (PIL and json only) is
scored by ``locate --pairs`` exactly as the naive reference scores it, a box patch is PatchHeads at the tokens
covering the box, two processes write the one-process files; a task file runs through ``eval --data`` and
``ablate --data``; what cannot be meant is refused with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import get_tiny, write_hand_pairs, write_hand_task

import vlmbind as vb
from vlmbind.analysis import answer_token_ids, locate
from vlmbind.cli import main
from vlmbind.engine.interventions import PatchHeads

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
BOX = [30, 40, 90, 100]  # the red shape of write_hand_pairs's first pair


def located(out):
    frame = pd.read_csv(out / "scores.csv").sort_values(["layer", "head"])
    return frame["score"].to_numpy(), json.loads((out / "summary.json").read_text())


def test_locate_reads_hand_written_pairs_exact_equals_naive(tmp_path, capsys, monkeypatch):
    write_hand_pairs(tmp_path / "mine", 3, patch={"box": BOX})
    base = ["locate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "mine"), "--json"]
    assert main([*base, "--out", str(tmp_path / "exact")]) == 0
    assert main([*base, "--method", "naive", "--out", str(tmp_path / "naive")]) == 0
    exact, summary = located(tmp_path / "exact")
    naive, _ = located(tmp_path / "naive")
    np.testing.assert_allclose(exact, naive, atol=1e-5)
    assert np.abs(naive).max() > 1e-4, "the pairs must move some head for the comparison to mean anything"
    assert summary["condition"] == "colour_swap" and summary["pair_ids"] == ["p0", "p1", "p2"]
    assert summary["pairs_file"] == str((tmp_path / "mine" / "pairs.jsonl").resolve())
    check = summary["predictions"]
    assert check["n"] == 3 and len(check["per_pair"]) == 3 and 0 <= check["clean_is_a"] <= 3
    capsys.readouterr()
    # the default folder names the pairs folder and the condition
    monkeypatch.chdir(tmp_path)
    assert main(["locate", "--model", "tiny-qwen2_vl", "--pairs", "mine", "--json"]) == 0
    assert (tmp_path / "runs/locate/tiny-qwen2_vl-mine-colour_swap/scores.csv").is_file()


def test_a_box_patch_is_patch_heads_at_the_tokens_covering_the_box(tmp_path):
    """Computed here from the processor's tokens alone: Qwen2-VL lays a 224 px image out as 8 x 8 merged patches
    of 28 px, in row-major order, one <|image_pad|> token each."""
    vlm = get_tiny("tiny-qwen2_vl")
    pairs = vb.stimuli.load_pairs(write_hand_pairs(tmp_path / "mine", 1, patch={"box": BOX}))
    scores = locate(vlm, pairs, method="exact", prompt_format="raw")
    pair = pairs[0]
    clean = vlm.prepare(pair.clean.image, pair.clean.prompt)
    cf = vlm.prepare(pair.counterfactual.image, pair.counterfactual.prompt)
    ids = clean.inputs["input_ids"][0]
    image_positions = torch.nonzero(ids == vlm.adapter.tokenizer.convert_tokens_to_ids("<|image_pad|>"))[:, 0]
    assert len(image_positions) == 64
    cells = [r * 8 + c for r in range(40 // 28, -(-100 // 28)) for c in range(30 // 28, -(-90 // 28))]
    positions = image_positions[cells].tolist()
    _, a, a_star = answer_token_ids(vlm.adapter.tokenizer, pair.answer, pair.answer_counterfactual)

    def diff(interventions=()):
        logits = vlm.logits(clean, interventions)[0, -1].float()
        return float(logits[a_star] - logits[a])

    base = diff()
    effects = []
    for layer, head in [(0, 1), (1, 2), (3, 0)]:
        z_cf = vlm.capture(cf, f"blocks.{layer}.attn.hook_z")[f"blocks.{layer}.attn.hook_z"]
        patch = PatchHeads(layer=layer, heads=[head], positions=positions, values=z_cf[:, positions][:, :, [head]])
        effects.append(diff([patch]) - base)
        assert scores.per_pair[0, layer, head] == pytest.approx(effects[-1], abs=1e-5)
    assert max(map(abs, effects)) > 1e-4


def test_two_processes_on_a_pairs_file_write_the_one_process_files(tmp_path, capsys):
    write_hand_pairs(tmp_path / "mine", 4, patch={"text": "red object"})
    args = ["locate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "mine"), "--json"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    done = subprocess.run([sys.executable, "-m", "vlmbind", *args, "--out", str(tmp_path / "two"), "--processes",
                           "2"], capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["processes"] == 2
    assert (tmp_path / "two/scores.csv").read_bytes() == (tmp_path / "one/scores.csv").read_bytes()


@pytest.mark.parametrize("extra,message", [
    (["--n-pairs", "8"], "--n-pairs does not apply with --pairs"),
    (["--seed", "1", "--entropy", "low"], "--seed, --entropy do not apply with --pairs"),
    (["--condition", "shape_swap"], "no pair of condition 'shape_swap'"),
])
def test_options_that_do_not_apply_to_a_pairs_file_are_refused(tmp_path, capsys, extra, message):
    write_hand_pairs(tmp_path / "mine", 2)
    code = main(["locate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "mine"), *extra,
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,message", [
    (["--condition", "colour_swap"], "--condition 'colour_swap' is not registered"),
    (["--condition", "id_selecton"], "Did you mean 'id_selection'"),
    ([], "pass --condition"),
    (["--condition", "attention_swap", "--entropy", "low"], "--entropy does not apply to --condition attention_swap"),
    (["--condition", "id_selection", "--trace-task", "search"], "--trace-task does not apply"),
])
def test_built_in_conditions_are_checked_before_the_model_loads(argv, message, capsys):
    assert main(["locate", "--model", "tiny-qwen2_vl", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_resume_is_refused_when_the_pairs_file_changed(tmp_path, capsys):
    write_hand_pairs(tmp_path / "mine", 2)
    write_hand_pairs(tmp_path / "other", 2)
    out = str(tmp_path / "out")
    assert main(["locate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "mine"), "--out", out]) == 0
    capsys.readouterr()
    assert main(["locate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "other"), "--out", out,
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--pairs" in err and "other" in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_is_never_resumed_on_other_pairs_with_the_same_ids(tmp_path):
    """Generated pairs are named pair-00000... for every seed: the checkpoint's content digest tells them apart."""
    vlm = get_tiny("tiny-qwen2_vl")
    checkpoint = tmp_path / "locate.partial.safetensors"
    seed0 = vb.stimuli.scene_pairs(2, "id_selection", 0)
    from vlmbind.analysis.mediation import save_checkpoint, pairs_digest

    key = {"model": vlm.name, "method": "exact", "condition": "id_selection", "layers": list(range(vlm.n_layers)),
           "pairs": [p.id for p in seed0], "content": pairs_digest(seed0),
           "prompt_format": vlm.active_prompt_format}
    save_checkpoint(checkpoint, key, np.zeros((1, vlm.n_layers, vlm.n_heads)))
    seed1 = vb.stimuli.scene_pairs(2, "id_selection", 1)
    assert [p.id for p in seed1] == key["pairs"]
    with pytest.raises(vb.InputError, match="content"):
        locate(vlm, seed1, checkpoint=checkpoint)


def test_a_misspelt_answer_is_named_with_the_clean_prediction_rate(tmp_path, capsys):
    """On organism-vsm, vlmbind's own id_selection pairs written as a pairs file, one answer misspelt: the model's
    clean prediction is a on the others, and the warning names the misspelt pair."""
    from vlmbind.analysis.evaluation import training_defaults
    from helpers import shared_organism

    kwargs = training_defaults(shared_organism("organism-vsm"), "scene", {"n_objects": 3})
    vb.stimuli.scene_pairs(8, "id_selection", 5, **kwargs).save(tmp_path / "vsm")
    path = tmp_path / "vsm" / "pairs.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    colour, shape = records[3]["answer"].split()
    records[3]["answer"] = f"{colour[0]}{colour[2]}{colour[1]}{colour[3:]} {shape}"  # red -> rde
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["locate", "--model", "organism-vsm", "--pairs", str(tmp_path / "vsm"), "--out",
                 str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "the model's clean prediction is a on 7/8 pairs" in text, text
    assert "warning: not a on pair-00003" in text and "spelling" in text
    check = json.loads((tmp_path / "out/summary.json").read_text())["predictions"]
    assert [r["id"] for r in check["per_pair"] if not r["clean_is_a"]] == ["pair-00003"]
    assert check["failing"][0]["predicted"].strip() == colour
    assert check["counterfactual_is_own"] == check["counterfactual_checked"] == 8


def test_eval_and_ablate_read_a_task_file(tmp_path, capsys, monkeypatch):
    write_hand_task(tmp_path / "mine", 3, accept=["box"], scorer="first_word")
    out = tmp_path / "eval"
    assert main(["eval", "--model", "tiny-qwen2_vl", "--data", str(tmp_path / "mine"), "--out", str(out),
                 "--batch-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "your task (n=3" in text and "95% Wilson interval" in text
    records = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["q0", "q1", "q2"]
    for r in records:  # the task file's scorer judged each reply
        words = vb.stimuli.answers.answer_words(r["output"])
        assert r["correct"] == (words[:1] in (["square"], ["box"]))
    monkeypatch.chdir(tmp_path)  # the default folder is relative
    assert main(["ablate", "--model", "tiny-qwen2_vl", "--data", "mine/task.jsonl", "--heads", "0.1,1.2",
                 "--seeds", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["task"] == "user" and summary["out"] == "runs/ablate/tiny-qwen2_vl-mine-image_attention-heads"
    arms = json.loads((tmp_path / summary["out"] / "results.json").read_text())["arms"]
    assert [a["arm"] for a in arms] == ["clean", "top", "random", "random", "random_same_layers",
                                        "random_same_layers", "bottom"]
    assert arms[1]["heads"] == ["0.1", "1.2"] and all(a["n"] == 3 for a in arms)


@pytest.mark.parametrize("argv,message", [
    (["eval", "--data", "{d}", "--n", "5"], "--n does not apply with --data"),
    (["eval", "--data", "{d}", "--objects", "3", "--seed", "2"], "--seed, --objects do not apply with --data"),
    (["ablate", "--data", "{d}", "--heads", "0.1", "--n", "5"], "--n does not apply with --data"),
    (["eval", "--data", "{d}", "--task", "scene"], "not allowed with argument"),
])
def test_generator_options_do_not_apply_to_a_task_file(tmp_path, capsys, argv, message):
    write_hand_task(tmp_path / "mine", 2)
    argv = [a.replace("{d}", str(tmp_path / "mine")) for a in argv]
    assert main([argv[0], "--model", "tiny-qwen2_vl", *argv[1:], "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_validate_scores_the_methods_against_given_heads_on_a_pairs_file(tmp_path, capsys):
    """organism-vsm's id_selection pairs, read back from a pairs file: exact and naive rank the planted heads 2.3 and
    3.1 first, and ablating them (zero) on the pairs' clean inputs drops accuracy below random heads'."""
    from helpers import shared_organism

    from vlmbind.analysis.evaluation import training_defaults
    from vlmbind.analysis.validate import held_out_objects

    vlm = shared_organism("organism-vsm")
    kwargs = training_defaults(vlm, "scene", {"n_objects": held_out_objects(vlm)})
    vb.stimuli.scene_pairs(12, "id_selection", 2000, **kwargs).save(tmp_path / "vsm")
    out = tmp_path / "out"
    assert main(["validate", "--model", "organism-vsm", "--pairs", str(tmp_path / "vsm"), "--heads",
                 "id_selection=2.3,3.1", "--methods", "exact,naive", "--modes", "zero", "--ablation-seeds", "3",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "12 pairs of" in text and "edit not run" in text and "probes not run" in text
    result = json.loads((out / "validation.json").read_text())
    exact = next(r for r in result["methods"] if r["method"] == "exact")
    assert exact["condition"] == "id_selection" and sorted(exact["planted_ranks"]) == [1, 2]
    assert result["naive_check"]["id_selection"]["max_abs_difference"] < 1e-4
    arms = {}
    for row in result["ablation"]:
        arms.setdefault(row["arm"], []).append(row["accuracy"])
    assert arms["clean"][0] >= 0.9 and arms["top"][0] <= 0.2 < min(arms["random"])


def test_validate_runs_on_hand_written_pairs(tmp_path, capsys):
    write_hand_pairs(tmp_path / "mine", 3)
    out = tmp_path / "out"
    assert main(["validate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "mine"), "--heads",
                 "colour_swap=1.2", "--methods", "exact,attribution", "--modes", "zero", "--ablation-seeds", "2",
                 "--out", str(out), "--json"]) == 0
    result = json.loads((out / "validation.json").read_text())
    assert [(r["condition"], r["method"]) for r in result["methods"]] == [("colour_swap", "exact"),
                                                                         ("colour_swap", "attribution")]
    assert {r["arm"] for r in result["ablation"]} == {"clean", "top", "random", "random_same_layers", "bottom"}
    assert all(r["n"] == 3 for r in result["ablation"])
    capsys.readouterr()
    for extra, message in ((["--n-pairs", "4"], "--n-pairs does not apply with --pairs"),
                           ([], "--pairs needs --heads")):
        argv = ["validate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "mine"), *extra]
        if extra:
            argv += ["--heads", "colour_swap=1.2"]
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert main(["validate", "--model", "tiny-qwen2_vl", "--pairs", str(tmp_path / "mine"), "--heads",
                 "id_selection=1.2"]) == 2
    assert "are not the conditions validated here: colour_swap" in capsys.readouterr().err


def test_stimuli_outside_an_organisms_training_get_a_one_line_warning(capsys):
    from helpers import get_tiny, shared_organism

    from vlmbind.analysis.evaluation import outside_training, training_defaults
    from vlmbind.stimuli import Canvas

    p2a = shared_organism("organism-p2a")
    assert outside_training(p2a, "count", training_defaults(p2a, "count", {"objects": (5, 10)})) is None
    message = outside_training(p2a, "count", training_defaults(p2a, "count", {"objects": (11, 15)}))
    assert "11-15 objects per image (trained on 5-10)" in message and "organism-p2a" in message
    wide = outside_training(p2a, "scene", {"n_objects": 3, "canvas": Canvas(image_size=224, grid=3)})
    assert "224-pixel canvas of 3 x 3 cells (trained on 168 pixels, 6 x 6)" in wide
    vsm = shared_organism("organism-vsm")
    assert "was not trained on count" in outside_training(vsm, "count", {})
    assert outside_training(get_tiny("tiny-qwen2_vl"), "count", {"objects": (11, 15)}) is None  # no record
    assert main(["locate", "--model", "organism-vsm", "--condition", "id_selection", "--objects", "5", "--entropy",
                 "low", "--n-pairs", "2", "--json"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["vlmbind: warning: scene stimuli with 5 objects per image (trained on 2-4) lie outside what "
                        "organism-vsm was trained on: expect accuracy near chance there"]


def test_answers_that_tokenise_alike_are_named_with_their_pair(tmp_path, capsys):
    """'square' and ' square' differ as text but not as tokens after the separator: nothing to score, said with the
    pair's id."""
    path = write_hand_pairs(tmp_path / "mine", 2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[1]["answer_counterfactual"] = "square  "
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(vb.stimuli.PairsFileError, match="equals 'answer'"):
        vb.stimuli.load_pairs(path)  # the file's check catches the plain case
    records[1]["answer_counterfactual"] = "Square"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    vlm = get_tiny("tiny-qwen2_vl")
    pairs = vb.stimuli.load_pairs(path)
    tokenizer = vlm.adapter.tokenizer  # Qwen's: case-sensitive, so "Square" is another token
    assert tokenizer(" square", add_special_tokens=False)["input_ids"] != \
        tokenizer(" Square", add_special_tokens=False)["input_ids"]
    from vlmbind.analysis.mediation import aligned_scene_pair

    aligned_scene_pair(vlm, pairs[1])  # distinct tokens: scored
    from dataclasses import replace

    same = replace(pairs[1], answer_counterfactual="square")
    with pytest.raises(vb.InputError, match="pair 'p1': answers 'square' and 'square' have no differing token"):
        aligned_scene_pair(vlm, same)
