"""Tiny Aya Vision: 4 text layers (Cohere2, 4 heads, 2 KV heads, d_head 32, parallel attention + MLP blocks), a
2-block SigLIP tower on 64 px tiles, the pixel shuffle and the SwiGLU projector.

Design: the real ``AyaVisionConfig`` / ``AyaVisionForConditionalGeneration`` / ``GotOcr2ImageProcessor`` /
``AyaVisionProcessor`` at a tiny size, shaped like ``CohereLabs/aya-vision-8b`` (364 px tiles of 14 px SigLIP patches,
``downsample_factor = 2``, 13x13 = 169 tokens a tile, up to 12 tiles): here 8 px patches make an 8x8 patch grid a
64 px tile, the pixel shuffle (``downsample_factor = 2``) makes it a 4x4 grid of 16 tokens, each token 2x2 patches
(16 px of a tile), and every SigLIP feature is kept (``vision_feature_select_strategy="full"``: SigLIP has no CLS).
The image processor tiles as the real one does (``crop_to_patches``: the ``cols x rows`` canvas of at most
``max_patches`` tiles whose aspect ratio is closest to the image's, then the whole image as one more frame, the global
image, when there is more than one tile), with ``max_patches = 6`` instead of 12 to keep sequences short: a 224x224
image is 2x2 tiles and the global image (5 frames, 80 image tokens: the tiles together an 8x8 grid over the image).
The processor writes
``<|START_OF_IMG|>``, then ``TILE_{i}`` + 16 ``<|IMG_PATCH|>`` per tile, ``TILE_GLOBAL`` + 16 ``<|IMG_PATCH|>`` for the
global image, then ``<|END_OF_IMG|>``. The text model is Cohere2 as Command R7B: layers 0-2 slide (window 16, shorter
than any image prompt, with RoPE) and layer 3 attends to everything without positional encoding (the real
checkpoint's 3 : 1 pattern); its ``logit_scale`` is set, though ``AyaVisionForConditionalGeneration`` never applies
it. The tokenizer prepends ``<BOS_TOKEN>`` as Cohere's does and holds ``TILE`` and ``TILE_GLOBAL`` as tokens (so
``TILE_1`` is ``TILE``, ``_``, ``1``); the chat template is Cohere's turn format
(``<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|><image>...<|END_OF_TURN_TOKEN|>`` then
``<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>``). The text layers are redrawn with std 0.08 so head effects are
O(0.1-1) logits; the input and output embeddings are tied, as in the real checkpoint, and the projector's random
init (biases zero, weights not) needs no redraw.
"""

from __future__ import annotations

from transformers import (
    AyaVisionConfig,
    AyaVisionForConditionalGeneration,
    AyaVisionProcessor,
    Cohere2Config,
    GotOcr2ImageProcessor,
    SiglipVisionConfig,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
            "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_OF_IMG|>", "<|END_OF_IMG|>",
            "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL"]
# Cohere's turn format, images as the processor's <image> placeholder
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|START_OF_TURN_TOKEN|>"
    "{% if message['role'] == 'user' %}<|USER_TOKEN|>{% elif message['role'] == 'system' %}<|SYSTEM_TOKEN|>"
    "{% else %}<|CHATBOT_TOKEN|>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|END_OF_TURN_TOKEN|>{% endfor %}"
    "{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"
)
TILE = 64
PATCH_SIZE = 8
DOWNSAMPLE_FACTOR = 2
MAX_TILES = 6
TOKENS_PER_TILE = (TILE // (PATCH_SIZE * DOWNSAMPLE_FACTOR)) ** 2
SLIDING_WINDOW = 16
LAYER_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
LOGIT_SCALE = 0.125
SIGLIP_MEAN, SIGLIP_STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]

_TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@register_tiny("tiny-aya_vision", rank=33)
def tiny_aya_vision(
    seed: int = 0, *, attn_implementation: str = "eager"
) -> tuple[AyaVisionForConditionalGeneration, AyaVisionProcessor]:
    """Build the tiny Aya Vision model and processor."""
    tok = build_tokenizer(SPECIALS, bos_token="<BOS_TOKEN>", eos_token="<|END_OF_TURN_TOKEN|>", pad_token="<PAD>",
                          unk_token="<UNK>", add_bos=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    config = AyaVisionConfig(
        text_config=Cohere2Config(vocab_size=len(tok), bos_token_id=ids["<BOS_TOKEN>"],
                                  eos_token_id=ids["<|END_OF_TURN_TOKEN|>"], pad_token_id=ids["<PAD>"],
                                  sliding_window=SLIDING_WINDOW, layer_types=LAYER_TYPES, logit_scale=LOGIT_SCALE,
                                  **_TEXT),
        vision_config=SiglipVisionConfig(image_size=TILE, patch_size=PATCH_SIZE, vision_use_head=False, **_VISION),
        image_token_index=ids["<|IMG_PATCH|>"],
        downsample_factor=DOWNSAMPLE_FACTOR,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        alignment_intermediate_size=256,
        tie_word_embeddings=True,
    )
    model = random_model(AyaVisionForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    image_processor = GotOcr2ImageProcessor(size={"height": TILE, "width": TILE}, crop_to_patches=True,
                                            min_patches=1, max_patches=MAX_TILES, image_mean=SIGLIP_MEAN,
                                            image_std=SIGLIP_STD)
    processor = AyaVisionProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
                                   img_size=TILE, downsample_factor=DOWNSAMPLE_FACTOR, chat_template=CHAT_TEMPLATE)
    return model.eval(), processor
