"""Tiny Mistral3 (Mistral-Small-3.x vision): 4 text layers (Mistral, 4 heads, 2 KV heads, d_head 32), a 2-block
Pixtral tower with 2-D RoPE, and the RMS-norm + 2x2 patch merger + MLP projector.

Design: the real ``Mistral3Config`` / ``Mistral3ForConditionalGeneration`` / ``PixtralImageProcessor`` /
``PixtralProcessor`` at a tiny size, so every code path a real checkpoint takes is exercised. Patches are 14 px and
``spatial_merge_size = 2`` as in ``mistralai/Mistral-Small-3.1-24B-Instruct-2503``, so an image token covers 28
resized pixels. The image processor keeps the aspect ratio, shrinks the longest edge to at most 224 px (real
checkpoints: 1540) and rounds each side up to a multiple of 28: a 224x224 image is an 8x8 grid, each row of
``[IMG]`` tokens followed by ``[IMG_BREAK]`` and the last by ``[IMG_END]`` (72 tokens). The tokenizer prepends
``<s>`` as Mistral's does; the chat template (``<s>[INST][IMG]...[/INST]``) writes ``<s>`` itself.
"""

from __future__ import annotations

from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessor,
    PixtralProcessor,
    PixtralVisionConfig,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

# Mistral's control tokens, in the real vocabulary's order where it has them (<unk> 0, <s> 1, </s> 2, ...)
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<pad>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}[IMG]{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}"
    "{{ eos_token }}{% endif %}{% endfor %}"
)
PATCH_SIZE = 14
MERGE_SIZE = 2
LONGEST_EDGE = 224

_TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "sliding_window": None}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


# listed after the families before it (ranks 0-13)
@register_tiny("tiny-mistral3", rank=16)
def tiny_mistral3(
    seed: int = 0, *, attn_implementation: str = "eager"
) -> tuple[Mistral3ForConditionalGeneration, PixtralProcessor]:
    """Build the tiny Mistral3 model and processor."""
    tok = build_tokenizer(
        SPECIALS, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", add_bos=True,
        extra_special_tokens={"image_token": "[IMG]"},
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    config = Mistral3Config(
        text_config=MistralConfig(vocab_size=len(tok), bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                                  pad_token_id=ids["<pad>"], **_TEXT),
        vision_config=PixtralVisionConfig(image_size=LONGEST_EDGE, patch_size=PATCH_SIZE, head_dim=16, **_VISION),
        image_token_index=ids["[IMG]"],
        spatial_merge_size=MERGE_SIZE,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    model = random_model(Mistral3ForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    image_processor = PixtralImageProcessor(size={"longest_edge": LONGEST_EDGE},
                                            patch_size={"height": PATCH_SIZE, "width": PATCH_SIZE})
    processor = PixtralProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
        chat_template=CHAT_TEMPLATE,
    )
    return model.eval(), processor
