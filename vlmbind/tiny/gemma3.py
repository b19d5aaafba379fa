"""Tiny Gemma-3: 4 text layers (4 heads, 2 KV heads, d_head 32), a 2-block SigLIP tower, an 8x8 pooled image grid.

Design: the real ``Gemma3Config`` / ``Gemma3ForConditionalGeneration`` / ``Gemma3Processor`` /
``Gemma3ImageProcessor`` at a tiny size, so every Gemma-3 code path a real checkpoint takes is exercised. A 224 px
image is cut into 16x16 SigLIP patches of 14 px, average-pooled 2x2 by the projector into ``mm_tokens_per_image = 64``
tokens (an 8x8 grid, 28 px a cell). Layers alternate sliding-window (window 16, shorter than any image prompt, so the
window really truncates attention) and full attention, as Gemma-3 interleaves local and global layers; the image block
attends bidirectionally when the processor's ``token_type_ids`` reach the forward. Gemma-3 initialises
``multi_modal_projector.mm_input_projection_weight`` to zeros, which would make a random model blind; it is redrawn
from the seed here. The tokenizer prepends ``<bos>`` as Gemma's does.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
IMAGE_SIZE = 224
PATCH_SIZE = 14
TOKENS_PER_SIDE = 8
SLIDING_WINDOW = 16


@register_tiny("tiny-gemma3", rank=4)
def tiny_gemma3(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[Gemma3ForConditionalGeneration, Gemma3Processor]:
    """Build the tiny Gemma-3 model and processor."""
    tok = tokenizer or build_tokenizer(
        SPECIALS,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos=True,
        extra_special_tokens={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    n_tokens = TOKENS_PER_SIDE * TOKENS_PER_SIDE
    text = dict(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=4096,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
    )
    vision = dict(
        model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=n_tokens,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"], tie_word_embeddings=True,
    )
    model = random_model(Gemma3ForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    # Gemma-3 zero-initialises the projection, so a random model would ignore the image: redraw it from the seed.
    # Its input is RMS-normalised (entries ~1), so this std gives image features the scale of the text embeddings
    # (initializer_range * sqrt(hidden), Gemma's embedding scale).
    proj = model.model.multi_modal_projector.mm_input_projection_weight
    embed_std = config.text_config.initializer_range * config.text_config.hidden_size**0.5
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        proj.copy_(torch.randn(proj.shape, generator=g) * embed_std / proj.shape[0] ** 0.5)
    image_processor = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tok,
        chat_template=chat_template or CHAT_TEMPLATE, image_seq_length=n_tokens,
    )
    return model.eval(), processor
