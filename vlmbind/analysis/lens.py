"""The logit lens over the image grid, and the head lens: which words each image token's residual stream (and each
head's write there) already reads as, layer by layer.

**Logit lens.** For every decoder layer ``l`` the residual stream after it (``blocks.{l}.hook_resid_post``), and the
input of layer 0 (row ``embed``: at image tokens, the projector's output), captured through the engine's hook session
(:meth:`~vlmbind.engine.vlm.VLM.capture`, so open interventions apply), is decoded at every image token as the model
decodes its last layer: the language model's final norm (:meth:`~vlmbind.adapters.base.ModelAdapter.
final_norm_module`), the unembedding (``model.get_output_embeddings()``) and the final logit softcapping the family's
forward applies (:meth:`~vlmbind.adapters.base.ModelAdapter.final_logit_softcap`), then a softmax in float32. So the
last layer's lens at the last position is the model's own next-token distribution (tested on every tiny family).
On a DeepStack family (Qwen3-VL) ``hook_resid_post`` is the layer's output before the injection after it is added.

**Head lens.** Head ``(l, h)``'s write into the residual stream at a position is its slice of the ``o_proj`` input
(``blocks.{l}.attn.hook_z``) through its slice of ``W_O`` and the family's post-norm and gate
(:func:`vlmbind.engine.patching.head_writes` with every other head at zero; ``o_proj``'s bias cancels). Normalisation:
the final norm is applied to the head's write alone (``ln_final(write)``, as nnterp's and TransformerLens' users
decode one component), not with the scale of the full residual stream; with an RMS norm the decoded distribution
then does not depend on the write's size, so ``write_norm`` (its L2 norm) is saved beside it. On a post-norm family
(Gemma-3, PaliGemma 2) the head's ``o_proj`` output also passes through the layer's post-attention norm alone first,
as ``head_writes`` defines a head's write for patching. The head lens is read at
the last prompt token (where the answer is predicted: heads that move image information to the text are read there)
for every head, and at every image token for the heads named (``heads=``) or with ``head_cells=True``.

**Words.** A word's probability is that of the first token of ``" " + word`` (a leading space, as the answers follow
``... and a``), whatever the prompt format. Default words: the colour and shape names of the data set's scenes (the
objects' ``colour`` and ``shape``), one ``p_<word>`` column each.

**Decodable.** An object's colour is decodable at a layer when, averaged over the object's own image tokens (those
whose pixel boxes overlap its box, :meth:`~vlmbind.core.tokens.TokenIndex.positions_covering`, every grid of the
image), the lens probability of its colour word is the highest among the task's colour pool (likewise its shape
among the shape pool). Per layer: the share of objects decodable with a 95% Wilson interval and ``n``, beside chance
(1 / pool size) and the same readout at the image's background tokens (image tokens covering no object, averaged):
is the object's word the pool's top word there? The background readout is one argmax per image, so it can match at
most the objects sharing one colour: ``background_ceiling`` says how high it could go. An object's first decodable
layer is the first row (``embed``, then the layers looked at) where it is decodable.

The simpler explanation of an early layer: the projector may already map a red patch near the unembedding of
``" red"`` (with tied embeddings, near its input embedding), so the colour is read off the image features, not
computed by the language model. The ``embed`` row is that check; a background share as high as the objects' says the
word is on every image token, not bound to the object's own.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.choices import LENS_TASKS as TASKS
from ..core.errors import InputError, NoImageTokensError, close_matches
from ..core.io import json_default, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..core.sites import parse_heads
from ..engine.patching import head_writes
from ..stimuli.core import COLOURS, SHAPES
from ..stimuli.tasks import generate
from ..viz import write_html_atomic
from ..viz.lens import decodable_figure, lens_grid_figure
from .ablation import wilson_interval
from .evaluation import stimulus_defaults

__all__ = ["DECODABLE_RULE", "EMBED", "HEAD_NORMALISATION", "SIMPLER_EXPLANATION", "TASKS", "WORD_RULE", "LensResult",
           "lens", "lens_dataset", "unembed"]

EMBED = "embed"
FEATURES = ("colour", "shape")
HEAD_NORMALISATION = ("the final norm applied to the head's write alone (ln_final(write), then the unembedding), "
                      "not scaled by the full residual stream; write_norm is the write's L2 norm; on post-norm "
                      "families the write is the layer's post-attention norm of the head's o_proj output alone")
WORD_RULE = "a word's probability is that of the first token of ' ' + word (a leading space, as the answers follow)"
DECODABLE_RULE = ("an object's colour (shape) is decodable when its word has the highest lens probability among the "
                  "task's colour (shape) pool, the probabilities averaged over the object's own image tokens (boxes "
                  "overlapping the object's); background: the same readout averaged over the image tokens covering "
                  "no object")
SIMPLER_EXPLANATION = ("an early decodable layer need not mean the language model computed the word: the projector "
                       "may already map the object's patches near the word's unembedding (the 'embed' row, the "
                       "projector output decoded, checks this), and a background share as high as the objects' says "
                       "the word is on every image token rather than bound to the object's own")
# logits of at most this many floats are held at once when decoding (positions are chunked to fit)
_DECODE_FLOATS = 1 << 25
_LENS_TEXT = ("example", "layer", "grid", "top_token", "objects")
_HEAD_TEXT = ("example", "where", "grid", "top_token")
_OBJECT_TEXT = ("example", "colour", "shape", "first_colour_layer", "first_shape_layer")


# ----------------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------------
def _device_of(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return fallback


def unembed(vlm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``... V`` float32 logits of residual-stream vectors ``... d_model`` decoded as the model decodes its last layer:
    the final norm, the unembedding and the family's final logit softcapping."""
    adapter = vlm.adapter
    norm, head = adapter.final_norm_module(), vlm.model.get_output_embeddings()
    with torch.no_grad():
        x = norm(hidden.to(_device_of(norm, vlm.device), next(head.parameters()).dtype))
        logits = head(x.to(_device_of(head, vlm.device))).float()
    cap = adapter.final_logit_softcap()
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _decoded(vlm: Any, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n d_model`` residual vectors -> (top token id ``n``, its probability ``n``, probabilities of ``ids``
    ``n len(ids)``), decoded in chunks of positions so that no more than ``_DECODE_FLOATS`` logits are held."""
    n = hidden.shape[0]
    vocab = vlm.model.get_output_embeddings().weight.shape[0]
    step = max(1, _DECODE_FLOATS // max(vocab, 1))
    tops, top_probs, word_probs = [], [], []
    for lo in range(0, n, step):
        probs = torch.softmax(unembed(vlm, hidden[lo : lo + step]), -1)
        best = probs.max(-1)
        tops.append(best.indices.cpu())
        top_probs.append(best.values.cpu())
        word_probs.append(probs[:, ids.to(probs.device)].cpu())
    if not tops:
        return np.zeros(0, int), np.zeros(0), np.zeros((0, len(ids)))
    return (torch.cat(tops).numpy().astype(np.int64), torch.cat(top_probs).double().numpy(),
            torch.cat(word_probs).double().numpy())


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------
def _check_layers(vlm: Any, layers: Sequence[int] | None) -> list[int]:
    if layers is None:
        return list(range(vlm.n_layers))
    values = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
    if not values or any(isinstance(l, bool) or not isinstance(l, (int, np.integer)) for l in values):
        raise InputError(f"layers must be a non-empty list of layer numbers, got {layers!r}")
    out = sorted({int(l) for l in values})
    bad = [l for l in out if not 0 <= l < vlm.n_layers]
    if bad:
        raise InputError(f"layers {bad} are outside the model's {vlm.n_layers} layers (0..{vlm.n_layers - 1})")
    return out


def _check_heads(vlm: Any, heads: Any, layers: list[int]) -> tuple[list[tuple[int, int]], bool]:
    """The heads to read (``(layer, head)``) and whether they were named."""
    adapter = vlm.adapter
    if heads is None:
        # a head's write alone needs a fixed gate, which hyper-connections (Qwen4-Exp: write_sources) do not give
        with_heads = {l for l in adapter.head_layers() if not adapter.write_sources(l, "attn")}
        return [(l, h) for l in layers if l in with_heads for h in range(vlm.n_heads)], False
    pairs = sorted(set(parse_heads(heads)))
    if not pairs:
        raise InputError("heads names no head: pass LAYER.HEAD labels, e.g. '3.1,5.2'")
    bad = [f"{l}.{h}" for l, h in pairs if not (0 <= l < vlm.n_layers and 0 <= h < vlm.n_heads)]
    if bad:
        raise InputError(f"heads {bad} are outside the model's {vlm.n_layers} layers x {vlm.n_heads} heads")
    absent = adapter.absent_sites()
    for layer in sorted({l for l, _ in pairs}):
        error = absent.get(adapter.z_site(layer))
        if error is not None:
            raise type(error)(f"no head lens for layer {layer}: {error}")
    return pairs, True


def _check_words(words: Any) -> list[str] | None:
    if words is None:
        return None
    if isinstance(words, str):
        words = [w for w in words.split(",")]
    words = [w.strip() if isinstance(w, str) else w for w in words]
    bad = [w for w in words if not isinstance(w, str) or not w]
    if bad or not words:
        raise InputError(f"words must be non-empty strings, e.g. 'red,square'; got {list(words)!r}")
    if len(set(words)) != len(words):
        raise InputError(f"words repeat in {words}")
    return list(words)


def _pool(name: str, given: Any, params: dict[str, Any], default: Sequence[str], seen: list[str]) -> list[str]:
    pool = list(given) if given is not None else list(params.get(name) or default)
    if len(set(pool)) != len(pool) or not pool:
        raise InputError(f"the {name} pool must be distinct words, got {pool}")
    missing = sorted(set(seen) - set(pool))
    if missing:
        raise InputError(f"objects' {name} {missing} are not in the {name} pool {pool}; pass {name}=... holding "
                         "every object's")
    return pool


def _first_ids(vlm: Any, words: Sequence[str]) -> list[int]:
    """The first token id of ``" " + word`` for each word (:data:`WORD_RULE`)."""
    return [vlm.answer_ids(w, chat=False)[0] for w in words]


def _check_distinct(pool: list[str], ids: list[int], name: str) -> None:
    firsts: dict[int, str] = {}
    for word, i in zip(pool, ids):
        if i in firsts:
            raise InputError(f"{name} {firsts[i]!r} and {word!r} begin with the same token ({i}): their lens "
                             f"probabilities are one number; pass a {name} pool whose words begin differently")
        firsts[i] = word


# ----------------------------------------------------------------------------------------------------------------
# Stimuli
# ----------------------------------------------------------------------------------------------------------------
def lens_dataset(vlm: Any, task: str, n: int, seed: int = 1) -> Any:
    """``n`` examples of the ``scene`` or ``query`` task drawn with the model's training defaults (an organism's
    canvas and pools; other models: the family's typical image size).

    Raises:
        InputError: an unknown task; StimulusError: impossible stimulus parameters.
    """
    if task not in TASKS:
        raise InputError(f"lens reads colour and shape words: task must be one of {TASKS}, got {task!r}."
                         f"{close_matches(str(task), TASKS)}")
    kwargs, _ = stimulus_defaults(vlm, task, {})
    return generate(task, n, seed, kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------------------------------
def _read_csv(path: Path, columns: tuple[str, ...], text: tuple[str, ...],
              floats: tuple[str, ...] = ()) -> pd.DataFrame:
    """A CSV this module wrote: ``text`` columns kept verbatim (a token ``"null"`` or ``""`` is text, not NaN), only
    ``floats`` may be empty (NaN), the other floats parsed exactly as written."""
    return read_csv_columns(path, columns, "lens table", text_columns=text, nullable=floats)


def _interval(successes: int, n: int) -> tuple[float, float, float]:
    """``(share, low, high)`` with the 95% Wilson interval; NaNs for ``n == 0``."""
    if n == 0:
        return math.nan, math.nan, math.nan
    share = successes / n
    lo, hi = wilson_interval(share, n)
    return share, lo, hi


@register_result
@dataclass
class LensResult(Result):
    """The logit lens over the image grid and the head lens of one model on one data set.

    Attributes:
        model: the model's name.
        task: the stimulus task.
        cells: ``lens.csv``: one row per example, layer (``embed``, ``0``, ...) and image cell: ``example, layer,
            grid, row, col, position, objects`` (``;``-joined indices of the objects whose boxes the cell overlaps,
            empty for background), ``top_token, top_id, top_prob`` and one ``p_<word>`` column per word.
        decodable: ``decodable.csv``: per layer and feature (``colour`` / ``shape``): ``share, low, high, n`` of
            objects decodable at their own tokens, ``chance``, and ``background_share, background_low,
            background_high, background_n, background_ceiling`` (see the module docstring).
        heads: ``head_lens.csv``: one row per example, head and position read (``where``: ``last`` or ``image``):
            ``example, layer, head, where, grid, row, col, position`` (``row = col = -1`` and ``grid`` empty at the
            last token), ``top_token, top_id, top_prob, write_norm, p_answer`` and the ``p_<word>`` columns.
        objects: ``objects.csv``: per object: ``example, object, colour, shape, n_tokens`` and its first decodable
            layer for each feature (empty: never).
        meta: what ``summary.json`` holds besides the tables' numbers (words and their token ids, pools, layers,
            conventions, timings).
    """

    kind = "lens"
    reproduced_files = ("lens.csv", "decodable.csv", "head_lens.csv", "objects.csv", "lens.html", "decodable.html")
    marker_files = ("lens.csv", "decodable.csv")

    model: str
    task: str
    cells: pd.DataFrame
    decodable: pd.DataFrame
    heads: pd.DataFrame
    objects: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- views ------------------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[str]:
        """The rows decoded, in order: ``embed``, then the decoder layers looked at (as strings)."""
        return list(self.meta["layers"])

    @property
    def words(self) -> list[str]:
        return list(self.meta["words"])

    def to_frame(self) -> pd.DataFrame:
        """The per-layer decodability table (``decodable.csv``)."""
        return self.decodable.copy()

    def first_layer(self, feature: str = "colour", against: str = "chance") -> str | None:
        """The first row whose share's 95% lower bound exceeds ``chance`` (or, with ``against="background"``, also
        the background share's upper bound); None when none does."""
        rows = self.decodable[self.decodable["feature"] == feature]
        for _, r in rows.iterrows():
            bar = r["chance"]
            if against == "background" and np.isfinite(r["background_high"]):
                bar = max(bar, r["background_high"])
            if np.isfinite(r["low"]) and r["low"] > bar:
                return str(r["layer"])
        return None

    def summary(self) -> dict[str, Any]:
        share = {f: [{"layer": str(r["layer"]), "share": r["share"], "low": r["low"], "high": r["high"],
                      "n": int(r["n"]), "background_share": r["background_share"],
                      "background_low": r["background_low"], "background_high": r["background_high"]}
                     for _, r in self.decodable[self.decodable["feature"] == f].iterrows()] for f in FEATURES}
        firsts = {f: {"above_chance": self.first_layer(f), "above_background": self.first_layer(f, "background")}
                  for f in FEATURES}
        return {"model": self.model, "task": self.task, **self.meta, "decodable": share, "first_layer": firsts}

    # ---- figures ------------------------------------------------------------------------------------------------
    def figure(self, example: str | int | None = None, words: Sequence[str] | None = None) -> Any:
        """The image grid of one example (default: the first) per layer (slider), one panel per word (default: the
        example's own colour and shape words), coloured by the word's lens probability, the top token written in
        each cell."""
        ids = list(dict.fromkeys(self.cells["example"]))
        if not ids:
            raise InputError("this lens result holds no image cell")
        if example is None:
            example = ids[0]
        elif isinstance(example, int) and not isinstance(example, bool):
            if not 0 <= example < len(ids):
                raise InputError(f"example {example} is out of range; this result has examples 0..{len(ids) - 1}")
            example = ids[example]
        if example not in ids:
            raise InputError(f"no example {example!r} in this result.{close_matches(str(example), ids)}")
        grid = self.meta.get("figure_grid")
        rows = self.cells[(self.cells["example"] == example) & (self.cells["grid"] == grid)]
        mine = self.objects[self.objects["example"] == example]
        if words is None:
            own = [*mine["colour"], *mine["shape"]]
            words = [w for w in dict.fromkeys(own) if w in self.words] or self.words[:4]
        unknown = [w for w in words if w not in self.words]
        if unknown:
            raise InputError(f"words {unknown} were not decoded; this result has {self.words}")
        names = {int(o): f"{c} {s}" for o, c, s in zip(mine["object"], mine["colour"], mine["shape"])}
        return lens_grid_figure(rows, words=list(words), layers=self.layers, example=str(example), grid=str(grid),
                                object_names=names, model=self.model)

    def decodable_figure(self) -> Any:
        """Share of objects decodable per layer (95% Wilson intervals, n) beside background tokens and chance."""
        return decodable_figure(self.decodable, layers=self.layers, model=self.model, task=self.task)

    def exports(self) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
        return ({"lens": self.figure, "decodable": self.decodable_figure},
                {"lens.csv": self.cells, "decodable.csv": self.decodable, "head_lens.csv": self.heads,
                 "objects.csv": self.objects})

    # ---- files -------------------------------------------------------------------------------------------------
    def save(self, out: str | os.PathLike) -> Path:
        """Write ``lens.csv``, ``decodable.csv``, ``head_lens.csv``, ``objects.csv``, ``lens.html``,
        ``decodable.html`` and ``summary.json`` atomically."""
        out = Path(out)
        for name, frame in (("lens.csv", self.cells), ("decodable.csv", self.decodable),
                            ("head_lens.csv", self.heads), ("objects.csv", self.objects)):
            # every text field quoted: a token holding a bare carriage return would otherwise end the row
            write_text_atomic(frame.to_csv(index=False, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC), out / name)
        write_html_atomic(self.figure(), out / "lens.html")
        write_html_atomic(self.decodable_figure(), out / "decodable.html")
        write_text_atomic(json.dumps(self.summary(), indent=2, default=json_default) + "\n", out / "summary.json")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> LensResult:
        """The result from its files (``summary.json`` for the words, layers and conventions).

        Raises:
            InputError: a file is missing, unreadable or lacks what vlmbind lens writes.
        """
        directory = Path(directory)
        summary = read_json_object(directory / "summary.json")
        require_keys(summary, ("model", "task", "layers", "words"), directory / "summary.json")
        words = [f"p_{w}" for w in summary["words"]]
        cells = _read_csv(directory / "lens.csv", ("example", "layer", "grid", "row", "col", "position", "objects",
                                                   "top_token", "top_id", "top_prob", *words), _LENS_TEXT)
        decodable = _read_csv(directory / "decodable.csv", tuple(_DECODABLE_COLUMNS), ("layer", "feature"),
                              tuple(c for c in _DECODABLE_COLUMNS if c not in ("layer", "feature", "n",
                                                                               "background_n")))
        heads = _read_csv(directory / "head_lens.csv", tuple(_HEAD_COLUMNS) + tuple(words), _HEAD_TEXT, ("p_answer",))
        objects = _read_csv(directory / "objects.csv", tuple(_OBJECT_COLUMNS), _OBJECT_TEXT)
        meta = {k: v for k, v in summary.items() if k not in ("model", "task", "decodable", "first_layer")}
        return cls(model=summary["model"], task=summary["task"], cells=cells, decodable=decodable, heads=heads,
                   objects=objects, meta=meta)


_DECODABLE_COLUMNS = ("layer", "feature", "share", "low", "high", "n", "chance", "background_share", "background_low",
                      "background_high", "background_n", "background_ceiling")
_HEAD_COLUMNS = ("example", "layer", "head", "where", "grid", "row", "col", "position", "top_token", "top_id",
                 "top_prob", "write_norm", "p_answer")
_OBJECT_COLUMNS = ("example", "object", "colour", "shape", "n_tokens", "first_colour_layer", "first_shape_layer")


# ----------------------------------------------------------------------------------------------------------------
# lens
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class _Cells:
    """The image cells of one example: per cell its grid, row, col, position and the objects it overlaps."""

    grid: list[str]
    row: list[int]
    col: list[int]
    position: np.ndarray
    objects: list[str]
    object_positions: list[np.ndarray]
    background: np.ndarray


def _cells(index: Any, objects: Sequence[Any]) -> _Cells:
    grids = [g for g in index.grids if g.image == 0]
    grid, row, col, position = [], [], [], []
    for g in grids:
        rows, cols = g.shape
        for i in range(rows):
            for j in range(cols):
                grid.append(g.name)
                row.append(i)
                col.append(j)
                position.append(int(g.positions[i, j]))
    covering = [index.positions_covering(tuple(o.box), image=0) for o in objects]
    owners: dict[int, list[str]] = {}
    for k, positions in enumerate(covering):
        for p in positions.tolist():
            owners.setdefault(int(p), []).append(str(k))
    pos = np.asarray(position, dtype=np.int64)
    background = np.asarray([p for p in position if p not in owners], dtype=np.int64)
    return _Cells(grid, row, col, pos, [";".join(owners.get(p, [])) for p in position], covering, background)


def _readout(probs: np.ndarray, where: np.ndarray, pool: slice) -> int | None:
    """The index (within the pool) of the pool word with the highest mean probability over the cells ``where``."""
    if where.size == 0:
        return None
    return int(np.argmax(probs[where][:, pool].mean(0)))


def lens(vlm: Any, dataset: Any, *, layers: Sequence[int] | None = None, words: Any = None, heads: Any = None,
         head_cells: bool | None = None, colours: Sequence[str] | None = None, shapes: Sequence[str] | None = None,
         batch_size: int = 8, progress: bool = False) -> LensResult:
    """The logit lens over every image token and the head lens (see the module docstring).

    Args:
        vlm: a loaded VLM (its open interventions apply).
        dataset: a :class:`~vlmbind.stimuli.Dataset` (e.g. :func:`lens_dataset`) or a list of examples, each with
            one image and ``objects`` (``box``, ``colour``, ``shape``).
        layers: decoder layers to decode after (default: all); the ``embed`` row is always read.
        words: the words whose probabilities are saved (default: every colour and shape of the data set's objects).
        heads: heads for the head lens, ``"3.1,5.2"`` or ``[(3, 1), ...]`` (default: every head of the layers
            looked at, at the last token only; none on a family whose head writes need the run's hyper-connection
            weights, Qwen4-Exp, where naming one raises UnsupportedModelError).
        head_cells: also read the heads at every image token (default: when ``heads`` are named).
        colours, shapes: the pools decodability is judged among (default: the data set's ``params``, else all).
        batch_size: examples run together.
        progress: show a progress bar.

    Returns:
        A :class:`LensResult`.

    Raises:
        NoImageTokensError: the model's image never enters the sequence (Llama-3.2-Vision's cross-attention).
        HeadLayoutError: a named head in a layer without per-head outputs (Qwen3.5's linear attention).
        InputError: bad layers, heads, words or pools, examples without objects, or two pool words beginning with
            the same token.
    """
    start = time.perf_counter()
    adapter = vlm.adapter
    if not adapter.image_tokens_in_sequence:
        raise NoImageTokensError(
            f"the logit lens over the image grid reads image tokens of the language model's sequence, and "
            f"{adapter.display_name} has none: its image reaches the language model only as cross-attention keys")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
    layers = _check_layers(vlm, layers)
    head_list, named = _check_heads(vlm, heads, layers)
    head_cells = named if head_cells is None else bool(head_cells)
    words = _check_words(words)
    examples = list(dataset)
    if not examples:
        raise InputError("the data set is empty: nothing to decode")
    empty = [e.id for e in examples if not getattr(e, "objects", None)]
    if empty:
        raise InputError(f"example {empty[0]!r} has no objects: the lens reads objects' colour and shape words")
    params = getattr(dataset, "params", {}) or {}
    colour_pool = _pool("colours", colours, params, tuple(COLOURS), [o.colour for e in examples for o in e.objects])
    shape_pool = _pool("shapes", shapes, params, SHAPES, [o.shape for e in examples for o in e.objects])
    if words is None:
        seen = {w for e in examples for o in e.objects for w in (o.colour, o.shape)}
        words = [w for w in (*colour_pool, *shape_pool) if w in seen]
    colour_ids, shape_ids, word_ids = (_first_ids(vlm, p) for p in (colour_pool, shape_pool, words))
    _check_distinct(colour_pool, colour_ids, "colours")
    _check_distinct(shape_pool, shape_ids, "shapes")
    # the probabilities kept per cell: the pools' first tokens, then the words' (the head lens adds the answer's)
    ids = [*colour_ids, *shape_ids, *word_ids]
    pools = {"colour": slice(0, len(colour_ids)), "shape": slice(len(colour_ids), len(colour_ids) + len(shape_ids))}
    word_cols = slice(len(colour_ids) + len(shape_ids), len(ids))
    labels = [EMBED, *(str(l) for l in layers)]
    sites = ["blocks.0.hook_resid_pre", *(f"blocks.{l}.hook_resid_post" for l in layers)]
    head_layers = sorted({l for l, _ in head_list})
    z_sites = [adapter.z_site(l) for l in head_layers]
    chat = vlm.active_prompt_format == "chat"

    lens_rows: list[pd.DataFrame] = []
    head_rows: list[pd.DataFrame] = []
    object_rows: list[dict[str, Any]] = []
    hits = {f: [] for f in FEATURES}  # per object: L+1 bools
    background = {f: [] for f in FEATURES}  # per object: L+1 bools, or None without background cells
    ceiling = {f: [0, 0] for f in FEATURES}  # (most objects one argmax per image can match, objects with background)
    head_hits = {(l, h, f): [] for l, h in head_list for f in FEATURES} if head_cells else {}
    figure_grid = None
    bar = tqdm(total=len(examples), desc="lens", disable=not progress)
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo : lo + batch_size]
        batch = vlm.prepare([e.image for e in chunk], [e.prompt for e in chunk])
        cache = vlm.capture(batch, [*sites, *z_sites])
        for r, e in enumerate(chunk):
            index = batch.index[r]
            cells = _cells(index, e.objects)
            if figure_grid is None and cells.grid:
                figure_grid = cells.grid[0]
            where = {p: k for k, p in enumerate(cells.position.tolist())}
            own = [np.asarray([where[p] for p in ps.tolist() if p in where], dtype=np.int64)
                   for ps in cells.object_positions]
            bg = np.asarray([where[p] for p in cells.background.tolist()], dtype=np.int64)
            answer = vlm.answer_ids(e.answer, chat)[0] if getattr(e, "answer", None) else None
            pos = torch.as_tensor(cells.position, device=cache[sites[0]].device)
            per_object = {f: np.zeros((len(e.objects), len(labels)), bool) for f in FEATURES}
            per_bg = {f: np.zeros((len(e.objects), len(labels)), bool) for f in FEATURES}
            for d, site in enumerate(sites):
                top, top_p, probs = _decoded(vlm, cache[site][r, pos], torch.as_tensor(ids))
                frame = pd.DataFrame({
                    "example": e.id, "layer": labels[d], "grid": cells.grid, "row": cells.row, "col": cells.col,
                    "position": cells.position, "objects": cells.objects,
                    "top_token": [adapter.tokenizer.decode([t]) for t in top.tolist()], "top_id": top,
                    "top_prob": top_p})
                for k, w in enumerate(words):
                    frame[f"p_{w}"] = probs[:, word_cols][:, k]
                lens_rows.append(frame)
                for f in FEATURES:
                    pool = colour_pool if f == "colour" else shape_pool
                    for k, o in enumerate(e.objects):
                        target = pool.index(getattr(o, f))
                        per_object[f][k, d] = _readout(probs, own[k], pools[f]) == target
                        per_bg[f][k, d] = _readout(probs, bg, pools[f]) == target
            for f in FEATURES:
                for k in range(len(e.objects)):
                    if own[k].size:
                        hits[f].append(per_object[f][k])
                        background[f].append(per_bg[f][k] if bg.size else None)
                values = [getattr(o, f) for k, o in enumerate(e.objects) if own[k].size]
                if bg.size and values:
                    ceiling[f][0] += max(values.count(v) for v in set(values))
                    ceiling[f][1] += len(values)
            for k, o in enumerate(e.objects):
                first = {f: next((labels[d] for d in range(len(labels)) if per_object[f][k, d]), "")
                         for f in FEATURES}
                object_rows.append({"example": e.id, "object": k, "colour": o.colour, "shape": o.shape,
                                    "n_tokens": int(own[k].size),
                                    "first_colour_layer": first["colour"] if own[k].size else "",
                                    "first_shape_layer": first["shape"] if own[k].size else ""})
            if head_list:
                head_rows += _head_lens(vlm, cache, r, e, index, cells, head_list, head_cells, ids, words, word_cols,
                                        answer, own, pools, colour_pool, shape_pool, head_hits)
        bar.update(len(chunk))
    bar.close()

    decodable = []
    for f in FEATURES:
        pool = colour_pool if f == "colour" else shape_pool
        got = np.asarray(hits[f], bool).reshape(-1, len(labels))
        bgs = [b for b in background[f] if b is not None]
        bg_got = np.asarray(bgs, bool).reshape(-1, len(labels))
        ceil = ceiling[f][0] / ceiling[f][1] if ceiling[f][1] else math.nan
        for d, label in enumerate(labels):
            share, low, high = _interval(int(got[:, d].sum()), len(got))
            b_share, b_low, b_high = _interval(int(bg_got[:, d].sum()), len(bg_got))
            decodable.append({"layer": label, "feature": f, "share": share, "low": low, "high": high, "n": len(got),
                              "chance": 1.0 / len(pool), "background_share": b_share, "background_low": b_low,
                              "background_high": b_high, "background_n": len(bg_got), "background_ceiling": ceil})
    word_columns = [f"p_{w}" for w in words]
    cells_frame = (pd.concat(lens_rows, ignore_index=True) if lens_rows else
                   pd.DataFrame(columns=[*_LENS_COLUMNS, *word_columns]))
    heads_frame = (pd.concat(head_rows, ignore_index=True) if head_rows else
                   pd.DataFrame(columns=[*_HEAD_COLUMNS, *word_columns]))
    head_decodable = []
    for (l, h, f), rows in head_hits.items():
        share, low, high = _interval(int(np.sum(rows)), len(rows))
        head_decodable.append({"layer": l, "head": h, "feature": f, "share": share, "low": low, "high": high,
                               "n": len(rows)})
    head = vlm.model.get_output_embeddings().weight
    meta = {
        "n_examples": len(examples), "n_objects": len(hits["colour"]), "layers": labels, "words": words,
        "word_token_ids": dict(zip(words, word_ids)), "colours": colour_pool, "shapes": shape_pool,
        "colour_token_ids": dict(zip(colour_pool, colour_ids)), "shape_token_ids": dict(zip(shape_pool, shape_ids)),
        "figure_grid": figure_grid, "heads": [f"{l}.{h}" for l, h in head_list], "head_cells": head_cells,
        "head_decodable": head_decodable, "word_rule": WORD_RULE, "decodable_rule": DECODABLE_RULE,
        "head_normalisation": HEAD_NORMALISATION, "simpler_explanation": SIMPLER_EXPLANATION,
        "embed_row": "the input of layer 0 (blocks.0.hook_resid_pre): at image tokens, the projector's output",
        "final_norm": type(adapter.final_norm_module()).__name__, "final_logit_softcap": adapter.final_logit_softcap(),
        "tied_embeddings": bool(head.data_ptr() == vlm.model.get_input_embeddings().weight.data_ptr()),
        "prompt_format": vlm.active_prompt_format, "seconds": time.perf_counter() - start,
    }
    return LensResult(model=vlm.name, task=str(examples[0].task), cells=cells_frame,
                      decodable=pd.DataFrame(decodable, columns=list(_DECODABLE_COLUMNS)), heads=heads_frame,
                      objects=pd.DataFrame(object_rows, columns=list(_OBJECT_COLUMNS)), meta=meta)


_LENS_COLUMNS = ("example", "layer", "grid", "row", "col", "position", "objects", "top_token", "top_id", "top_prob")


def _head_lens(vlm: Any, cache: dict[str, torch.Tensor], r: int, example: Any, index: Any, cells: _Cells,
               head_list: list[tuple[int, int]], head_cells: bool, ids: list[int], words: list[str],
               word_cols: slice, answer: int | None, own: list[np.ndarray], pools: dict[str, slice],
               colour_pool: list[str], shape_pool: list[str],
               head_hits: dict[tuple[int, int, str], list[bool]]) -> list[pd.DataFrame]:
    """The head lens of one example: each head's write alone, decoded at the last token (and the image cells)."""
    adapter = vlm.adapter
    last = index.last_position
    positions = np.concatenate([[last], cells.position]) if head_cells else np.asarray([last])
    n_img = positions.size - 1
    where = ["last", *(["image"] * n_img)]
    grid = ["", *cells.grid] if head_cells else [""]
    row = [-1, *cells.row] if head_cells else [-1]
    col = [-1, *cells.col] if head_cells else [-1]
    all_ids = torch.as_tensor([*ids, answer if answer is not None else 0])
    out = []
    by_layer: dict[int, list[int]] = {}
    for l, h in head_list:
        by_layer.setdefault(l, []).append(h)
    for layer, hs in by_layer.items():
        captured = cache[adapter.z_site(layer)]
        z = captured[r, torch.as_tensor(positions, device=captured.device)]  # n H D
        with torch.no_grad():
            writes = head_writes(vlm, layer, torch.zeros_like(z), z)  # H n d_model
        for h in hs:
            top, top_p, probs = _decoded(vlm, writes[h], all_ids)
            frame = pd.DataFrame({
                "example": example.id, "layer": layer, "head": h, "where": where, "grid": grid, "row": row,
                "col": col, "position": positions.astype(np.int64),
                "top_token": [adapter.tokenizer.decode([t]) for t in top.tolist()], "top_id": top, "top_prob": top_p,
                "write_norm": writes[h].float().norm(dim=-1).double().cpu().numpy(),
                "p_answer": probs[:, -1] if answer is not None else np.nan})
            for k, w in enumerate(words):
                frame[f"p_{w}"] = probs[:, word_cols][:, k]
            out.append(frame)
            if head_cells:
                image_probs = probs[1:]
                for f in FEATURES:
                    pool = colour_pool if f == "colour" else shape_pool
                    for k, o in enumerate(example.objects):
                        if own[k].size:
                            hit = _readout(image_probs, own[k], pools[f]) == pool.index(getattr(o, f))
                            head_hits[(layer, h, f)].append(bool(hit))
    return out
