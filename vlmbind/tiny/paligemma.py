"""Tiny PaliGemma 2: 4 Gemma-2 text layers (4 heads, 2 KV heads, d_head 32), a 2-block SigLIP tower, a 7x7 image grid.

Design: the real ``PaliGemmaConfig`` / ``PaliGemmaForConditionalGeneration`` / ``PaliGemmaProcessor`` /
``SiglipImageProcessor`` at a tiny size, with a Gemma-2 text model (PaliGemma 2's), so every code path a real
checkpoint takes is exercised: alternating sliding-window (window 16, shorter than any image prompt) and full layers,
attention-logit and final-logit soft-capping, post-norms, 1-indexed positions, and the prefix-LM mask (image and
prompt attend bidirectionally, ``token_type_ids`` 0; appended answer tokens, 1, are causal). A 112 px image is cut
into 7x7 SigLIP patches of 16 px and the linear projector maps each patch to one image token (no pooling). The
processor writes ``<image>``*49 ``<bos>`` prompt ``\\n`` itself and adds PaliGemma's ``<locNNNN>`` / ``<segNNN>``
tokens to the tokenizer, so the vocabulary is sized after the processor is built. PaliGemma has no chat template;
the tiny one writes the raw prompt (see ``CHAT_TEMPLATE``).
"""

from __future__ import annotations

from typing import Any

from transformers import (
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    PaliGemmaProcessor,
    SiglipImageProcessor,
)

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
# PaliGemma checkpoints have no chat template; this one writes the raw prompt (the user turns' image placeholders and
# text), so that a saved tiny model loads as a chat checkpoint like every other family's and both formats agree
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endif %}{% endfor %}"
)
IMAGE_SIZE = 112
PATCH_SIZE = 16
SLIDING_WINDOW = 16


@register_tiny("tiny-paligemma", rank=20)
def tiny_paligemma(
    seed: int = 0, *, attn_implementation: str = "eager", tokenizer: Any = None, chat_template: str | None = None
) -> tuple[PaliGemmaForConditionalGeneration, PaliGemmaProcessor]:
    """Build the tiny PaliGemma 2 model and processor."""
    tok = tokenizer or build_tokenizer(
        SPECIALS, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    n_tokens = (IMAGE_SIZE // PATCH_SIZE) ** 2
    image_processor = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    image_processor.image_seq_length = n_tokens  # PaliGemmaProcessor reads the token count from here
    # the processor adds the location / segmentation tokens to the tokenizer: build it before sizing the vocabulary
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok,
                                   chat_template=chat_template or CHAT_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(
        model_type="gemma2", vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        max_position_embeddings=4096, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
    )
    vision = dict(
        model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False,
    )
    config = PaliGemmaConfig(
        text_config=text, vision_config=vision, image_token_index=ids["<image>"], projection_dim=128,
        hidden_size=128, vocab_size=len(tok), bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"], tie_word_embeddings=True,
    )
    model = random_model(PaliGemmaForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    return model.eval(), processor
