"""Tiny Qwen3-VL, dense and MoE: 4 text layers (4 heads, 2 KV heads, d_head 32), 3 vision blocks, 2x2 merger, and
DeepStack features from vision blocks 0 and 1 added after text layers 0 and 1.

Qwen3-VL's vision patches are 16 px (Qwen2.5-VL's are 14), so a merged image token covers 32 px and a 224 px square
image becomes a 7x7 grid. The tokenizer, its special tokens and the chat template are Qwen2.5-VL's
(:mod:`vlmbind.tiny.qwen`), as in the real checkpoints. The MoE model routes every text token to 2 of 4 experts in
every layer; its expert and router weights are re-drawn like the dense text weights, so that routing is decisive
(no near-ties that float rounding could flip) and the experts' outputs are O(1).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

from .common import build_tokenizer
from .qwen import CHAT_TEMPLATE, SPECIALS, qwen_random_model
from .registry import register_tiny

PATCH_SIZE = 16
MERGE_SIZE = 2
# Qwen3-VL's processors normalise to [-1, 1] (mean = std = 0.5), not with CLIP's statistics as Qwen2.5-VL's do
IMAGE_MEAN = IMAGE_STD = [0.5, 0.5, 0.5]


def interleaved_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's (temporal, height, width) counts of the ``head_dim / 2`` rotary frequencies, in the checkpoints'
    24:20:20 ratio (``[24, 20, 20]`` for d_head 128, ``[6, 5, 5]`` for d_head 32). The frequencies are interleaved
    (t, h, w, t, h, w, ...), so height and width each need ``3 * count <= head_dim / 2``."""
    half = head_dim // 2
    hw = half * 20 // 64
    return [half - 2 * hw, hw, hw]


def qwen_tokenizer() -> Any:
    """The tiny byte-level BPE with Qwen's special tokens, named as Qwen's processors look them up."""
    return build_tokenizer(
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


def _redraw_experts(module: torch.nn.Module, std: float, seed: int) -> None:
    """Re-draw the MoE experts' stacked weights and the routers' weights from N(0, std): they are plain
    Parameters, not Linear layers, so :func:`rescale_linear_weights` leaves them at HF's small init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")):
                parameter.copy_(torch.randn(parameter.shape, generator=g) * std)


def build_qwen3_vl(
    family: str,
    seed: int,
    image_size: int = 224,
    *,
    layers: int = 4,
    hidden: int = 128,
    intermediate: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 4,
    experts_per_token: int = 2,
    expert_intermediate: int = 64,
    vision_depth: int = 3,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    deepstack_layers: tuple[int, ...] = (0, 1),
    text_init_std: float | None = 0.08,
    attn_implementation: str = "eager",
) -> tuple[torch.nn.Module, Any]:
    """A Qwen3-VL (``family="qwen3_vl"``) or Qwen3-VL-MoE (``"qwen3_vl_moe"``) with random weights, the tiny Qwen
    tokenizer and a fixed-size processor.

    The processor's ``min_pixels = max_pixels = image_size**2``, so a square ``image_size`` image (a multiple of 32)
    is not resized and becomes an ``image_size/32`` square grid of merged image tokens.

    Args:
        family: ``"qwen3_vl"`` or ``"qwen3_vl_moe"``.
        seed: seeds the weight init (``torch.manual_seed``) and the text re-scale.
        image_size: side of the fixed image size in pixels.
        layers, hidden, intermediate, heads, kv_heads: the text decoder (intermediate defaults to ``2 * hidden``).
        experts, experts_per_token, expert_intermediate: the MoE blocks (``qwen3_vl_moe`` only).
        vision_depth, vision_hidden, vision_heads: the vision tower.
        deepstack_layers: the vision blocks whose merged outputs are added to the image tokens' residual stream,
            the i-th after text layer i (at most ``layers`` of them).
        text_init_std: re-draw the text decoder's weights (experts and routers included) from N(0, std); None keeps
            HF's init.
        attn_implementation: ``"eager"`` (attention patterns available) or ``"sdpa"``.

    Returns:
        ``(model, processor)``, the model in eval mode.
    """
    if family not in ("qwen3_vl", "qwen3_vl_moe"):
        raise ValueError(f"family must be 'qwen3_vl' or 'qwen3_vl_moe', got {family!r}")
    tok = qwen_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    pixels = image_size * image_size
    sizes = dict(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, image_mean=IMAGE_MEAN,
                                            image_std=IMAGE_STD, **sizes)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": pixels, "longest_edge": pixels},
                                            image_mean=IMAGE_MEAN, image_std=IMAGE_STD, **sizes)
    text = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": interleaved_mrope_section(hidden // heads),
                         "mrope_interleaved": True, "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=vision_heads,
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, out_hidden_size=hidden,
        # a 16x16 learned position grid, bilinearly resampled to each image's patch grid
        num_position_embeddings=256, deepstack_visual_indexes=list(deepstack_layers),
    )
    if family == "qwen3_vl_moe":
        text.update(num_experts=experts, num_experts_per_tok=experts_per_token,
                    moe_intermediate_size=expert_intermediate, decoder_sparse_step=1, mlp_only_layers=[])
        config_cls, model_cls = transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration
    else:
        config_cls, model_cls = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
    model = qwen_random_model(config_cls, model_cls, text, vision, ids, seed, attn_implementation, text_init_std)
    if text_init_std is not None:
        _redraw_experts(model.model.language_model, std=text_init_std, seed=seed + 2)
    processor = transformers.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok,
                                              video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


# dense before MoE in `vlmbind models`
@register_tiny("tiny-qwen3_vl", rank=7)
def tiny_qwen3_vl(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny Qwen3-VL model and processor."""
    return build_qwen3_vl("qwen3_vl", seed, attn_implementation=attn_implementation)


@register_tiny("tiny-qwen3_vl_moe", rank=8)
def tiny_qwen3_vl_moe(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny Qwen3-VL-MoE model and processor."""
    return build_qwen3_vl("qwen3_vl_moe", seed, attn_implementation=attn_implementation)
