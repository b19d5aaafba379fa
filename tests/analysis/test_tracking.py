"""Tests of attention-centroid tracking (``vlmbind.analysis.tracking`` and ``vlmbind track``).

References are independent of the code under test: centroids of hand-made maps with answers worked out by hand, the
attention rows the capture keeps against HF ``output_attentions`` of one full forward on the same sequence, the grid
-> point-frame mapping against the canvas' own cell arithmetic, and a stand-in trace whose maps are built by hand to
peak on the generated point's cell (tokens of each point found by tokenising the points one by one, not by the
decoder under test).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny

from vlmbind.analysis import tracking
from vlmbind.analysis.traces import extend_batch
from vlmbind.analysis.tracking import (
    TOKEN_RULE,
    centroid,
    grid_to_pixels,
    grid_to_point_frame,
    pixels_to_canvas,
    point_token_steps,
    track,
    tracking_dataset,
)
from vlmbind.cli import main
from vlmbind.core.errors import InputError
from vlmbind.stimuli import Canvas, counting


# ----------------------------------------------------------------------------------------------------------------
# centroid on hand-made maps
# ----------------------------------------------------------------------------------------------------------------
def test_centroid_single_peak_ignores_cells_below_the_threshold():
    a = np.zeros((4, 5))
    a[2, 3] = 1.0
    a[0, 0] = 0.5  # below 0.9 * max: dropped
    res = centroid(a)
    assert res.xy.tolist() == [3.0, 2.0] and res.n_empty == 0
    # a lower threshold keeps it: x = (3 * 1 + 0 * 0.5) / 1.5, y = (2 * 1 + 0 * 0.5) / 1.5
    np.testing.assert_allclose(centroid(a, threshold=0.4).xy, [2.0, 4.0 / 3.0])


def test_centroid_two_equal_peaks_lands_between_them():
    a = np.zeros((5, 5))
    a[1, 0] = a[3, 4] = 0.3
    assert centroid(a).xy.tolist() == [2.0, 2.0]


def test_centroid_threshold_is_strict_and_weights_kept_cells():
    a = np.zeros((3, 3))
    a[0, 0], a[0, 2] = 1.0, 0.95
    np.testing.assert_allclose(centroid(a).xy, [2 * 0.95 / 1.95, 0.0])
    a[0, 2] = 0.9  # exactly 0.9 * max is not kept
    assert centroid(a).xy.tolist() == [0.0, 0.0]


def test_centroid_all_zero_maps_are_nan_and_counted_and_vectorised():
    rng = np.random.default_rng(0)
    maps = rng.random((2, 3, 4, 6))
    maps[0, 1] = 0.0
    maps[1, 2] = 0.0
    res = centroid(torch.as_tensor(maps))
    assert res.xy.shape == (2, 3, 2) and res.n_empty == 2
    assert np.isnan(res.xy[0, 1]).all() and np.isnan(res.xy[1, 2]).all()
    for i in range(2):
        for j in range(3):
            if (i, j) in ((0, 1), (1, 2)):
                continue
            np.testing.assert_allclose(res.xy[i, j], centroid(maps[i, j]).xy)
            assert 0 <= res.xy[i, j, 0] <= 5 and 0 <= res.xy[i, j, 1] <= 3


@pytest.mark.parametrize("bad", [{"threshold": 1.0}, {"threshold": -0.1}, {"weights": -np.ones((2, 2))},
                                 {"weights": np.full((2, 2), np.nan)}, {"weights": np.ones(3)}])
def test_centroid_rejects_bad_input(bad):
    kwargs = {"weights": np.ones((2, 2)), "threshold": 0.9, **bad}
    with pytest.raises(InputError):
        centroid(kwargs["weights"], kwargs["threshold"])


# ----------------------------------------------------------------------------------------------------------------
# grid -> point frame
# ----------------------------------------------------------------------------------------------------------------
def test_grid_to_point_frame_identity_on_an_aligned_canvas(organism_p2a):
    ex = counting(1, 0, objects=5, regime="p2a", canvas=Canvas(image_size=168, grid=6))[0]
    g = organism_p2a.prepare([ex.image], [ex.prompt]).index[0].grids[0]
    assert g.shape == (6, 6)
    cells = np.stack(np.meshgrid(np.arange(6.0), np.arange(6.0), indexing="xy"), -1)  # 6 6 2: (x=col, y=row)
    np.testing.assert_allclose(grid_to_point_frame(cells, g.boxes, Canvas(image_size=168, grid=6)), cells)
    frac = np.array([[2.25, 4.5], [0.0, 5.0], [np.nan, np.nan]])
    out = grid_to_point_frame(frac, g.boxes, Canvas(image_size=168, grid=6).to_dict())
    np.testing.assert_allclose(out[:2], frac[:2])
    assert np.isnan(out[2]).all()


def test_grid_to_point_frame_on_a_coarser_canvas(organism_p2a):
    ex = counting(1, 0, objects=5, regime="p2a", canvas=Canvas(image_size=168, grid=3))[0]
    g = organism_p2a.prepare([ex.image], [ex.prompt]).index[0].grids[0]
    canvas = Canvas(image_size=168, grid=3)
    cols = np.arange(6.0)
    xy = np.stack([cols, cols[::-1]], -1)
    # token centre 28 c + 14 px; canvas cells are 56 px: x = (28 c + 14) / 56 - 0.5 = c / 2 - 0.25
    np.testing.assert_allclose(grid_to_point_frame(xy, g.boxes, canvas), xy / 2 - 0.25)
    # every canvas cell centre, through the canvas' own arithmetic, lands back on its cell
    for row in range(3):
        for col in range(3):
            np.testing.assert_allclose(pixels_to_canvas(np.array(canvas.cell_centre(row, col)), canvas), [col, row])
    # token cells (2, 3) x (4, 5) surround canvas cell (1, 2): their midpoint maps to it
    np.testing.assert_allclose(grid_to_point_frame(np.array([2.5, 4.5]), g.boxes, canvas), [1.0, 2.0])


def test_grid_to_pixels_uses_box_centres_of_a_scaled_grid():
    from vlmbind.core.tokens import grid_boxes

    boxes = grid_boxes(2, 4, 28, 28, scale_x=0.5, scale_y=2.0)  # processed -> original pixels
    np.testing.assert_allclose(grid_to_pixels(np.array([[0, 0], [3, 1], [1.5, 0.5]]), boxes),
                               [[28, 7], [196, 21], [112, 14]])  # x = 56 c + 28, y = 14 r + 7


# ----------------------------------------------------------------------------------------------------------------
# tokens of a point
# ----------------------------------------------------------------------------------------------------------------
def test_point_token_steps_plain_and_molmo_style(organism_p2a):
    tok = organism_p2a.adapter.tokenizer
    pieces = [" (1, 2)", " (4, 0)", " 2"]
    split = [tok(p, add_special_tokens=False)["input_ids"] for p in pieces]
    ids = [t for s in split for t in s]
    found, skipped = point_token_steps(tok, ids)
    n1, n2 = len(split[0]), len(split[1])
    assert skipped == 0
    assert [(steps, span.points[0]) for steps, span in found] == [(list(range(n1)), (1.0, 2.0)),
                                                                  (list(range(n1, n1 + n2)), (4.0, 0.0))]
    tag = tok(' <point x="10" y="20">cat</point>', add_special_tokens=False)["input_ids"]
    found, _ = point_token_steps(tok, tag + split[0])
    assert [(steps, span.points[0], span.format) for steps, span in found] == [
        (list(range(len(tag))), (10.0, 20.0), "molmo"), (list(range(len(tag), len(tag) + n1)), (1.0, 2.0), "tuple")]
    assert point_token_steps(tok, tok(" none no", add_special_tokens=False)["input_ids"]) == ([], 0)
    assert "'('" in TOKEN_RULE and "')'" in TOKEN_RULE


def test_point_token_steps_split_a_molmo2_tag_into_its_points(organism_p2a):
    tok = organism_p2a.adapter.tokenizer
    head = tok(' <points coords="1', add_special_tokens=False)["input_ids"]
    first = tok(" 1 100 300", add_special_tokens=False)["input_ids"]
    second = tok(" 2 900 900", add_special_tokens=False)["input_ids"]
    tail = tok('">objects</points> 2', add_special_tokens=False)["input_ids"]
    ids = head + first + second + tail
    text = tok.decode(ids)
    assert text == ' <points coords="1 1 100 300 2 900 900">objects</points> 2'  # the pieces tokenise apart
    found, skipped = point_token_steps(tok, ids)
    assert skipped == 0 and [span.points for _, span in found] == [[(100.0, 300.0)], [(900.0, 900.0)]]
    n0, n1 = len(head), len(first)
    # each point owns the tokens of its own triple (the leading space rides along), never the other's
    assert set(found[0][0]) <= set(range(n0, n0 + n1))
    assert set(found[1][0]) <= set(range(n0 + n1, n0 + n1 + len(second)))
    assert found[0][0] and found[1][0]


def test_point_token_steps_keep_qwen2_vl_box_markers():
    from vlmbind.tiny import real

    tok = real.real_tokenizer("qwen2_vl")
    ref = tok("<|object_ref_start|>circle<|object_ref_end|>", add_special_tokens=False)["input_ids"]
    box = tok("<|box_start|>(100,200),(300,400)<|box_end|>", add_special_tokens=False)["input_ids"]
    end = tok(" 1<|im_end|>", add_special_tokens=False)["input_ids"]
    found, skipped = point_token_steps(tok, ref + box + end)
    assert skipped == 0 and len(found) == 1
    steps, span = found[0]
    assert steps == list(range(len(ref), len(ref) + len(box)))  # the markers are the box's first and last tokens
    assert span.format == "box" and span.points == [(200.0, 300.0)]


# ----------------------------------------------------------------------------------------------------------------
# the capture against HF output_attentions
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("query", ["emit", "self"])
def test_captured_maps_equal_hf_output_attentions_of_a_full_forward(query):
    vlm = get_tiny("tiny-qwen2_5_vl")
    images = [draw_scene(1), draw_scene(2)]
    prompts = [PROMPT + " and a long tail of words to pad the other row", PROMPT]
    batch = vlm.prepare(images, prompts)
    rows = tracking._trace(vlm, batch, 6, query)
    checked = 0
    for r, (ids, maps) in enumerate(rows):
        assert maps.shape[:3] == (len(ids), vlm.n_layers, vlm.n_heads) and maps.shape[3] == batch.seq_len
        if len(ids) < 2:
            continue
        single = vlm.prepare([images[r]], [prompts[r]])  # unpadded, as the reference sees it
        full = extend_batch(vlm, single, ids)
        with torch.no_grad():
            out = vlm.model(**vlm.model_inputs(full), output_attentions=True, use_cache=False)
        p = single.seq_len
        g_pad, g_ref = batch.index[r].grids[0], single.index[0].grids[0]
        for k in range(len(ids)):
            q = p - 1 + k if query == "emit" else p + k
            for layer in range(vlm.n_layers):
                ref = out.attentions[layer][0, :, q].float().numpy()
                np.testing.assert_allclose(maps[k, layer][:, g_pad.positions], ref[:, g_ref.positions],
                                           rtol=1e-4, atol=1e-6)
                # the whole row over the prompt, not only the image cells
                np.testing.assert_allclose(maps[k, layer][:, batch.seq_len - p:], ref[:, :p], rtol=1e-4, atol=1e-6)
            checked += 1
    assert checked >= 4


# ----------------------------------------------------------------------------------------------------------------
# a stand-in trace whose attention peaks on the pointed cell
# ----------------------------------------------------------------------------------------------------------------
def _fake_trace(vlm, points_text: list[str], answer: str, cells_for, noise_cell=(5, 5)):
    """A ``_trace`` replacement: each row writes ``points_text`` then ``answer``; tokens of point j attend (every
    layer and head) to the token cells ``cells_for(point j)``, every other token to ``noise_cell``."""
    tok = vlm.adapter.tokenizer
    split = [tok(p, add_special_tokens=False)["input_ids"] for p in [*points_text, answer]]
    ids = [t for s in split for t in s]
    owners = [j for j, s in enumerate(split) for _ in s]
    from vlmbind.stimuli import parse_points

    def fake(vlm_, batch, max_new_tokens, query):
        rows = []
        for r in range(len(batch)):
            g = batch.index[r].grids[0]
            maps = np.full((len(ids), vlm.n_layers, vlm.n_heads, batch.seq_len), 1e-4, dtype=np.float32)
            for k, j in enumerate(owners):
                cells = cells_for(parse_points(points_text[j])[0]) if j < len(points_text) else [noise_cell]
                for row, col in cells:
                    maps[k, :, :, g.positions[row, col]] = 0.5
            rows.append((ids, maps))
        return rows

    return fake


@pytest.mark.parametrize("grid,cells_for,expected", [
    (6, lambda p: [(int(p[1]), int(p[0]))], 0.0),  # aligned: the point's own token cell
    (6, lambda p: [(int(p[1]), int(p[0]) + 1)], 1.0),  # one token column to the right: one canvas cell off
    (3, lambda p: [(2 * int(p[1]) + a, 2 * int(p[0]) + b) for a in (0, 1) for b in (0, 1)], 0.0),  # 2x2 tokens
])
def test_attention_peaking_on_the_pointed_cell_gives_rmse_zero(organism_p2a, monkeypatch, grid, cells_for, expected):
    texts = [" (1, 2)", " (4, 0)"] if grid == 6 else [" (1, 2)", " (0, 0)"]
    monkeypatch.setattr(tracking, "_trace", _fake_trace(organism_p2a, texts, " 2", cells_for))
    ds = counting(3, 0, objects=2, regime="p2a", canvas=Canvas(image_size=168, grid=grid))
    res = track(organism_p2a, ds)
    assert res.n_points == 6 and res.n_empty_maps == 0 and not res.skipped
    np.testing.assert_allclose(res.points, [[1, 2], [4, 0]] * 3 if grid == 6 else [[1, 2], [0, 0]] * 3)
    np.testing.assert_allclose(res.rmse_mean, expected, atol=1e-12)
    np.testing.assert_allclose(res.rmse_heads, expected, atol=1e-12)
    frame = res.to_frame()
    np.testing.assert_allclose(frame["rmse"], expected, atol=1e-12)
    assert (frame["n_points"] == 6).all()


# ----------------------------------------------------------------------------------------------------------------
# the organism (structure only: no numbers that were not measured)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["count", "search"])
def test_organism_tracking_structure(organism_p2a, task, tmp_path):
    ds = tracking_dataset(organism_p2a, task, 3, seed=1)
    assert ds.params["canvas"]["image_size"] == 168 and ds.params["canvas"]["grid"] == [6, 6]
    if task == "count":
        assert min(ds.params["objects"]) == 5 and max(ds.params["objects"]) == 10
    res = track(organism_p2a, ds)
    L, H = organism_p2a.n_layers, organism_p2a.n_heads
    frame = res.to_frame()
    assert len(frame) == L * (H + 1)
    assert frame.groupby("layer").size().tolist() == [H + 1] * L
    assert (frame["head"] == "mean").sum() == L
    assert np.isfinite(frame["rmse"]).all() and (frame["rmse"] >= 0).all()
    assert (frame["n_points"] == res.n_points).all() and res.n_points > 0
    # every point is one the model wrote, and every centroid lies inside the 6x6 canvas
    from vlmbind.stimuli import parse_points

    written = [p for ex in res.examples for p in parse_points(ex["output"])]
    assert [tuple(p) for p in res.points] == written
    assert np.nanmin(res.head_centroids) >= 0 and np.nanmax(res.head_centroids) <= 5
    assert res.valley_layer == int(np.argmin(res.rmse_mean))
    assert res.best_heads()[0][2] == pytest.approx(float(np.min(res.rmse_heads[0])))
    json.dumps(res.centroids_json(), allow_nan=False)
    fig = res.example_figure(0)
    assert fig.layout.images[0].source.startswith("data:image/png;base64,")
    assert len(res.figure().data) == 3
    res.save(tmp_path)
    saved = json.loads((tmp_path / "centroids.json").read_text())
    assert sum(len(e["points"]) for e in saved["examples"]) == res.n_points
    assert len(saved["examples"][0]["points"][0]["centroid_heads"]) == L


def test_ablated_image_attention_gives_nan_centroids_not_a_crash(organism_p2a):
    # zeroing layer 1's attention to the image (all heads) leaves every layer-1 map all-zero; the model still points
    ds = tracking_dataset(organism_p2a, "search", 2, seed=3)
    with organism_p2a.ablate([(1, h) for h in range(organism_p2a.n_heads)], mode="image_attention"):
        res = track(organism_p2a, ds)
    assert res.n_points > 0
    # one empty head-averaged map and one per head, for every token of every point, all at layer 1
    assert res.n_empty_maps == sum(len(t) for t in res.point_tokens) * (organism_p2a.n_heads + 1)
    frame = res.to_frame()
    layer1 = frame[frame["layer"] == 1]
    assert np.isnan(layer1["rmse"]).all() and (layer1["n_points"] == 0).all()
    assert np.isfinite(frame[frame["layer"] != 1]["rmse"]).all()
    assert res.valley_layer != 1
    json.dumps(res.centroids_json(), allow_nan=False)


def test_track_rejects_bad_input(organism_p2a):
    direct = counting(2, 0, objects=5, regime="direct", canvas=Canvas(image_size=168, grid=6))
    with pytest.raises(InputError, match="Point-to-Answer"):
        track(organism_p2a, direct)
    p2a = counting(2, 0, objects=5, regime="p2a", canvas=Canvas(image_size=168, grid=6))
    with pytest.raises(InputError, match="query"):
        track(organism_p2a, p2a, query="after")
    with pytest.raises(InputError, match="threshold"):
        track(organism_p2a, p2a, threshold=1.5)
    with pytest.raises(InputError, match="canvas"):
        track(organism_p2a, list(p2a))
    with pytest.raises(InputError, match="task"):
        tracking_dataset(organism_p2a, "scene", 2)


def _scripted_trace(monkeypatch, vlm, text):
    """Every trace writes ``text`` (with all-zero attention maps): what a checkpoint's format does to track."""
    ids = vlm.adapter.tokenizer(text, add_special_tokens=False)["input_ids"]

    def fake(vlm_, batch, max_new_tokens, query):
        maps = np.zeros((len(ids), vlm_.n_layers, vlm_.n_heads, batch.seq_len), dtype=np.float32)
        return [(list(ids), maps) for _ in range(len(batch))]
    monkeypatch.setattr(tracking, "_trace", fake)


def test_track_refuses_points_in_an_unknown_frame(monkeypatch):
    # a checkpoint vlmbind did not train writes "(x, y)": pixels? per-mille? cells? Track must not guess
    vlm = get_tiny("tiny-qwen2_5_vl")
    ds = counting(2, 0, objects=2, regime="p2a", canvas=Canvas(image_size=112, grid=4))
    _scripted_trace(monkeypatch, vlm, " (56, 28) 1")
    with pytest.raises(tracking.UnknownFrameError, match=r"--point-frame.*\(56, 28\)"):
        track(vlm, ds)
    res = track(vlm, ds, point_frame="pixels")  # told the frame, it converts: pixel (56, 28) is cell (1.5, 0.5)
    np.testing.assert_allclose(res.points, [(1.5, 0.5)] * 2)
    res = track(vlm, ds, point_frame="canvas")
    np.testing.assert_allclose(res.points, [(56.0, 28.0)] * 2)


def test_track_converts_self_describing_formats(monkeypatch):
    vlm = get_tiny("tiny-qwen2_5_vl")
    ds = counting(2, 0, objects=2, regime="p2a", canvas=Canvas(image_size=112, grid=4))
    _scripted_trace(monkeypatch, vlm, ' <point x="62.5" y="12.5">a</point> 1')  # Molmo percent
    np.testing.assert_allclose(track(vlm, ds).points, [(2.0, 0.0)] * 2)


# ----------------------------------------------------------------------------------------------------------------
# vlmbind track
# ----------------------------------------------------------------------------------------------------------------
def test_track_command(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["track", "--model", "organism-p2a", "--task", "search", "--n", "2", "--out", str(out),
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {p.name for p in out.iterdir()} == {"rmse.csv", "rmse.html", "centroids.json", "summary.json",
                                               "plotly.min.js"}
    import pandas as pd

    frame = pd.read_csv(out / "rmse.csv")
    assert list(frame.columns) == ["layer", "head", "rmse", "n_points"]
    assert len(frame) == 4 * 5
    means = frame[frame["head"] == "mean"].sort_values("layer")["rmse"].to_numpy()
    np.testing.assert_allclose(means, printed["rmse_mean"])
    assert printed["valley_layer"] == int(np.argmin(means))
    assert printed["out"] == str(out)


@pytest.mark.parametrize("argv,needle", [
    (["--task", "count", "--n", "0"], "--n"),
    (["--task", "count", "--objects", "40"], "40"),
    (["--task", "scene"], "invalid choice"),
    (["--task", "count", "--threshold", "1"], "--threshold"),
])
def test_track_command_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, needle):
    out = tmp_path / "never"
    extra = [] if "--n" in argv else ["--n", "1"]
    assert main(["track", "--model", "organism-p2a", *argv, *extra, "--out", str(out)]) == 2
    # transformers draws its own "Loading weights" bar on stderr while the organism loads; everything else counts
    err = [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith("Loading weights")]
    assert len(err) == 1 and err[0].startswith("vlmbind: error: ") and needle in err[0]
    assert not out.exists()
