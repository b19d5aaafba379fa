"""Tiny Qwen3.5 (``qwen3_5``, and ``qwen3_5_moe`` with 4 experts, top 2, plus a gated shared expert): a hybrid 4-layer text model, Gated DeltaNet (linear attention) and gated softmax
attention alternating ``[linear, full, linear, full]`` (4 heads of 32, 2 KV heads; the DeltaNet layers have 4 value
heads of 32 too, 2 key heads), and Qwen3-VL's vision tower without DeepStack (3 blocks, 16 px patches, 2x2 merger).

The tokenizer, processors and chat template are Qwen3-VL's tiny ones (:mod:`vlmbind.tiny.qwen3_vl`). A 224 px square
image is a 7x7 grid of merged image tokens. Real checkpoints have twice as many DeltaNet value heads as attention
heads, of half the width; the tiny model makes them equal so that per-head sites exist on every layer (the adapter
refuses them by name on DeltaNet layers whose heads differ).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

from .qwen import CHAT_TEMPLATE, SPECIALS, qwen_random_model
from .qwen3_vl import (
    IMAGE_MEAN,
    IMAGE_STD,
    MERGE_SIZE,
    PATCH_SIZE,
    _redraw_experts,
    interleaved_mrope_section,
    qwen_tokenizer,
)
from .registry import register_tiny

LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")


def build_qwen3_5(
    seed: int,
    image_size: int = 224,
    *,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    linear_key_heads: int = 2,
    linear_value_heads: int | None = None,
    layer_types: tuple[str, ...] = LAYER_TYPES,
    vision_depth: int = 3,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    moe: bool = False,
    text_init_std: float | None = 0.08,
    attn_implementation: str = "eager",
) -> tuple[torch.nn.Module, Any]:
    """A Qwen3.5 (``moe``: Qwen3.5-MoE, 4 experts of 64, top 2, and a gated shared expert of 64) with random weights, the tiny Qwen tokenizer and a fixed-size processor
    (``min_pixels = max_pixels = image_size**2``).

    Args:
        seed: seeds the weight init and the text re-scale.
        image_size: side of the fixed image size in pixels (a multiple of 32).
        hidden, heads, kv_heads: the text decoder; the DeltaNet layers get ``linear_key_heads`` key heads and
            ``linear_value_heads`` value heads (default ``heads``, as the attention layers) of width
            ``hidden / linear_value_heads``, so ``out_proj`` is as wide as ``o_proj`` either way.
        layer_types: ``linear_attention`` / ``full_attention`` per layer.
        moe: build ``Qwen3_5MoeForConditionalGeneration``; its experts and routers are re-drawn like the dense text
            weights, so that routing is decisive (as in :mod:`vlmbind.tiny.qwen3_vl`).
        vision_depth, vision_hidden, vision_heads: the vision tower.
        text_init_std: re-draw the text decoder's Linear weights from N(0, std); None keeps HF's init.
        attn_implementation: ``"eager"`` or ``"sdpa"`` (the full-attention layers').

    Returns:
        ``(model, processor)``, the model in eval mode.
    """
    tok = qwen_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    pixels = image_size * image_size
    sizes = dict(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, image_mean=IMAGE_MEAN,
                                            image_std=IMAGE_STD, **sizes)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": pixels, "longest_edge": pixels},
                                            image_mean=IMAGE_MEAN, image_std=IMAGE_STD, **sizes)
    d_head = hidden // heads
    value_heads = linear_value_heads or heads
    # partial rotary (a quarter of d_head, as the checkpoints): the interleaved sections cover its half
    rotary = d_head // 4
    text = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d_head,
        linear_num_value_heads=value_heads, linear_value_head_dim=hidden // value_heads,
        linear_num_key_heads=linear_key_heads,
        linear_key_head_dim=d_head, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": interleaved_mrope_section(rotary),
                         "mrope_interleaved": True, "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        bos_token_id=None, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=vision_heads,
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, out_hidden_size=hidden,
        num_position_embeddings=256,
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64)
        del text["intermediate_size"]
        config_cls, model_cls = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
    else:
        config_cls, model_cls = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
    model = qwen_random_model(config_cls, model_cls, text, vision, ids, seed, attn_implementation, text_init_std)
    if text_init_std is not None:
        _redraw_experts(model.model.language_model, std=text_init_std, seed=seed + 2)
    processor = transformers.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok,
                                              video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


# dense before MoE in `vlmbind models`
@register_tiny("tiny-qwen3_5", rank=9)
def tiny_qwen3_5(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny Qwen3.5 model and processor."""
    return build_qwen3_5(seed, attn_implementation=attn_implementation)


@register_tiny("tiny-qwen3_5_moe", rank=10)
def tiny_qwen3_5_moe(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny Qwen3.5-MoE model and processor."""
    return build_qwen3_5(seed, moe=True, attn_implementation=attn_implementation)
