"""circuits/binding_information: the README's tables are the ones rendered from the committed results (no number
typed by hand), the results hold what the README's findings claim, and the no-model pixel baseline is what it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

HERE = Path(__file__).resolve().parent.parent / "circuits" / "binding_information"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"binding_information_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_shows_the_tables_rendered_from_the_saved_results():
    tables = _module("tables")
    text = tables.README.read_text()
    assert tables.readme_tables.replaced(text, tables.render(), tables.README) == text, \
        "run python circuits/binding_information/tables.py"
    assert "organism-p2a" in tables._models()


def test_the_saved_ladder_backs_the_readmes_claims():
    ladder = pd.read_csv(HERE / "results" / "organism-p2a" / "ladder-organism" / "probe.csv")
    attention = ladder[ladder["family"] == "attention"]
    # somewhere the attention probe on spatial tokens finds information: B_O > 0 with a margin of > 3 SE
    found = attention[(attention["B_O"] > 0) & (attention["margin_O"] > 3 * attention["margin_O_se"])]
    assert len(found) >= 1
    # the generalisation gap: the flexible families fit their training codes far better than the test ones
    for family in ("quadratic", "shared_factor"):
        rows = ladder[ladder["family"] == family]
        assert ((rows["CE_O"] - rows["CE_O_train"]) > 3).all(), family
    pixels = pd.read_csv(HERE / "results" / "organism-p2a" / "ladder-organism" / "pixels.csv")
    linear = ladder[ladder["family"] == "linear"]
    assert pixels.set_index("family").loc["linear", "B_O"] >= linear["B_O"].max() - 0.1
    same = pd.read_csv(HERE / "results" / "organism-p2a" / "same_object" / "same_object.csv")
    assert set(same["strongest_baseline"]) == {"same_class"}


def test_pixel_patch_means_are_the_mean_patch_on_the_patch_grid():
    run = _module("run")
    from vlmbind.stimuli.colorshape import balanced_color_shape

    data = balanced_color_shape(2, 0, world="organism")
    z = run.pixel_patch_means(data, 14)
    assert z.shape == (2, 14 * 14 * 3)
    x = np.asarray(data[1].image, dtype=np.float32) / 255.0
    tiles = [x[r:r + 14, c:c + 14] for r in range(0, 168, 14) for c in range(0, 168, 14)]
    np.testing.assert_allclose(z[1], np.mean(tiles, 0).ravel(), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception):
        run.pixel_patch_means([object()], 14)


# the papers' numbers the findings quote (docs/binding_information.md, docs/methods.md): not from these results
REFERENCE_NUMBERS = {"0.927", "0.628"}


def test_every_number_the_findings_quote_is_in_the_rendered_tables():
    """Each number with two or more decimals in 'What the tables say' appears in the tables rendered from results
    (as printed there, sign aside), so no finding quotes a number typed by hand."""
    import re

    tables = _module("tables")
    text = tables.README.read_text()
    findings = text.split("## What the tables say", 1)[1].split("## Tables", 1)[0]
    rendered = tables.render()
    printed = {m.lstrip("+-") for m in re.findall(r"[-+]?\d+\.\d{2,}", rendered)}
    quoted = {m.lstrip("+-") for m in re.findall(r"[-+]?\d+\.\d{2,}", findings)}
    assert quoted, "the findings quote no number"
    missing = sorted(quoted - printed - REFERENCE_NUMBERS)
    assert not missing, f"numbers in the findings that no rendered table holds: {missing}"
