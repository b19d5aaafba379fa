"""Shared pieces of the tiny builders: the vocabulary, the tokenizer, seeding and weight re-scaling."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "cyan", "gray", "black", "white", "pink", "brown"]
SHAPES = ["square", "circle", "triangle", "diamond", "pentagon", "hexagon", "cross", "star", "L", "T", "H", "E",
          "letter", "shape", "object", "objects", "shapes"]
WORDS = ("in this image there is are a an the and of what colour color is it which object how many count point "
         "points to each find yes no answer question : ? , . ( ) < > = \" ' / x y at left right top bottom row col "
         "column image picture describe missing last first second third fourth target present absent among "
         "none").split()
NUMBERS = [str(i) for i in range(0, 101)]


def _corpus() -> list[str]:
    words = COLOURS + SHAPES + WORDS + NUMBERS
    lines = [" ".join(words)]
    lines += [f" {w}" for w in words for _ in range(3)]
    lines += [f" {c} {s}" for c in COLOURS for s in SHAPES]
    lines += [f"({x}, {y})" for x in range(10) for y in range(10)]
    return lines


def build_tokenizer(
    special_tokens: list[str],
    *,
    vocab_size: int = 600,
    extra_special_tokens: dict[str, str] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    add_bos: bool = False,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained deterministically on the stimuli's vocabulary.

    ``special_tokens`` get the first ids in the given order; ``extra_special_tokens`` names family attributes such
    as ``image_token``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    if add_bos and bos_token is not None:
        bos_id = tok.token_to_id(bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)]
        )
    kwargs = {k: v for k, v in dict(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                                     unk_token=unk_token).items() if v is not None}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, extra_special_tokens=extra_special_tokens or {}, **kwargs
    )


def random_model(model_cls: type, config: Any, seed: int, attn_implementation: str) -> torch.nn.Module:
    """``model_cls`` built from ``config`` with the weights HF's init draws after ``torch.manual_seed(seed)``."""
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    return model_cls._from_config(config, attn_implementation=attn_implementation)


def rescale_linear_weights(module: torch.nn.Module, std: float, seed: int) -> None:
    """Re-draw every Linear weight under ``module`` from N(0, std) so head effects are O(0.1-1) logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
