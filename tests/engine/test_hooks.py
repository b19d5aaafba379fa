"""Interventions do what their names say, check their input, and never leave a hook behind."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPT, draw_scene

import vlmbind as vb
from vlmbind.core.errors import NoImageTokensError
from vlmbind.engine.hooks import PROB_EDITS, SCORE_EDITS, ATTENTION_IMPL, HookSession
from vlmbind.engine.interventions import PatchHeadsWhere


def _hook_count(model: torch.nn.Module) -> int:
    """Hooks vlmbind registered (transformers installs its own output-capturing hooks; those are not ours)."""
    return sum(
        getattr(fn, "__module__", "") == "vlmbind.engine.hooks"
        for m in model.modules()
        for fn in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
    )


def _clean_state(vlm) -> None:
    assert _hook_count(vlm.model) == 0
    assert not any(hasattr(m, PROB_EDITS) or hasattr(m, SCORE_EDITS) for m in vlm.model.modules())
    assert vlm.adapter.text_config._attn_implementation != ATTENTION_IMPL
    assert vlm.active == []


@pytest.fixture
def batch(tiny):
    return tiny.prepare([draw_scene(0), draw_scene(3)], [PROMPT, "the red object is a"])


def _all_interventions(vlm, batch):
    site = vlm.adapter.z_site(1)  # a cross-attention layer's heads on Llama-3.2-Vision
    z = vlm.capture(batch, site)[site]
    d = vlm.adapter.d_head
    image_edits = [
        vb.ZeroImageAttention(layer=1, heads=[0], renormalize=True),
        vb.ZeroImageAttention(layer=1, heads=[0], renormalize=False),
        vb.SteerAttention(layer=1, heads=[0], keys=[ti.image_positions[:2] for ti in batch.index],
                          query_positions=[-1]),
        vb.BlockAttention(layer=1, heads=[0], keys=[ti.image_positions for ti in batch.index]),
    ] if vlm.adapter.image_tokens_in_sequence else []  # refused by name otherwise (see below)
    last = torch.zeros(z.shape[:2], dtype=torch.bool)
    last[:, -1] = True
    return [
        vb.PatchHeads(layer=1, heads=[0], positions=[-1], values=z[:, [-1]][:, :, [0]] * 2),
        PatchHeadsWhere(layer=1, heads=[0], where=last, values=z * 2),
        vb.AblateHeads(layer=1, heads=[1], mode="zero"),
        vb.AblateHeads(layer=1, heads=[1], mode="mean", means=torch.ones(1, d)),
        vb.AddToHeads(layer=1, heads=[0, 1], positions=[-1], vector=torch.ones(d), alpha=3.0),
        *image_edits,
    ]


def test_hooks_removed_when_forward_raises(tiny, batch):
    clean = tiny.logits(batch)
    a = tiny.adapter
    with tiny.intervene([vb.AblateHeads(layer=0, heads=[0])]):
        tiny.run(batch, sites=a.z_site(0))
        assert _hook_count(tiny.model) == 0  # hooks live only during a call

    def boom(module, args, output):
        raise RuntimeError("boom")

    for intervention in _all_interventions(tiny, batch):
        handle = a.layer(a.n_layers - 1).register_forward_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="boom"):
                tiny.run(batch, sites=["blocks.*attn.hook_pattern", a.z_site(0)],
                         interventions=[intervention])
        finally:
            handle.remove()
        _clean_state(tiny)
        torch.testing.assert_close(tiny.logits(batch), clean, atol=0, rtol=0)


def test_context_managers_clean_up_on_error(tiny, batch):
    clean = tiny.logits(batch)
    # image_attention needs softmax layers (hybrid models declare which: adapter.pattern_layers)
    softmax = tiny.adapter.pattern_layers()
    modes = [("image_attention", [(softmax[0], 0), (softmax[-1], 1)])] if tiny.adapter.image_tokens_in_sequence else []
    for mode, heads in (*modes, ("zero", [(0, 0), (1, 1)])):
        with pytest.raises(ValueError, match="inside"):
            with tiny.ablate(heads, mode=mode):
                assert (tiny.logits(batch) - clean).abs().max() > 0
                raise ValueError("inside the block")
        _clean_state(tiny)
        torch.testing.assert_close(tiny.logits(batch), clean, atol=0, rtol=0)


def test_every_intervention_changes_logits_then_leaves_no_trace(tiny, batch):
    clean = tiny.logits(batch)
    for intervention in _all_interventions(tiny, batch):
        changed = tiny.logits(batch, [intervention])
        assert (changed - clean).abs().max() > 1e-5, intervention
        _clean_state(tiny)
    torch.testing.assert_close(tiny.logits(batch), clean, atol=0, rtol=0)


def test_zero_ablation_zeroes_z(tiny, batch):
    site = tiny.adapter.z_site(2)
    out = tiny.run(batch, sites=site, interventions=[vb.AblateHeads(layer=2, heads=[1, 3 % tiny.n_heads])])
    z = out[site]
    assert z[:, :, [1, 3 % tiny.n_heads]].abs().max() == 0
    assert z[:, :, 0].abs().max() > 0


def test_zero_image_attention_matches_decomposition(tiny, batch):
    """Zeroing attention to image tokens after the softmax = removing those keys' weighted values from z."""
    layer, head = 1, 0
    if not tiny.adapter.image_tokens_in_sequence:
        # Llama-3.2-Vision: no sequence position holds image features; refused by name, on every layer kind
        for l in (0, 1):
            with pytest.raises(NoImageTokensError, match="cross-attention layers"):
                tiny.logits(batch, [vb.ZeroImageAttention(layer=l, heads=[head])])
            with pytest.raises(NoImageTokensError):
                with tiny.ablate([(l, head)], mode="image_attention"):
                    pass
        _clean_state(tiny)
        return
    sites = [f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_z"]
    clean = tiny.run(batch, sites=sites)
    for renorm in (False, True):
        out = tiny.run(batch, sites=sites,
                       interventions=[vb.ZeroImageAttention(layer=layer, heads=[head], renormalize=renorm)])
        pattern = out[sites[0]]
        for row, ti in enumerate(batch.index):
            img = torch.as_tensor(ti.image_positions)
            assert pattern[row, head][:, img].abs().max() == 0
            other = [h for h in range(tiny.n_heads) if h != head]
            torch.testing.assert_close(pattern[row, other], clean[sites[0]][row, other], atol=0, rtol=0)
            sums = pattern[row, head, ti.last_position].sum()
            if renorm:
                torch.testing.assert_close(sums, torch.tensor(1.0), atol=1e-5, rtol=0)
            else:
                kept = 1 - clean[sites[0]][row, head, ti.last_position, img].sum()
                torch.testing.assert_close(sums, kept, atol=1e-5, rtol=0)


def test_bad_interventions_raise_named_errors(tiny, batch):
    d = tiny.adapter.d_head
    with pytest.raises(vb.InterventionError, match="layer 99"):
        tiny.logits(batch, [vb.AblateHeads(layer=99, heads=[0])])
    with pytest.raises(vb.InterventionError, match=r"heads \[42\]"):
        tiny.logits(batch, [vb.AblateHeads(layer=0, heads=[42])])
    with pytest.raises(vb.InterventionError, match="outside the sequence"):
        tiny.logits(batch, [vb.PatchHeads(layer=0, heads=[0], positions=[10_000], values=torch.zeros(1, 1, d))])
    with pytest.raises(vb.InterventionError, match="do not fit"):
        tiny.logits(batch, [vb.PatchHeads(layer=0, heads=[0], positions=[1], values=torch.zeros(3, 2, 1, d + 1))])
    with pytest.raises(vb.InterventionError, match="needs means"):
        vb.AblateHeads(layer=0, heads=[0], mode="mean")
    with pytest.raises(vb.InterventionError, match="mode"):
        vb.AblateHeads(layer=0, heads=[0], mode="half")
    with pytest.raises(vb.InputError, match="ablation mode"):
        tiny.ablate([(0, 0)], mode="imag_attention")
    _clean_state(tiny)


def test_generate_applies_interventions_and_cleans_up(tiny):
    batch = tiny.prepare(draw_scene(0), PROMPT)
    site = f"blocks.{tiny.adapter.pattern_layers()[0]}.attn.hook_pattern"
    texts, caps = tiny.generate(batch, max_new_tokens=3, sites=site)
    assert len(texts) == 1 and len(caps[site]) == 3
    _clean_state(tiny)


def test_hook_counter_sees_our_hooks(tiny, batch):
    from vlmbind.engine.hooks import HookSession

    with HookSession(tiny.adapter, tiny.sites(["blocks.*attn.hook_z", "vision.*"]), index=batch.index):
        assert _hook_count(tiny.model) == tiny.n_layers + tiny.adapter.n_vision_layers
    assert _hook_count(tiny.model) == 0


# ------------------------------------------------------------------------------------------------------------------
# Training through the hooks: captures in the graph and a differentiable patch, against the plain hooks they replace
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eager_qwen():
    """A tiny Qwen2.5-VL on HF's eager attention (whose modules return their probabilities), and a two-row batch."""
    vlm = vb.load("tiny-qwen2_5_vl", attn_implementation="eager")
    batch = vlm.prepare([draw_scene(0), draw_scene(3)], [PROMPT, "the red object is a"])
    return vlm, vlm.model_inputs(batch)


def _gradients(vlm, loss: torch.Tensor, *extra: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in vlm.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [*extra, *params], allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, [*extra, *params])]


def test_z_captured_in_the_graph_trains_as_a_plain_pre_hook_capture(eager_qwen):
    """``HookSession(detach=False)`` keeps a head-output capture in the graph: a loss on it and on the logits has the
    value and the parameter gradients of the same loss on a plain ``o_proj`` pre-hook's capture, exactly."""
    vlm, inputs = eager_qwen
    site = vlm.adapter.z_site(1)
    seen = {}
    handle = vlm.adapter.o_proj_module(1).register_forward_pre_hook(lambda _m, args: seen.__setitem__("z", args[0]))
    try:
        logits = vlm.model(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    plain_loss = logits[:, -1].logsumexp(-1).sum() + (seen["z"] ** 2).sum()
    session = HookSession(vlm.adapter, vlm.sites(site), detach=False)
    with session:
        logits = vlm.model(**inputs, use_cache=False).logits
    z = session.captured[site][0]
    assert z.requires_grad and z.shape[2:] == (vlm.n_heads, vlm.adapter.d_head)
    loss = logits[:, -1].logsumexp(-1).sum() + (z.flatten(2) ** 2).sum()
    assert torch.equal(loss, plain_loss)
    ours, plain = _gradients(vlm, loss), _gradients(vlm, plain_loss)
    assert any(g.abs().max() > 0 for g in ours)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))


def test_patterns_captured_in_the_graph_train_as_a_plain_hook_on_eager_attention(eager_qwen):
    """A ``hook_pattern`` capture with the graph (vlmbind's own eager attention, switched on for the call) gives HF's
    eager probabilities and the gradients a loss on them has through a plain forward hook on the attention module,
    exactly; the model's own attention setting is back after the call."""
    vlm, inputs = eager_qwen
    site = vlm.adapter.pattern_site(1)
    seen = {}
    handle = vlm.adapter.attention_module(1).register_forward_hook(lambda _m, _a, out: seen.__setitem__("p", out[1]))
    try:
        vlm.model(**inputs, use_cache=False)
    finally:
        handle.remove()
    plain_loss = -torch.log(seen["p"][:, :, -1, -8:].sum(-1)).mean()
    session = HookSession(vlm.adapter, vlm.sites(site), detach=False)
    with session:
        assert vlm.adapter.text_config._attn_implementation == ATTENTION_IMPL  # not HF's eager function
        vlm.model(**inputs, use_cache=False)
    pattern = session.captured[site][0]
    assert vlm.adapter.text_config._attn_implementation == "eager"
    assert pattern.requires_grad and torch.equal(pattern, seen["p"])
    loss = -torch.log(pattern[:, :, -1, -8:].sum(-1)).mean()
    ours, plain = _gradients(vlm, loss), _gradients(vlm, plain_loss)
    assert any(g.abs().max() > 0 for g in ours)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))


def test_patch_heads_where_is_a_plain_where_pre_hook_with_its_gradients(eager_qwen):
    """``PatchHeadsWhere`` writes the listed heads' slices of another run's z at the masked positions by
    ``torch.where``: the logits, the gradient reaching the values (only at what it wrote) and the parameters'
    gradients are those of a plain ``o_proj`` pre-hook doing that ``torch.where`` on the flat input, exactly."""
    vlm, inputs = eager_qwen
    n, d = vlm.n_heads, vlm.adapter.d_head
    b, p = inputs["input_ids"].shape
    where = torch.zeros(b, p, dtype=torch.bool)
    where[0, [3, 7, p - 1]] = True
    where[1, p - 2] = True
    values = torch.randn(b, p, n, d, generator=torch.Generator().manual_seed(0)).requires_grad_()
    heads = [0, n - 1]

    def plain(_module, args):
        columns = torch.zeros(n, d, dtype=torch.bool)
        columns[heads] = True
        mask = where[:, :, None] & columns.flatten()[None, None]
        return (torch.where(mask, values.flatten(2), args[0]), *args[1:])

    handle = vlm.adapter.o_proj_module(1).register_forward_pre_hook(plain)
    try:
        reference = vlm.model(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    patch = PatchHeadsWhere(layer=1, heads=heads, where=where, values=values)
    with HookSession(vlm.adapter, (), [patch]):
        logits = vlm.model(**inputs, use_cache=False).logits
    assert torch.equal(logits, reference)
    assert (logits - vlm.model(**inputs, use_cache=False).logits).abs().max() > 1e-5  # the patch did something
    ours = _gradients(vlm, logits.logsumexp(-1).sum(), values)
    theirs = _gradients(vlm, reference.logsumexp(-1).sum(), values)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    written = where[:, :, None, None] & torch.isin(torch.arange(n), torch.tensor(heads))[None, None, :, None]
    assert ours[0].abs().amax(-1)[written[..., 0]].min() > 0 and not ours[0][~written.expand_as(ours[0])].any()
    with pytest.raises(vb.InterventionError, match="PatchHeadsWhere"):
        vlm.logits(vlm.prepare(draw_scene(0), PROMPT), [patch])  # one row, not the two the mask is for
    _clean_state(vlm)
