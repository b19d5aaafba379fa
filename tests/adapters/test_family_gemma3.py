"""Gemma-3 specifics: the pooled image grid and its boxes, roles, the bidirectional image block and sliding windows.

The tiny model stretches every image to 224 x 224, cuts 16 x 16 SigLIP patches of 14 px and pools them 2 x 2, so the
language model sees an 8 x 8 grid, 28 processed pixels a cell. Expected boxes below are worked out by hand from that.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PROMPT, draw_scene
from PIL import Image

import vlmbind as vb
from vlmbind.core.errors import InputError
from vlmbind.tiny.gemma3 import SLIDING_WINDOW


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    # a private instance: HF's output_attentions installs permanent capture hooks, which would leak into the
    # session-wide tiny model that the hook-hygiene tests count hooks on
    return vb.load("tiny-gemma3")


def _ids(vlm: vb.VLM) -> dict[str, int]:
    tok = vlm.adapter.tokenizer
    return {t: tok.convert_tokens_to_ids(t) for t in ("<bos>", "<start_of_image>", "<end_of_image>",
                                                     "<image_soft_token>")}


def test_square_image_grid_and_boxes(vlm):
    ti = vlm.prepare(Image.new("RGB", (224, 224), "white"), PROMPT).index[0]
    assert len(ti.grids) == 1
    grid = ti.grid("image", 0)
    assert grid.shape == (8, 8)
    # no stretch: cell (r, c) covers [28c, 28c + 28) x [28r, 28r + 28)
    np.testing.assert_array_equal(grid.boxes[0, 0], [0, 0, 28, 28])
    np.testing.assert_array_equal(grid.boxes[2, 5], [140, 56, 168, 84])
    np.testing.assert_array_equal(grid.boxes[7, 7], [196, 196, 224, 224])
    assert ti.cell(int(grid.positions[2, 5])) == ("image", 0, 2, 5)
    assert ti.box(int(grid.positions[2, 5])) == (140.0, 56.0, 168.0, 84.0)
    # a box strictly inside one cell maps to that cell only
    np.testing.assert_array_equal(ti.positions_covering((145, 60, 160, 80)), [grid.positions[2, 5]])


def test_non_square_image_is_stretched(vlm):
    # 320 x 160 is stretched to 224 x 224: 0.7 x horizontally, 1.4 x vertically, so a cell is 40 x 20 original px
    ti = vlm.prepare(Image.new("RGB", (320, 160), "white"), PROMPT).index[0]
    grid = ti.grid()
    assert grid.shape == (8, 8)
    np.testing.assert_allclose(grid.boxes[0, 0], [0, 0, 40, 20])
    np.testing.assert_allclose(grid.boxes[2, 5], [200, 40, 240, 60])
    np.testing.assert_allclose(grid.boxes[7, 7], [280, 140, 320, 160])
    np.testing.assert_allclose(grid.boxes[..., 2] - grid.boxes[..., 0], 40.0)
    np.testing.assert_allclose(grid.boxes[..., 3] - grid.boxes[..., 1], 20.0)
    assert ti.image_sizes == [(320, 160)]


def test_token_layout_and_roles(vlm):
    batch = vlm.prepare(draw_scene(0), "what colour is the circle ?")
    ti, ids = batch.index[0], _ids(vlm)
    boi = int(np.flatnonzero(ti.input_ids == ids["<start_of_image>"])[0])
    eoi = int(np.flatnonzero(ti.input_ids == ids["<end_of_image>"])[0])
    assert ti.input_ids[0] == ids["<bos>"] and ti.roles[0] == "special"
    # the soft tokens are exactly the run between <start_of_image> and <end_of_image>, in raster order
    np.testing.assert_array_equal(ti.grid().positions.reshape(-1), np.arange(boi + 1, eoi))
    np.testing.assert_array_equal(ti.image_positions, np.arange(boi + 1, eoi))
    assert ti.roles[boi] == "special" and ti.roles[eoi] == "special"
    assert ti.cell(boi) is None and ti.cell(eoi) is None
    # the processor's "\n\n" around the image block is text, the prompt follows it
    assert ti.text.strip() == "what colour is the circle ?"
    assert (ti.roles[eoi + 1 :] == "text").all()


def test_image_token_count_equals_inserted_features(vlm):
    batch = vlm.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "the red object is a"])
    out = vlm.run(batch, sites="projector.hook_out")
    features = out["projector.hook_out"]
    assert features.shape == (2, vlm.model.config.mm_tokens_per_image, vlm.adapter.d_model)
    n_image = sum(len(ti.image_positions) for ti in batch.index)
    assert n_image == features.shape[0] * features.shape[1] == 128
    image_mask = batch.inputs["input_ids"] == vlm.adapter.image_token_id
    assert int(image_mask.sum()) == n_image


def test_two_images_in_one_prompt_and_uneven_rows(vlm):
    rows = [[draw_scene(0), Image.new("RGB", (320, 160), "white")], [draw_scene(2)]]
    batch = vlm.prepare(rows, ["compare the two images", "is"])
    first, second = batch.index
    assert [(g.name, g.image, g.shape) for g in first.grids] == [("image", 0, (8, 8)), ("image", 1, (8, 8))]
    assert [(g.image, g.shape) for g in second.grids] == [(0, (8, 8))]
    # the second image's grid comes after the first's <end_of_image> and has its own stretch
    assert first.grids[1].positions.min() > first.grids[0].positions.max() + 1
    np.testing.assert_allclose(first.grids[1].boxes[7, 7], [280, 140, 320, 160])
    np.testing.assert_allclose(first.grids[0].boxes[7, 7], [196, 196, 224, 224])
    assert batch.inputs["pixel_values"].shape[0] == 3
    # the left-padded single-image row gets the same logits as on its own
    alone = vlm.logits(vlm.prepare(rows[1], "is"))
    torch.testing.assert_close(vlm.logits(batch)[1, -1], alone[0, -1], atol=1e-4, rtol=1e-4)


def test_processor_returns_token_type_ids_on_image_tokens(vlm):
    batch = vlm.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "is"])
    tti = batch.inputs["token_type_ids"]
    np.testing.assert_array_equal(tti.numpy() == 1, batch.inputs["input_ids"].numpy() == vlm.adapter.image_token_id)
    for row, ti in enumerate(batch.index):
        np.testing.assert_array_equal(np.flatnonzero(tti[row].numpy()), ti.image_positions)


def test_image_block_is_bidirectional_only_with_token_type_ids(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    first, last = int(ti.image_positions[0]), int(ti.image_positions[-1])
    full = 1
    assert vlm.model.config.text_config.layer_types[full] == "full_attention"
    pattern = vlm.capture(batch, f"blocks.{full}.attn.hook_pattern")[f"blocks.{full}.attn.hook_pattern"][0]
    # an image token attends to later image tokens, but never to the text after the block
    assert (pattern[:, first, last] > 0).all()
    assert (pattern[:, first, last + 1 :] == 0).all()
    # text stays causal
    q = ti.last_position - 3
    assert (pattern[:, q, q + 1 :] == 0).all()
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, use_cache=False)
        inputs = {k: v for k, v in batch.inputs.items() if k != "token_type_ids"}
        causal = vlm.model(**inputs, use_cache=False, output_attentions=True)
    assert (causal.attentions[full][0, :, first, first + 1 :] == 0).all()
    assert (causal.logits[0, -1] - ref.logits[0, -1]).abs().max() > 1e-3


def test_forward_kwargs_restore_dropped_token_type_ids(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    full = vlm.logits(batch)
    batch.inputs = {k: v for k, v in batch.inputs.items() if k != "token_type_ids"}
    derived = vlm.adapter.forward_kwargs(batch.inputs)["token_type_ids"]
    assert derived.sum() == 64
    torch.testing.assert_close(vlm.logits(batch), full, atol=0, rtol=0)
    assert vlm.adapter.forward_kwargs({"token_type_ids": derived, "input_ids": derived}) == {}


def test_sliding_window_truncates_attention(vlm):
    text_config = vlm.model.config.text_config
    sliding = [i for i, t in enumerate(text_config.layer_types) if t == "sliding_attention"]
    assert sliding and text_config.sliding_window == SLIDING_WINDOW
    batch = vlm.prepare(draw_scene(0), PROMPT)
    ti = batch.index[0]
    assert batch.seq_len > 4 * SLIDING_WINDOW
    layer = sliding[0]
    pattern = vlm.capture(batch, f"blocks.{layer}.attn.hook_pattern")[f"blocks.{layer}.attn.hook_pattern"][0]
    q = ti.last_position
    # a text query sees exactly the last SLIDING_WINDOW keys, itself included
    attended = np.flatnonzero((pattern[0, q] > 0).numpy())
    np.testing.assert_array_equal(attended, np.arange(q - SLIDING_WINDOW + 1, q + 1))
    # the last image token sees later image tokens (none) and only the window behind it; the first sees the block
    first, last = int(ti.image_positions[0]), int(ti.image_positions[-1])
    assert (pattern[:, last, : last - SLIDING_WINDOW + 1] == 0).all()
    assert (pattern[:, first, last] > 0).all()
    with torch.no_grad():
        ref = vlm.model(**batch.inputs, use_cache=False, output_attentions=True)
    torch.testing.assert_close(pattern, ref.attentions[layer][0], atol=1e-6, rtol=0)


def test_generate_keeps_the_bidirectional_prefill(vlm):
    batch = vlm.prepare(draw_scene(0), PROMPT)
    site = f"blocks.{vlm.n_layers - 1}.hook_resid_post"
    texts, captured = vlm.generate(batch, max_new_tokens=2, sites=site)
    # the prefill step must see the image block bidirectionally, exactly as a plain run does
    torch.testing.assert_close(captured[site][0], vlm.capture(batch, site)[site], atol=1e-5, rtol=1e-5)
    first = int(vlm.logits(batch)[0, -1].argmax())
    assert texts[0].startswith(vlm.adapter.tokenizer.decode([first], skip_special_tokens=True))


def test_projector_is_not_zero_and_the_image_matters(vlm):
    weight = vlm.model.model.multi_modal_projector.mm_input_projection_weight
    assert weight.abs().min() > 0
    other = vb.load("tiny-gemma3", seed=1).model.model.multi_modal_projector.mm_input_projection_weight
    assert not torch.equal(weight, other)
    a = vlm.logits(vlm.prepare(draw_scene(0), PROMPT))
    b = vlm.logits(vlm.prepare(draw_scene(5), PROMPT))
    assert (a[0, -1] - b[0, -1]).abs().max() > 1e-2


def test_pan_and_scan_crops_are_refused(vlm):
    image = Image.new("RGB", (600, 224), "white")
    inputs = dict(vlm.processor(images=[[image]], text=["<start_of_image>is"], return_tensors="pt",
                                do_pan_and_scan=True, pan_and_scan_min_crop_size=32))
    assert inputs["pixel_values"].shape[0] > 1  # the processor did add crops
    roles = vlm.adapter.roles(inputs["input_ids"][0].numpy(), inputs["attention_mask"][0].numpy())
    with pytest.raises(InputError, match="pan-and-scan"):
        vlm.adapter.image_grids(inputs, 0, roles, [0], [image.size])


def test_chat_template_keeps_one_grid(vlm):
    batch = vlm.prepare(draw_scene(0), "what colour is the circle ?", chat=True)
    ti = batch.index[0]
    assert [g.shape for g in ti.grids] == [(8, 8)]
    assert "<start_of_turn>" not in ti.text and "what colour is the circle ?" in ti.text
    assert ti.input_ids[0] == _ids(vlm)["<bos>"] and (ti.input_ids == _ids(vlm)["<bos>"]).sum() == 1

