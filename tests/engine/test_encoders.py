"""Standalone vision encoders (CLIP, SigLIP, DINOv2): sites equal HF hidden states, patch boxes follow the image
processor's geometry, captures pool per object, and they load through from_pretrained from disk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as t
from PIL import Image

import vlmbind as vb
from vlmbind.engine.encoders import ENCODER_NAMES, VisionEncoder, build_tiny_encoder

S = vb.stimuli


@pytest.mark.parametrize("name", ENCODER_NAMES)
def test_sites_equal_hf_hidden_states_and_capture_pools_objects(name):
    enc = vb.load(name)
    assert isinstance(enc, VisionEncoder) and name in vb.registered_names()
    data = list(S.scene_description(3, 0, n_objects=3))
    batch = enc.prepare([e.image for e in data])
    out = enc.run(batch, sites="vision.blocks.*.hook_resid_post")
    with torch.no_grad():
        ref = enc.model(pixel_values=batch.inputs["pixel_values"], output_hidden_states=True).hidden_states
    for layer in range(enc.n_vision_layers):
        torch.testing.assert_close(out[f"vision.blocks.{layer}.hook_resid_post"], ref[layer + 1], atol=1e-6, rtol=0)
    acts = vb.capture(enc, data, "vision.blocks.*.hook_resid_post")
    frame, x = acts.objects("vision.blocks.1.hook_resid_post")
    assert len(frame) == sum(len(e.objects) for e in data)
    owner = acts.token_objects(0)
    expected = ref[2][0][torch.as_tensor(owner == 0)].mean(0)
    np.testing.assert_allclose(x[0], expected.numpy(), atol=1e-5)
    with pytest.raises(vb.InputError, match="no last prompt token"):
        vb.capture(enc, data, "vision.blocks.0.hook_resid_post", tokens="last")
    with pytest.raises(vb.SiteError):
        enc.sites("blocks.0.hook_resid_post")


def test_patch_boxes_follow_resize_and_centre_crop():
    enc = build_tiny_encoder("tiny-clip")
    # CLIP's own default processing: shortest edge to 224, then a 224 centre crop
    enc.processor = t.CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    image = Image.new("RGB", (448, 224), "white")          # wide: resized to 448x224, 112 px cut on each side
    index = enc.prepare(image).index[0]
    assert (index.rows, index.cols, index.prefix) == (14, 14, 1)
    np.testing.assert_allclose(index.boxes[0, 0], [112, 0, 128, 16])
    np.testing.assert_allclose(index.boxes[13, 13], [320, 208, 336, 224])
    plain = build_tiny_encoder("tiny-siglip")                # fixed 224x224 resize, no crop: scale 2 both ways
    np.testing.assert_allclose(plain.prepare(Image.new("RGB", (448, 448))).index[0].boxes[1, 2], [64, 32, 96, 64])


def test_token_table_marks_the_patches_inside_each_object():
    enc = build_tiny_encoder("tiny-dinov2")
    ex = S.scene_description(1, 2, n_objects=2)[0]
    index = enc.prepare(ex.image).index[0]
    table = index.token_table(ex.objects)
    assert table["grid"][0] == "cls" and table["object"][0] == -1
    for pos, r, c, obj in zip(table["position"], table["row"], table["col"], table["object"]):
        if r < 0:
            continue
        x0, y0, x1, y1 = index.boxes[r, c]
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        inside = [k for k, o in enumerate(ex.objects) if o.box[0] <= cx < o.box[2] and o.box[1] <= cy < o.box[3]]
        assert obj == (inside[0] if inside else -1)
    assert sum(o >= 0 for o in table["object"]) > 0


def test_encoder_loads_from_disk(tmp_path):
    enc = build_tiny_encoder("tiny-siglip", seed=3)
    enc.model.save_pretrained(tmp_path)
    enc.processor.save_pretrained(tmp_path)
    loaded = vb.load(str(tmp_path))
    assert isinstance(loaded, VisionEncoder) and loaded.family == "siglip_vision_model"
    image = S.scene_description(1, 0)[0].image
    a = enc.run(enc.prepare(image), sites="vision.blocks.2.hook_resid_post")["vision.blocks.2.hook_resid_post"]
    b = loaded.run(loaded.prepare(image), sites="vision.blocks.2.hook_resid_post")["vision.blocks.2.hook_resid_post"]
    torch.testing.assert_close(a, b)
    with pytest.raises(vb.InputError, match="one image per example"):
        loaded.prepare([[image, image]])


def test_tiny_encoder_takes_the_placement_it_is_given():
    encoder = vb.load("tiny-clip", dtype="bfloat16", device="cpu")
    assert {p.dtype for p in encoder.model.parameters()} == {torch.bfloat16}
    with pytest.raises(vb.InputError, match="tiny model goes on one --device"):
        vb.load("tiny-siglip", device_map="auto")
