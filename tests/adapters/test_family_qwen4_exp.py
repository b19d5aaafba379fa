"""Qwen4-Exp: Qwen3.5's token grid on a hybrid MoE language model with hyper-connected residual streams, a QSA-indexed
softmax attention layer (1) among Gated DeltaNet layers (0, 2, 3), and per-layer n-gram embeddings (PLE, layers 0
and 2). The residual sites are both streams side by side, the attention / MLP outputs are what each sub-block writes
into them, patterns are sparse where the indexer drops keys, exact == naive without prefix-cache reuse, and what
needs a fixed gate (path patching, a head's write alone) is refused by name.

Hand computations (tiny processor: ``min_pixels = max_pixels = 224**2``, 16 px patches, 2x2 merge), as for Qwen3.5:

* 224 x 224 is kept: a 7 x 7 token grid, token ``(r, c)`` covering ``[32c, 32c + 32) x [32r, 32r + 32)``.
* 320 x 224 (W x H) exceeds 224**2 px, so both sides are divided by ``sqrt(320 * 224 / 224**2) = 1.195`` and floored
  to multiples of 32: 256 x 160, a 5 x 8 grid; a token covers ``32 * 320 / 256 = 40`` px across and
  ``32 * 224 / 160 = 44.8`` down.
* The raw prompt is ``<|vision_start|>`` (position 0), the 49 image tokens (1..49), ``<|vision_end|>`` (50), then
  the prompt's 15 text tokens (51..65): 66 positions. The merger hands the language model 49 rows, one per image
  token, and the embeddings enter both streams: the residual stream is ``hc_count * d_model = 2 * 128 = 256`` wide.
* QSA on layer 1 (budget 16, blocks of 4 keys): query ``q`` sees ``n = q + 1`` keys, ``n // 4`` complete blocks and
  the ``n % 4`` keys after them; it keeps ``min(4, n // 4)`` blocks and that tail. So every query up to ``q = 15``
  sees all its keys (``n <= 16``), ``q = 20`` keeps 4 of its 5 blocks and key 20 (17 keys), and the last query
  (``q = 65``) keeps 4 of 16 blocks and keys 64, 65: 18 of 66 keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import assert_painting_is_local, check_chat_grids, check_exact_equals_naive, pushed_scene_task
from helpers import PROMPT, draw_scene, expected_boxes

import vlmbind as vb
from vlmbind.adapters import adapter_class_for_config
from vlmbind.adapters.capabilities import capability_cells
from vlmbind.analysis.lens import EMBED, lens, lens_dataset, unembed
from vlmbind.core.errors import InputError, NoAttentionPatternError, UnsupportedModelError
from vlmbind.engine.patching import atp_star_diffs, exact_diffs, packable, prefix_end
from vlmbind.engine.paths import Edge, PathTask, exact_path_diffs, naive_path_diffs

LINEAR, INDEXED, PLE = (0, 2, 3), (1,), (0, 2)
# every batched layout falls back to whole-prompt runs from each head's layer (the states are recurrent)
LAYOUTS = ({}, {"layout": "batched", "max_rows": 3})


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    # a private instance: HF's output_attentions installs permanent capture hooks, which would leak into the
    # session-wide tiny model that the hook-hygiene tests count hooks on
    return vb.load("tiny-qwen4_exp")


@pytest.fixture(scope="module")
def one(vlm):
    return vlm.prepare(draw_scene(0), PROMPT)


def _recorded(modules: dict[str, torch.nn.Module], pre: bool = False):
    """Plain forward (pre-)hooks storing each module's output (first input with ``pre``) under its key: the
    reference vlmbind's sites are checked against."""
    seen: dict[str, object] = {}

    def keep(key):
        if pre:
            return lambda m, args, kwargs: seen.__setitem__(key, args[0] if args else kwargs["hidden_states"])
        return lambda m, args, output: seen.__setitem__(key, output)

    handles = [m.register_forward_pre_hook(keep(k), with_kwargs=True) if pre else m.register_forward_hook(keep(k))
               for k, m in modules.items()]
    return seen, handles


# ---- declarations -------------------------------------------------------------------------------------------------
def test_declarations(vlm):
    a, text = vlm.adapter, vlm.model.model.language_model
    assert adapter_class_for_config(vlm.model.config) is type(a) and a.family == "qwen4_exp"
    assert [a.layer_kind(l) for l in range(4)] == ["linear_attention", "indexed_attention"] + ["linear_attention"] * 2
    assert a.pattern_layers() == list(INDEXED) and a.recurrent_layers() == list(LINEAR)
    assert a.head_layers() == [0, 1, 2, 3] and a.ple_layers() == list(PLE)
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.d_head, a.d_model, a.n_residual_streams) == (4, 4, 2, 32, 128, 2)
    assert a.final_norm_module() is text.hyper_connection_mixer and not hasattr(text, "norm")
    paths = a.declared_paths()
    assert paths["o_proj"] is text.layers[1].self_attn.o_proj and paths["indexer"] is text.layers[1].self_attn.indexer
    assert paths["linear_o_proj"] is text.layers[0].linear_attn.out_proj and paths["ple"] is text.layers[0].ple
    assert paths["projector"] is vlm.model.model.visual.merger and a.n_vision_layers == 2
    assert a.write_sources(0, "attn") == (text.layers[0].ple, text.layers[0].attn_hyper_connection)
    assert a.write_sources(1, "attn") == (text.layers[1].attn_hyper_connection,)
    assert a.write_sources(2, "mlp") == (text.layers[2].mlp_hyper_connection,)
    assert type(a.mlp_module(3)).__name__ == "Qwen4ExpTextSparseMoeBlock"
    cells = capability_cells(type(a))
    assert cells["TransformerLens"].startswith("no: ") and "hyper-connection" in cells["capture"]


# ---- the token grid -----------------------------------------------------------------------------------------------
def test_square_grid_boxes_token_layout_and_image_rows(vlm, one):
    ti, tok = one.index[0], vlm.adapter.tokenizer
    assert one.seq_len == 66 and [(g.name, g.shape) for g in ti.grids] == [("image", (7, 7))]
    np.testing.assert_array_equal(ti.grid().positions, np.arange(1, 50).reshape(7, 7))
    edges = 32.0 * np.arange(8)
    np.testing.assert_allclose(ti.grid().boxes, expected_boxes(edges, edges))
    assert tok.convert_ids_to_tokens([int(ti.input_ids[0]), int(ti.input_ids[50])]) == ["<|vision_start|>",
                                                                                       "<|vision_end|>"]
    assert list(ti.roles[[0, 50]]) == ["special"] * 2 and set(ti.roles[1:50]) == {"image"}
    assert set(ti.roles[51:]) == {"text"}
    out = vlm.run(one, sites=["projector.hook_out", "blocks.0.hook_resid_pre"])
    rows, streams = out["projector.hook_out"], out["blocks.0.hook_resid_pre"][0].unflatten(-1, (2, 128))
    assert rows.shape == (49, 128)
    for k in range(2):  # the image rows enter both streams
        torch.testing.assert_close(streams[ti.image_positions, k], rows, atol=0, rtol=0)


def test_non_square_image_is_resized_to_multiples_of_32(vlm):
    batch = vlm.prepare(draw_scene(1, (320, 224)), PROMPT)
    grid = batch.index[0].grid()
    assert grid.shape == (5, 8) and batch.inputs["image_grid_thw"][0].tolist() == [1, 10, 16]
    np.testing.assert_allclose(grid.boxes, expected_boxes(40.0 * np.arange(9), 44.8 * np.arange(6)))


def test_painting_a_cell_changes_only_the_token_covering_it(vlm):
    assert_painting_is_local(vlm, draw_scene(3, (320, 224)), "image", (3, 6))


def test_chat_prompt_keeps_the_grid(vlm):
    check_chat_grids(vlm, "image", "<|im_start|>user\n<|vision_start|>", "<|im_start|>assistant\n")


# ---- hyper-connected residual streams -----------------------------------------------------------------------------
def test_sub_block_writes_are_what_the_streams_gain(vlm, one):
    """``hook_attn_out`` is what the layer's MLP hyper-connection reads minus the layer's input, ``hook_mlp_out`` the
    layer's output minus that; each is the sub-block's output times one weight per stream (the hyper-connection's),
    plus the PLE's write on a PLE layer's attention. The final mixer is the norm the logit lens decodes through."""
    a, text = vlm.adapter, vlm.model.model.language_model
    mids, pre_handles = _recorded({str(l): text.layers[l].mlp_hyper_connection for l in range(4)}, pre=True)
    parts, handles = _recorded({**{f"attn{l}": a.attention_module(l) for l in range(4)},
                                **{f"mlp{l}": a.mlp_module(l) for l in range(4)},
                                **{f"hc_attn{l}": a.hyper_connection(l, "attn") for l in range(4)},
                                **{f"hc_mlp{l}": a.hyper_connection(l, "mlp") for l in range(4)},
                                **{f"ple{l}": text.layers[l].ple for l in PLE}})
    try:
        out = vlm.run(one, sites=["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", "blocks.*.hook_attn_out",
                                  "blocks.*.hook_mlp_out"])
    finally:
        for handle in pre_handles + handles:
            handle.remove()
    for l in range(4):
        pre, post = out[f"blocks.{l}.hook_resid_pre"], out[f"blocks.{l}.hook_resid_post"]
        attn, mlp = out[f"blocks.{l}.hook_attn_out"], out[f"blocks.{l}.hook_mlp_out"]
        assert pre.shape == post.shape == attn.shape == mlp.shape == (1, 66, 256)
        torch.testing.assert_close(pre + attn, mids[str(l)], atol=1e-6, rtol=0)
        torch.testing.assert_close(mids[str(l)] + mlp, post, atol=1e-6, rtol=0)
        for kind, value in (("attn", attn), ("mlp", mlp)):
            output = parts[f"{kind}{l}"]
            output = output[0] if isinstance(output, tuple) else output
            weights = parts[f"hc_{kind}{l}"][2]  # 1 66 2: one weight per stream
            streams = (value - parts[f"ple{l}"] if kind == "attn" and l in PLE else value).unflatten(-1, (2, 128))
            for k in range(2):
                torch.testing.assert_close(streams[..., k, :], output * weights[..., k, None], atol=1e-6, rtol=0)
        if l in PLE:  # the n-gram write is a sizeable part of what the layer adds before its MLP
            assert parts[f"ple{l}"].norm() > 0.1 * attn.norm()
    torch.testing.assert_close(unembed(vlm, out["blocks.3.hook_resid_post"]), out.logits, atol=1e-5, rtol=0)


def test_what_needs_a_fixed_gate_is_refused_by_name(vlm, one):
    """Path patching holds later outputs at their clean values, and a head's write alone needs a gate: the
    hyper-connections' weights depend on the residual stream at each position, so both are refused."""
    task = pushed_scene_task(vlm, "id_selection")
    path = PathTask(task.batch, task.positions, task.positions, task.values, task.score_position, task.a, task.a_star)
    for method in (exact_path_diffs, naive_path_diffs):
        with pytest.raises(UnsupportedModelError, match="hyper-connections"):
            method(vlm, path, [Edge((1, 0), None, "logits")])
    with pytest.raises(UnsupportedModelError, match="head's write alone"):
        atp_star_diffs(vlm, task, [(1, 0)], grad_drop=False)
    with pytest.raises(UnsupportedModelError, match="same forward"):
        vlm.adapter.residual_write(0, "attn", torch.zeros(1, 1, 128), {})


# ---- the QSA indexer ----------------------------------------------------------------------------------------------
def test_indexed_attention_keeps_the_selected_blocks_only(vlm, one):
    """HF's probabilities (and vlmbind's, equal to them) are nonzero exactly on the kept blocks and the tail, the
    same keys for every head (the indexer scores per query, not per head), in the counts worked out above."""
    with torch.no_grad():
        ref = vlm.model(**one.inputs, output_attentions=True, use_cache=False).attentions
    assert len(ref) == 1
    ours = vlm.capture(one, "blocks.1.attn.hook_pattern")["blocks.1.attn.hook_pattern"]
    torch.testing.assert_close(ours, ref[0], atol=1e-6, rtol=0)
    kept = ref[0][0] > 0  # H Q K
    assert torch.equal(kept, kept[:1].expand_as(kept))
    for q in range(66):
        n = q + 1
        keys = torch.nonzero(kept[0, q]).flatten().numpy()
        tail = np.arange(4 * (n // 4), n)
        blocks = keys[keys < 4 * (n // 4)]
        assert len(keys) == 4 * min(4, n // 4) + n % 4 and np.array_equal(keys[len(blocks):], tail), q
        assert np.array_equal(blocks.reshape(-1, 4), blocks.reshape(-1, 4)[:, :1] + np.arange(4)), q
        assert (blocks.reshape(-1, 4)[:, 0] % 4 == 0).all(), q
    assert kept[0, 15].sum() == 16 and kept[0, 20].sum() == 17 and kept[0, 65].sum() == 18


def test_moe_routing_is_top_two_of_four_and_decisive(vlm, one):
    with torch.no_grad():
        router = vlm.model(**one.inputs, output_router_logits=True, use_cache=False).router_logits
    assert len(router) == 4 and all(r.shape == (66, 4) for r in router)
    for logits in router:
        top = logits.float().sort(-1, descending=True).values
        assert (top[:, 1] - top[:, 2]).min() > 1e-4  # no near-tie that rounding could flip


# ---- exact == naive, without prefix-cache reuse ------------------------------------------------------------------
@pytest.mark.parametrize("condition", ["id_selection", "id_retrieval"])
def test_exact_equals_naive(vlm, condition):
    """The last token, and a mid-prompt span; heads of every layer kind, each run from its own layer."""
    task = check_exact_equals_naive(vlm, condition, layouts=LAYOUTS)
    assert len(task.positions) == (1 if condition == "id_selection" else 2)
    inputs = vlm.model_inputs(task.batch)
    assert prefix_end(vlm, task.batch, inputs, int(task.positions.min())) == 0 and not packable(vlm)
    for layout in ("packed", "single"):
        with pytest.raises(InputError, match=layout):
            exact_diffs(vlm, task, [(1, 0)], layout=layout)


def test_deltanet_layers_have_no_patterns(vlm, one):
    for layer in LINEAR:
        with pytest.raises(NoAttentionPatternError, match=rf"layer {layer} .*linear_attention.*layers \[1\]"):
            vlm.capture(one, f"blocks.{layer}.attn.hook_pattern")
    assert [s.layer for s in vlm.sites("blocks.*.attn.hook_pattern")] == list(INDEXED)


def test_the_logit_lens_decodes_through_the_mixer_and_leaves_the_head_lens_out(vlm):
    """Every layer decodes (through the hyper-connection mixer); a head's write alone needs the run's stream weights,
    so the default head lens reads no head and a named one is refused."""
    data = lens_dataset(vlm, "scene", 1)
    result = lens(vlm, data)
    assert result.layers == [EMBED, "0", "1", "2", "3"] and result.heads.empty
    assert result.meta["final_norm"] == "Qwen4ExpTextGatedResidual"
    with pytest.raises(UnsupportedModelError, match="head's write alone"):
        lens(vlm, data, heads="1.0")
