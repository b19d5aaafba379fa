"""Fixtures every test folder shares; the builders behind them are in ``helpers.py``."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import draw_scene, get_tiny, shared_models_changed, shared_organism
from hypothesis import settings
from PIL import Image

import vlmbind as vb
from vlmbind.tiny import TINY_NAMES

# one torch thread per pytest-xdist worker (`make test` runs one worker per core), two when run alone
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

# CI replays the same property-test examples every run (a failure there is reproducible, never a coin toss); locally
# hypothesis keeps exploring new ones
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(params=TINY_NAMES)
def tiny(request) -> vb.VLM:
    """Each tiny model in turn (built once per test process)."""
    return get_tiny(request.param)


@pytest.fixture
def organism_p2a() -> vb.VLM:
    """The shipped organism-p2a, loaded once per test process and shared (``helpers.shared_organism(name)`` gives
    the others the same way). Not a session-scoped fixture, so that a copy a test changed is never handed on."""
    return shared_organism("organism-p2a")


@pytest.fixture
def scene() -> Image.Image:
    return draw_scene(0)


@pytest.fixture(autouse=True)
def shared_models_unchanged():
    """A test may use the shared tiny models and organisms but must leave them as it found them."""
    yield
    changed = shared_models_changed()
    assert not changed, (f"this test changed the shared model(s) (what changed: {changed}); load a copy of your "
                         f"own with vb.load")
