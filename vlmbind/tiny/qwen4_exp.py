"""Tiny Qwen4-Exp: a hybrid 4-layer MoE text model on 2 hyper-connected residual streams, Gated DeltaNet layers 0,
2 and 3 and a QSA-indexed softmax attention layer 1 (4 heads of 32, 2 KV heads; the DeltaNet layers have 4 value heads
of 32 too, 2 key heads), per-layer n-gram embeddings (PLE) on DeltaNet layers 0 and 2, and Qwen3.5's vision tower
(2 blocks, 16 px patches, 2x2 merger).

Every MLP is a sparse MoE block (4 experts of 64, top 2, plus a gated shared expert of 64). The QSA indexer lets each
query attend to at most 4 complete blocks of 4 keys (a budget of 16) plus the unfinished block it sits in, so a
prompt of ~70 tokens is sparse where it matters. The tokenizer, processors and chat template are Qwen3-VL's tiny ones
(:mod:`vlmbind.tiny.qwen3_vl`); a 224 px square image is a 7x7 grid of merged image tokens. The n-gram tables are
hashed into a few primes above 1000 rows (checkpoints: above 20 million), saved in 2 shards.
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

# the checkpoints' 3:1 ratio of DeltaNet to indexed layers, the indexed one at layer 1 (where the generic tests edit
# attention); each indexed layer runs HF's per-query indexer loop, the slow part of a forward on CPU
LAYER_TYPES = ("linear_attention", "indexed_attention", "linear_attention", "linear_attention")


def _redraw_ple_convolutions(module: torch.nn.Module, std: float, seed: int) -> None:
    """Re-draw the PLE's short convolutions from N(0, std): HF starts them at zero, which would leave the convolution
    (and its cached state) out of every forward. The n-gram tables keep HF's init, which makes the PLE's write about
    as large as a sub-block's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=g) * std)


def build_qwen4_exp(
    seed: int,
    image_size: int = 224,
    *,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    layer_types: tuple[str, ...] = LAYER_TYPES,
    streams: int = 2,
    ple_layers: tuple[int, ...] = (0, 2),
    index_budget: int = 16,
    index_block: int = 4,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    text_init_std: float | None = 0.08,
    attn_implementation: str = "eager",
) -> tuple[torch.nn.Module, Any]:
    """A Qwen4-Exp with random weights, the tiny Qwen tokenizer and a fixed-size processor
    (``min_pixels = max_pixels = image_size**2``).

    Args:
        seed: seeds the weight init and the text re-draws.
        image_size: side of the fixed image size in pixels (a multiple of 32).
        hidden, heads, kv_heads: the text decoder; the DeltaNet layers get 2 key heads and ``heads`` value heads of
            ``hidden / heads``, so their ``out_proj`` input is laid out as the attention layers' ``o_proj`` input.
        layer_types: ``linear_attention`` / ``indexed_attention`` per layer.
        streams: the hyper-connections' residual streams (``hc_count``, at least 2).
        ple_layers: the (0-based, DeltaNet) layers with a per-layer n-gram embedding.
        index_budget, index_block: the QSA indexer's token budget and block size (``indexer_budget``,
            ``indexer_compress_ratio``).
        vision_depth, vision_hidden, vision_heads: the vision tower.
        text_init_std: re-draw the text decoder's Linear weights, experts and routers from N(0, std) and the PLE
            convolutions (:func:`_redraw_ple_convolutions`); None keeps HF's init.
        attn_implementation: ``"eager"`` or ``"sdpa"`` (the indexed layers').

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
    # partial rotary (a quarter of d_head, as the checkpoints): the interleaved sections cover its half
    rotary = d_head // 4
    text = dict(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d_head,
        linear_num_value_heads=heads, linear_value_head_dim=d_head, linear_num_key_heads=2, linear_key_head_dim=d_head,
        linear_conv_kernel_dim=4, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": interleaved_mrope_section(rotary),
                         "mrope_interleaved": True, "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        hc_count=streams, hc_lowrank=32,
        # PLE: 2 hashed heads per n-gram order (bigrams, trigrams) of 32 dims each (ple_embed_dim: hidden_size); the
        # ids are one-based. With these sizes a saved tiny checkpoint's float weights sit 16-byte aligned in its
        # safetensors file, which CPU kernels need to reload it bit-identically (where the int64 hash buffers and
        # the header leave them 8 bytes off, a 1-output Linear rounds differently: test_save_pretrained_round_trip)
        ple_layer_ids=[layer + 1 for layer in ple_layers], ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=1000, split_ngram_parts=2,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=d_head, indexer_budget=index_budget,
        indexer_compress_ratio=index_block,
        bos_token_id=None, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=vision_heads,
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, out_hidden_size=hidden,
        num_position_embeddings=256,
    )
    model = qwen_random_model(transformers.Qwen4ExpConfig, transformers.Qwen4ExpForConditionalGeneration, text,
                              vision, ids, seed, attn_implementation, text_init_std)
    if text_init_std is not None:
        _redraw_experts(model.model.language_model, std=text_init_std, seed=seed + 2)
        _redraw_ple_convolutions(model.model.language_model, std=0.05, seed=seed + 3)
    processor = transformers.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok,
                                              video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


@register_tiny("tiny-qwen4_exp", rank=31)
def tiny_qwen4_exp(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny Qwen4-Exp model and processor."""
    return build_qwen4_exp(seed, attn_implementation=attn_implementation)
