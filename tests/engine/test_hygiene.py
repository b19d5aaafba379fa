"""Hook hygiene under faults, for every intervention type and every way of applying one: an exception raised inside
the ``with`` block, inside the forward (a failing module), or by the intervention itself mid-forward leaves zero
vlmbind hooks, no probability edit, no swapped attention implementation, and the next run's logits equal a clean
model's exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny
from test_hooks import _clean_state

import vlmbind as vb
from vlmbind.engine.decoding import greedy_decode
from vlmbind.engine.hooks import PatchHeadEntries
from vlmbind.engine.interventions import AddToHeadRows

FAMILIES = ["tiny-qwen2_5_vl", "tiny-gemma3"]  # a plainly causal family and one with sliding windows


def interventions(vlm, batch) -> dict[str, vb.Intervention]:
    """One of each intervention type (and each mode), each changing the logits."""
    z = vlm.capture(batch, "blocks.1.attn.hook_z")["blocks.1.attn.hook_z"]
    d, b = vlm.adapter.d_head, z.shape[0]
    last = [ti.last_position for ti in batch.index]
    return {
        "patch": vb.PatchHeads(layer=1, heads=[0], positions=[-1], values=z[:, [-1]][:, :, [0]] * 3),
        "patch_entries": PatchHeadEntries(layer=1, heads=[0, 1], rows=list(range(b))[:2], positions=last[:2],
                                             values=torch.ones(2, d) * 4),
        "ablate_zero": vb.AblateHeads(layer=1, heads=[1], mode="zero"),
        "ablate_mean": vb.AblateHeads(layer=1, heads=[1], mode="mean", means=torch.ones(1, d)),
        "add": vb.AddToHeads(layer=1, heads=[0, 1], positions=[-1], vector=torch.ones(d), alpha=3.0),
        "add_rows": AddToHeadRows(layer=1, heads=[0], positions=[-1], vector=torch.randn(b, 1, d), alpha=5.0),
        "image_attention": vb.ZeroImageAttention(layer=1, heads=[0], renormalize=True),
        "image_attention_raw": vb.ZeroImageAttention(layer=1, heads=[0], renormalize=False),
    }


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    vlm = get_tiny(request.param)
    batch = vlm.prepare([draw_scene(0), draw_scene(3)], [PROMPT, "the red object is a"])
    return vlm, batch, vlm.logits(batch)


KINDS = [
    "patch", "patch_entries", "ablate_zero", "ablate_mean", "add", "add_rows", "image_attention",
    "image_attention_raw"]


@pytest.mark.parametrize("kind", KINDS)
def test_exception_inside_the_with_block(setup, kind):
    vlm, batch, clean = setup
    intervention = interventions(vlm, batch)[kind]
    with pytest.raises(KeyError, match="user code"):
        with vlm.intervene([intervention]):
            changed = vlm.logits(batch)
            assert (changed - clean).abs().max() > 1e-6, "the intervention must act for the test to mean anything"
            raise KeyError("user code")
    _clean_state(vlm)
    torch.testing.assert_close(vlm.logits(batch), clean, atol=0, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_exception_inside_the_forward(setup, kind):
    """A module after the hooked layer raises, during logits, HF generate and the no-cache greedy decode."""
    vlm, batch, clean = setup
    intervention = interventions(vlm, batch)[kind]
    a = vlm.adapter

    def boom(module, args, output):
        raise RuntimeError("module failed")

    calls = [lambda: vlm.logits(batch, [intervention]),
             lambda: vlm.run(batch, sites=["blocks.*.attn.hook_pattern"], interventions=[intervention]),
             lambda: vlm.generate(batch, 2, interventions=[intervention], use_cache=False),
             lambda: greedy_decode(vlm, batch, [intervention], max_new_tokens=2)]
    for call in calls:
        handle = a.layer(a.n_layers - 1).register_forward_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="module failed"):
                call()
        finally:
            handle.remove()
        _clean_state(vlm)
    torch.testing.assert_close(vlm.logits(batch), clean, atol=0, rtol=0)


def test_an_intervention_failing_mid_forward_leaves_nothing(setup):
    """The second of two interventions raises inside its hook (wrong per-row vector shape), after the first ran."""
    vlm, batch, clean = setup
    d = vlm.adapter.d_head
    good = vb.AblateHeads(layer=0, heads=[0], mode="zero")
    bad = AddToHeadRows(layer=1, heads=[0], positions=[-1], vector=torch.ones(7, 1, d))
    with pytest.raises(vb.InterventionError, match="per-row vector"):
        vlm.logits(batch, [good, bad])
    _clean_state(vlm)
    with pytest.raises(vb.InterventionError):
        with vlm.ablate([(0, 0)], mode="image_attention"):
            vlm.logits(batch, [bad])
    _clean_state(vlm)
    torch.testing.assert_close(vlm.logits(batch), clean, atol=0, rtol=0)


def test_ablate_context_cleans_up_for_every_mode(setup):
    vlm, batch, clean = setup
    means = {0: torch.zeros(1, vlm.adapter.d_head)}
    for mode in ("zero", "mean", "image_attention"):
        with pytest.raises(ValueError, match="inside"):
            with vlm.ablate([(0, 0)], mode=mode, means=means if mode == "mean" else None):
                raise ValueError("inside the block")
        _clean_state(vlm)
    torch.testing.assert_close(vlm.logits(batch), clean, atol=0, rtol=0)
