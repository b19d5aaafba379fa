"""Tiny LLaVA-1.5 and LLaVA-OneVision: 4 text layers (4 heads, 2 KV heads, d_head 32), 2-block vision towers.

Design: the real HF config, model, image-processor and processor classes of each family at a tiny size, so every code
path a real checkpoint takes is exercised, including the ones that shape the image-token layout.

* LLaVA-1.5 (``tiny-llava``): a Llama text model and a CLIP tower (224 px, 14 px patches, so a 16x16 grid of 256
  image tokens), ``vision_feature_select_strategy="default"`` (the CLS feature is dropped) and
  ``vision_feature_layer=-2`` as in ``llava-hf/llava-1.5-7b-hf``: the features come from the penultimate CLIP block,
  so the last vision block does not reach the language model. The image processor resizes the shortest edge to
  224 px and center-crops 224x224. The tokenizer prepends ``<s>`` as Llama's does.
* LLaVA-OneVision (``tiny-llava_onevision``): a Qwen2 text model and a SigLIP tower on 112 px tiles (14 px patches,
  an 8x8 base grid of 64 tokens, ``vision_feature_select_strategy="full"``). ``image_grid_pinpoints`` are every
  ``(112 i, 112 j)`` for ``i, j`` in 1..4, so a 224x224 image is cut into 2x2 tiles: a 16x16 hi-res grid whose rows
  are each followed by a newline feature, 64 + 16 * 17 = 336 image features in all. Images needing more than
  ``anyres_max_9`` tiles' worth of features (3x4 tiles or more) take the model's bilinear down-sampling branch.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaImageProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    LlavaProcessor,
    Qwen2Config,
    SiglipVisionConfig,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

# ---- LLaVA-1.5 ------------------------------------------------------------------------------------------------
LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if not loop.last %} {% endif %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)
LLAVA_IMAGE_SIZE = 224
LLAVA_PATCH_SIZE = 14

# ---- LLaVA-OneVision ------------------------------------------------------------------------------------------
ONEVISION_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ONEVISION_TILE = 112
ONEVISION_PATCH_SIZE = 14
ONEVISION_PINPOINTS = [[ONEVISION_TILE * i, ONEVISION_TILE * j] for i in range(1, 5) for j in range(1, 5)]
SIGLIP_MEAN = [0.5, 0.5, 0.5]
SIGLIP_STD = [0.5, 0.5, 0.5]

_TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@register_tiny("tiny-llava", rank=2)
def tiny_llava(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """Build the tiny LLaVA-1.5 model and processor."""
    tok = tokenizer or build_tokenizer(
        LLAVA_SPECIALS, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", add_bos=True,
        extra_special_tokens={"image_token": "<image>"},
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAVA_SPECIALS}
    n_tokens = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2
    config = LlavaConfig(
        text_config=LlamaConfig(vocab_size=len(tok), bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                                pad_token_id=ids["<pad>"], **_TEXT),
        vision_config=CLIPVisionConfig(image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH_SIZE,
                                       projection_dim=64, **_VISION),
        image_token_index=ids["<image>"],
        image_seq_length=n_tokens,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    model = random_model(LlavaForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    image_processor = LlavaImageProcessor(
        size={"shortest_edge": LLAVA_IMAGE_SIZE}, crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=LLAVA_PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=chat_template or LLAVA_CHAT_TEMPLATE,
    )
    return model.eval(), processor


@register_tiny("tiny-llava_onevision", rank=3)
def tiny_llava_onevision(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor]:
    """Build the tiny LLaVA-OneVision model and processor."""
    tok = build_tokenizer(
        ONEVISION_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in ONEVISION_SPECIALS}
    n_tokens = (ONEVISION_TILE // ONEVISION_PATCH_SIZE) ** 2
    config = LlavaOnevisionConfig(
        text_config=Qwen2Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                                pad_token_id=ids["<|endoftext|>"], **_TEXT),
        vision_config=SiglipVisionConfig(image_size=ONEVISION_TILE, patch_size=ONEVISION_PATCH_SIZE,
                                         vision_use_head=False, **_VISION),
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=False,
    )
    model = random_model(LlavaOnevisionForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    tile = {"height": ONEVISION_TILE, "width": ONEVISION_TILE}
    image_processor = LlavaOnevisionImageProcessor(
        size=tile, image_grid_pinpoints=ONEVISION_PINPOINTS, image_mean=SIGLIP_MEAN, image_std=SIGLIP_STD,
    )
    video_processor = LlavaOnevisionVideoProcessor(size=tile, image_mean=SIGLIP_MEAN, image_std=SIGLIP_STD)
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor, tokenizer=tok, video_processor=video_processor, num_image_tokens=n_tokens,
        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
        chat_template=ONEVISION_CHAT_TEMPLATE,
    )
    return model.eval(), processor
