"""Checks the family test files (test_family_*.py beside it) share: pushed patch tasks and exact == naive, painting a
cell under a silenced vision tower, chat prompts that keep the plain prompt's grids, and refusals of a processor or
config setting the adapter cannot place. Each family file keeps its own hand-computed expectations and asserts them
on what these return."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import PROMPT, draw_scene, silenced_vision_attention
from PIL import Image, ImageDraw

import vlmbind as vb
from vlmbind.analysis.mediation import scene_task
from vlmbind.core.errors import UnsupportedModelError
from vlmbind.engine.patching import PatchTask, exact_diffs, naive_diffs

# one head in every layer of a 4-layer tiny model
HEADS = ((0, 1), (1, 2), (2, 0), (3, 3))
# the default layout, then packed and batched runs cut small enough to need several passes
LAYOUTS = ({}, {"layout": "packed", "max_tokens": 5}, {"layout": "batched", "max_rows": 3})
MAGENTA = (255, 0, 255)
RESID0 = "blocks.0.hook_resid_pre"


# ---- exact == naive -----------------------------------------------------------------------------------------------
def pushed(task: PatchTask, seed: int = 0) -> PatchTask:
    """The task with its counterfactual z pushed far from the clean one, so head effects are well above float error."""
    gen = torch.Generator().manual_seed(seed)
    return replace(task, values={l: v + 30.0 * v.std() * torch.randn(v.shape, generator=gen)
                                 for l, v in task.values.items()})


def pushed_scene_task(vlm: vb.VLM, condition: str) -> PatchTask:
    """The first 3-object scene pair of ``condition`` as a task on every layer, pushed."""
    pair = vb.stimuli.scene_pairs(1, condition, 0, n_objects=3)[0]
    return pushed(scene_task(vlm, pair, range(vlm.n_layers)))


def assert_exact_equals_naive(vlm: vb.VLM, task: PatchTask, heads: Sequence[tuple[int, int]] = HEADS,
                              layouts: Sequence[dict[str, Any]] = LAYOUTS) -> np.ndarray:
    """``exact_diffs`` in each of ``layouts`` (keyword arguments) equals ``naive_diffs``: the same clean score and
    the same head effects, to 1e-4 of their spread; the effects must be large enough to mean anything. Returns the
    naive effects."""
    heads = list(heads)
    clean, naive = naive_diffs(vlm, task, heads)
    effects = naive - clean
    assert np.abs(effects).max() > 2e-3, "effects too small for the comparison to mean anything"
    for kwargs in layouts:
        c, exact = exact_diffs(vlm, task, heads, **kwargs)
        assert c == pytest.approx(clean, abs=1e-5)
        np.testing.assert_allclose(exact - c, effects, atol=1e-4 * np.ptp(effects) + 1e-6, err_msg=str(kwargs))
    return effects


def check_exact_equals_naive(vlm: vb.VLM, condition: str, heads: Sequence[tuple[int, int]] = HEADS,
                             layouts: Sequence[dict[str, Any]] = LAYOUTS) -> PatchTask:
    """:func:`assert_exact_equals_naive` on :func:`pushed_scene_task`; returns the task for the caller's checks of
    where it patches."""
    task = pushed_scene_task(vlm, condition)
    assert_exact_equals_naive(vlm, task, heads, layouts)
    return task


# ---- painting one cell is local -----------------------------------------------------------------------------------
def inner_box(box: Sequence[float], margin: float = 0.3) -> tuple[float, float, float, float]:
    """``box`` shrunk by ``margin`` of its width and height on every side (resampling kernels reach a few pixels
    past a box edge)."""
    x0, y0, x1, y1 = box
    mx, my = margin * (x1 - x0), margin * (y1 - y0)
    return (x0 + mx, y0 + my, x1 - mx, y1 - my)


def paint(image: Image.Image, box: Sequence[float], fill: tuple[int, int, int] = MAGENTA) -> Image.Image:
    """A copy of ``image`` with the whole pixels inside ``box`` (``x0 y0 x1 y1``, ends excluded) painted ``fill``."""
    painted = image.copy()
    ImageDraw.Draw(painted).rectangle(
        [int(np.ceil(box[0])), int(np.ceil(box[1])), int(np.floor(box[2])) - 1, int(np.floor(box[3])) - 1],
        fill=fill,
    )
    return painted


def changed_positions(vlm: vb.VLM, clean: vb.Batch, painted: vb.Batch, sites: Sequence[str] = (RESID0,),
                      record: Callable[[], Any] | None = None) -> tuple[dict[str, np.ndarray], list]:
    """With the vision tower's attention silenced, the positions of row 0 where each site's activations of
    ``painted`` differ from ``clean``'s (by more than 1e-6), and what ``record()`` (a context manager entered around
    each of the two runs) gave, clean first."""
    sites = list(sites)
    outs, recorded = [], []
    with silenced_vision_attention(vlm):
        for batch in (clean, painted):
            with (record() if record is not None else contextlib.nullcontext()) as r:
                outs.append(vlm.capture(batch, sites))
            recorded.append(r)
    changed = {s: np.flatnonzero((outs[0][s][0] - outs[1][s][0]).abs().amax(-1).numpy() > 1e-6) for s in sites}
    return changed, recorded


@dataclass
class PaintedCell:
    index: Any  # the clean image's TokenIndex
    box: tuple[float, float, float, float]  # the painted box, in original pixels
    expected: np.ndarray  # ``index.positions_covering(box)``
    changed: np.ndarray  # the changed positions at the first site
    changed_at: dict[str, np.ndarray]  # ... at each site
    recorded: list  # what ``record()`` gave around the clean and the painted run
    position: int  # the painted cell's own position


def painted_cell_changes(vlm: vb.VLM, image: Image.Image, grid: str | None, cell: tuple[int, int],
                         sites: Sequence[str] = (RESID0,), record: Callable[[], Any] | None = None,
                         fill: tuple[int, int, int] = MAGENTA) -> PaintedCell:
    """Paint the middle of ``cell``'s box of ``grid`` (30% margins; ``None``: the image's only grid) and compare the
    runs of the clean and the painted image with the tower's attention silenced (:func:`changed_positions`)."""
    clean = vlm.prepare(image, PROMPT)
    ti = clean.index[0]
    g = ti.grid() if grid is None else ti.grid(grid)
    box = inner_box(g.boxes[cell])
    changed, recorded = changed_positions(vlm, clean, vlm.prepare(paint(image, box, fill), PROMPT), sites, record)
    return PaintedCell(index=ti, box=box, expected=ti.positions_covering(box), changed=changed[list(sites)[0]],
                       changed_at=changed, recorded=recorded, position=int(g.positions[cell]))


def assert_painting_is_local(vlm: vb.VLM, image: Image.Image, grid: str, cell: tuple[int, int]) -> None:
    """Painting a cell changes exactly the positions covering the paint, the cell's own among them."""
    p = painted_cell_changes(vlm, image, grid, cell)
    ti = p.index
    assert len(p.expected) >= 1 and ti.cell(int(ti.grid(grid).positions[cell]))[:2] == (grid, 0)
    np.testing.assert_array_equal(p.changed, p.expected)


# ---- prompts and refusals -----------------------------------------------------------------------------------------
def check_chat_grids(vlm: vb.VLM, grid_name: str, starts: str, ends: str) -> None:
    """The chat prompt has the plain prompt's grids (names and shapes), starts with ``starts``, ends with ``ends``,
    and its image positions are the plain prompt's shifted by where ``grid_name`` moved."""
    plain = vlm.prepare(draw_scene(0), PROMPT).index[0]
    chat = vlm.prepare(draw_scene(0), PROMPT, chat=True).index[0]
    assert [(g.name, g.shape) for g in chat.grids] == [(g.name, g.shape) for g in plain.grids]
    text = vlm.adapter.tokenizer.decode(chat.input_ids)
    assert text.startswith(starts) and text.endswith(ends)
    offset = int(chat.grid(grid_name).positions[0, 0] - plain.grid(grid_name).positions[0, 0])
    np.testing.assert_array_equal(chat.image_positions, plain.image_positions + offset)


def check_prepare_refused(vlm: vb.VLM, obj: Any, attribute: str, value: Any, match: str,
                          image: Image.Image | None = None) -> None:
    """With ``obj.attribute`` set to ``value`` (restored after), preparing ``image`` (default: scene 0) with the
    usual prompt is an :class:`UnsupportedModelError` matching ``match``."""
    before = getattr(obj, attribute)
    setattr(obj, attribute, value)
    try:
        with pytest.raises(UnsupportedModelError, match=match):
            vlm.prepare(draw_scene(0) if image is None else image, PROMPT)
    finally:
        setattr(obj, attribute, before)


def check_tokens_per_frame_must_agree(vlm: vb.VLM, attribute: str, match: str | None = None) -> None:
    """A processor writing 9 image tokens a frame (``processor.attribute = 9``) where the model has 16 is refused."""
    check_prepare_refused(vlm, vlm.processor, attribute, 9, attribute if match is None else match)
