"""Tiny Gemma-4: 4 text layers (4 heads, 2 KV heads, d_head 32), a 2-block Gemma-4 vision encoder, an 8x8 image grid.

Design: the real ``Gemma4Config`` / ``Gemma4ForConditionalGeneration`` / ``Gemma4Processor`` /
``Gemma4ImageProcessor`` at a tiny size, modelled on google/gemma-4-31B-it (dense, no per-layer embeddings, no KV
sharing, no audio tower), so every code path such a checkpoint takes is exercised. The image processor keeps the
aspect ratio: it resizes an image to the largest multiple of 32 px per side (16 px patches, as in the checkpoints,
pooled 2 x 2 here, 3 x 3 there) whose patches fit a budget of 70 soft tokens (the smallest it takes; checkpoints are
fed 280), so a 224 px square becomes 256 x 256 px and an 8 x 8 grid of tokens, a 320 x 160 image 352 x 160 px and
11 x 5 tokens. The encoder reads the patches padded to the budget (280 rows an image).
Layers alternate sliding-window (window 16, shorter than any image prompt) and full attention; the sliding layers
see the image block bidirectionally (``use_bidirectional_attention="vision"``, with the processor's
``mm_token_type_ids``), the full layers causally, as in the checkpoints. The full layers share one key / value head
whose keys are also its values (``attention_k_eq_v``: no ``v_proj``), as the checkpoints' global layers do; their
head width is the sliding layers' 32 here (the checkpoints': 512 against 256), so that every layer has
``n_heads x d_head`` heads. Every layer ends by scaling the residual stream by its ``layer_scalar``, which HF
initialises to 1 and trained checkpoints hold well below it (about 0.005 to 0.9 in a 12B): it is drawn from
[0.5, 1) here so that the scale matters. The patch embedder's position table (HF: ones, which would make the tower blind to where a patch is)
is drawn from the seed. Final logits are soft-capped at 30, as in the checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>",
            "<|video|>", "<|audio>", "<audio|>", "<|audio|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
PATCH_SIZE = 16
POOLING = 2
# the smallest budget the image processor takes: a square image becomes floor(sqrt(70)) = 8 tokens a side
MAX_SOFT_TOKENS = 70
SLIDING_WINDOW = 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@register_tiny("tiny-gemma4", rank=29)
def tiny_gemma4(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[Gemma4ForConditionalGeneration, Gemma4Processor]:
    """Build the tiny Gemma-4 model and processor; ``tokenizer`` and ``chat_template`` replace the tiny ones
    (:mod:`vlmbind.tiny.real`)."""
    return build_gemma4(seed, attn_implementation=attn_implementation, tokenizer=tokenizer,
                        chat_template=chat_template)


def build_gemma4(
    seed: int = 0, *, attn_implementation: str = "eager", text_overrides: dict[str, Any] | None = None,
    tokenizer: Any = None, chat_template: str | None = None,
) -> tuple[Gemma4ForConditionalGeneration, Gemma4Processor]:
    """The tiny Gemma-4 with ``text_overrides`` applied to its text config: the tests build the other checkpoints'
    shapes with it (the 26B-A4B's MoE block, wider full-attention heads, E2B's per-layer embeddings)."""
    tok = tokenizer or build_tokenizer(
        SPECIALS,
        bos_token="<bos>",
        eos_token="<turn|>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos=True,
        extra_special_tokens={
            "image_token": "<|image|>",
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "audio_token": "<|audio|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
        },
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        max_position_embeddings=4096, sliding_window=SLIDING_WINDOW, layer_types=list(LAYER_TYPES),
        final_logit_softcapping=30.0, use_bidirectional_attention="vision", hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=len(tok), num_kv_shared_layers=0,
        bos_token_id=ids["<bos>"], eos_token_id=ids["<turn|>"], pad_token_id=ids["<pad>"],
    )
    text.update(text_overrides or {})
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, patch_size=PATCH_SIZE, pooling_kernel_size=POOLING, position_embedding_size=64,
    )
    config = Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None,
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"], boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"], tie_word_embeddings=True,
    )
    model = random_model(Gemma4ForConditionalGeneration, config, seed, attn_implementation)
    language_model = model.model.language_model
    rescale_linear_weights(language_model, std=0.08, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in language_model.layers:
            layer.layer_scalar.copy_(0.5 + 0.5 * torch.rand(layer.layer_scalar.shape, generator=g))
            experts = getattr(layer, "experts", None)
            if experts is not None:  # stacked Parameters, not Linear layers: HF's small init would mute them
                for weight in (experts.gate_up_proj, experts.down_proj):
                    weight.copy_(torch.randn(weight.shape, generator=g) * 0.08)
        table = model.model.vision_tower.patch_embedder.position_embedding_table
        table.copy_(torch.randn(table.shape, generator=g) * 0.5)
    image_processor = Gemma4ImageProcessor(patch_size=PATCH_SIZE, pooling_kernel_size=POOLING,
                                           max_soft_tokens=MAX_SOFT_TOKENS)
    video_processor = Gemma4VideoProcessor(patch_size=PATCH_SIZE, pooling_kernel_size=POOLING,
                                           max_soft_tokens=MAX_SOFT_TOKENS)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor, tokenizer=tok,
        video_processor=video_processor, chat_template=chat_template or CHAT_TEMPLATE, image_seq_length=MAX_SOFT_TOKENS,
    )
    return model.eval(), processor
