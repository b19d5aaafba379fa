"""Tiny Qwen2.5-VL and Qwen2-VL: 4 text layers (4 heads, 2 KV heads, d_head 32), 2 vision blocks, 2x2 merger."""

from __future__ import annotations

import transformers
from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

from . import register_tiny
from .common import build_tokenizer, rescale_linear_weights, seeded

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _build(family: str, seed: int, image_size: int = 224, **model_kwargs):
    tok = build_tokenizer(
        SPECIALS,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=pixels, max_pixels=pixels)
    text = dict(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
    )
    if family == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                      fullatt_block_indexes=[1], window_size=56)
        config_cls, model_cls, proc_cls = (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                                           transformers.Qwen2_5_VLProcessor)
    else:
        vision = dict(depth=2, embed_dim=64, hidden_size=128, mlp_ratio=2, num_heads=4)
        config_cls, model_cls, proc_cls = (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                                           transformers.Qwen2VLProcessor)
    config = config_cls(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = [model_cls.__name__]
    seeded(seed)
    model = model_cls._from_config(config, attn_implementation=model_kwargs.pop("attn_implementation", "eager"))
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    processor = proc_cls(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                         chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


@register_tiny("tiny-qwen2_5_vl")
def tiny_qwen2_5_vl(seed: int = 0, **kwargs):
    return _build("qwen2_5_vl", seed, **kwargs)


@register_tiny("tiny-qwen2_vl")
def tiny_qwen2_vl(seed: int = 0, **kwargs):
    return _build("qwen2_vl", seed, **kwargs)
