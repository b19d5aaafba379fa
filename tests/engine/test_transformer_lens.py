"""vlmbind against TransformerLens 4.3's TransformerBridge, and proof that nothing is installed at run time.

For every family TL 4.3 bridges (Qwen2.5-VL, LLaVA, LLaVA-OneVision, Gemma-3) a bridge is booted once per module on
a copy of the tiny model (:func:`vlmbind.engine.interop.transformer_lens_bridge`) and fed the very processor outputs vlmbind
runs (:func:`vlmbind.engine.interop.bridge_inputs`), on a left-padded batch of two. Then: the bridge's logits equal HF's;
vlmbind's captures equal the bridge's hooks of the same name; a head ablation done by vlmbind equals one done with a
bridge hook. TL 4.3's ``boot_transformers`` runs ``pip install torchvision`` in the current interpreter when it
cannot load a processor, so the boot and runs happen under a guard that blocks and records every process spawn (the
subprocess functions and ``os.system`` patched, plus a Python audit hook that also sees spawns through references
taken before patching), and the installed distributions are compared before and after. A separate test shows the
guard does catch TL's real install attempt (torchvision hidden), so its silence elsewhere means something.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import PROMPT, draw_scene, get_tiny

import vlmbind as vb
from vlmbind.adapters import ADAPTERS
from vlmbind.core.errors import ModelLoadError, UnsupportedModelError
from vlmbind.engine.interop import bridge_inputs, transformer_lens_architectures, transformer_lens_bridge
from vlmbind.tiny import TINY_NAMES

BRIDGED = ("tiny-qwen2_5_vl", "tiny-llava", "tiny-llava_onevision", "tiny-gemma3", "tiny-llava_next", "tiny-qwen3_vl",
           "tiny-qwen3_vl_moe", "tiny-qwen3_5", "tiny-qwen3_5_moe",
           "tiny-idefics3", "tiny-mistral3", "tiny-gemma4", "tiny-glm4v")
NOT_BRIDGED = tuple(n for n in TINY_NAMES if n not in BRIDGED)
# vlmbind sites whose TL namesake must hold the same tensor (brief: exact or <= 1e-5)
CORE_HOOKS = ("attn.hook_z", "hook_resid_pre", "hook_resid_post", "attn.hook_pattern")
ATOL = 1e-5


def _require(name: str) -> None:
    assert name in TINY_NAMES, f"{name} is not registered (vlmbind.tiny.TINY_NAMES = {TINY_NAMES})"


# ------------------------------------------------------------------------------------------------------------------
# The spawn guard
# ------------------------------------------------------------------------------------------------------------------
# Audit events raised by every way CPython starts or replaces a process.
_SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn", "os.fork", "os.forkpty", "pty.spawn"}
)
_ACTIVE_RECORDERS: list[list[str]] = []  # non-empty only inside `spawn_guard`


def _audit(event: str, args: tuple) -> None:
    # Raising from an audit hook aborts the operation before the process starts: a second, unpatchable barrier.
    if _ACTIVE_RECORDERS and event in _SPAWN_EVENTS:
        _ACTIVE_RECORDERS[-1].append(f"[audit {event}] {args!r:.300}")
        raise RuntimeError(f"test guard: {event} blocked")


sys.addaudithook(_audit)  # audit hooks cannot be removed; it is inert outside `spawn_guard`


def _command_line(args: tuple, kwargs: dict) -> str:
    cmd = args[0] if args else kwargs.get("args", kwargs.get("command", ""))
    return " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)


@contextlib.contextmanager
def spawn_guard() -> Iterator[list[str]]:
    """Block and record every process spawn inside the block; yields the list of recorded command lines."""
    calls: list[str] = []

    def blocked(name: str):
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls.append(f"[{name}] {_command_line(args, kwargs)}")
            raise RuntimeError(f"test guard: {name} blocked")

        return fn

    with pytest.MonkeyPatch.context() as mp:
        for name in ("run", "call", "check_call", "check_output", "Popen"):
            mp.setattr(subprocess, name, blocked(f"subprocess.{name}"))
        mp.setattr(os, "system", blocked("os.system"))
        _ACTIVE_RECORDERS.append(calls)
        try:
            yield calls
        finally:
            _ACTIVE_RECORDERS.pop()


def install_commands(calls: list[str]) -> list[str]:
    return [c for c in calls if re.search(r"\bpip\b|install", c)]


def installed_distributions() -> set[tuple[str, str]]:
    """``(name, version)`` of every distribution importlib.metadata can see on sys.path."""
    return {(str(d.metadata["Name"]).lower(), d.version) for d in importlib.metadata.distributions()}


# ------------------------------------------------------------------------------------------------------------------
# Fixtures: one VLM, batch and bridge per family, booted under the guard
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=BRIDGED)
def family(request) -> dict[str, Any]:
    """``vlm``, a left-padded two-example ``batch``, the ``bridge`` and what the guard saw while booting it."""
    name = request.param
    _require(name)
    vlm = get_tiny(name)
    batch = vlm.prepare([draw_scene(0), draw_scene(1)], [PROMPT, "the red object is a"])
    before = installed_distributions()
    with spawn_guard() as calls:
        bridge = transformer_lens_bridge(vlm)
        ids, kwargs = bridge_inputs(vlm, batch)
        with torch.no_grad():
            logits = bridge(ids, **kwargs)
            _, cache = bridge.run_with_cache(ids, names_filter=_names(vlm, CORE_HOOKS), **kwargs)
    return dict(
        name=name, vlm=vlm, batch=batch, bridge=bridge, ids=ids, kwargs=kwargs, logits=logits, cache=cache,
        calls=calls, dists_before=before, dists_after=installed_distributions(),
    )


def _names(vlm: vb.VLM, hooks: tuple[str, ...]) -> list[str]:
    # TL has attn.* and hook_attn_out on softmax layers only (Qwen3.5's DeltaNet layers: blocks.{l}.linear_attn.*,
    # which tests/adapters/test_family_qwen3_5.py compares)
    softmax = vlm.adapter.pattern_layers()
    return [f"blocks.{layer}.{hook}" for layer in range(vlm.n_layers) for hook in hooks
            if layer in softmax or not hook.startswith(("attn.", "hook_attn_out"))]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ------------------------------------------------------------------------------------------------------------------
# 1. logits
# ------------------------------------------------------------------------------------------------------------------
def test_bridge_wraps_a_copy_of_the_model(family):
    """The bridge rewired its own copy (BlockBridge in place of the HF layers); the VLM's model is untouched."""
    from transformer_lens.model_bridge.generalized_components import BlockBridge

    vlm, bridge = family["vlm"], family["bridge"]
    assert bridge.original_model is not vlm.model
    assert isinstance(bridge.blocks[0], BlockBridge)  # or a subclass (Gemma-4's delegated attention blocks)
    assert len(bridge.blocks) == vlm.n_layers
    hf_layer = vlm.adapter.layer(0)
    assert not type(hf_layer).__name__.endswith("Bridge"), type(hf_layer)
    # same weights, not a re-initialised model
    torch.testing.assert_close(
        bridge.original_model.lm_head.weight, vlm.model.lm_head.weight, atol=0, rtol=0
    )


def test_bridge_logits_equal_hf(family):
    vlm, batch = family["vlm"], family["batch"]
    with torch.no_grad():
        hf = vlm.model(**batch.inputs, use_cache=False).logits
    logits = family["logits"]
    assert logits.shape == hf.shape
    assert batch.inputs["attention_mask"].min() == 0, "the batch should be left-padded to exercise the mask"
    torch.testing.assert_close(logits, hf, atol=ATOL, rtol=0)
    # the comparison is not vacuous: a different image changes the logits by far more than the tolerance
    other = vlm.prepare([draw_scene(5), draw_scene(6)], [PROMPT, "the red object is a"])
    ids, kwargs = bridge_inputs(vlm, other)
    with torch.no_grad():
        moved = family["bridge"](ids, **kwargs)
    if moved.shape == logits.shape:
        assert _max_diff(moved, logits) > 100 * ATOL


def test_unpinned_positions_agree_up_to_float_error(family):
    """Without ``position_ids`` the bridge derives them from the mask on padded rows (HF uses arange): RoPE is
    relative, so logits still agree to float error; ``bridge_inputs`` pins HF's positions to make them identical."""
    vlm, batch = family["vlm"], family["batch"]
    ids, kwargs = bridge_inputs(vlm, batch)
    kwargs.pop("position_ids", None)
    with torch.no_grad():
        unpinned = family["bridge"](ids, **kwargs)
        hf = vlm.model(**batch.inputs, use_cache=False).logits
    torch.testing.assert_close(unpinned, hf, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------------------------
# 2. captures
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hook", CORE_HOOKS)
def test_captures_equal_bridge_hooks(family, hook):
    vlm, bridge, cache = family["vlm"], family["bridge"], family["cache"]
    names = _names(vlm, (hook,))
    for name in names:
        assert name in bridge.hook_dict, f"TL's {type(bridge.adapter).__name__} has no hook {name}"
    ours = vlm.run(family["batch"], sites=names).cache
    for name in names:
        assert name in cache, f"{name} did not fire on the bridge (names_filter typos give empty caches silently)"
        assert tuple(ours[name].shape) == tuple(cache[name].shape), name
        torch.testing.assert_close(ours[name], cache[name], atol=ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    if hook == "attn.hook_z":
        b, p = family["ids"].shape
        assert tuple(cache[names[0]].shape) == (b, p, vlm.n_heads, vlm.adapter.d_head)  # batch pos head d_head


@pytest.mark.parametrize("hook", ("hook_attn_out", "hook_mlp_out"))
def test_block_output_sites_equal_bridge_hooks(family, hook):
    """Same name, same tensor: vlmbind's attention / MLP outputs against the bridge's.

    Gemma-3 has post-attention and post-feedforward norms; both TL and vlmbind name the *normed* branch output (what
    is added to the residual) ``hook_attn_out`` / ``hook_mlp_out``.
    """
    vlm, bridge = family["vlm"], family["bridge"]
    names = _names(vlm, (hook,))
    ids, kwargs = family["ids"], family["kwargs"]
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids, names_filter=names, **kwargs)
    ours = vlm.run(family["batch"], sites=names).cache
    for name in names:
        torch.testing.assert_close(ours[name], cache[name], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["tiny-gemma3"], indirect=True)
def test_gemma3_block_outputs_are_post_norm(family):
    """Gemma-3's ``hook_attn_out`` / ``hook_mlp_out`` are the post-normed branch outputs, not TL's pre-norm
    ``attn.hook_out`` / ``mlp.hook_out`` (the two really differ on this model)."""
    vlm, bridge = family["vlm"], family["bridge"]
    ours = vlm.run(family["batch"], sites=_names(vlm, ("hook_attn_out", "hook_mlp_out"))).cache
    tl_names = _names(vlm, ("attn.hook_out", "mlp.hook_out", "hook_attn_out", "hook_mlp_out"))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(family["ids"], names_filter=tl_names, **family["kwargs"])
    for layer in range(vlm.n_layers):
        block = vlm.adapter.layer(layer)
        attn, mlp = ours[f"blocks.{layer}.hook_attn_out"], ours[f"blocks.{layer}.hook_mlp_out"]
        pre_attn, pre_mlp = cache[f"blocks.{layer}.attn.hook_out"], cache[f"blocks.{layer}.mlp.hook_out"]
        with torch.no_grad():
            torch.testing.assert_close(block.post_attention_layernorm(pre_attn), attn, atol=ATOL, rtol=0)
            torch.testing.assert_close(block.post_feedforward_layernorm(pre_mlp), mlp, atol=ATOL, rtol=0)
        assert _max_diff(attn, pre_attn) > 1e-2  # the pre- and post-norm tensors really differ


def test_head_ablation_equals_bridge_hook(family):
    """Zeroing one head's z with vlmbind and with a bridge hook on ``hook_z`` gives the same logits."""
    vlm, bridge, batch = family["vlm"], family["bridge"], family["batch"]
    layer, head = 1, 2

    def zero_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    ours = vlm.logits(batch, interventions=[vb.AblateHeads(layer=layer, heads=[head], mode="zero")])
    with torch.no_grad():
        theirs = bridge.run_with_hooks(
            family["ids"], fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)], **family["kwargs"]
        )
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert _max_diff(ours, family["logits"]) > 100 * ATOL  # the ablation moved the logits


# ------------------------------------------------------------------------------------------------------------------
# 3. nothing installed at run time
# ------------------------------------------------------------------------------------------------------------------
def test_boot_and_run_spawn_no_process_and_install_nothing(family):
    """The fixture booted and ran the bridge under the guard: no spawn at all, the same distributions."""
    assert install_commands(family["calls"]) == [], family["calls"]
    assert family["calls"] == [], f"the bridge boot spawned processes: {family['calls']}"
    assert family["dists_after"] == family["dists_before"], (
        f"distributions changed: added {family['dists_after'] - family['dists_before']}, "
        f"removed {family['dists_before'] - family['dists_after']}"
    )
    assert family["bridge"].processor is not None  # loaded from the local copy: TL's install fallback never ran


def test_processor_fallback_path_installs_nothing():
    """TL's fallback (processor not loadable -> import or install torchvision) under the guard, torchvision present.

    ``load_modality_processor`` is what ``boot_transformers`` calls; a directory without a processor sends it down
    the ``_ensure_torchvision`` branch that would pip-install torchvision if it could not import it.
    """
    from transformer_lens.model_bridge.sources.transformers import helpers

    bridge, cfg = SimpleNamespace(processor=None), SimpleNamespace(is_multimodal=True)
    before = installed_distributions()
    with spawn_guard() as calls:
        helpers.load_modality_processor(bridge, cfg, str(Path(__file__).parent / "no-such-model"), False, None)
    assert bridge.processor is None
    assert calls == []
    assert installed_distributions() == before


def test_guard_catches_tl_install_attempt(monkeypatch):
    """With torchvision hidden, TL 4.3 really tries ``pip install torchvision``; the guard records and blocks it.

    This is what makes the silence of the guard in the other tests meaningful.
    """
    from transformer_lens.model_bridge.sources.transformers import helpers

    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` now raises ImportError
    before = installed_distributions()
    with spawn_guard() as calls:
        assert helpers._ensure_torchvision() is False  # the blocked install "failed"
    assert install_commands(calls), f"expected TL to attempt an install, saw {calls}"
    assert any("torchvision" in c for c in calls)
    assert installed_distributions() == before


def test_interop_refuses_instead_of_installing(monkeypatch):
    """vlmbind's helper checks torchvision itself and raises a named error; TL never reaches its installer."""
    vlm = get_tiny("tiny-qwen2_5_vl")
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with spawn_guard() as calls, pytest.raises(ModelLoadError, match="torchvision"):
        transformer_lens_bridge(vlm)
    assert calls == []


@pytest.mark.parametrize("name", NOT_BRIDGED)
def test_unbridged_family_is_refused(name):
    vlm = get_tiny(name)
    with pytest.raises(UnsupportedModelError, match="no bridge"):
        transformer_lens_bridge(vlm)


def test_adapter_flags_match_transformer_lens():
    """``ModelAdapter.transformer_lens_bridge`` is true exactly for the families TL has an adapter for."""
    supported = set(transformer_lens_architectures())
    flags = {cls.family: cls.transformer_lens_bridge for cls in ADAPTERS.values()}
    truth = {cls.family: cls.model_class_name in supported for cls in ADAPTERS.values()}
    assert flags == truth
    assert truth.get("qwen2_5_vl") is True and truth.get("qwen2_vl") is False


def test_bridge_leaves_vlm_unchanged():
    """Booting a bridge neither rewires the VLM's model nor edits its tokenizer; its logits do not move."""
    vlm = get_tiny("tiny-qwen2_5_vl")
    batch = vlm.prepare([draw_scene(3)], [PROMPT])
    tok = vlm.adapter.tokenizer
    special = (tok.bos_token, tok.eos_token, tok.pad_token, tuple(tok.all_special_ids), len(tok))
    layer_types = [type(m).__name__ for m in vlm.model.modules()]
    before = vlm.logits(batch)
    transformer_lens_bridge(vlm)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tuple(tok.all_special_ids), len(tok)) == special
    assert [type(m).__name__ for m in vlm.model.modules()] == layer_types
    torch.testing.assert_close(vlm.logits(batch), before, atol=0, rtol=0)


_CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys

    SPAWN = {"subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn", "os.fork", "os.forkpty",
             "pty.spawn"}
    audit, patched = [], []

    def hook(event, args):
        if event in SPAWN:
            audit.append(f"{event} {args!r:.200}")

    sys.addaudithook(hook)  # before anything else is imported

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            patched.append(f"{name} {args[:1]!r:.200}")
            return fn(*args, **kwargs)
        return wrapper

    for name in ("run", "call", "check_call", "check_output", "Popen"):
        setattr(subprocess, name, recording("subprocess." + name, getattr(subprocess, name)))
    os.system = recording("os.system", os.system)

    import torch  # phase 1: torch's own import (CUDA wheels look up libdl with `ldconfig -p`)

    seen = {"torch_import": audit + patched}
    del audit[:], patched[:]
    from PIL import Image, ImageDraw  # phase 2: vlmbind, everything it imports, and its main paths
    import vlmbind as vb
    from vlmbind.tiny import TINY_NAMES

    img = Image.new("RGB", (224, 224), "white")
    ImageDraw.Draw(img).rectangle([40, 40, 90, 90], fill="red")
    shapes = {}
    for name in TINY_NAMES:
        vlm = vb.load(name)
        batch = vlm.prepare([img, img], ["what colour is the square ?", "the red object is a"])
        pattern = f"blocks.{vlm.adapter.pattern_layers()[0]}.attn.hook_pattern"  # a softmax layer (hybrid models)
        out = vlm.run(batch, sites=["blocks.0.attn.hook_z", "blocks.1.hook_resid_post", pattern])
        cap = vlm.capture(batch, "blocks.*.hook_resid_pre")
        shapes[name] = [list(out.logits.shape), list(out.cache["blocks.0.attn.hook_z"].shape), len(cap)]
    seen.update(audit=list(audit), patched=list(patched), shapes=shapes)
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # probe: both detectors must see this one
    seen["probe_audit"], seen["probe_patched"] = audit[len(seen["audit"]):], patched[len(seen["patched"]):]
    print("RESULT " + json.dumps(seen))
    """
)


@pytest.mark.slow
def test_vlmbind_main_paths_never_spawn_a_process():
    """Import vlmbind and load / prepare / run / capture every tiny family in a fresh interpreter whose audit hook
    and patched subprocess functions record every spawn: there must be none (import-time ones included).

    ``import torch`` is measured apart: the CUDA build of torch 2.14 imports ``cuda.pathfinder``, whose
    ``ctypes.util.find_library`` runs ``/sbin/ldconfig -p`` (a read-only library look-up). That is allowed and
    nothing else is; everything vlmbind and its other dependencies do afterwards must spawn nothing.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600, env=env,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    seen = json.loads(line[len("RESULT "):])
    assert set(seen["shapes"]) == set(TINY_NAMES)
    for name, (logits, z, n_resid) in seen["shapes"].items():
        assert logits[0] == 2 and len(z) == 4 and n_resid == get_tiny(name).n_layers, name
    assert seen["audit"] == [] and seen["patched"] == [], seen
    assert seen["probe_audit"] and seen["probe_patched"], "the detectors missed a real spawn"
    assert install_commands(seen["torch_import"]) == []
    assert all("ldconfig" in c for c in seen["torch_import"]), seen["torch_import"]
