"""Tiny Llama-3.2-Vision (``mllama``): 5 text layers (4 heads, 2 KV heads, d_head 32), two of them cross-attention
layers (1 and 3), and a tiled vision tower (2 local layers, 1 global) reading 56 px tiles of 14 px patches.

Design: the real ``MllamaConfig`` / ``MllamaForConditionalGeneration`` / ``MllamaImageProcessor`` /
``MllamaProcessor`` at a tiny size, so every code path a real checkpoint takes is exercised. The image never enters
the text sequence: the prompt holds one ``<|image|>`` token, and the cross-attention layers attend from every text
token after it to the projector's rows (per tile: a CLS row, then 4 x 4 patches). The image processor picks a canvas
of up to 4 tiles (1x1, 1x2, 2x2, ... as ``max_image_tiles`` allows), resizes the image into it keeping the aspect
ratio and pads the rest; a 112 px square image is a 2 x 2 canvas of tiles, an 8 x 8 grid of patch keys. The
vision output concatenates the last layer with two intermediate ones (``vision_output_dim`` = 3 x 64). HF
initialises the cross-attention layers' tanh gates at 0 (the image would change nothing); the tiny model opens them
(``GATE``). The chat template writes Llama 3's headers; the tokenizer prepends ``<|begin_of_text|>``, which the
template also writes, so chat texts are encoded without special tokens (the adapter's ``processor_kwargs``).
"""

from __future__ import annotations

import torch
from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessor, MllamaProcessor

from .common import build_tokenizer, random_model, rescale_linear_weights
from .registry import register_tiny

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|image|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TILE_SIZE = 56
PATCH_SIZE = 14
MAX_TILES = 4
CROSS_LAYERS = [1, 3]
# tanh(1) ~ 0.76: the cross-attention and its MLP reach the residual stream
GATE = 1.0


@register_tiny("tiny-mllama", rank=28)
def tiny_mllama(
    seed: int = 0, *, attn_implementation: str = "eager"
) -> tuple[MllamaForConditionalGeneration, MllamaProcessor]:
    """Build the tiny Llama-3.2-Vision model and processor."""
    tok = build_tokenizer(
        SPECIALS, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>",
        add_bos=True, extra_special_tokens={"image_token": "<|image|>"},
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    vision_hidden, intermediate = 64, [0, 1]
    config = MllamaConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, cross_attention_layers=CROSS_LAYERS, max_position_embeddings=4096,
            bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|eot_id|>"],
            pad_token_id=ids["<|finetune_right_pad_id|>"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            hidden_size=vision_hidden, intermediate_size=128, num_hidden_layers=2, num_global_layers=1,
            attention_heads=4, image_size=TILE_SIZE, patch_size=PATCH_SIZE, max_num_tiles=MAX_TILES,
            # the projector reads the last layer and the intermediate ones, concatenated
            vision_output_dim=vision_hidden * (len(intermediate) + 1), intermediate_layers_indices=intermediate,
        ),
        image_token_index=ids["<|image|>"],
    )
    model = random_model(MllamaForConditionalGeneration, config, seed, attn_implementation)
    rescale_linear_weights(model.model.language_model, std=0.08, seed=seed + 1)
    with torch.no_grad():
        for layer in CROSS_LAYERS:
            block = model.model.language_model.layers[layer]
            block.cross_attn_attn_gate.fill_(GATE)
            block.cross_attn_mlp_gate.fill_(GATE)
    image_processor = MllamaImageProcessor(size={"height": TILE_SIZE, "width": TILE_SIZE}, max_image_tiles=MAX_TILES)
    processor = MllamaProcessor(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE)
    return model.eval(), processor
