"""vb.load: names, directories, and the errors users see."""

from __future__ import annotations

import pytest
import transformers

import vlmbind as vb
from vlmbind.tiny import TINY_NAMES


def test_registered_names_include_every_tiny_model():
    assert set(TINY_NAMES) <= set(vb.registered_names())


def test_unknown_name_lists_close_matches():
    with pytest.raises(vb.UnsupportedModelError, match="tiny-qwen2_5_vl"):
        vb.load("tiny-qwen25_vl")


def test_unsupported_family_lists_supported_ones(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(vb.UnsupportedModelError) as e:
        vb.load(str(tmp_path))
    assert "'gpt2'" in str(e.value)
    assert "Qwen2.5-VL" in str(e.value)


def test_missing_directory_and_missing_weights(tmp_path):
    with pytest.raises(vb.ModelLoadError, match="not a model directory"):
        vb.load(str(tmp_path / "nope"))
    with pytest.raises(vb.ModelLoadError, match="config"):
        vb.load(str(tmp_path))  # empty directory
    vlm = vb.load(TINY_NAMES[0])
    vlm.model.config.save_pretrained(tmp_path)
    with pytest.raises(vb.ModelLoadError, match="weights or processor"):
        vb.load(str(tmp_path))


def test_corrupt_weights(tmp_path):
    vlm = vb.load(TINY_NAMES[0])
    vlm.model.save_pretrained(tmp_path)
    vlm.processor.save_pretrained(tmp_path)
    weights = next(tmp_path.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(vb.ModelLoadError):
        vb.load(str(tmp_path))


def test_load_never_trusts_remote_code(monkeypatch, tmp_path):
    seen = []
    real = transformers.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    vlm = vb.load(TINY_NAMES[0])
    vlm.model.save_pretrained(tmp_path)
    vlm.processor.save_pretrained(tmp_path)
    vb.load(str(tmp_path))
    assert seen and not any(seen)


def test_bad_prepare_inputs():
    vlm = vb.load(TINY_NAMES[0])
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    with pytest.raises(vb.InputError, match="2 images for 1 prompts"):
        vlm.prepare([img, img], ["a"])
    with pytest.raises(vb.InputError, match="empty"):
        vlm.prepare(img, "   ")
    with pytest.raises(vb.InputError, match="PIL image"):
        vlm.prepare(["not an image"], ["a"])
    gray = vlm.prepare(Image.new("L", (64, 64)), "a")
    assert gray.images[0][0].mode == "RGB"


def _run_offline(code: str, cache) -> "subprocess.CompletedProcess":
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_hub_id_loads_from_the_hub_cache(tmp_path):
    """A hub id resolves through huggingface_hub's cache (laid out as a download leaves it), offline."""
    snapshot = tmp_path / "models--vlmbind-test--tiny-qwen" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "models--vlmbind-test--tiny-qwen" / "refs").mkdir()
    (tmp_path / "models--vlmbind-test--tiny-qwen" / "refs" / "main").write_text("0" * 40)
    vlm = vb.load(TINY_NAMES[0])
    vlm.model.save_pretrained(snapshot)
    vlm.processor.save_pretrained(snapshot)
    code = (
        "import vlmbind as vb\n"
        "vlm = vb.load('vlmbind-test/tiny-qwen')\n"
        "print(vlm.family, vlm.source)\n"
        "try:\n    vb.load('vlmbind-test/absent')\nexcept vb.ModelLoadError as e:\n    print('ERR', e)\n"
    )
    result = _run_offline(code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"{vlm.family} hub:vlmbind-test/tiny-qwen"
    assert lines[1].startswith("ERR could not read a model config from hub id 'vlmbind-test/absent'")


def test_a_misspelt_name_is_refused_at_once_with_the_close_match():
    with pytest.raises(vb.UnsupportedModelError, match="Did you mean 'organism-p2a'"):
        vb.load("orgnism-p2a")  # no "tiny-" / "organism-" prefix, yet never sent to the hub


def test_an_uncached_hub_id_fails_at_once_without_trying_the_network(tmp_path):
    """Nothing downloads at run time: an id missing from the cache is an error before any HTTP retry, with or
    without HF_HUB_OFFLINE."""
    import os
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_HUB_CACHE": str(tmp_path), "TRANSFORMERS_VERBOSITY": "error"}
    code = ("import time, vlmbind as vb\nvb.load  # imported on first use: not part of the measured call\n"
            "t = time.perf_counter()\n"
            "try:\n    vb.load('vlmbind-test/absent')\nexcept vb.ModelLoadError as e:\n"
            "    print(round(time.perf_counter() - t, 2)); print(e)\n")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and len(lines) == 2, result.stderr[-2000:]
    assert float(lines[0]) < 3.0 and time.perf_counter() - start < 60
    assert "never downloads" in lines[1] and "huggingface-cli download vlmbind-test/absent" in lines[1]
    assert "Retrying" not in result.stderr and "Retry" not in result.stdout
