"""Tiny Ovis2 (``Ovis2ForConditionalGeneration``): 4 text layers (Qwen2, 4 heads, 2 KV heads, d_head 32), a 2-block
AIMv2-style tower on 112 px tiles, the visual tokenizer head and the visual embedding table.

Design: the real ``Ovis2Config`` / ``Ovis2ForConditionalGeneration`` / ``Ovis2ImageProcessor`` / ``Ovis2Processor`` at
a tiny size, so every code path a real checkpoint (``thisisiron/Ovis2-2B-hf``: 448 px tiles, 14 px patches,
``hidden_stride`` 2, 256 tokens a frame) takes is exercised: 14 px patches make an 8x8 patch grid a 112 px tile and
``hidden_stride = 2`` concatenates 2x2 patches into one token, so a frame is a 4x4 grid of 16 tokens
(``image_seq_length = 16``). The visual tokenizer maps each token to a softmax over a visual vocabulary of 64 words
(59 visual words and the 5 visual indicators' rows), and the language model receives that distribution times the
visual embedding table. The image processor crops to patches as the real one does (``use_covering_area_grid``: the
fewest tiles covering 90% of the image, a thumbnail of the whole image first when there is more than one tile) with
``max_patches = 6`` instead of 12 to keep sequences short: a 224x224 image is 2x2 tiles and the thumbnail (5 frames,
80 image tokens, the tiles together an 8x8 token grid), and a square image of at most one tile's size one frame.
The processor writes ``<IMG_START>``, the first frame's ``<IMG_ATOM>`` tokens, ``<IMG_GRID>``, the tiles' tokens
with ``<IMG_COL>`` between columns and ``<IMG_ROW>`` between rows, then ``<IMG_END>``. The tokenizer has Ovis2's
tokens in the order of the real one (``<IMG_ATOM>`` then the five indicators, whose ids the config lists) and
prepends nothing (Qwen2's does not); the chat template is ``thisisiron/Ovis2-2B-hf``'s (a system turn, then
``<|im_start|>user\\n<image>\\n...<|im_end|>\\n<|im_start|>assistant\\n``). The text layers are redrawn with std 0.08
so head effects are O(0.1-1) logits, and the visual embedding table with std 0.1 so that the image rows (averages of
its rows under the visual tokenizer's distributions) are about as large as the text embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Ovis2Config,
    Ovis2ForConditionalGeneration,
    Ovis2ImageProcessor,
    Ovis2Processor,
    Ovis2VisionConfig,
    Qwen2Config,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

INDICATORS = ["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<IMG_ATOM>", *INDICATORS]
# thisisiron/Ovis2-2B-hf's template
CHAT_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TILE = 112
PATCH_SIZE = 14
HIDDEN_STRIDE = 2
MAX_TILES = 6
VISUAL_VOCAB = 64
TOKENS_PER_FRAME = (TILE // PATCH_SIZE // HIDDEN_STRIDE) ** 2

_TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def ovis2_tokenizer() -> Any:
    """The tiny byte-level BPE with Ovis2's special tokens (``<image>``, which the processor replaces before
    tokenizing, is no token of it, as in the real one)."""
    return build_tokenizer(SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@register_tiny("tiny-ovis2", rank=34)
def tiny_ovis2(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[Ovis2ForConditionalGeneration, Ovis2Processor]:
    """Build the tiny Ovis2 model and processor; ``tokenizer`` and ``chat_template`` replace the tiny ones
    (:mod:`vlmbind.tiny.real`)."""
    tok = tokenizer or ovis2_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = _TEXT["hidden_size"]
    config = Ovis2Config(
        text_config=Qwen2Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                                pad_token_id=ids["<|endoftext|>"], **_TEXT),
        vision_config=Ovis2VisionConfig(image_size=TILE, patch_size=PATCH_SIZE, hidden_stride=HIDDEN_STRIDE,
                                        vocab_size=VISUAL_VOCAB, num_visual_indicator_tokens=len(INDICATORS),
                                        **_VISION),
        image_token_id=ids["<IMG_ATOM>"],
        visual_indicator_token_ids=[ids[t] for t in INDICATORS],
        vocab_size=len(tok),
        hidden_size=text,
        tie_word_embeddings=True,
    )
    model = random_model(Ovis2ForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    table = model.model.visual_embeddings_table.weight
    with torch.no_grad():
        table.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(seed + 2)) * 0.1)
    image_processor = Ovis2ImageProcessor(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
                                          max_patches=MAX_TILES, use_covering_area_grid=True)
    processor = Ovis2Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=TOKENS_PER_FRAME,
                               chat_template=chat_template or CHAT_TEMPLATE)
    return model.eval(), processor
