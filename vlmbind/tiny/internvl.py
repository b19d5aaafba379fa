"""Tiny InternVL (InternVL 3 / 3.5 as transformers ships it natively): 4 text layers (Qwen2, 4 heads, 2 KV heads,
d_head 32), a 2-block InternViT-style tower on 64 px tiles, the pixel shuffle and the LayerNorm + MLP projector.

Design: the real ``InternVLConfig`` / ``InternVLForConditionalGeneration`` / ``GotOcr2ImageProcessor`` /
``InternVLProcessor`` at a tiny size, so every code path a real checkpoint (``OpenGVLab/InternVL3-1B-hf``) takes is
exercised: 8 px patches make an 8x8 patch grid a tile, ``downsample_ratio = 0.5`` as the real checkpoints, so the pixel
shuffle makes a 4x4 grid of 16 tokens a tile (``image_seq_length = 16``), each token 2x2 patches (16 px of a tile);
the CLS feature is dropped (``vision_feature_select_strategy="default"``). The image processor tiles dynamically as
the real one does (``crop_to_patches``: the ``cols x rows`` canvas of at most ``max_patches`` tiles whose aspect ratio
is closest to the image's, then a thumbnail of the whole image when there is more than one tile), with
``max_patches = 6`` instead of 12 to keep sequences short: a 224x224 image is 2x2 tiles and the thumbnail (5 frames,
80 image tokens), 448x224 one row of 2 tiles and the thumbnail, 320x224 3 columns x 2 rows and the thumbnail, and a
square image of at most twice a tile's area (64x64 up to 90x90) one frame. The processor writes
``<img>`` + 16 ``<IMG_CONTEXT>`` per frame + ``</img>`` for each image. The tokenizer has the InternVL special tokens
under the names the processor reads and prepends nothing (Qwen2's does not); the chat template is InternVL3's
(``<|im_start|>user\\n<IMG_CONTEXT>\\n...<|im_end|>\\n<|im_start|>assistant\\n``). The text layers are redrawn with
std 0.08 so head effects are O(0.1-1) logits.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    GotOcr2ImageProcessor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    InternVLVisionConfig,
    Qwen2Config,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
# OpenGVLab/InternVL3-1B-hf's template
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}{% elif c['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TILE = 64
PATCH_SIZE = 8
DOWNSAMPLE_RATIO = 0.5
MAX_TILES = 6
TOKENS_PER_TILE = int(TILE // PATCH_SIZE * DOWNSAMPLE_RATIO) ** 2
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # InternVL normalises as ImageNet

_TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def internvl_tokenizer() -> Any:
    """The tiny byte-level BPE with InternVL's special tokens, named as ``InternVLProcessor`` looks them up."""
    return build_tokenizer(
        SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
    )


# listed after the families before it (ranks 0-20)
@register_tiny("tiny-internvl", rank=24)
def tiny_internvl(
    seed: int = 0, *, attn_implementation: str = "eager"
) -> tuple[InternVLForConditionalGeneration, InternVLProcessor]:
    """Build the tiny InternVL model and processor."""
    tok = internvl_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    config = InternVLConfig(
        text_config=Qwen2Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                                pad_token_id=ids["<|endoftext|>"], **_TEXT),
        vision_config=InternVLVisionConfig(image_size=TILE, patch_size=PATCH_SIZE, **_VISION),
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=TOKENS_PER_TILE,
        downsample_ratio=DOWNSAMPLE_RATIO,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    model = random_model(InternVLForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    size = {"height": TILE, "width": TILE}
    image_processor = GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=MAX_TILES,
                                            image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    video_processor = InternVLVideoProcessor(size=size, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    processor = InternVLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                  image_seq_length=TOKENS_PER_TILE, chat_template=CHAT_TEMPLATE)
    return model.eval(), processor
