"""Tiny Idefics3 and SmolVLM: 4 text layers (Llama, 4 heads, 2 KV heads, d_head 32), 2-block SigLIP-style towers on
64 px tiles, a pixel-shuffle connector.

Design: the real config, model, image-processor and processor classes of each family at a tiny size, so that every
code path a real checkpoint takes is exercised: the image processor resizes the longest edge to 128 px (twice the
64 px tile, as real checkpoints use a multiple of their tile), stretches the image to whole tiles, cuts them and
appends the whole image squashed to one tile (the global image); the processor writes ``<fake_token_around_image>``,
a ``<row_i_col_j>`` tag and the tile's ``<image>`` tokens per tile, a newline after each row of tiles, then
``\\n<fake_token_around_image><global-img>`` and the global image's tokens and a closing
``<fake_token_around_image>``. So a 224x224 image becomes 2x2 tiles and a global image, 448x224 one row of 2 tiles.

* Idefics3 (``tiny-idefics3``): 8 px patches (8x8 a tile), ``scale_factor = 2`` as ``HuggingFaceM4/Idefics3-8B-Llama3``,
  so the connector's pixel shuffle makes a 4x4 grid of 16 tokens a tile, each token 2x2 patches (16 px of a tile).
* SmolVLM (``tiny-smolvlm``): 4 px patches (16x16 a tile), ``scale_factor = 4`` as ``HuggingFaceTB/SmolVLM-256M``,
  again 16 tokens a tile, each token 4x4 patches.

A 224x224 image is 5 frames of 16 tokens: 80 image tokens, 11 structure tokens and 3 newlines. The connector's single
Linear keeps HF's init (std 0.02): it already hands the language model features of std 0.3 (Idefics3) and 0.7
(SmolVLM), 15 to 35 times the token embeddings'. The text layers are redrawn with std 0.08 so head effects are
O(0.1-1) logits. The tokenizer has every structure token as a special token (the 36 ``<row_i_col_j>`` tags up to 6x6
tiles, as Idefics3's processor knows them) and does not prepend a BOS token; the chat template is SmolVLM's
(``<|im_start|>User:<image>...<end_of_utterance>\\nAssistant:``).
SmolVLM's processor needs the ``num2words`` package (for its video prompts), as in transformers.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    LlamaConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessor,
    SmolVLMProcessor,
    SmolVLMVideoProcessor,
)

from ..core.errors import ModelLoadError
from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

TILE_TAGS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>",
            "<image>", "<global-img>", *TILE_TAGS]
# SmolVLM's template (the Idefics3 checkpoints' is the same but for a leading BOS)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TILE = 64
LONGEST_EDGE = 2 * TILE
SIGLIP_MEAN = SIGLIP_STD = [0.5, 0.5, 0.5]
# family -> (config, model and image-processor classes, patch size, pixel-shuffle scale factor)
FAMILIES = {
    "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, 8, 2),
    "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessor, 4, 4),
}
_TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def idefics3_tokenizer() -> Any:
    """The tiny byte-level BPE with the structure tokens, named as SmolVLM's processor looks them up."""
    return build_tokenizer(
        SPECIALS, bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                              "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"},
    )


def build_idefics3(family: str, seed: int, attn_implementation: str = "eager") -> tuple[torch.nn.Module, Any]:
    """An Idefics3 (``family="idefics3"``) or SmolVLM (``"smolvlm"``) with random weights and its processor.

    Args:
        family: ``"idefics3"`` or ``"smolvlm"``.
        seed: weights are a deterministic function of it (same seed -> identical weights).
        attn_implementation: ``"eager"`` (attention patterns available) or ``"sdpa"``.

    Returns:
        ``(model, processor)``; the model is in eval mode.

    Raises:
        ModelLoadError: SmolVLM without the ``num2words`` package, which its processor requires.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if family == "smolvlm" and importlib.util.find_spec("num2words") is None:  # SmolVLMProcessor refuses to start
        raise ModelLoadError("SmolVLM's processor needs the num2words package (transformers uses it for video "
                             "prompts); install it: pip install num2words")
    config_cls, model_cls, image_processor_cls, patch, scale = FAMILIES[family]
    tok = idefics3_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    tokens_per_tile = (TILE // patch // scale) ** 2
    config = config_cls(
        text_config=LlamaConfig(vocab_size=len(tok), bos_token_id=ids["<|im_start|>"],
                                eos_token_id=ids["<end_of_utterance>"], pad_token_id=ids["<|im_end|>"], **_TEXT),
        vision_config={"image_size": TILE, "patch_size": patch, **_VISION},
        image_token_id=ids["<image>"],
        scale_factor=scale,
        tie_word_embeddings=False,
    )
    model = random_model(model_cls, config, seed, attn_implementation)
    rescale_linear_weights(model.model.text_model, std=0.08, seed=seed + 1)
    image_processor = image_processor_cls(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}, do_image_splitting=True,
        image_mean=SIGLIP_MEAN, image_std=SIGLIP_STD,
    )
    if family == "smolvlm":
        video_processor = SmolVLMVideoProcessor(
            size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}, image_mean=SIGLIP_MEAN,
            image_std=SIGLIP_STD,
        )
        processor = SmolVLMProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                     image_seq_len=tokens_per_tile, chat_template=CHAT_TEMPLATE)
    else:
        processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=tokens_per_tile,
                                      chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


# listed after the other families (ranks 0-8)
@register_tiny("tiny-idefics3", rank=12)
def tiny_idefics3(
    seed: int = 0, *, attn_implementation: str = "eager"
) -> tuple[Idefics3ForConditionalGeneration, Idefics3Processor]:
    """Build the tiny Idefics3 model and processor."""
    return build_idefics3("idefics3", seed, attn_implementation=attn_implementation)


@register_tiny("tiny-smolvlm", rank=13)
def tiny_smolvlm(
    seed: int = 0, *, attn_implementation: str = "eager"
) -> tuple[SmolVLMForConditionalGeneration, SmolVLMProcessor]:
    """Build the tiny SmolVLM model and processor."""
    return build_idefics3("smolvlm", seed, attn_implementation=attn_implementation)
