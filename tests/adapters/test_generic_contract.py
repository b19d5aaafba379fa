"""The adapter contract, for every tiny model of every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny

import vlmbind as vb
from vlmbind.tiny import TINY_NAMES


def test_every_family_has_a_tiny_model():
    """Each tiny model builds its family, which its name says (``tiny-<family>``: the families table relies on it)."""
    from vlmbind.tiny import tiny_family

    families = {n: get_tiny(n).family for n in TINY_NAMES}
    assert set(families.values()) == set(vb.supported_families())
    assert {n: tiny_family(n) for n in TINY_NAMES} == families


def test_declared_paths_resolve(tiny):
    paths = tiny.adapter.declared_paths()
    assert len(paths["text_layers"]) == tiny.n_layers
    assert paths["o_proj"].in_features == tiny.adapter.n_heads * tiny.adapter.d_head
    assert tiny.adapter.n_heads % tiny.adapter.n_kv_heads == 0
    assert tiny.adapter.n_vision_layers >= 1
    for layer in range(tiny.adapter.n_vision_layers):
        assert tiny.adapter.vision_block(layer) is not None


def test_hook_shapes(tiny, scene):
    a = tiny.adapter
    batch = tiny.prepare([scene, draw_scene(1)], [PROMPT, "what colour is the circle ? it is"])
    b, p = batch.inputs["input_ids"].shape
    out = tiny.run(batch, sites=["blocks.*attn.hook_z", "blocks.*attn.hook_pattern", "blocks.*.hook_resid_pre",
                                 "blocks.*.hook_resid_post", "blocks.*.hook_attn_out", "blocks.*.hook_mlp_out",
                                 "vision.*", "projector.hook_out"])
    assert out.logits.shape[:2] == (b, p)
    # hybrid models declare the layers with per-head outputs and softmax patterns (Qwen3.5: not its DeltaNet ones);
    # cross-attention layers (Llama-3.2-Vision) have cross_attn.* in place of attn.*, their keys the image's
    assert [k for k in out.cache if k.endswith("hook_pattern")] == [a.pattern_site(l) for l in a.pattern_layers()]
    assert [k for k in out.cache if k.endswith("hook_z")] == [a.z_site(l) for l in a.head_layers()]
    keys = out["projector.hook_out"].shape[1:-1].numel() if a.cross_attention_layers() else p
    for layer in range(a.n_layers):
        if layer in a.head_layers():
            assert out[a.z_site(layer)].shape == (b, p, a.n_heads, a.d_head)
        if layer in a.pattern_layers():
            k = keys if layer in a.cross_attention_layers() else p
            assert out[a.pattern_site(layer)].shape == (b, a.n_heads, p, k)
        # hyper-connection families (Qwen4-Exp) keep several d_model streams side by side
        for hook in ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out"):
            assert out[f"blocks.{layer}.{hook}"].shape == (b, p, a.n_residual_streams * a.d_model)
    n_image = sum(len(ti.image_positions) for ti in batch.index)
    assert out["projector.hook_out"].reshape(-1, a.d_model).shape[0] >= n_image
    assert len([k for k in out.cache if k.startswith("vision.")]) == a.n_vision_layers


def test_patterns_are_probabilities(tiny, scene):
    batch = tiny.prepare(scene, PROMPT)
    site = f"blocks.{tiny.adapter.pattern_layers()[0]}.attn.hook_pattern"
    pattern = tiny.capture(batch, site)[site]
    torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1]), atol=1e-5, rtol=0)


def test_different_image_changes_logits(tiny):
    a = tiny.logits(tiny.prepare(draw_scene(0), PROMPT))
    b = tiny.logits(tiny.prepare(draw_scene(5), PROMPT))
    assert (a[0, -1] - b[0, -1]).abs().max() > 1e-3


def test_same_seed_same_weights_other_seed_differs():
    name = TINY_NAMES[0]
    batch_model = vb.load(name, seed=3)
    again = vb.load(name, seed=3)
    other = vb.load(name, seed=4)
    batch = batch_model.prepare(draw_scene(0), PROMPT)
    torch.testing.assert_close(batch_model.logits(batch), again.logits(batch), atol=0, rtol=0)
    assert (batch_model.logits(batch) - other.logits(batch)).abs().max() > 1e-3


@pytest.mark.parametrize("name", TINY_NAMES)
def test_every_tiny_model_is_deterministic(name):
    a, b = vb.load(name, seed=1), vb.load(name, seed=1)
    for (ka, va), (kb, vb_) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb_), ka


def test_save_pretrained_round_trip(tiny, tmp_path, scene):
    """Saving with save_pretrained and loading the directory is the real-checkpoint path: identical logits."""
    tiny.model.save_pretrained(tmp_path)
    tiny.processor.save_pretrained(tmp_path)
    loaded = vb.load(str(tmp_path), attn_implementation="eager")  # the tiny model's kernel: bit-identical logits
    assert loaded.family == tiny.family
    assert loaded.source == str(tmp_path.resolve())
    # saved, the tiny model is a checkpoint with a chat template (chat by default); compare the same raw prompt
    assert loaded.active_prompt_format == "chat" and tiny.active_prompt_format == "raw"
    batch_a = tiny.prepare(scene, PROMPT)
    batch_b = loaded.prepare(scene, PROMPT, chat=False)
    for key, value in batch_a.inputs.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, batch_b.inputs[key], atol=0, rtol=0, msg=key)
    torch.testing.assert_close(tiny.logits(batch_a), loaded.logits(batch_b), atol=0, rtol=0)
    assert [g.shape for g in batch_a.index[0].grids] == [g.shape for g in batch_b.index[0].grids]
    default = vb.load(str(tmp_path))  # checkpoints load with sdpa: the same numbers up to float rounding
    # (PaliGemma 2's Gemma-2 text model has no sdpa: eager)
    expected = "eager" if default.family == "paligemma" else "sdpa"
    assert default.adapter.text_config._attn_implementation == expected
    torch.testing.assert_close(tiny.logits(batch_a), default.logits(default.prepare(scene, PROMPT, chat=False)),
                               atol=1e-4, rtol=1e-4)


def test_batch_rows_match_single_examples(tiny):
    """Left padding must not change a row's next-token logits."""
    images, prompts = [draw_scene(0), draw_scene(1)], [PROMPT, "the red object is a"]
    batch = tiny.prepare(images, prompts)
    logits = tiny.logits(batch)
    for row in range(2):
        single = tiny.prepare(images[row], prompts[row])
        torch.testing.assert_close(logits[row, -1], tiny.logits(single)[0, -1], atol=1e-4, rtol=1e-4)


def test_roles_cover_every_position(tiny, scene):
    batch = tiny.prepare([scene, draw_scene(2)], [PROMPT, "is"])
    for ti in batch.index:
        assert set(np.unique(ti.roles)) <= {"text", "image", "special", "pad"}
        # a family without image tokens in the sequence (Llama-3.2-Vision) has grids over its image keys instead
        assert bool(ti.grids) == tiny.adapter.image_tokens_in_sequence != bool(ti.key_grids)
        for grids, expected in ((ti.grids, ti.image_positions), (ti.key_grids, None)):
            cells = np.concatenate([g.positions.reshape(-1) for g in grids] or [np.zeros(0, dtype=int)])
            assert len(np.unique(cells)) == len(cells)
            if expected is not None:
                assert set(cells.tolist()) == set(expected.tolist())
        assert ti.roles[ti.last_position] != "pad"


def test_every_family_declares_the_image_size_its_checkpoints_are_fed(tiny):
    """``typical_image_size`` (the size vlmbind draws a checkpoint's stimuli at) is declared by every family, on the
    class, and its tiny model's processor turns an image of that size into the image tokens of a batch."""
    from vlmbind.adapters import ADAPTERS

    # the base class only annotates it: a family without the declaration raises AttributeError here
    assert all(isinstance(cls.typical_image_size, int) for cls in ADAPTERS.values())
    size = tiny.adapter.typical_image_size
    assert 112 <= size <= 1024
    batch = tiny.prepare(draw_scene(0, (size, size)), PROMPT)
    assert batch.index[0].image_positions.size > 0 or not tiny.adapter.image_tokens_in_sequence
