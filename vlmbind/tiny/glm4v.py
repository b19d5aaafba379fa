"""Tiny GLM-4.1V: 4 text layers (4 heads, 2 KV heads, d_head 32) with GLM's sandwich norms, 2 vision blocks, a 2x2
conv downsample and the patch merger.

GLM-4.1V's vision patches are 14 px and the downsample merges 2x2 of them, so a language-model image token covers
28 px and a 224 px square image becomes an 8x8 grid. The text decoder rotates half of each head (partial rotary
factor 0.5, as the checkpoints do) with M-RoPE, its frequencies split 2:3:3 between time, height and width (the
checkpoints' 8:12:12). The tokenizer carries GLM's chat and image tokens; the chat template writes GLM's
``[gMASK]<sop><|user|>\\n ... <|assistant|>\\n`` turns with ``<|begin_of_image|><|image|><|end_of_image|>`` per image.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import Glm4vImageProcessor, Glm4vVideoProcessor

from .common import build_tokenizer, random_model, rescale_linear_weights
from .qwen import mrope_section
from .registry import register_tiny

SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
            "<|video|>"]
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PATCH_SIZE = 14
MERGE_SIZE = 2
# the checkpoints rotate half of each head's dimensions
PARTIAL_ROTARY_FACTOR = 0.5


def glm_tokenizer() -> Any:
    """The tiny byte-level BPE with GLM's special tokens, named as GLM's processor looks them up."""
    return build_tokenizer(
        SPECIALS,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
    )


def glm4v_configs(tok: Any, *, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                  vision_depth: int = 2, vision_hidden: int = 64, vision_heads: int = 4,
                  image_size: int = 224) -> dict[str, Any]:
    """The keyword arguments of a GLM-4.1V config (``Glm4vConfig`` or ``Glm46VConfig``) for the tokenizer ``tok``:
    text and vision sub-configs and the image / video token ids."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    head_dim = hidden // heads
    text = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
                         "mrope_section": mrope_section(int(head_dim * PARTIAL_ROTARY_FACTOR))},
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=vision_depth, hidden_size=vision_hidden, num_heads=vision_heads, intermediate_size=2 * hidden,
        out_hidden_size=hidden, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
        # the learned position grid (image_size / patch_size per side), bicubically resampled to each image's patches
        image_size=image_size,
    )
    return dict(
        text_config=text, vision_config=vision, image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )


def glm4v_processor(tok: Any, image_size: int = 224, processor_cls: type = transformers.Glm4vProcessor) -> Any:
    """GLM's processor with the image size fixed: GLM's resize compares ``2 * h * w`` (two frames of an image) with
    its pixel bounds, so bounds of ``2 * image_size**2`` keep a square ``image_size`` image (a multiple of 28) as it
    is."""
    pixels = 2 * image_size * image_size
    size = {"shortest_edge": pixels, "longest_edge": pixels}
    sizes = dict(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2)
    return processor_cls(image_processor=Glm4vImageProcessor(size=size, **sizes), tokenizer=tok,
                         video_processor=Glm4vVideoProcessor(size=size, **sizes), chat_template=CHAT_TEMPLATE)


def finish_glm4v(model: torch.nn.Module, seed: int, text_init_std: float = 0.08) -> torch.nn.Module:
    """Re-draw the text decoder's Linear weights from N(0, ``text_init_std``), so random heads have visible effects,
    and return the model in eval mode."""
    rescale_linear_weights(model.model.language_model, std=text_init_std, seed=seed + 1)
    return model.eval()


@register_tiny("tiny-glm4v", rank=30)
def tiny_glm4v(seed: int = 0, *, attn_implementation: str = "eager"):
    """Build the tiny GLM-4.1V model and processor (``Glm4vForConditionalGeneration``)."""
    tok = glm_tokenizer()
    config = transformers.Glm4vConfig(**glm4v_configs(tok))
    model = random_model(transformers.Glm4vForConditionalGeneration, config, seed, attn_implementation)
    return finish_glm4v(model, seed), glm4v_processor(tok)
