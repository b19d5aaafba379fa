"""``vlmbind ui``: a local Dash app to ablate, patch or steer attention heads by clicking them and see the answer
change (steering: click a cell of the attention overlay to send the selected heads' attention there).

Design: all model work lives in :class:`UIController`, whose methods are the callbacks' bodies and take and return
plain values (so tests call them without a browser); :func:`build_app` only lays out the page and wires Dash
callbacks to those methods. The page state (current input, clicked heads, scores) lives in ``dcc.Store`` components
as JSON; images travel as base64 PNG so the server keeps no per-user state beyond the model. Every forward pass runs
under one ``threading.Lock`` because Dash may run callbacks concurrently and hooks are installed on the shared model.
Uploads are validated before decoding (size in bytes, pixel count, animation) and converted to RGB; a bad upload
yields a message in the page, never an exception.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from PIL import Image

from ..analysis import locate
from ..analysis.evaluation import training_defaults
from ..core.choices import ABLATION_MODES, UI_CONDITIONS
from ..core.errors import InputError
from ..core.userfiles import SCORE_COLUMNS, read_json_object, read_scores
from ..engine.alignment import patch_positions
from ..engine.hooks import PatchHeads, SteerAttention
from ..stimuli import scene_pairs
from ..viz import attention_overlay, head_heatmap

MODES = ABLATION_MODES
ACTIONS = ("ablate", "patch", "steer")
# last-token conditions of scene_pairs: their counterfactual is patched at the last position, as the UI does
CONDITIONS = UI_CONDITIONS
MAX_UPLOAD_BYTES = 20 * 1024 * 1024
MAX_PIXELS_SIDE = 4096
TOP_K = 5
ANSWER_TOKENS = 4
CLEAN_CACHE = 8
GRAPH_CONFIG = {"displayModeBar": True, "displaylogo": False,
                "toImageButtonOptions": {"format": "png", "scale": 2}}


def _png_b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _from_b64(data: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def decode_upload(contents: str | None, filename: str | None = None) -> Image.Image:
    """An uploaded file (a ``data:...;base64,...`` URI from ``dcc.Upload``) as an RGB image.

    Raises:
        InputError: empty, not base64, over ``MAX_UPLOAD_BYTES``, not an image, larger than
            ``MAX_PIXELS_SIDE`` on a side, animated, or in a mode that cannot be converted to RGB.
    """
    name = filename or "the upload"
    if not contents:
        raise InputError(f"{name} is empty; upload a PNG or JPEG image")
    payload = contents.split(",", 1)[1] if contents.startswith("data:") and "," in contents else contents
    # base64 is 4/3 of the bytes: refuse before decoding a huge payload
    if len(payload) * 3 // 4 > MAX_UPLOAD_BYTES:
        raise InputError(f"{name} is larger than {MAX_UPLOAD_BYTES // 2**20} MB; upload a smaller image")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{name} is not valid base64 data; upload the file again") from None
    if len(raw) > MAX_UPLOAD_BYTES:
        raise InputError(f"{name} is larger than {MAX_UPLOAD_BYTES // 2**20} MB; upload a smaller image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            width, height = image.size  # read from the header, before any pixel is decoded
            if width > MAX_PIXELS_SIDE or height > MAX_PIXELS_SIDE:
                raise InputError(f"{name} is {width}x{height} pixels; the limit is {MAX_PIXELS_SIDE}x"
                                 f"{MAX_PIXELS_SIDE}, resize it first")
            if getattr(image, "is_animated", False) or getattr(image, "n_frames", 1) > 1:
                raise InputError(f"{name} is animated ({getattr(image, 'n_frames', '?')} frames); upload one still "
                                 "image")
            image.load()
            if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
                # transparent pixels carry arbitrary colours: composite on white as the stimuli are drawn
                rgba = image.convert("RGBA")
                background = Image.new("RGBA", rgba.size, "white")
                return Image.alpha_composite(background, rgba).convert("RGB")
            if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
                # high bit-depth greyscale: scale to 8 bits rather than clipping
                arr = np.asarray(image, dtype=np.float64)
                span = float(arr.max() - arr.min()) or 1.0
                image = Image.fromarray(((arr - arr.min()) / span * 255).astype(np.uint8), "L")
            return image.convert("RGB")
    except InputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError(f"{name} decodes to too many pixels; upload a smaller image") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure means "not an image we can read"
        raise InputError(f"{name} is not an image Pillow can read ({type(exc).__name__}); upload a PNG or "
                         "JPEG") from None


def _head_key(layer: int, head: int) -> str:
    return f"{int(layer)}.{int(head)}"


def _parse_key(key: str) -> tuple[int, int]:
    layer, head = key.split(".")
    return int(layer), int(head)


def scores_frame(scores: Any, n_layers: int, n_heads: int) -> pd.DataFrame:
    """A ``layer, head, score`` frame from HeadScores, a frame, a ``scores.csv`` path, or None (all zero).

    Raises:
        InputError: a missing file or column, or heads outside the model.
    """
    if scores is None:
        return pd.DataFrame([(l, h, 0.0) for l in range(n_layers) for h in range(n_heads)],
                            columns=["layer", "head", "score"])
    if hasattr(scores, "to_frame"):
        frame = scores.to_frame()
    elif isinstance(scores, pd.DataFrame):
        frame = scores
    else:
        return read_scores(scores, n_layers=n_layers, n_heads=n_heads, what="scores file")[list(SCORE_COLUMNS)]
    missing = {"layer", "head", "score"} - set(frame.columns)
    if missing:
        raise InputError(f"scores need columns layer, head, score; missing {sorted(missing)}")
    frame = frame[["layer", "head", "score"]].astype({"layer": int, "head": int, "score": float})
    negative = bool((frame[["layer", "head"]] < 0).any(axis=None))
    if negative or frame["layer"].max() >= n_layers or frame["head"].max() >= n_heads:
        raise InputError(f"scores name heads outside the model's {n_layers} layers x {n_heads} heads")
    return frame.reset_index(drop=True)


def scores_condition(scores: Any) -> str | None:
    """The condition the scores were located under: HeadScores' own, or the ``condition`` in the ``summary.json``
    beside a ``scores.csv`` written by ``vlmbind locate``; None when unknown (a bare frame or a foreign file)."""
    if scores is None:
        return None
    if hasattr(scores, "condition"):
        return str(scores.condition)
    if isinstance(scores, pd.DataFrame):
        return None
    summary = Path(scores).parent / "summary.json"
    if summary.is_file():
        try:
            value = read_json_object(summary).get("condition")
        except InputError:
            return None
        return str(value) if value else None
    return None


def condition_status(scores_cond: str | None, cf_cond: str) -> tuple[str, bool]:
    """The page's line naming the heatmap's and the counterfactual's conditions, and whether they match (an
    unknown scores condition counts as a match: there is nothing to compare)."""
    shown = scores_cond or "unknown condition"
    match = scores_cond is None or scores_cond == cf_cond
    text = f"heatmap: {shown} scores | counterfactual for patching: {cf_cond}"
    if not match:
        text += (f" -- they differ: patching would move the {cf_cond} answer, not what the heatmap ranks; pick "
                 f"{scores_cond} as the counterfactual, or press locate for {cf_cond} scores")
    return text, match


class UIController:
    """The model side of the app: every callback body, serialised by one lock.

    Attributes:
        vlm: the loaded model.
        lock: held around every forward pass.
        condition: scene_pairs condition of generated counterfactuals (a pairs file's condition with ``pairs``).
        n_pairs: pairs for on-demand ``locate``.
        pairs: a researcher's own pairs (:class:`~vlmbind.stimuli.PairSet`): the page's inputs are its pairs (the
            seed picks one), patched where each pair says, and on-demand ``locate`` runs on all of them.
    """

    def __init__(self, vlm: Any, *, condition: str = "id_selection", n_pairs: int = 8,
                 lock: threading.Lock | None = None, pairs: Any = None):
        if pairs is not None:
            condition = pairs.condition
        elif condition not in CONDITIONS:
            raise InputError(f"condition {condition!r} is not one of {CONDITIONS}")
        self.vlm = vlm
        self.lock = lock or threading.Lock()
        self.condition = condition
        self.n_pairs = n_pairs
        self.pairs = pairs
        # input hash -> (V clean logits at the last position, clean greedy answer)
        self._clean: dict[str, tuple[torch.Tensor, str]] = {}

    @property
    def conditions(self) -> tuple[str, ...]:
        """The counterfactual conditions the page offers: the pairs file's, or the generated scenes'."""
        return (self.pairs.condition,) if self.pairs is not None else CONDITIONS

    # ---- inputs ----------------------------------------------------------------------------------------------
    def _scene_kwargs(self) -> dict[str, Any]:
        return training_defaults(self.vlm, "scene", {"n_objects": 3})

    def generate_stimulus(self, seed: int) -> tuple[dict[str, Any], str]:
        """A scene-description example and its counterfactual (``self.condition``) as the page's input state.

        Returns:
            ``(state, message)``; ``state``: ``image``, ``cf_image`` (base64 PNG), ``prompt``, ``expected``.
        """
        seed = int(seed or 0)
        if seed < 0:
            raise InputError(f"seed {seed} is negative; pass a seed >= 0")
        if self.pairs is not None:
            pair = self.pairs[seed % len(self.pairs)]
            source = f"pair {pair.id} ({seed % len(self.pairs) + 1} of {len(self.pairs)})"
        else:
            # scene_pairs' clean scenes are exactly scene_description(n, seed, ...)'s with the same parameters
            pair = scene_pairs(1, self.condition, seed, **self._scene_kwargs())[0]
            source = f"scene seed {seed}"
        state = {"image": _png_b64(pair.clean.image), "cf_image": _png_b64(pair.counterfactual.image),
                 "prompt": pair.clean.prompt, "expected": pair.clean.answer, "source": source,
                 "seed": seed, "cf_condition": self.condition, "cf_expected": pair.answer_counterfactual}
        if self.pairs is not None:
            state.update(pair_id=pair.id, patch=pair.patch, cf_prompt=pair.counterfactual.prompt)
        return state, (f"{'generated scene' if self.pairs is None else 'your'} {source}; expected answer "
                       f"{pair.clean.answer!r}; {self.condition} counterfactual answer {pair.answer_counterfactual!r}")

    def set_condition(self, condition: str, state: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
        """Switch the counterfactual condition; a generated scene gets its counterfactual for the new condition
        (same seed), an uploaded counterfactual stays as it is."""
        if condition not in self.conditions:
            return state, f"condition {condition!r} is not one of {', '.join(self.conditions)}"
        self.condition = condition
        if state and state.get("seed") is not None and state.get("cf_condition") in self.conditions:
            return self.generate_stimulus(state["seed"])
        new = dict(state or {})
        new["cf_condition"] = condition
        return new, f"counterfactual condition: {condition}"

    def upload(self, contents: str | None, filename: str | None, state: dict[str, Any] | None,
               prompt: str | None, *, counterfactual: bool = False) -> tuple[dict[str, Any] | None, str]:
        """Validate an uploaded image and put it in the state (as the input or its counterfactual).

        Returns:
            ``(state, message)``: the unchanged state and an error message on a bad upload; never raises.
        """
        try:
            image = decode_upload(contents, filename)
        except InputError as exc:
            return state, f"upload refused: {exc}"
        new = dict(state or {})
        if counterfactual:
            if not new.get("image"):
                return state, "upload refused: load or generate an input image before its counterfactual"
            # same size as the input so both give the same number of image tokens
            size = _from_b64(new["image"]).size
            new["cf_image"] = _png_b64(image.resize(size, Image.BILINEAR) if image.size != size else image)
            new.update(cf_condition=f"uploaded ({filename or 'image'})", cf_expected=None, patch=None, cf_prompt=None)
            return new, f"counterfactual {filename or 'image'} loaded ({image.size[0]}x{image.size[1]})"
        new.update(image=_png_b64(image), cf_image=None, expected=None, source=filename or "upload", seed=None,
                   cf_condition=None, cf_expected=None, patch=None, cf_prompt=None, pair_id=None)
        new["prompt"] = prompt if prompt else new.get("prompt", "")
        return new, f"loaded {filename or 'image'} ({image.size[0]}x{image.size[1]}, RGB)"

    # ---- heads -----------------------------------------------------------------------------------------------
    @staticmethod
    def toggle_head(click_data: dict[str, Any] | None, heads: list[str] | None) -> tuple[list[str], str | None]:
        """Toggle the clicked head in the active list.

        Returns:
            ``(heads, selected)``: the new sorted list of ``"layer.head"`` and the clicked head (None without a click).
        """
        heads = list(heads or [])
        if not click_data or not click_data.get("points"):
            return heads, None
        point = click_data["points"][0]
        key = _head_key(round(point["y"]), round(point["x"]))
        if key in heads:
            heads.remove(key)
        else:
            heads.append(key)
        return sorted(heads, key=_parse_key), key

    # ---- forwards --------------------------------------------------------------------------------------------
    def _batch(self, state: dict[str, Any], image_key: str = "image") -> Any:
        # a pair's counterfactual keeps its own prompt (same token count) unless the page's prompt was edited
        own = state.get("cf_prompt") if image_key == "cf_image" and state.get("patch") else None
        prompt = (own or state.get("prompt") or "").strip()
        if not prompt:
            raise InputError("the prompt is empty; type the text that follows the image")
        return self.vlm.prepare(_from_b64(state[image_key]), prompt)

    def _steering(self, batch: Any, heads: list[tuple[int, int]], point: Any) -> list[SteerAttention]:
        """``heads`` steered, at the prompt's last token and every answer token, to the image token(s) under
        ``point`` (``[x, y]`` in image pixels, from a click on the overlay)."""
        if not point:
            raise InputError("steering needs a target: click a cell of the attention overlay to steer the heads there")
        x, y = (float(v) for v in point)
        index = batch.index[0]
        box = (x, y, x + 1e-3, y + 1e-3)
        cross = set(self.vlm.adapter.cross_attention_layers())
        last = index.last_position
        queries = [last + i for i in range(ANSWER_TOKENS)]
        items = []
        for layer in sorted({l for l, _ in heads}):
            keys = index.keys_covering(box) if layer in cross else index.positions_covering(box)
            if not len(keys):
                raise InputError(f"no image token of layer {layer}'s keys lies under ({x:.0f}, {y:.0f}): click a cell "
                                 "of the image")
            items.append(SteerAttention(layer=layer, heads=[h for l, h in heads if l == layer], keys=keys,
                                        query_positions=queries))
        return items

    def _interventions(self, state: dict[str, Any], batch: Any, heads: list[tuple[int, int]], action: str,
                       mode: str, steer_point: Any = None) -> tuple[list[Any], Any]:
        """The interventions for ``heads``: ``([PatchHeads...] or [SteerAttention...], None)`` or ``([], ablate
        context)``. Lock held."""
        if action == "patch":
            if not state.get("cf_image"):
                raise InputError("patching needs a counterfactual image: generate a scene or upload one")
            cf = self._batch(state, "cf_image")
            if state.get("patch"):  # a pairs file's pair: where it says, on sides that line up token for token
                if len(cf.index[0]) != len(batch.index[0]):
                    raise InputError("the counterfactual's tokens do not line up with the input's (the prompt was "
                                     "edited?): reload the pair")
                pair = SimpleNamespace(id=state.get("pair_id"), patch=state["patch"])
                where = patch_positions(batch.index[0], pair).tolist()
                cf_where = where
            else:
                where, cf_where = [batch.index[0].last_position], [cf.index[0].last_position]
            layers = sorted({l for l, _ in heads})
            cache = self.vlm.capture(cf, [self.vlm.adapter.z_site(l) for l in layers])
            items = []
            for layer in layers:
                hs = [h for l, h in heads if l == layer]
                z = cache[self.vlm.adapter.z_site(layer)]  # B P H D
                items.append(PatchHeads(layer=layer, heads=hs, positions=where, values=z[:, cf_where][:, :, hs]))
            return items, None
        if action == "steer":
            return self._steering(batch, heads, steer_point), None
        if action != "ablate":
            raise InputError(f"action {action!r} is not one of {ACTIONS}")
        means = None
        if mode in ("mean", "role_mean"):
            # mean z over the current input's positions (of each role for role_mean): the only data the page has
            means = {l: self.vlm.head_means(batch, l, [h for ll, h in heads if ll == l], by_role=mode == "role_mean")
                     for l in {l for l, _ in heads}}
        return [], self.vlm.ablate(heads, mode=mode, means=means)

    def answer(self, state: dict[str, Any] | None, heads: list[str] | None, action: str = "ablate",
               mode: str = "image_attention", scores_condition: str | None = None,
               steer_point: Any = None) -> dict[str, Any]:
        """Clean and intervened answer with the top logits at the last position.

        Args:
            scores_condition: the condition of the scores on the page; patching from a generated counterfactual of
                another condition is refused (the answer would not test what the heatmap ranks).
            steer_point: ``[x, y]`` in image pixels: where ``action="steer"`` sends the heads' attention (the image
                token under it), at the prompt's last token and every answer token.

        Returns:
            ``{"error": msg}`` on bad input, else ``heads``, ``action``, ``mode``, ``answer`` and ``clean_answer``
            (greedy continuations), ``top`` (``[{token, id, logit, clean_logit, diff}]``, the intervened top-k),
            ``logits`` (``V`` intervened logits at the last position, as a list).
        """
        if not state or not state.get("image"):
            return {"error": "no input yet: generate a scene or upload an image"}
        keys = list(heads or [])
        pairs = [_parse_key(k) for k in keys]
        cf_condition = state.get("cf_condition")
        if action == "patch" and pairs and scores_condition and cf_condition in self.conditions \
                and cf_condition != scores_condition:
            return {"error": f"patching refused: the heatmap shows {scores_condition} scores but the "
                             f"counterfactual is a {cf_condition} scene; pick {scores_condition} as the "
                             f"counterfactual condition, or press locate for {cf_condition} scores"}
        try:
            with self.lock:
                batch = self._batch(state)
                last = batch.index[0].last_position
                key = hashlib.sha256(f"{state['prompt']}\0{state['image']}".encode()).hexdigest()
                if key not in self._clean:
                    # every click re-runs the same clean input: keep the last few clean results
                    if len(self._clean) >= CLEAN_CACHE:
                        self._clean.pop(next(iter(self._clean)))
                    self._clean[key] = (self.vlm.logits(batch)[0, last].float().cpu(),
                                        self.vlm.generate(batch, ANSWER_TOKENS)[0][0])
                clean, clean_text = self._clean[key]
                if pairs:
                    items, context = self._interventions(state, batch, pairs, action, mode, steer_point)
                    if context is None:
                        logits = self.vlm.logits(batch, items)[0, last].float().cpu()
                        # no KV cache: every step re-runs the prompt, so a patch stays at the prompt's last token
                        text = self.vlm.generate(batch, ANSWER_TOKENS, interventions=items, use_cache=False)[0][0]
                    else:
                        with context:
                            logits = self.vlm.logits(batch)[0, last].float().cpu()
                            text = self.vlm.generate(batch, ANSWER_TOKENS)[0][0]
                else:
                    logits, text = clean, clean_text
        except InputError as exc:
            return {"error": str(exc)}
        tokenizer = self.vlm.adapter.tokenizer
        top = torch.topk(logits, min(TOP_K, logits.numel()))
        rows = [{"token": tokenizer.decode([int(i)]), "id": int(i), "logit": float(v),
                 "clean_logit": float(clean[int(i)]), "diff": float(v - clean[int(i)])}
                for v, i in zip(top.values, top.indices)]
        return {"heads": keys, "action": action, "mode": mode, "answer": text.strip(),
                "clean_answer": clean_text.strip(), "top": rows, "logits": logits.tolist()}

    def overlay(self, state: dict[str, Any] | None, selected: str | None) -> go.Figure:
        """The selected head's last-token attention over the image grid (layer 0 head 0 when none is selected)."""
        if not state or not state.get("image"):
            return go.Figure(layout={"title": {"text": "no input yet"}})
        layer, head = _parse_key(selected) if selected else (0, 0)
        try:
            with self.lock:
                batch = self._batch(state)
                site = self.vlm.adapter.pattern_site(layer)
                pattern = self.vlm.capture(batch, site)[site]  # B H P P, or B H P K over cross-attention keys
        except InputError as exc:
            return go.Figure(layout={"title": {"text": str(exc)}})
        index = batch.index[0]
        # a cross-attention layer's keys are the image's patches (Llama-3.2-Vision), laid out by its key grids
        grids = index.key_grids if layer in self.vlm.adapter.cross_attention_layers() else index.grids
        if not grids:
            return go.Figure(layout={"title": {"text": f"layer {layer} attends to no image token: pick a "
                                                       f"cross-attention layer {self.vlm.adapter.cross_attention_layers()}"}})
        grid = grids[0]
        weights = pattern[0, head, index.last_position].detach().to("cpu", torch.float64).numpy()[grid.positions]
        return attention_overlay(_from_b64(state["image"]), grid.positions, grid.boxes, weights,
                                 title=f"L{layer}.H{head}: last-token attention over the {grid.name} grid "
                                       f"({grid.shape[0]}x{grid.shape[1]}), clean run")

    def locate(self, seed: int) -> tuple[list[dict[str, Any]], str]:
        """Per-head scores on ``n_pairs`` generated pairs with the exact method.

        Returns:
            ``(records of layer, head, score, message)``.
        """
        if self.pairs is not None:
            pairs, where = self.pairs, " of your pairs file"
        else:
            pairs, where = scene_pairs(self.n_pairs, self.condition, int(seed or 0), **self._scene_kwargs()), ""
        with self.lock:
            scores = locate(self.vlm, pairs, method="exact")
        frame = scores_frame(scores, self.vlm.n_layers, self.vlm.n_heads)
        return frame.to_dict("records"), (f"located {self.condition} on {scores.n} pairs{where} in "
                                          f"{scores.seconds:.2f} s; the heatmap now shows these scores")

    def heatmap(self, records: list[dict[str, Any]], heads: list[str] | None, title: str) -> go.Figure:
        """The scores heatmap with an ``x`` on every active head."""
        frame = pd.DataFrame(records)
        fig = head_heatmap(frame, "score", title=title, model=self.vlm.name, signed=True)
        pairs = [_parse_key(k) for k in heads or []]
        fig.add_trace(go.Scatter(x=[h for _, h in pairs], y=[l for l, _ in pairs], mode="markers",
                                 marker={"symbol": "x", "size": 14, "color": "black"}, name="active",
                                 hoverinfo="skip", showlegend=False))
        fig.update_layout(clickmode="event")
        return fig


def _answer_view(result: dict[str, Any]) -> Any:
    from dash import html

    if "error" in result:
        return html.Div(result["error"], className="error", style={"color": "#b00"})
    rows = [html.Tr([html.Th(c) for c in ("token", "logit", "clean", "diff")])]
    rows += [html.Tr([html.Td(repr(r["token"])), html.Td(f"{r['logit']:.3f}"), html.Td(f"{r['clean_logit']:.3f}"),
                      html.Td(f"{r['diff']:+.3f}")]) for r in result["top"]]
    what = (f"{result['action']} ({result['mode']})" if result["action"] == "ablate" else "patch from counterfactual")
    return html.Div([
        html.P([html.B("answer: "), html.Span(result["answer"], id="answer-text")]),
        html.P(f"clean answer: {result['clean_answer']}  |  {what}: "
               f"{', '.join(result['heads']) or 'no heads'}"),
        html.Table(rows),
    ])


UI_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 0; background: #fafafa; }
#vb-page { max-width: 1500px; margin: 0 auto; padding: 0.5em 1.2em 2em; }
#vb-page h3 { margin: 0.6em 0 0.4em; font-weight: 600; }
.vb-bar { display: flex; flex-wrap: wrap; align-items: center; gap: 0.6em; margin: 0.35em 0; }
.vb-bar label { color: #555; font-size: 0.9em; }
button { font: inherit; font-size: 0.9em; padding: 0.25em 0.8em; border: 1px solid #bbb; border-radius: 4px;
         background: #fff; cursor: pointer; }
button:hover { background: #eef4fa; border-color: #1f77b4; }
#message { color: #444; font-size: 0.9em; min-height: 1.2em; }
#conditions { font-size: 0.9em; padding: 0.3em 0.6em; border-left: 4px solid #2ca02c; background: #f1f8f1; }
#conditions.mismatch { border-left-color: #d62728; background: #fbeeee; color: #8b1a1a; }
.vb-images { display: flex; gap: 1em; align-items: flex-start; }
.vb-images figure { margin: 0; text-align: center; font-size: 0.85em; color: #555; }
.vb-images img { width: 168px; height: 168px; image-rendering: pixelated; border: 1px solid #ccc; background: #fff; }
.vb-panel { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 0.4em 0.8em; margin: 0.4em 0; }
.vb-figs { display: flex; flex-wrap: wrap; gap: 0.8em; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { padding: 1px 10px; text-align: right; }
.error { color: #b00; }
"""


def _image_src(data: str | None) -> str:
    return f"data:image/png;base64,{data}" if data else ""


def build_app(vlm: Any, *, scores: Any = None, seed: int = 0, condition: str | None = None, n_pairs: int = 8,
              controller: UIController | None = None, pairs: Any = None) -> Any:
    """The Dash app for ``vlm``.

    Args:
        vlm: a loaded VLM.
        scores: initial head scores (HeadScores, frame or a ``scores.csv`` path); None shows zeros until "locate".
        seed: the first generated scene's seed.
        condition: counterfactual condition of generated pairs (``id_selection`` or ``feature_retrieval``); None:
            the loaded scores' condition when it is one of those, else ``id_selection``.
        n_pairs: pairs for on-demand locate.
        controller: reuse a controller (tests); default a new one.
        pairs: a researcher's own pairs (:class:`~vlmbind.stimuli.PairSet`): the inputs, counterfactuals, patch
            positions and on-demand locate come from them (see :class:`UIController`).

    Returns:
        The ``dash.Dash`` app; ``app.vlmbind`` is its :class:`UIController`.
    """
    import dash
    from dash import Input, Output, State, dcc, html

    loaded_condition = scores_condition(scores)
    if pairs is not None:
        condition = pairs.condition
    elif condition is None:
        condition = loaded_condition if loaded_condition in CONDITIONS else "id_selection"
    ctl = controller or UIController(vlm, condition=condition, n_pairs=n_pairs, pairs=pairs)
    ctl.condition = condition
    initial_scores = scores_frame(scores, vlm.n_layers, vlm.n_heads).to_dict("records")
    initial_title = (f"{loaded_condition or 'loaded'} scores" if scores is not None
                     else "no scores yet: press 'locate'")
    state, message = ctl.generate_stimulus(seed)
    status, match = condition_status(loaded_condition, condition)

    app = dash.Dash(__name__, title=f"vlmbind ui: {vlm.name}")
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + UI_CSS + "</style>")
    app.layout = html.Div(id="vb-page", children=[
        html.H3(f"vlmbind ui: {vlm.name} ({vlm.n_layers} layers x {vlm.n_heads} heads)"),
        dcc.Store(id="input-store", data=state),
        dcc.Store(id="heads-store", data=[]),
        dcc.Store(id="selected-store", data=None),
        dcc.Store(id="scores-store", data={"records": initial_scores, "title": initial_title,
                                           "condition": loaded_condition,
                                           "source": "loaded" if scores is not None else None}),
        dcc.Store(id="result-store"),
        dcc.Store(id="steer-store", data=None),
        dcc.ConfirmDialog(id="confirm-locate"),
        html.Div(className="vb-panel", children=[
            html.Div(className="vb-bar", children=[
                html.Label("seed" if pairs is None else f"pair (0-{len(pairs) - 1})"),
                dcc.Input(id="seed", type="number", value=seed, min=0, step=1, style={"width": "5em"}),
                html.Button("generate scene" if pairs is None else "show pair", id="generate"),
                dcc.Upload(html.Button("upload image"), id="upload", multiple=False),
                dcc.Upload(html.Button("upload counterfactual"), id="upload-cf", multiple=False),
                html.Label("counterfactual"),
                dcc.Dropdown(list(ctl.conditions), condition, id="cf-condition", clearable=False,
                             style={"width": "200px"}),
            ]),
            html.Div(className="vb-bar", children=[
                html.Label("prompt"), dcc.Input(id="prompt", type="text", value=state["prompt"], debounce=True,
                                                style={"width": "60%"})]),
            html.Div(message, id="message"),
            html.Div(status, id="conditions", className="" if match else "mismatch"),
        ]),
        html.Div(className="vb-panel vb-bar", children=[
            dcc.RadioItems(ACTIONS, "ablate", id="action", inline=True),
            dcc.Dropdown(list(MODES), "image_attention", id="mode", clearable=False, style={"width": "200px"}),
            html.Button("clear heads", id="clear"),
            html.Button("locate", id="locate"),
            html.Button("download CSV", id="download-btn"),
            dcc.Download(id="download"),
            html.Span(id="heads-list"),
        ]),
        html.Div(className="vb-panel vb-bar", children=[
            html.Div(className="vb-images", children=[
                html.Figure([html.Img(id="clean-image", src=_image_src(state["image"])),
                             html.Figcaption("clean input", id="clean-caption")]),
                html.Figure([html.Img(id="cf-image", src=_image_src(state.get("cf_image"))),
                             html.Figcaption(f"counterfactual ({condition})", id="cf-caption")]),
            ]),
            html.Div(id="answer"),
        ]),
        html.Div(className="vb-figs", children=[
            dcc.Loading(dcc.Graph(id="heatmap", config=GRAPH_CONFIG), id="heatmap-loading"),
            dcc.Graph(id="overlay", config=GRAPH_CONFIG),
        ]),
    ])

    @app.callback(Output("input-store", "data"), Output("message", "children"), Output("prompt", "value"),
                  Input("generate", "n_clicks"), Input("upload", "contents"), Input("upload-cf", "contents"),
                  Input("prompt", "value"), Input("cf-condition", "value"), State("upload", "filename"),
                  State("upload-cf", "filename"), State("seed", "value"), State("input-store", "data"),
                  prevent_initial_call=True)
    def on_input(_n: Any, contents: Any, cf_contents: Any, prompt: Any, cf_condition: Any, filename: Any,
                 cf_filename: Any, seed_value: Any, current: Any) -> tuple[Any, str, Any]:
        trigger = dash.ctx.triggered_id
        if trigger == "generate":
            try:
                new, msg = ctl.generate_stimulus(seed_value)
            except InputError as exc:
                return current, str(exc), dash.no_update
            return new, msg, new["prompt"]
        if trigger == "cf-condition":
            with ctl.lock:
                new, msg = ctl.set_condition(cf_condition, current)
            return new, msg, dash.no_update
        if trigger == "upload":
            new, msg = ctl.upload(contents, filename, current, prompt)
            return new, msg, dash.no_update
        if trigger == "upload-cf":
            new, msg = ctl.upload(cf_contents, cf_filename, current, prompt, counterfactual=True)
            return new, msg, dash.no_update
        new = dict(current or {})
        new["prompt"] = prompt or ""
        return new, "prompt updated", dash.no_update

    @app.callback(Output("clean-image", "src"), Output("cf-image", "src"), Output("cf-caption", "children"),
                  Output("conditions", "children"), Output("conditions", "className"),
                  Input("input-store", "data"), Input("scores-store", "data"))
    def on_images(current: Any, store: Any) -> tuple[str, str, str, str, str]:
        current = current or {}
        cf_condition = current.get("cf_condition") or "none"
        expected = current.get("cf_expected")
        caption = f"counterfactual ({cf_condition})" + (f": {expected!r}" if expected else "")
        if not current.get("cf_image"):
            caption = "no counterfactual: generate a scene or upload one"
        text, ok = condition_status(store.get("condition"), cf_condition if cf_condition in ctl.conditions
                                    else ctl.condition)
        if store.get("source") is None:
            text = text.replace("unknown condition scores", "no scores yet (press locate)")
        return (_image_src(current.get("image")), _image_src(current.get("cf_image")), caption, text,
                "" if ok else "mismatch")

    @app.callback(Output("heads-store", "data"), Output("selected-store", "data"), Output("heatmap", "clickData"),
                  Input("heatmap", "clickData"), Input("clear", "n_clicks"), State("heads-store", "data"),
                  State("selected-store", "data"), prevent_initial_call=True)
    def on_click(click: Any, _clear: Any, heads: Any, selected: Any) -> tuple[list[str], Any, None]:
        # clickData is reset after every click: Dash fires only when it changes, so without the reset a second
        # click on the same cell (or a click on the last cell after "clear") would do nothing
        if dash.ctx.triggered_id == "clear":
            return [], selected, None
        if not click:
            return dash.no_update, dash.no_update, dash.no_update
        new, key = ctl.toggle_head(click, heads)
        return new, key or selected, None

    @app.callback(Output("steer-store", "data"), Input("overlay", "clickData"), Input("input-store", "data"),
                  prevent_initial_call=True)
    def on_steer_click(click: Any, _current: Any) -> Any:
        # a new input clears the target; a click on the overlay sets it to the clicked cell's centre
        if dash.ctx.triggered_id != "overlay" or not click or not click.get("points"):
            return None
        point = click["points"][0]
        return [point["x"], point["y"]]

    @app.callback(Output("result-store", "data"), Output("answer", "children"), Output("heads-list", "children"),
                  Input("input-store", "data"), Input("heads-store", "data"), Input("action", "value"),
                  Input("mode", "value"), Input("steer-store", "data"), State("scores-store", "data"))
    def on_answer(current: Any, heads: Any, action: Any, mode: Any, point: Any, store: Any) -> tuple[Any, Any, str]:
        result = ctl.answer(current, heads, action, mode, scores_condition=(store or {}).get("condition"),
                            steer_point=point)
        verb = {"ablate": "ablated", "patch": "patched"}.get(action, "steered")
        where = f" to ({point[0]:.0f}, {point[1]:.0f})" if action == "steer" and point else ""
        listed = f"{verb} heads: {', '.join(heads or []) or 'none'}{where}"
        return {k: v for k, v in result.items() if k != "logits"}, _answer_view(result), listed

    @app.callback(Output("overlay", "figure"), Input("input-store", "data"), Input("selected-store", "data"))
    def on_overlay(current: Any, selected: Any) -> go.Figure:
        return ctl.overlay(current, selected)

    @app.callback(Output("confirm-locate", "displayed"), Output("confirm-locate", "message"),
                  Output("scores-store", "data"), Output("message", "children", allow_duplicate=True),
                  Input("locate", "n_clicks"), Input("confirm-locate", "submit_n_clicks"), State("seed", "value"),
                  State("scores-store", "data"), prevent_initial_call=True)
    def on_locate(_n: Any, _confirmed: Any, seed_value: Any, store: Any) -> tuple[Any, Any, Any, Any]:
        if dash.ctx.triggered_id == "locate" and (store or {}).get("source") == "loaded":
            ask = (f"Replace the loaded {store.get('condition') or ''} scores with {ctl.condition} scores located "
                   f"now on {ctl.n_pairs} pairs? (the loaded file is not changed)")
            return True, ask, dash.no_update, dash.no_update
        try:
            records, msg = ctl.locate(seed_value)
        except InputError as exc:
            return False, dash.no_update, dash.no_update, str(exc)
        return False, dash.no_update, {"records": records, "title": f"{ctl.condition} scores (exact)",
                                       "condition": ctl.condition, "source": "located"}, msg

    @app.callback(Output("heatmap", "figure"), Input("scores-store", "data"), Input("heads-store", "data"))
    def on_heatmap(store: Any, heads: Any) -> go.Figure:
        return ctl.heatmap(store["records"], heads, store["title"])

    @app.callback(Output("download", "data"), Input("download-btn", "n_clicks"), State("scores-store", "data"),
                  prevent_initial_call=True)
    def on_download(_n: Any, store: Any) -> Any:
        return dcc.send_data_frame(pd.DataFrame(store["records"]).to_csv, "scores.csv", index=False)

    app.vlmbind = ctl
    return app
