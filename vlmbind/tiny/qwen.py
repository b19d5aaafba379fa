"""Tiny Qwen2.5-VL and Qwen2-VL: 4 text layers (4 heads, 2 KV heads, d_head 32), 2 vision blocks, 2x2 merger.

:func:`build_qwen_vl` is the one builder behind the tiny models and the trained organisms
(:mod:`vlmbind.organisms.model`): the same tokenizer, processor and config layout at any size. The tiny models use its
defaults plus a re-scaled text init (so random heads have visible effects); organisms pass their sizes and keep HF's
default init.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's (temporal, height, width) split of ``head_dim / 2`` rotary frequencies, in Qwen's 1:1.5:1.5 ratio
    (``[16, 24, 24]`` for d_head 128, ``[4, 6, 6]`` for d_head 32)."""
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


def qwen_random_model(config_cls: type, model_cls: type, text: dict[str, Any], vision: dict[str, Any],
                      ids: dict[str, int], seed: int, attn_implementation: str,
                      text_init_std: float | None) -> torch.nn.Module:
    """A model of the Qwen-VL layout (its image, video and vision-span token ids) with random weights from ``seed``,
    the text decoder's Linear weights re-drawn from N(0, ``text_init_std``) unless it is None."""
    config = config_cls(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = random_model(model_cls, config, seed, attn_implementation)
    if text_init_std is not None:
        rescale_linear_weights(model.model.language_model, std=text_init_std, seed=seed + 1)
    return model


def build_qwen_vl(
    family: str,
    seed: int,
    image_size: int = 224,
    *,
    layers: int = 4,
    hidden: int = 128,
    intermediate: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_intermediate: int | None = None,
    vision_heads: int = 4,
    text_init_std: float | None = 0.08,
    attn_implementation: str = "eager",
    tokenizer: Any = None,
    chat_template: str | None = None,
    processor_defaults: bool = False,
    rope_theta: float = 10000.0,
) -> tuple[torch.nn.Module, Any]:
    """A Qwen2.5-VL or Qwen2-VL with random weights, its byte-level BPE tokenizer and a fixed-size processor.

    The processor's ``min_pixels = max_pixels = image_size**2``, so a square ``image_size`` image (a multiple of 28)
    is not resized and becomes an ``image_size/28`` square grid of merged image tokens.

    Args:
        family: ``"qwen2_5_vl"`` or ``"qwen2_vl"``.
        seed: seeds the weight init (``torch.manual_seed``) and the text re-scale.
        image_size: side of the fixed image size in pixels.
        layers, hidden, intermediate, heads, kv_heads: the text decoder (intermediate defaults to ``2 * hidden``).
        vision_depth, vision_hidden, vision_intermediate, vision_heads: the vision tower (intermediate defaults to
            ``2 * vision_hidden``); the last vision block attends globally, the others in windows (Qwen2.5-VL).
        text_init_std: re-draw the text decoder's Linear weights from N(0, std) (tiny models); None keeps HF's init.
        attn_implementation: ``"eager"`` (attention patterns available) or ``"sdpa"``.
        tokenizer, chat_template: a real tokenizer and template instead of the tiny ones
            (:mod:`vlmbind.tiny.real`).
        processor_defaults: the image processor keeps the family's default pixel bounds (real checkpoints'
            settings: images are resized to multiples of 28 px within them) instead of one fixed size.
        rope_theta: the text decoder's RoPE base (M-RoPE gives the image column its lowest frequencies: with a small
            head and the usual 10,000 they barely turn across a grid).

    Returns:
        ``(model, processor)``, the model in eval mode.
    """
    tok = tokenizer or build_tokenizer(
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
    bounds = {} if processor_defaults else {"min_pixels": pixels, "max_pixels": pixels}
    image_processor = Qwen2VLImageProcessor(**bounds)
    video_processor = Qwen2VLVideoProcessor(**bounds)
    text = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": mrope_section(hidden // heads),
                         "rope_theta": float(rope_theta)},
        bos_token_id=None, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
    )
    if family == "qwen2_5_vl":
        vision = dict(depth=vision_depth, hidden_size=vision_hidden,
                      intermediate_size=vision_intermediate or 2 * vision_hidden, num_heads=vision_heads,
                      out_hidden_size=hidden, fullatt_block_indexes=[vision_depth - 1], window_size=56)
        config_cls, model_cls, proc_cls = (transformers.Qwen2_5_VLConfig,
                                           transformers.Qwen2_5_VLForConditionalGeneration,
                                           transformers.Qwen2_5_VLProcessor)
    else:
        mlp_ratio = (vision_intermediate or 2 * vision_hidden) // vision_hidden
        vision = dict(depth=vision_depth, embed_dim=vision_hidden, hidden_size=hidden, mlp_ratio=mlp_ratio,
                      num_heads=vision_heads)
        config_cls, model_cls, proc_cls = (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                                           transformers.Qwen2VLProcessor)
    model = qwen_random_model(config_cls, model_cls, text, vision, ids, seed, attn_implementation, text_init_std)
    processor = proc_cls(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                         chat_template=chat_template or CHAT_TEMPLATE)
    return model.eval(), processor


@register_tiny("tiny-qwen2_5_vl", rank=0)
def tiny_qwen2_5_vl(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny Qwen2.5-VL model and processor."""
    return build_qwen_vl("qwen2_5_vl", seed, attn_implementation=attn_implementation)


@register_tiny("tiny-qwen2_vl", rank=1)
def tiny_qwen2_vl(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny Qwen2-VL model and processor."""
    return build_qwen_vl("qwen2_vl", seed, attn_implementation=attn_implementation)
