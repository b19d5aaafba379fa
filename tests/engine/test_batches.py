"""``batches.append_tokens``: the one way tokens are appended, driven by the adapter's ``token_inputs``.

Checked against the model itself: on every family, the logits of a batch extended by appended ids equal those of the
processor's own batch for the longer text, and every per-token input the processor returns is declared by the
adapter (so none is left a token short). And what an appended answer follows: the reply's first word comes after
a space only where the chat template ends on a word.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny

import vlmbind as vb
from vlmbind.engine.batches import append_tokens


def test_every_per_token_input_is_declared(tiny):
    batch = tiny.prepare([draw_scene(0), draw_scene(1)], [PROMPT, PROMPT + " red"])
    ids = batch.inputs["input_ids"]
    per_token = {k for k, v in batch.inputs.items() if isinstance(v, torch.Tensor) and v.shape == ids.shape}
    assert per_token <= {"input_ids", "attention_mask", *tiny.adapter.token_inputs}


def test_appended_ids_run_like_the_prepared_longer_prompt(tiny):
    """Appending the ids of one more word gives the logits of the prompt that already holds it (one row, so no
    padding moves). Where appended tokens are answer tokens (PaliGemma's prefix LM: the prompt attends both ways, the
    answer causally), no longer prompt runs like them: they carry the declared values instead, the prompt's inputs
    are untouched, and tests/adapters/test_family_paligemma.py checks them against HF's own generation. A value repeated
    from the last position (Llama-3.2-Vision's cross-attention mask) is what the longer prompt has there."""
    tok = tiny.adapter.tokenizer
    word = tok(" red", add_special_tokens=False)["input_ids"]
    short = tiny.prepare(draw_scene(0), PROMPT)
    if any(v != "last" for v in tiny.adapter.appended_token_values.values()):
        inputs = append_tokens(tiny.adapter, short.inputs, torch.tensor([word]))
        n = short.inputs["input_ids"].shape[1]
        assert inputs["input_ids"][0, n:].tolist() == word
        for key, value in tiny.adapter.appended_token_values.items():
            assert torch.equal(inputs[key][:, :n], short.inputs[key]), key
            assert inputs[key][0, n:].tolist() == [value] * len(word), key
        return
    long = tiny.prepare(draw_scene(0), PROMPT + " red")
    assert long.inputs["input_ids"][0, -len(word):].tolist() == word  # the word is its own tokens at the end
    inputs = append_tokens(tiny.adapter, short.inputs, torch.tensor([word]))
    assert set(inputs) == set(long.inputs)
    for key in ("input_ids", "attention_mask", *tiny.adapter.token_inputs):
        if key in long.inputs:
            assert torch.equal(inputs[key], long.inputs[key]), key
    extended = vb.Batch(inputs=inputs, index=tiny.token_index(inputs, short.images), prompts=short.prompts,
                        images=short.images)
    torch.testing.assert_close(tiny.logits(extended)[0, -1], tiny.logits(long)[0, -1], rtol=0, atol=1e-5)
    assert short.inputs["input_ids"].shape[1] + len(word) == inputs["input_ids"].shape[1]  # the input is untouched


def test_an_undeclared_per_token_input_is_refused():
    vlm = vb.load("tiny-llava")
    batch = vlm.prepare(draw_scene(0), PROMPT)
    inputs = {**batch.inputs, "segment_ids": torch.zeros_like(batch.inputs["input_ids"])}
    with pytest.raises(vb.InputError, match="segment_ids.*LlavaAdapter.token_inputs"):
        append_tokens(vlm.adapter, inputs, torch.tensor([5]))
    with pytest.raises(vb.InputError, match="B or B T tokens"):
        append_tokens(vlm.adapter, batch.inputs, torch.tensor([[[5]]]))


# the chat prompt ends on a new line (ChatML, Gemma-3, the tiny Gemma-4), on a marker token (Kimi's <|im_middle|>,
# Cohere's <|CHATBOT_TOKEN|>, Mistral's [/INST]) or on a word (LLaVA's ASSISTANT:, Idefics3's Assistant:, LLaVA-NeXT's
# [/INST], which its vocabulary spells in pieces)
SEPARATORS = {"tiny-qwen2_5_vl": "", "tiny-gemma3": "", "tiny-gemma4": "", "tiny-kimi_k25": "",
              "tiny-aya_vision": "", "tiny-mistral3": "", "tiny-llava": " ", "tiny-idefics3": " ",
              "tiny-llava_next": " "}


@pytest.mark.parametrize("name", SEPARATORS)
def test_a_chat_answer_follows_the_templates_last_token(name):
    vlm = get_tiny(name)
    assert vlm.answer_separator(True) == SEPARATORS[name]
    assert vlm.answer_separator(False) == " "
    assert vlm.answer_ids("red", chat=True) == vlm.adapter.tokenizer(SEPARATORS[name] + "red",
                                                                     add_special_tokens=False)["input_ids"]
