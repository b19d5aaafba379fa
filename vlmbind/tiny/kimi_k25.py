"""Tiny Kimi-K2.5: 4 DeepSeek-V3 text layers (4 MLA heads, d_head 32), a 2-block MoonViT tower, a 2x2 patch merger.

Design: the real HF config, model, image-processor and processor classes at a tiny size, shaped like
``moonshotai/Kimi-K2.5``. The text model keeps the checkpoint's kinds of layer: multi-head latent attention with a
low-rank query (``q_lora_rank`` 64) and a shared key/value latent (``kv_lora_rank`` 32), queries and keys of
32 + 16 dimensions (the 16 rotary, interleaved) and values of 32, so ``d_head`` (the value width) differs from the
width the patterns come from; layer 0 is dense (``first_k_dense_replace=1``) and layers 1-3 route every token to 2
of 4 experts by a sigmoid router (one group), plus one shared expert. The MoE experts and routers are plain
Parameters, so they are re-drawn like the text model's Linear weights: routing is decisive (no near-ties that float
rounding could flip) and the experts' outputs are O(1). The tower cuts 14 px patches and the image processor keeps
an image of at most ``max_patches = 256`` patches (224 x 224) as it is, shrinking larger ones to that budget and
padding to multiples of 28 px, so a 224 px square image becomes an 8 x 8 grid of 64 image tokens. The tokenizer has
Kimi's special tokens and the chat template Kimi's turn markers (``<|im_user|>user<|im_middle|>`` ...
``<|im_end|>``), without the default system prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    DeepseekV3Config,
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    Kimi_K25ImageProcessor,
    Kimi_K25Processor,
    Kimi_K25VideoProcessor,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
            "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
            "<|kimi_k25_video_placeholder|>"]
IMAGE_BLOCK = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}" + IMAGE_BLOCK + "\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
PATCH_SIZE = 14
MERGE_SIZE = 2
# 16 x 16 patches: a 224 px square is kept as it is, larger images shrink to this budget
MAX_PATCHES = 256
TEXT_INIT_STD = 0.08


def _redraw_experts(module: torch.nn.Module, std: float, seed: int) -> None:
    """Re-draw the MoE experts' stacked weights and the routers' weights from N(0, std): they are plain
    Parameters, not Linear layers, so :func:`rescale_linear_weights` leaves them at HF's small init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")):
                parameter.copy_(torch.randn(parameter.shape, generator=g) * std)


@register_tiny("tiny-kimi_k25", rank=32)
def tiny_kimi_k25(seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None,
                  chat_template: str | None = None) -> tuple[Kimi_K25ForConditionalGeneration, Kimi_K25Processor]:
    """Build the tiny Kimi-K2.5 model and processor."""
    tok = tokenizer or build_tokenizer(
        SPECIALS, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
        extra_special_tokens={"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"},
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, n_group=1, topk_group=1, num_mtp_layers=0, max_position_embeddings=4096,
        bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"], tie_word_embeddings=False,
    )
    vision = dict(patch_size=PATCH_SIZE, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, pos_emb_height=16, pos_emb_width=16,
                  merge_kernel_size=[MERGE_SIZE, MERGE_SIZE])
    config = Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=vision["hidden_size"],
        image_token_id=ids["<|media_pad|>"], video_token_id=ids["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=ids["<|media_begin|>"], vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False,
    )
    model = random_model(Kimi_K25ForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=TEXT_INIT_STD, seed=seed + 1)
    _redraw_experts(model.model.language_model, std=TEXT_INIT_STD, seed=seed + 2)
    bounds = dict(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, max_patches=MAX_PATCHES)
    processor = Kimi_K25Processor(
        image_processor=Kimi_K25ImageProcessor(**bounds), tokenizer=tok,
        video_processor=Kimi_K25VideoProcessor(**bounds), chat_template=chat_template or CHAT_TEMPLATE,
    )
    return model.eval(), processor
