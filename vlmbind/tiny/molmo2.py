"""Tiny Molmo2: 4 text layers (4 heads, 2 KV heads, d_head 32), a 2-layer ViT on 224 px crops, 2x2 attention pooling.

Design: the real ``Molmo2Config`` / ``Molmo2ForConditionalGeneration`` / ``Molmo2Processor`` /
``Molmo2ImageProcessor`` at a tiny size, so every Molmo2 code path a real checkpoint takes (overlapping crops, the
pooling adapter, ``<im_col>`` separators, the bidirectional image block) is exercised. Crops are 224 px (16x16 ViT
patches of 14 px); the adapter pools 2x2 patches into one token, so a 224x224 image gives an 8x8 low-res grid (the
whole image resized to one crop) and an 8x8 high-res grid (one overlapping crop; larger or non-square images get more
crops, up to ``max_crops = 8``, and a larger high-res grid). The adapter (attention pooling then a gated MLP,
initialised with std 0.02 in every layer) hands the language model features of ~5e-6, far below the token
embeddings, so a random model would ignore the image: its Linear layers are redrawn here with std ``1/sqrt(fan_in)``
from the seed, which gives features of order one. The text layers are redrawn with std 0.08 so head effects are
O(0.1-1) logits. The special tokens are in the base vocabulary (``additional_vocab_size = 0``), unlike the real
checkpoints, which keep them in an extra embedding table past ``vocab_size``; the forward does not care.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Molmo2Config,
    Molmo2ForConditionalGeneration,
    Molmo2ImageProcessor,
    Molmo2Processor,
    Molmo2VideoProcessor,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

# The processor looks these eight up by name (``Molmo2Processor.image_token_ids``); every one of them is marked as an
# image token in ``mm_token_type_ids`` and so joins the bidirectional image block.
IMAGE_TOKENS = ["<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<frame_start>", "<im_end>",
                "<frame_end>", "<im_low>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>", "<|video|>", *IMAGE_TOKENS]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CROP_SIZE = 224
PATCH_SIZE = 14


def _reinit_adapter(adapter: torch.nn.Module, seed: int) -> None:
    """Redraw every Linear of the pooling adapter from N(0, 1/fan_in) (biases zero) so image features are O(1).

    Args:
        adapter: ``model.model.multi_modal_projector``.
        seed: seed of the generator (the draw is independent of the global RNG state).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapter.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / m.in_features**0.5)
                if m.bias is not None:
                    m.bias.zero_()


@register_tiny("tiny-molmo2", rank=5)
def tiny_molmo2(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[Molmo2ForConditionalGeneration, Molmo2Processor]:
    """Build the tiny Molmo2 model and its processor.

    Args:
        seed: weights are a function of the seed alone.
        **kwargs: ``attn_implementation`` (default ``"eager"``); ``tokenizer`` and ``chat_template`` replace the
            tiny ones (:mod:`vlmbind.tiny.real`).

    Returns:
        ``(model, processor)``; the model is in eval mode.
    """
    tok = tokenizer or build_tokenizer(
        SPECIALS,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    image_processor = Molmo2ImageProcessor(
        size={"height": CROP_SIZE, "width": CROP_SIZE}, patch_size=PATCH_SIZE, pooling_size=[2, 2],
        overlap_margins=[4, 4], max_crops=8,
    )
    video_processor = Molmo2VideoProcessor(
        size={"height": CROP_SIZE, "width": CROP_SIZE}, patch_size=PATCH_SIZE, pooling_size=[2, 2]
    )
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, image_size=[CROP_SIZE, CROP_SIZE], patch_size=PATCH_SIZE,
    )
    # the real model concatenates ViT layers [24, 18] of 25 (the last and an earlier one); here the last and the first
    adapter = dict(
        vision_feature_layer=[1, 0], hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        intermediate_size=128, text_hidden_size=128,
    )
    text = dict(
        vocab_size=len(tok), additional_vocab_size=0, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = Molmo2Config(
        vision_config=vision, adapter_config=adapter, text_config=text,
        image_start_token_id=ids["<im_start>"], low_res_image_start_token_id=ids["<low_res_im_start>"],
        image_end_token_id=ids["<im_end>"], image_patch_id=ids["<im_patch>"],
        frame_start_token_id=ids["<frame_start>"], frame_end_token_id=ids["<frame_end>"],
        tie_word_embeddings=False,
    )
    config.text_config.eos_token_id = ids["<|endoftext|>"]
    config.text_config.pad_token_id = ids["<|endoftext|>"]
    model = random_model(Molmo2ForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    _reinit_adapter(model.model.multi_modal_projector, seed=seed + 2)
    processor = Molmo2Processor(
        image_processor=image_processor, video_processor=video_processor, tokenizer=tok,
        chat_template=chat_template or CHAT_TEMPLATE,
    )
    return model.eval(), processor
