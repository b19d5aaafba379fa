"""The tiny-model registry: every builder takes the shared options and refuses others by name, a builder's weights
are a function of its seed, and registration refuses a name or a rank twice."""

from __future__ import annotations

import pytest
import torch

import vlmbind as vb
from vlmbind import tiny
from vlmbind.tiny.registry import LISTING_RANK, TINY_BUILDERS, register_tiny


@pytest.mark.parametrize("name", tiny.TINY_NAMES)
def test_every_builder_documents_and_checks_its_options(name):
    build = TINY_BUILDERS[name]
    assert "attn_implementation" in build.__doc__ and "Returns:" in build.__doc__
    with pytest.raises(vb.InputError, match=rf"{name} takes the options attn_implementation.*not revision"):
        tiny.build(name, revision="main")


def test_a_from_pretrained_option_on_a_tiny_name_is_refused_not_ignored():
    with pytest.raises(vb.InputError, match="tiny-idefics3 takes the options attn_implementation; not tokenizer"):
        vb.load("tiny-idefics3", tokenizer=object())


def test_the_options_a_builder_takes_reach_it():
    model, processor = tiny.build("tiny-llava", seed=1, attn_implementation="sdpa", chat_template="{{ 'x' }}")
    assert model.config._attn_implementation == "sdpa" and processor.chat_template == "{{ 'x' }}"


def test_weights_are_a_function_of_the_seed():
    first, second, other = (tiny.build("tiny-qwen2_5_vl", seed=s)[0] for s in (3, 3, 4))
    for (name, a), b, c in zip(first.state_dict().items(), second.state_dict().values(),
                               other.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.state_dict().values(), other.state_dict().values()))


def test_a_name_or_rank_is_registered_once():
    taken_name, taken_rank = next(iter(LISTING_RANK.items()))
    with pytest.raises(ValueError, match="registered twice"):
        register_tiny(taken_name, rank=999)(lambda seed=0: None)
    with pytest.raises(ValueError, match=f"rank {taken_rank} is taken"):
        register_tiny("tiny-never-registered", rank=taken_rank)(lambda seed=0: None)
    assert "tiny-never-registered" not in TINY_BUILDERS
