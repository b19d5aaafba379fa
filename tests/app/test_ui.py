"""vlmbind ui: callback bodies tested directly against independent computations, plus one real-browser test."""

from __future__ import annotations

import base64
import io
import os
import socket
import threading
import time

import pytest
import torch
from helpers import shared_organism
from PIL import Image

import vlmbind as vb
from vlmbind.analysis.evaluation import training_defaults
from vlmbind.app import ui
from vlmbind.app.ui import UIController, build_app, decode_upload

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def vlm() -> vb.VLM:
    return shared_organism("organism-p2a")


@pytest.fixture(scope="module")
def ctl(vlm: vb.VLM) -> UIController:
    return UIController(vlm)


@pytest.fixture(scope="module")
def state(ctl: UIController) -> dict:
    return ctl.generate_stimulus(0)[0]


def _uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _independent(vlm: vb.VLM, state: dict, heads: list[tuple[int, int]], mode: str) -> torch.Tensor:
    image = Image.open(io.BytesIO(base64.b64decode(state["image"]))).convert("RGB")
    batch = vlm.prepare(image, state["prompt"])
    last = batch.index[0].last_position
    means = None
    if mode == "mean":
        means = {l: vlm.head_means(batch, l, [h for ll, h in heads if ll == l]) for l in {l for l, _ in heads}}
    with vlm.ablate(heads, mode=mode, means=means):
        return vlm.logits(batch)[0, last].float()


def test_toggle_head_adds_and_removes() -> None:
    click = {"points": [{"x": 1, "y": 2, "curveNumber": 0}]}
    heads, selected = UIController.toggle_head(click, ["0.3"])
    assert heads == ["0.3", "2.1"] and selected == "2.1"
    heads, selected = UIController.toggle_head(click, heads)
    assert heads == ["0.3"] and selected == "2.1"
    assert UIController.toggle_head(None, ["1.1"]) == (["1.1"], None)


@pytest.mark.parametrize("mode", ["image_attention", "zero", "mean"])
def test_answer_logits_equal_independent_ablation(vlm, ctl, state, mode) -> None:
    heads, _ = ctl.toggle_head({"points": [{"x": 0, "y": 3}]}, ["1.2", "2.1"])
    result = ctl.answer(state, heads, "ablate", mode)
    assert "error" not in result and result["heads"] == ["1.2", "2.1", "3.0"]
    expected = _independent(vlm, state, [(1, 2), (2, 1), (3, 0)], mode)
    got = torch.tensor(result["logits"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    clean = ctl.answer(state, [], "ablate", mode)
    assert not torch.allclose(torch.tensor(clean["logits"]), got), "ablation should move the logits"
    top = result["top"][0]
    assert top["id"] == int(expected.argmax())
    assert top["diff"] == pytest.approx(top["logit"] - float(torch.tensor(clean["logits"])[top["id"]]), abs=1e-5)


def test_patch_from_counterfactual_matches_patchheads(vlm, ctl, state) -> None:
    result = ctl.answer(state, ["3.0", "3.1", "3.2", "3.3"], "patch")
    assert "error" not in result
    clean_img = Image.open(io.BytesIO(base64.b64decode(state["image"]))).convert("RGB")
    cf_img = Image.open(io.BytesIO(base64.b64decode(state["cf_image"]))).convert("RGB")
    batch, cf = vlm.prepare(clean_img, state["prompt"]), vlm.prepare(cf_img, state["prompt"])
    last = batch.index[0].last_position
    z = vlm.capture(cf, "blocks.3.attn.hook_z")["blocks.3.attn.hook_z"]
    patch = vb.PatchHeads(layer=3, heads=[0, 1, 2, 3], positions=[last],
                          values=z[:, [cf.index[0].last_position]])
    expected = vlm.logits(batch, [patch])[0, last].float()
    torch.testing.assert_close(torch.tensor(result["logits"]), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, vlm.logits(batch)[0, last].float())
    no_cf = dict(state, cf_image=None)
    assert "counterfactual" in ctl.answer(no_cf, ["3.0"], "patch")["error"]


def test_bad_uploads_give_messages_not_exceptions(ctl, state, tmp_path) -> None:
    gif = io.BytesIO()
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    bad = {
        "text": (_uri(b"hello, not an image", "text/plain"), "not an image"),
        "base64": ("data:image/png;base64,@@@@", "not valid base64"),
        "huge file": ("data:image/png;base64," + "A" * (28 * 1024 * 1024), "larger than 20 MB"),
        "huge pixels": (_uri(_png(Image.new("L", (5000, 8)))), "5000x8"),
        "animated": (_uri(gif.getvalue(), "image/gif"), "animated"),
        "empty": (None, "empty"),
    }
    for name, (contents, words) in bad.items():
        new, msg = ctl.upload(contents, f"{name}.bin", state, "a prompt")
        assert new is state, name
        assert msg.startswith("upload refused") and words in msg, (name, msg)
    # modes are converted to RGB; transparency composited on white
    rgba = Image.new("RGBA", (20, 10), (255, 0, 0, 0))
    for image in (rgba, Image.new("L", (20, 10), 7), Image.new("I;16", (20, 10), 300), Image.new("P", (20, 10)),
                  Image.new("CMYK", (20, 10))):
        fmt = "JPEG" if image.mode == "CMYK" else "PNG"
        out = decode_upload(_uri(_png(image, fmt)), "x")
        assert out.mode == "RGB" and out.size == (20, 10)
    assert decode_upload(_uri(_png(rgba)), "x").getpixel((0, 0)) == (255, 255, 255)
    new, msg = ctl.upload(_uri(_png(Image.new("RGB", (168, 168), "white"))), "ok.png", state, "in this image")
    assert new["prompt"] == "in this image" and new["cf_image"] is None and msg.startswith("loaded")


def test_model_access_is_serialised_by_the_lock(ctl, state) -> None:
    out: list = []
    with ctl.lock:
        worker = threading.Thread(target=lambda: out.append(ctl.answer(state, ["1.0"], "ablate", "zero")))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not out, "answer ran while the lock was held"
    worker.join(30)
    assert not worker.is_alive() and "logits" in out[0]


def test_scores_frame_and_cli(vlm, tmp_path, monkeypatch, capsys) -> None:
    path = tmp_path / "scores.csv"
    pairs = vb.stimuli.scene_pairs(2, "id_selection", 0, **training_defaults(vlm, "scene", {"n_objects": 3}))
    vb.locate(vlm, pairs).to_frame().to_csv(path, index=False)
    frame = ui.scores_frame(str(path), vlm.n_layers, vlm.n_heads)
    assert len(frame) == vlm.n_layers * vlm.n_heads
    with pytest.raises(vb.InputError, match="does not exist"):
        ui.scores_frame(str(tmp_path / "missing.csv"), 4, 4)
    with pytest.raises(vb.InputError, match="outside"):
        ui.scores_frame(frame.assign(layer=frame["layer"] + 9), 4, 4)

    calls: list = []

    class _App:
        def run(self, **kw):
            calls.append(kw)

    monkeypatch.setattr("vlmbind.app.commands.ui.build_app", lambda *a, **k: _App())
    monkeypatch.setattr("vlmbind.engine.loading.load", lambda name: vlm)
    from vlmbind.cli import main

    assert main(["ui", "--port", "8123"]) == 0
    assert calls[-1]["host"] == "127.0.0.1" and "warning" not in capsys.readouterr().err
    assert main(["ui", "--host", "0.0.0.0", "--port", "8123"]) == 0
    assert calls[-1]["host"] == "0.0.0.0" and "warning" in capsys.readouterr().err
    assert main(["ui", "--port", "0"]) == 2


def pick_condition(page, condition: str) -> None:
    """Choose the counterfactual condition in the page's dropdown, as a user does (type, then Enter)."""
    field = page.locator("#cf-condition input")
    field.fill(condition)
    field.press("Enter")


def _answer_changing_head(ctl: UIController, state: dict, scores: vb.HeadScores) -> str:
    """The highest-scoring head whose image_attention ablation changes the greedy answer."""
    clean = ctl.answer(state, [], "ablate", "image_attention")["answer"]
    for layer, head in scores.top(ctl.vlm.n_layers * ctl.vlm.n_heads):
        key = f"{layer}.{head}"
        if ctl.answer(state, [key], "ablate", "image_attention")["answer"] != clean:
            return key
    pytest.fail("no single head changes the answer under image_attention ablation")


def _serve(app):
    from werkzeug.serving import make_server

    with socket.socket() as s:  # a free port on the loopback interface
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = make_server("127.0.0.1", port, app.server, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread, port


def test_browser_click_ablates_head_and_exports(vlm, ctl, state, tmp_path) -> None:
    # the browser is part of the set-up (`make test` installs Debian's chromium when it is missing), so no skip
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: run `make browser` (installs Debian's chromium)"
    from playwright.sync_api import sync_playwright

    pairs = vb.stimuli.scene_pairs(4, "id_selection", 0, **training_defaults(vlm, "scene", {"n_objects": 3}))
    scores = vb.locate(vlm, pairs)
    key = _answer_changing_head(ctl, state, scores)
    layer, head = (int(v) for v in key.split("."))
    app = build_app(vlm, scores=scores, seed=0, controller=ctl)
    server, thread, port = _serve(app)
    start = time.perf_counter()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1500, "height": 1100}, accept_downloads=True)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#answer-text", timeout=30000)
            page.wait_for_selector("#heatmap .nsewdrag", timeout=30000)
            before = page.inner_text("#answer-text")
            assert "none" in page.inner_text("#heads-list")
            box = page.locator("#heatmap .nsewdrag").first.bounding_box()
            n_l, n_h = vlm.n_layers, vlm.n_heads
            # axes span [-0.5, n - 0.5]; layer 0 is at the bottom
            x = box["x"] + box["width"] * (head + 0.5) / n_h
            y = box["y"] + box["height"] * (1 - (layer + 0.5) / n_l)
            page.mouse.move(x, y)
            page.mouse.click(x, y)
            page.wait_for_function(f"document.querySelector('#heads-list').innerText.includes('{key}')",
                                   timeout=30000)
            page.wait_for_function(
                f"document.querySelector('#answer-text') && "
                f"document.querySelector('#answer-text').innerText !== {before!r}", timeout=30000)
            after = page.inner_text("#answer-text")
            assert after != before
            assert after == ctl.answer(state, [key], "ablate", "image_attention")["answer"]
            assert page.inner_text("#heads-list") == f"ablated heads: {key}"

            def heads_become(text: str) -> None:
                page.wait_for_function(f"document.querySelector('#heads-list').innerText === {text!r}",
                                       timeout=30000)
                page.wait_for_selector("#heatmap .nsewdrag", timeout=30000)

            # clicks toggle: the same cell twice, and the last-clicked cell again after "clear heads"
            page.mouse.click(x, y)
            heads_become("ablated heads: none")
            page.mouse.click(x, y)
            heads_become(f"ablated heads: {key}")
            page.click("#clear")
            heads_become("ablated heads: none")
            page.mouse.click(x, y)
            heads_become(f"ablated heads: {key}")

            # the page names both conditions; the counterfactual image sits beside the clean one
            assert page.inner_text("#conditions") == ("heatmap: id_selection scores | counterfactual for "
                                                      "patching: id_selection")
            assert "mismatch" not in (page.get_attribute("#conditions", "class") or "")
            clean_box = page.locator("#clean-image").bounding_box()
            cf_box = page.locator("#cf-image").bounding_box()
            assert page.get_attribute("#cf-image", "src").startswith("data:image/png;base64,")
            assert cf_box["x"] > clean_box["x"] + clean_box["width"] - 1 and abs(cf_box["y"] - clean_box["y"]) < 2
            assert page.get_attribute("#cf-image", "src") != page.get_attribute("#clean-image", "src")

            # another counterfactual condition than the heatmap's: said on the page, and patching is refused
            page.locator("#action label", has_text="patch").click()
            pick_condition(page, "feature_retrieval")
            page.wait_for_function("document.querySelector('#conditions').className.includes('mismatch')",
                                   timeout=30000)
            page.wait_for_function("document.querySelector('#answer').innerText.includes('patching refused')",
                                   timeout=30000)
            assert "feature_retrieval" in page.inner_text("#cf-caption")
            pick_condition(page, "id_selection")
            page.wait_for_function("!document.querySelector('#conditions').className.includes('mismatch')",
                                   timeout=30000)
            patched = ctl.answer(state, [key], "patch", "image_attention")["answer"]
            page.wait_for_function(f"document.querySelector('#answer-text') && "
                                   f"document.querySelector('#answer-text').innerText === {patched!r}", timeout=30000)
            page.locator("#action label", has_text="ablate").click()

            # locate asks before it replaces loaded scores; dismissing keeps them, accepting replaces them
            page.once("dialog", lambda d: d.dismiss())
            page.click("#locate")
            page.wait_for_timeout(1500)
            assert "(exact)" not in page.text_content("#heatmap .gtitle")
            messages: list[str] = []
            page.once("dialog", lambda d: (messages.append(d.message), d.accept()))
            page.click("#locate")
            page.wait_for_function("document.querySelector('#heatmap .gtitle') && "
                                   "document.querySelector('#heatmap .gtitle').textContent.includes('(exact)')",
                                   timeout=60000)
            assert messages and "Replace the loaded id_selection scores" in messages[0]
            with page.expect_download(timeout=30000) as dl:
                page.hover("#heatmap .nsewdrag")
                page.click("#heatmap .modebar-btn[data-title^='Download plot']")
            png = tmp_path / "heatmap.png"
            dl.value.save_as(png)
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            with page.expect_download(timeout=30000) as dl:
                page.click("#download-btn")
            csv = tmp_path / "scores.csv"
            dl.value.save_as(csv)
            assert csv.read_text().splitlines()[0] == "layer,head,score"
            shot = tmp_path / "ui.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        assert Image.open(shot).size[0] >= 1000
        print(f"\nscreenshot: {shot}  (browser part {time.perf_counter() - start:.1f} s)")
    finally:
        server.shutdown()
        thread.join(5)


def test_parallel_http_clients_get_the_serial_answers(vlm, ctl, state) -> None:
    """Eight clients post the answer callback at once to the real threaded server; the lock serialises the model, so
    every response equals the one computed alone, and no hook is left on the model."""
    import json
    from concurrent.futures import ThreadPoolExecutor
    from urllib.request import Request, urlopen

    from werkzeug.serving import make_server

    cases = [(heads, action, mode, None) for heads in (["0.0"], ["1.1", "0.1"], [])
             for action, mode in (("ablate", "zero"), ("ablate", "image_attention"))]
    cases += [(["1.0"], "ablate", "mean", None), (["0.1", "1.0", "1.1"], "ablate", "zero", None),
              (["1.1", "2.0"], "steer", "zero", [40.0, 100.0])]
    expected = [{k: v for k, v in ctl.answer(state, heads, action, mode, steer_point=point).items() if k != "logits"}
                for heads, action, mode, point in cases]
    app = build_app(vlm, seed=0, controller=ctl)
    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    port = server.server_port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def post(case: tuple) -> dict:
        heads, action, mode, point = case
        body = {"output": "..result-store.data...answer.children...heads-list.children..",
                "outputs": [{"id": "result-store", "property": "data"}, {"id": "answer", "property": "children"},
                            {"id": "heads-list", "property": "children"}],
                "inputs": [{"id": "input-store", "property": "data", "value": state},
                           {"id": "heads-store", "property": "data", "value": heads},
                           {"id": "action", "property": "value", "value": action},
                           {"id": "mode", "property": "value", "value": mode},
                           {"id": "steer-store", "property": "data", "value": point}],
                "changedPropIds": ["heads-store.data"],
                "state": [{"id": "scores-store", "property": "data", "value": {"condition": None}}]}
        request = Request(f"http://127.0.0.1:{port}/_dash-update-component", data=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
        with urlopen(request, timeout=120) as response:
            return json.loads(response.read())["response"]["result-store"]["data"]

    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(post, cases * 2))
    finally:
        server.shutdown()
        thread.join(5)
    assert got == expected * 2
    assert len({json.dumps(g["top"]) for g in got}) > 1, "the cases must give different answers to be a test"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in vlm.model.modules()
                   if any(getattr(f, "__module__", "") == "vlmbind.engine.hooks"
                          for f in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]))


def test_conditions_are_named_matched_and_switchable(vlm, tmp_path) -> None:
    """The scores' condition is read from HeadScores or the summary beside a scores.csv; switching the
    counterfactual condition regenerates the same scene's counterfactual; patching across conditions is refused."""
    own = UIController(vlm)
    state, _ = own.generate_stimulus(3)
    assert state["cf_condition"] == "id_selection" and state["seed"] == 3
    pairs = vb.stimuli.scene_pairs(2, "feature_retrieval", 0, **training_defaults(vlm, "scene", {"n_objects": 3}))
    scores = vb.locate(vlm, pairs)
    assert ui.scores_condition(scores) == "feature_retrieval"
    scores.save(tmp_path / "loc")
    assert ui.scores_condition(str(tmp_path / "loc" / "scores.csv")) == "feature_retrieval"
    assert ui.scores_condition(scores.to_frame()) is None
    text, ok = ui.condition_status("feature_retrieval", "id_selection")
    assert not ok and "they differ" in text
    refused = own.answer(state, ["0.3"], "patch", scores_condition="feature_retrieval")
    assert "patching refused" in refused["error"]
    switched, _ = own.set_condition("feature_retrieval", state)
    expected = vb.stimuli.scene_pairs(1, "feature_retrieval", 3, **own._scene_kwargs())[0]
    assert switched["image"] == state["image"]  # the same clean scene
    assert switched["cf_condition"] == "feature_retrieval"
    assert switched["cf_expected"] == expected.answer_counterfactual
    assert "error" not in own.answer(switched, ["0.3"], "patch", scores_condition="feature_retrieval")
    _, message = own.set_condition("attention_swap", switched)
    assert "not one of" in message and own.condition == "feature_retrieval"
    app = build_app(vlm, scores=str(tmp_path / "loc" / "scores.csv"), controller=UIController(vlm))
    assert app.vlmbind.condition == "feature_retrieval"  # the counterfactual follows the loaded scores



def test_a_pairs_file_gives_the_pages_inputs_patched_where_each_pair_says(tmp_path) -> None:
    """``ui --pairs``: the page's input is the file's pair (the seed picks it), a patch writes the counterfactual's
    z at the pair's box tokens (PatchHeads computed here), and locate runs on the file's pairs; in a browser, the
    page shows the pair and the patched answer."""
    from helpers import get_tiny, write_hand_pairs

    vlm = get_tiny("tiny-qwen2_vl")
    write_hand_pairs(tmp_path / "mine", 3, patch={"box": [30, 40, 90, 100]})
    pairs = vb.stimuli.load_pairs(tmp_path / "mine")
    own = UIController(vlm, pairs=pairs)
    state, message = own.generate_stimulus(4)
    pair = pairs[1]  # 4 % 3
    assert "pair p1 (2 of 3)" in message and state["cf_condition"] == "colour_swap"
    assert Image.open(io.BytesIO(base64.b64decode(state["image"]))).tobytes() == pair.clean.image.tobytes()
    result = own.answer(state, ["1.2", "2.0"], "patch", scores_condition="colour_swap")
    batch = vlm.prepare(pair.clean.image, pair.clean.prompt)
    cf = vlm.prepare(pair.counterfactual.image, pair.counterfactual.prompt)
    grid = batch.index[0].grid()  # 8 x 8 cells of 28 px: the box covers rows 1-3, columns 1-3
    where = sorted(int(grid.positions[r, c]) for r in range(1, 4) for c in range(1, 4))
    patches = [vb.PatchHeads(layer=l, heads=[h], positions=where,
                             values=vlm.capture(cf, f"blocks.{l}.attn.hook_z")[f"blocks.{l}.attn.hook_z"][:, where][
                                 :, :, [h]]) for l, h in ((1, 2), (2, 0))]
    last = batch.index[0].last_position
    expected = vlm.logits(batch, patches)[0, last].float()
    torch.testing.assert_close(torch.tensor(result["logits"]), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, vlm.logits(batch)[0, last].float())
    records, message = own.locate(0)
    assert "on 3 pairs of your pairs file" in message and len(records) == vlm.n_layers * vlm.n_heads
    assert own.set_condition("id_selection", state)[1].startswith("condition 'id_selection' is not one of colour_swap")

    from playwright.sync_api import sync_playwright

    app = build_app(vlm, seed=4, pairs=pairs, controller=own)  # one controller: one lock around the model
    server, thread, port = _serve(app)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#answer-text", timeout=30000)
            page.wait_for_selector("#heatmap .nsewdrag", timeout=30000)
            assert page.get_attribute("#clean-image", "src").endswith(state["image"])
            assert page.get_attribute("#cf-image", "src").endswith(state["cf_image"])
            assert "colour_swap" in page.inner_text("#cf-caption") and "circle" in page.inner_text("#cf-caption")
            page.locator("#action label", has_text="patch").click()
            box = page.locator("#heatmap .nsewdrag").first.bounding_box()
            x = box["x"] + box["width"] * (2 + 0.5) / vlm.n_heads
            y = box["y"] + box["height"] * (1 - (1 + 0.5) / vlm.n_layers)
            page.mouse.click(x, y)
            page.wait_for_function("document.querySelector('#heads-list').innerText.includes('1.2')", timeout=30000)
            patched = own.answer(state, ["1.2"], "patch")["answer"]
            page.wait_for_function(f"document.querySelector('#answer-text') && "
                                   f"document.querySelector('#answer-text').innerText === {patched!r}", timeout=30000)
            browser.close()
    finally:
        server.shutdown()
        thread.join(5)


def test_steering_a_clicked_cell_equals_steerattention_and_moves_the_planted_answer() -> None:
    """Steering from the page is SteerAttention at the last prompt token and every answer token; on organism-vsm,
    sending the selecting head 3.1 to a described object's cell makes the model name that object."""
    vlm = shared_organism("organism-vsm")
    ctl = UIController(vlm)
    example = vb.stimuli.scene_description(1, 7, **training_defaults(vlm, "scene", {"n_objects": 3}))[0]
    described = next(o for i, o in enumerate(example.objects) if i != example.fields["target"])
    state = {"image": ui._png_b64(example.image), "prompt": example.prompt}
    assert "steering needs a target" in ctl.answer(state, ["3.1"], "steer")["error"]
    result = ctl.answer(state, ["3.1"], "steer", steer_point=[described.x, described.y])
    assert result["clean_answer"] == example.answer and result["answer"].startswith(described.name)
    batch = vlm.prepare(example.image, example.prompt)
    last = batch.index[0].last_position
    steering = vb.SteerAttention(layer=3, heads=[1], keys=batch.index[0].positions_covering(described.box),
                                 query_positions=[last + i for i in range(4)])
    torch.testing.assert_close(torch.tensor(result["logits"]), vlm.logits(batch, [steering])[0, last].float(),
                               rtol=1e-5, atol=1e-5)
