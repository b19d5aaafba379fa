"""circuits/binding_information: the README's tables are the ones rendered from the committed results (no number
typed by hand), the results hold what the README's findings claim, and the no-model pixel baseline is what it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

HERE = Path(__file__).resolve().parents[2] / "circuits" / "binding_information"


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


def test_pixel_cells_are_the_token_cells_averaged_to_one_patch():
    run = _module("run")
    from vlmbind.stimuli.colorshape import balanced_color_shape

    data = balanced_color_shape(2, 0, world="organism")
    z = run.pixel_cells(data, 14, 2)
    assert z.shape == (2, 36, 14 * 14 * 3)
    x = np.asarray(data[1].image, dtype=np.float32) / 255.0
    r, c = 2, 5  # the token cell in row 2, column 5: raster index 17, pixels 56..84 x 140..168
    cell = x[56:84, 140:168]
    down = cell.reshape(14, 2, 14, 2, 3).mean((1, 3))
    np.testing.assert_allclose(z[1, r * 6 + c], down.ravel(), rtol=1e-5, atol=1e-6)


def test_a_pixel_baseline_is_reused_only_from_a_run_with_the_same_images_cells_and_recipe(tmp_path):
    import argparse
    import json

    run = _module("run")
    args = argparse.Namespace(n_train=8, n_val=4, n_test=4, seed=0)
    key = run.pixel_key("organism", 14, 2, args, run.ProbeConfig(seed=0))
    (tmp_path / "a" / "ladder-organism").mkdir(parents=True)
    (tmp_path / "a" / "ladder-organism" / "pixels.csv").write_text("site,family\n")
    entry = {"file": "a/ladder-organism/pixels.csv", **key, "seconds": 1.0}
    (tmp_path / "a" / "runs.json").write_text(json.dumps({"pixels-organism": entry}))
    assert run.same_pixel_baseline(tmp_path, "b", "pixels-organism", key)["file"] == entry["file"]
    assert run.same_pixel_baseline(tmp_path, "a", "pixels-organism", key) is None  # never its own
    for changed in (run.pixel_key("organism", 14, 1, args, run.ProbeConfig(seed=0)),
                    run.pixel_key("organism", 14, 2, argparse.Namespace(n_train=8, n_val=4, n_test=4, seed=1),
                                  run.ProbeConfig(seed=1)),
                    run.pixel_key("organism", 14, 2, args, run.ProbeConfig(seed=0, attention_starts=("cold",)))):
        assert run.same_pixel_baseline(tmp_path, "b", "pixels-organism", changed) is None
    # a copy is never copied on: the chain always ends at the run that fitted it
    (tmp_path / "a" / "runs.json").write_text(json.dumps({"pixels-organism": {**entry, "copied_from": "c"}}))
    assert run.same_pixel_baseline(tmp_path, "b", "pixels-organism", key) is None
