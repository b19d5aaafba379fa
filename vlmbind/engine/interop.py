"""Interop with TransformerLens 4.3: boot a ``TransformerBridge`` on a loaded vlmbind :class:`~vlmbind.VLM`.

Design: vlmbind and TransformerLens name hooks the same way (``blocks.{l}.attn.hook_z`` ...), so a user can move
between the two, and the tests check that vlmbind's captures equal the bridge's hook values. Booting a bridge is not
free of side effects, and this module exists to contain them. ``TransformerBridge`` *replaces submodules of the model
it is given* with its own wrappers and rewrites the tokenizer it is given (``setup_tokenizer`` sets missing BOS / pad
tokens), so the bridge always gets a deep copy of the model and a tokenizer reloaded from a temporary directory,
never the VLM's own objects: the VLM keeps working unchanged beside its bridge. The temporary directory also holds
the processor and config, so TL's ``AutoProcessor`` / ``AutoTokenizer`` look-ups by ``model_name`` resolve locally
(no hub call) and TL's ``get_tokenizer_with_bos`` can reload a tokenizer that has a BOS token, which it does by its
``name_or_path`` (an in-memory tokenizer has none). Finally, when TL cannot load a processor it imports torchvision
and, if that fails, runs ``pip install torchvision`` in the current interpreter; :func:`transformer_lens_bridge`
imports torchvision first and refuses with :class:`~vlmbind.core.errors.ModelLoadError` if it is missing, so nothing is
ever installed at run time.
"""

from __future__ import annotations

import copy
import tempfile
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer

from ..core.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from .vlm import VLM, Batch


def transformer_lens_architectures() -> list[str]:
    """HF architecture names (``config.architectures[0]``) TransformerLens's bridge has an adapter for."""
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    return sorted(SUPPORTED_ARCHITECTURES)


def _require_torchvision() -> None:
    """Import torchvision so TL's install-on-failure path can never trigger.

    Raises:
        ModelLoadError: torchvision is not importable.
    """
    try:
        import torchvision  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(
            f"TransformerLens's bridge needs torchvision for multimodal processors and would otherwise try to "
            f"`pip install torchvision` at run time ({exc}). Install it yourself first (pinned next to torch, e.g. "
            f"torch==2.14.1 torchvision==0.29.1)."
        ) from exc


def transformer_lens_bridge(vlm: VLM) -> TransformerBridge:
    """Boot a TransformerLens ``TransformerBridge`` on a copy of ``vlm``'s model, with the same weights.

    The bridge runs the same HF forward (eager attention) on a deep copy of the model, so for the same inputs its
    logits and hooks equal vlmbind's; feed it a vlmbind batch with :func:`bridge_inputs`. Memory: the copy doubles
    the model's footprint, the price of leaving the VLM untouched (the bridge rewires the model it is given).

    Args:
        vlm: a loaded VLM of a family TransformerLens bridges (Qwen2.5-VL, LLaVA, LLaVA-OneVision, Gemma-3 in TL 4.3).

    Returns:
        The bridge, on the VLM's device and dtype, with ``bridge.processor`` loaded from the VLM's processor.

    Raises:
        UnsupportedModelError: TransformerLens has no bridge adapter for this family (e.g. Qwen2-VL, Molmo2).
        ModelLoadError: torchvision is missing (TL would try to install it at run time).
    """
    from transformer_lens.model_bridge import TransformerBridge
    architecture = vlm.adapter.model_class_for(vlm.model.config)
    supported = transformer_lens_architectures()
    if architecture not in supported:
        bridged = [a for a in supported if a.endswith("ForConditionalGeneration")]
        raise UnsupportedModelError(
            f"TransformerLens has no bridge for {vlm.adapter.display_name} ({architecture}); its multimodal "
            f"adapters cover {', '.join(bridged)}. Use vlmbind's hooks or vlm.nnsight() for this family."
        )
    _require_torchvision()
    model = copy.deepcopy(vlm.model)
    # TL picks its adapter from config.architectures, which configs built in memory (tiny models) may lack.
    model.config.architectures = [architecture]
    # Patterns need attention weights, which sdpa does not return; the copy's choice does not touch the VLM.
    model.set_attn_implementation("eager")
    dtype = next(model.parameters()).dtype
    with tempfile.TemporaryDirectory(prefix="vlmbind-tl-") as local:
        vlm.processor.save_pretrained(local)
        model.config.save_pretrained(local)
        # A fresh tokenizer whose name_or_path is `local`: TL mutates it and may reload it from there.
        tokenizer = AutoTokenizer.from_pretrained(local)
        bridge = TransformerBridge.boot_transformers(
            local, hf_model=model, tokenizer=tokenizer, device=str(vlm.device), dtype=dtype
        )
    return bridge


def bridge_inputs(vlm: VLM, batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
    """The arguments that make ``bridge(input_ids, **kwargs)`` run exactly the forward ``vlm.run(batch)`` runs.

    The processor outputs (pixel values, ``mm_token_type_ids``, ``token_type_ids``, ...) pass through unchanged, with
    ``use_cache=False``. One addition: for families with 1-D positions the bridge derives ``position_ids`` from the
    attention mask on left-padded rows, where HF's forward uses ``arange(P)``; the two agree only up to float error
    (RoPE is relative), so HF's default is passed explicitly and the forwards are identical. M-RoPE families
    (Qwen2.5-VL) build their 3-D positions inside the forward and are left alone, as the bridge leaves them.

    Args:
        vlm: the VLM the batch was prepared with.
        batch: a batch from ``vlm.prepare``.

    Returns:
        ``input_ids`` (``B P``) on the VLM's device, and the keyword arguments for the bridge's forward or
        ``run_with_cache``.
    """
    inputs = vlm.model_inputs(batch)
    input_ids = inputs.pop("input_ids")
    inputs["use_cache"] = False
    if not vlm.adapter.mrope and "position_ids" not in inputs:
        inputs["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    return input_ids, inputs


__all__ = ["bridge_inputs", "transformer_lens_architectures", "transformer_lens_bridge"]
