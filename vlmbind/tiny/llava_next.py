"""Tiny LLaVA-NeXT (``tiny-llava_next``): the real HF config, model and processor classes at a tiny size.

Shaped like ``llava-hf/llava-v1.6-mistral-7b-hf`` at a third of its tile size: a Mistral text model (4 layers, 4
heads, 2 KV heads, d_head 32, no sliding window, as Mistral-7B-Instruct-v0.2), a 2-block CLIP tower on 112 px tiles
(14 px patches, an 8x8 grid a tile) with ``vision_feature_select_strategy="default"`` (the CLS feature dropped) and
``vision_feature_layer=-2``. ``image_grid_pinpoints`` are every ``(112 i, 112 j)`` for ``i, j`` in 1..3: v1.6's
five layouts divided by 3 (1x2, 2x1, 2x2, 1x3, 3x1 tiles) and four more, so that middling images are enlarged into
their tiles rather than shrunk (with v1.6's five alone a 256x192 image is shrunk by 0.875 and the middle of every
base-grid cell ends exactly on a tile-cell edge, where the bicubic resampling leaks into the neighbouring tile cell:
true of the real model too, but it defeats the exact painting checks of the TokenIndex). A 224x224 image picks 2x2
tiles: an 8x8 base grid, then a 16x16 hi-res grid whose rows each end with the ``image_newline`` feature,
64 + 16 * 17 = 336 image tokens; a 320x224 one is kept at its size in 2x3 tiles and unpadded to 16x22. The
tokenizer is LLaVA-1.5's tiny one (``<s>`` prepended, ``<image>`` and ``<pad>`` added as llava-hf adds them), the
chat template Mistral's ``[INST] <image>\\n... [/INST]``.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    CLIPVisionConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    MistralConfig,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .llava import _TEXT, _VISION, LLAVA_SPECIALS
from .registry import register_tiny

NEXT_TILE = 112
NEXT_PATCH_SIZE = 14
# llava-v1.6's [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]] at the tiny tile size, and the rest of
# the 3x3 tile layouts (see the module docstring)
NEXT_PINPOINTS = [[NEXT_TILE * h, NEXT_TILE * w] for h in range(1, 4) for w in range(1, 4)]
NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}{% endfor %}"
    "{% endif %} [/INST]{% else %} {% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{{ message['content'][0]['text'] }}{% endif %}</s>{% endif %}{% endfor %}"
)


@register_tiny("tiny-llava_next", rank=6)
def tiny_llava_next(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[LlavaNextForConditionalGeneration, LlavaNextProcessor]:
    """Build the tiny LLaVA-NeXT model and processor.

    Args:
        seed: weights are a deterministic function of it (same seed -> identical weights).
        **kwargs: ``attn_implementation`` (default ``"eager"``); ``tokenizer`` and ``chat_template`` replace the
            tiny ones.

    Returns:
        ``(model, processor)``; the model is in eval mode.
    """
    tok = tokenizer or build_tokenizer(
        LLAVA_SPECIALS, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", add_bos=True,
        extra_special_tokens={"image_token": "<image>"},
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAVA_SPECIALS}
    config = LlavaNextConfig(
        text_config=MistralConfig(vocab_size=len(tok), bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                                  pad_token_id=ids["<pad>"], sliding_window=None, **_TEXT),
        vision_config=CLIPVisionConfig(image_size=NEXT_TILE, patch_size=NEXT_PATCH_SIZE, projection_dim=64,
                                       **_VISION),
        image_token_index=ids["<image>"],
        image_seq_length=(NEXT_TILE // NEXT_PATCH_SIZE) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_grid_pinpoints=NEXT_PINPOINTS,
        tie_word_embeddings=False,
    )
    model = random_model(LlavaNextForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": NEXT_TILE}, crop_size={"height": NEXT_TILE, "width": NEXT_TILE},
        image_grid_pinpoints=NEXT_PINPOINTS,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=NEXT_PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=chat_template or NEXT_CHAT_TEMPLATE,
    )
    return model.eval(), processor
