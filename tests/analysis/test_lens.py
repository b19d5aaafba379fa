"""The logit lens over the image grid and the head lens (``vlmbind.analysis.lens``), against hand computations on
Hugging Face's own outputs; the result's files round-trip byte for byte; the figures build from the tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import get_tiny

from vlmbind.analysis import lens as lens_module
from vlmbind.analysis.lens import EMBED, LensResult, lens, lens_dataset, unembed
from vlmbind.core.errors import HeadLayoutError, InputError, NoImageTokensError
from vlmbind.stimuli.core import Canvas
from vlmbind.stimuli.scenes import scene_description


def _scenes(n: int, seed: int = 3):
    """Scenes on a small canvas (few image tokens on the tiles of any-res families)."""
    return scene_description(n, seed, canvas=Canvas(image_size=112, grid=3))


def _one(vlm, seed: int = 3):
    """A one-example scene data set (one row: no padding, so batch positions are the model's own)."""
    return _scenes(1, seed)


def _hand_probs(vlm, hidden: torch.Tensor, norm: bool = True) -> torch.Tensor:
    """softmax(softcap(lm_head(norm(hidden)))) written out from the HF modules and the config."""
    text = vlm.model.model.language_model if hasattr(vlm.model.model, "language_model") else vlm.model.model.text_model
    with torch.no_grad():
        x = text.norm(hidden) if norm else hidden
        logits = (x @ vlm.model.lm_head.weight.T).float()
        cap = getattr(vlm.model.config.get_text_config(), "final_logit_softcapping", None)
        if cap is not None and vlm.family != "gemma3":  # Gemma3ForConditionalGeneration's forward applies none
            logits = cap * torch.tanh(logits / cap)
        return torch.softmax(logits, -1)


@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-gemma3", "tiny-paligemma"])
def test_the_lens_is_the_unembedding_of_hf_hidden_states(name):
    vlm = get_tiny(name)
    data = _one(vlm)
    result = lens(vlm, data)
    batch = vlm.prepare([data[0].image], [data[0].prompt])
    with torch.no_grad():
        out = vlm.model(**vlm.model_inputs(batch), output_hidden_states=True)
    hidden = out.hidden_states  # L + 1: the embeddings, then each layer's output
    # HF may hand back the last layer's output already normed: the logits say which
    normed_last = torch.allclose(vlm.model.lm_head(hidden[-1]), out.logits, atol=1e-5)
    image = np.flatnonzero(batch.inputs["input_ids"][0].numpy() == vlm.adapter.image_token_id)
    assert result.layers == [EMBED, *(str(l) for l in range(vlm.n_layers))]
    words = result.words
    ids = [vlm.adapter.tokenizer(" " + w, add_special_tokens=False)["input_ids"][0] for w in words]
    for depth, label in enumerate(result.layers):
        last = depth == vlm.n_layers
        probs = _hand_probs(vlm, hidden[depth][0, image], norm=not (last and normed_last)).double().numpy()
        rows = result.cells[result.cells["layer"] == label].set_index("position").loc[image]
        np.testing.assert_allclose(rows["top_prob"], probs.max(-1), rtol=1e-4, atol=1e-7)
        np.testing.assert_array_equal(rows["top_id"], probs.argmax(-1))
        for w, i in zip(words, ids):
            np.testing.assert_allclose(rows[f"p_{w}"], probs[:, i], rtol=1e-4, atol=1e-9)
    assert set(words) == {w for o in data[0].objects for w in (o.colour, o.shape)}


def test_the_last_layer_decoded_is_the_models_own_output(tiny):
    """The final norm and softcap every family declares: the last layer's residual decoded equals the logits."""
    batch = tiny.prepare([_one(tiny)[0].image], ["in this image there is a"])
    last = f"blocks.{tiny.n_layers - 1}.hook_resid_post"
    run = tiny.run(batch, sites=[last])
    torch.testing.assert_close(unembed(tiny, run.cache[last][0]), run.logits[0].float(), rtol=1e-5, atol=1e-5)
    decoder = tiny.adapter.text_layers.rpartition(".")[0]
    # the declared final norm: `norm`, or Qwen4-Exp's hyper-connection mixer
    assert tiny.adapter.final_norm_module() is tiny.model.get_submodule(f"{decoder}.{tiny.adapter.final_norm}")


def test_the_head_lens_is_the_o_proj_slice_of_one_head_and_goes_through_head_writes(monkeypatch):
    vlm = get_tiny("tiny-qwen2_5_vl")  # no post-norm, no gate: a head's write is z_h W_O[:, h]^T
    data = _one(vlm)
    calls = []
    original = lens_module.head_writes

    def spy(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(lens_module, "head_writes", spy)
    layer, head = 1, 2
    result = lens(vlm, data, heads=f"{layer}.{head}", layers=[0])
    assert calls == [layer] and result.meta["head_cells"]
    batch = vlm.prepare([data[0].image], [data[0].prompt])
    o_proj = vlm.model.model.language_model.layers[layer].self_attn.o_proj
    seen = {}
    handle = o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("z", a[0].detach().clone()))
    try:
        with torch.no_grad():
            vlm.model(**vlm.model_inputs(batch))
    finally:
        handle.remove()
    d = vlm.adapter.d_head
    rows = result.heads
    positions = rows["position"].to_numpy().copy()
    with torch.no_grad():
        z = seen["z"][0, positions, head * d : (head + 1) * d]
        write = z @ o_proj.weight[:, head * d : (head + 1) * d].T
        probs = _hand_probs(vlm, write).double().numpy()
    np.testing.assert_allclose(rows["top_prob"], probs.max(-1), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(rows["write_norm"], write.norm(dim=-1).double().numpy(), rtol=1e-5)
    w = result.words[0]
    i = vlm.adapter.tokenizer(" " + w, add_special_tokens=False)["input_ids"][0]
    np.testing.assert_allclose(rows[f"p_{w}"], probs[:, i], rtol=1e-4, atol=1e-9)
    assert rows["where"].iloc[0] == "last" and positions[0] == batch.index[0].last_position
    assert (rows["where"].iloc[1:] == "image").all() and len(rows) == 1 + len(batch.index[0].image_positions)


def test_decodability_recomputed_from_the_saved_table():
    """decodable.csv and objects.csv follow from lens.csv by the documented rule (pool words all saved)."""
    vlm = get_tiny("tiny-llava_onevision")  # two grids of one image: an object's tokens lie in both
    data = _scenes(3, 5)
    colours, shapes = data.params["colours"], data.params["shapes"]
    result = lens(vlm, data, words=[*colours, *shapes], layers=[1])
    assert result.meta["heads"] and not result.meta["head_cells"]  # every head, at the last token only
    cells = result.cells
    found = {"colour": {}, "shape": {}}
    for e in data:
        mine = cells[cells["example"] == e.id]
        for k, o in enumerate(e.objects):
            own = mine[mine["objects"].str.split(";").apply(lambda ks, k=k: str(k) in ks)]
            for feature, pool in (("colour", colours), ("shape", shapes)):
                for label in result.layers:
                    means = own[own["layer"] == label][[f"p_{w}" for w in pool]].mean(0).to_numpy()
                    found[feature].setdefault(label, []).append(pool[int(means.argmax())] == getattr(o, feature))
    for feature in ("colour", "shape"):
        rows = result.decodable[result.decodable["feature"] == feature].set_index("layer")
        for label, hits in found[feature].items():
            assert rows.loc[label, "n"] == len(hits)
            assert rows.loc[label, "share"] == pytest.approx(np.mean(hits))
            assert rows.loc[label, "low"] <= rows.loc[label, "share"] <= rows.loc[label, "high"]
        assert (rows["chance"] == 1 / len(colours if feature == "colour" else shapes)).all()
    first = result.objects["first_colour_layer"].tolist()
    hits = list(zip(*(found["colour"][label] for label in result.layers)))
    assert first == [next((l for l, h in zip(result.layers, row) if h), "") for row in hits]


def test_the_result_round_trips_byte_for_byte_with_awkward_tokens(tmp_path):
    vlm = get_tiny("tiny-qwen3_5")  # hybrid: the head lens only on layers with per-head outputs
    result = lens(vlm, _one(vlm), layers=[0, 1])
    assert set(result.heads["layer"]) <= set(vlm.adapter.head_layers())
    awkward = ["", "null", "NA", "nan", " a,b", '"q"', "\n", "\r", "x\r\ny", "None", "#", "0.50"]
    tokens = (awkward * (len(result.cells) // len(awkward) + 1))[: len(result.cells)]
    result.cells["top_token"] = tokens
    result.save(tmp_path / "a")
    loaded = LensResult.load(tmp_path / "a")
    assert loaded.cells["top_token"].tolist() == tokens
    pd.testing.assert_frame_equal(loaded.decodable, result.decodable)
    loaded.save(tmp_path / "b")
    for name in LensResult.reproduced_files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert LensResult.matches(tmp_path / "a")
    with pytest.raises(InputError, match="no column"):
        (tmp_path / "a" / "decodable.csv").write_text("layer,feature\nembed,colour\n")
        LensResult.load(tmp_path / "a")


@pytest.mark.parametrize("name", ["tiny-qwen2_5_vl", "tiny-llava_onevision", "tiny-gemma3"])
def test_the_figures_show_the_tables_numbers(name):
    vlm = get_tiny(name)
    result = lens(vlm, _one(vlm, 7), layers=[0, vlm.n_layers - 1])
    fig = result.figure()
    example = result.cells["example"].iloc[0]
    objects = result.objects[result.objects["example"] == example]
    words = list(dict.fromkeys([*objects["colour"], *objects["shape"]]))
    assert len(fig.data) == len(words) * len(result.layers)
    assert [s["label"] for s in fig.layout.sliders[0].steps] == result.layers
    grid = result.meta["figure_grid"]
    rows = result.cells[(result.cells["layer"] == EMBED) & (result.cells["grid"] == grid)]
    z = np.asarray(fig.data[0].z, dtype=float)
    for r, c, p in zip(rows["row"], rows["col"], rows[f"p_{words[0]}"]):
        assert z[r, c] == p
    assert sum(t.visible for t in fig.data) == len(words)
    decodable = result.decodable_figure()
    shares = result.decodable[result.decodable["feature"] == "colour"]["share"].tolist()
    assert decodable.data[0].y == tuple(shares)
    assert f"n={result.meta['n_objects']}" in decodable.layout.title.text


def test_refusals_are_named():
    with pytest.raises(NoImageTokensError, match="cross-attention"):
        lens(get_tiny("tiny-mllama"), _one(get_tiny("tiny-qwen2_5_vl")))
    vlm = get_tiny("tiny-qwen2_5_vl")
    data = _one(vlm)
    for bad in ({"layers": [99]}, {"layers": []}, {"heads": "9.0"}, {"heads": "1.x"}, {"words": ["red", ""]},
                {"words": ["red", "red"]}, {"colours": ["red"]}, {"batch_size": 0}):
        with pytest.raises(InputError):
            lens(vlm, data, **bad)
    hybrid = get_tiny("tiny-qwen3_5")
    linear = sorted(set(range(hybrid.n_layers)) - set(hybrid.adapter.head_layers()))
    if linear:
        with pytest.raises(HeadLayoutError):
            lens(hybrid, _one(hybrid), heads=f"{linear[0]}.0")
    with pytest.raises(InputError, match="task must be one of"):
        lens_dataset(vlm, "count", 1)
    drawn = lens_dataset(vlm, "query", 2, 4)  # the family's typical image size, the generator's pools
    assert drawn.task == "query" and drawn[0].image.size == (vlm.adapter.typical_image_size,) * 2

