"""ModelAdapter: one small declarative class per model family, and the registry that finds it.

An adapter says where things are in the Hugging Face model (module paths of the decoder layers, attention, o_proj,
MLP, vision blocks and projector), which config ``model_type`` values it handles, how a prompt asks for an image, and
how the family lays out image tokens (:meth:`ModelAdapter.image_grids`). It never reimplements the model's forward:
every run goes through the real HF ``forward``, and vlmbind only attaches hooks.

Register a family with ``@register_adapter`` on a subclass; :func:`adapter_class_for_config` finds it from a config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..core.errors import HeadLayoutError, NoAttentionPatternError, SiteError, UnsupportedModelError
from ..core.tokens import ROLE_DTYPE, ImageGrid

ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: add a family adapter to the registry (keyed by ``cls.family``)."""
    if cls.family in ADAPTERS:
        raise ValueError(f"adapter family {cls.family!r} registered twice")
    ADAPTERS[cls.family] = cls
    return cls


def supported_families() -> list[str]:
    return sorted(ADAPTERS)


def adapter_class_for_config(config: Any) -> type[ModelAdapter]:
    """The adapter class handling ``config.model_type``.

    Raises:
        UnsupportedModelError: no registered family handles it; the message lists the supported ones.
    """
    model_type = getattr(config, "model_type", None)
    for cls in ADAPTERS.values():
        if model_type in cls.model_types:
            return cls
    families = ", ".join(f"{c.display_name} ({'/'.join(c.model_types)})"
                         for c in sorted(ADAPTERS.values(), key=lambda c: c.family))
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported by vlmbind. Supported families: {families}."
    )


def get_module(root: nn.Module, path: str) -> nn.Module:
    """``root.a.b.3.c`` style lookup with a clear error naming the missing part."""
    module = root
    for part in path.split("."):
        if not hasattr(module, part):
            raise AttributeError(f"{type(root).__name__} has no module {path!r} (missing {part!r})")
        module = getattr(module, part)
    return module


class ModelAdapter:
    """Declarations for one model family, bound to a loaded model and processor.

    Class attributes declare the family; instances answer questions about one loaded model.
    """

    family: ClassVar[str]
    display_name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    model_class_name: ClassVar[str]
    text_layers: ClassVar[str] = "model.language_model.layers"
    attention: ClassVar[str] = "self_attn"
    o_proj: ClassVar[str] = "o_proj"
    # the query / key / value projections inside the attention module (their outputs are a receiver head's inputs
    # in path patching)
    qkv_proj: ClassVar[dict[str, str]] = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
    mlp: ClassVar[str] = "mlp"
    # modules (inside a layer) whose outputs are what the attention / MLP add to the residual stream; families with
    # post-norms (Gemma-3) point these at the norm so the names mean what they mean in TransformerLens
    attn_out: ClassVar[str | None] = None
    mlp_out: ClassVar[str | None] = None
    vision_blocks: ClassVar[str]
    # attention module inside a vision block (tests silence it to make the tower local, for the TokenIndex check)
    vision_attention: ClassVar[str] = "self_attn"
    projector: ClassVar[str] = "model.multi_modal_projector"
    # the language model's final norm (what the residual stream passes through before the unembedding), a module of
    # the decoder that holds ``text_layers`` (the logit lens decodes through it)
    final_norm: ClassVar[str] = "norm"
    # the attribute of the projector module's output holding the features (None: the output itself / its first
    # tensor), and whether its rows are the language model's image tokens in sequence order
    projector_output: ClassVar[str | None] = None
    projector_in_sequence_order: ClassVar[bool] = True
    image_placeholder: ClassVar[str]
    # positions the image features replace (special tokens around / between them are role "special")
    image_token_attr: ClassVar[str] = "image_token_id"
    bidirectional_image: ClassVar[bool] = False
    # whether image features sit at positions of the language model's sequence (False: the image reaches the LM
    # only through cross-attention keys, Llama-3.2-Vision; then no sequence position has the role "image")
    image_tokens_in_sequence: ClassVar[bool] = True
    # whether the forward takes an attention mask per layer type ({"full_attention": ..., "sliding_attention": ...},
    # as Gemma-3's does); the exact method's packed layout needs it when some layers slide
    mask_per_layer_type: ClassVar[bool] = True
    mrope: ClassVar[bool] = False
    # per-token processor outputs besides input_ids and attention_mask (0 on text tokens): they grow with the
    # sequence when tokens are appended (vlmbind.engine.batches.append_tokens)
    token_inputs: ClassVar[tuple[str, ...]] = ()
    # the value an appended token gets in a token input, where it is not 0 (PaliGemma's answer tokens: 1, causal;
    # "last": the last position's entry repeated, Llama-3.2-Vision's cross-attention mask)
    appended_token_values: ClassVar[dict[str, int | str]] = {}
    # processor outputs that never reach the forward (PaliGemma's training labels); VLM.prepare drops them
    dropped_inputs: ClassVar[tuple[str, ...]] = ()
    transformer_lens_bridge: ClassVar[bool] = False
    # the coordinate frames of the point formats this family's checkpoints write, where the format does not carry
    # its own (format -> frame of vlmbind.stimuli.answers.FRAMES); Qwen2-VL boxes and Molmo tags describe themselves
    point_frames: ClassVar[dict[str, str]] = {}
    # the families table (README, `vlmbind models --families`): how the image tokens are laid out, in a few words
    image_layout: ClassVar[str] = ""
    # the side in pixels of the square image the family's checkpoints are typically fed (its processor's native tile
    # or canvas size): vlmbind draws its stimuli for a checkpoint at this size unless told otherwise
    typical_image_size: ClassVar[int]
    # capability (a key of vlmbind.adapters.capabilities.CAPABILITIES) -> why it differs from the derived cell, as
    # "n/a because ..." or "no: ..." (or "yes (...)" to qualify it)
    capability_notes: ClassVar[dict[str, str]] = {}

    def __init__(self, model: nn.Module, processor: Any):
        self.model = model
        self.processor = processor

    # ---- shapes ---------------------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def text_config(self) -> Any:
        return self.model.config.text_config

    @property
    def n_layers(self) -> int:
        return len(get_module(self.model, self.text_layers))

    @property
    def n_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(getattr(self.text_config, "num_key_value_heads", None) or self.n_heads)

    @property
    def d_head(self) -> int:
        return int(self.o_proj_module(0).in_features // self.n_heads)

    def layer_d_head(self, layer: int) -> int:
        """The width of one head of layer ``layer`` (``attn.hook_z`` there is ``B P n_heads layer_d_head``):
        :attr:`d_head` by default; Gemma-4's full-attention layers have wider heads than its sliding ones."""
        return self.d_head

    def cache_width(self, layer: int) -> int:
        """Elements one position takes in layer ``layer``'s key-value cache (keys and values): ``2 x n_kv_heads x
        layer_d_head`` by default, an upper bound where a sliding window keeps fewer positions; multi-head latent
        attention (Kimi-K2.5) caches its shared latent instead. The exact method sizes its batched chunks by it."""
        return 2 * self.n_kv_heads * self.layer_d_head(layer)

    @property
    def d_model(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def n_residual_streams(self) -> int:
        """How many ``d_model`` streams the residual stream between decoder layers is, side by side: the residual
        sites are ``B P (n_residual_streams * d_model)``. 1 by default; hyper-connection families (Qwen4-Exp) keep
        several, which each layer mixes into its input and writes into with per-stream weights."""
        return 1

    @property
    def n_vision_layers(self) -> int:
        return len(get_module(self.model, self.vision_blocks))

    @property
    def n_deepstack(self) -> int:
        """How many DeepStack injections (image features added to the image tokens' residual stream after text
        layers ``0..n-1``, outside any module) the model makes; 0 for families without DeepStack."""
        return 0

    # ---- per-layer facts (hybrid families override these) ---------------------------------------------------
    def pattern_layers(self) -> list[int]:
        """Layers whose token mixer is softmax attention: the only ones with ``attn.hook_pattern``, vlmbind's eager
        attention and the ``image_attention`` ablation. Every layer by default (Qwen3.5: its full-attention layers,
        not the linear-attention ones)."""
        return list(range(self.n_layers))

    def head_layers(self) -> list[int]:
        """Layers whose ``o_proj`` input is ``n_heads x d_head``, head by head: the only ones with ``attn.hook_z``
        and head interventions. Every layer by default."""
        return list(range(self.n_layers))

    def reuses_prefix_cache(self) -> bool:
        """Whether the exact method may cut a clean forward's key/value cache back to a prefix and run the rest on
        it: not with recurrent layers, nor where some layers cache keys that are not sequence positions
        (cross-attention layers cache the image's keys)."""
        return not self.recurrent_layers() and not self.cross_attention_layers()

    def recurrent_layers(self) -> list[int]:
        """Layers that carry a recurrent state in the cache (a linear-attention layer's state after every cached
        position, which no slice of it rewinds): the exact method reuses no prefix cache when there are any. None
        by default."""
        return []

    def cross_attention_layers(self) -> list[int]:
        """Decoder layers whose token mixer is cross-attention from the text to the image features (Llama-3.2-Vision):
        their heads are ``blocks.{l}.cross_attn.hook_z`` / ``hook_pattern`` (keys: the image features, not sequence
        positions) in place of ``attn.*``. None by default."""
        return []

    def z_site(self, layer: int) -> str:
        """The per-head output site of decoder layer ``layer``: ``blocks.{l}.attn.hook_z``, or
        ``blocks.{l}.cross_attn.hook_z`` on a cross-attention layer. Head ``(l, h)`` means that layer's head h."""
        kind = "cross_attn" if layer in self.cross_attention_layers() else "attn"
        return f"blocks.{layer}.{kind}.hook_z"

    def pattern_site(self, layer: int) -> str:
        """The attention-probability site of decoder layer ``layer`` (``attn.hook_pattern`` or
        ``cross_attn.hook_pattern``)."""
        return self.z_site(layer).removesuffix("hook_z") + "hook_pattern"

    def absent_sites(self) -> dict[str, SiteError]:
        """Site name -> the error asking for it raises, for the per-layer sites this model lacks (wildcards skip
        them); empty for every family whose layers are all alike."""
        out: dict[str, SiteError] = {}
        for site, present, error, what in (
                (self.pattern_site, self.pattern_layers(), NoAttentionPatternError, "softmax attention patterns"),
                (self.z_site, self.head_layers(), HeadLayoutError, f"{self.n_heads} heads of {self.d_head}")):
            for layer in sorted(set(range(self.n_layers)) - set(present)):
                out[site(layer)] = error(self.layer_error(layer, what, present))
        return out

    def path_channels(self, layer: int) -> tuple[str, ...]:
        """The inputs through which a head of layer ``layer`` reads the residual stream, as path patching's receiver
        channels: ``("q", "k", "v")`` on a self-attention layer with separate projections, ``("q",)`` on a
        cross-attention layer (its keys and values come from the image features), ``()`` on a layer without heads
        (Qwen3.5's linear attention)."""
        if layer not in self.head_layers():
            return ()
        present = dict(self.attention_module(layer).named_children())
        channels = ("q",) if layer in self.cross_attention_layers() else ("q", "k", "v")
        return tuple(c for c in channels if self.qkv_proj[c] in present)

    def channel_module(self, layer: int, channel: str) -> nn.Module:
        """The projection whose output is channel ``channel`` (``q``, ``k`` or ``v``) of layer ``layer``'s heads.

        Raises:
            SiteError: the layer's heads do not read the residual stream through that channel.
        """
        if channel not in self.path_channels(layer):
            raise SiteError(self.layer_error(layer, f"{channel} input read from the residual stream",
                                             [l for l in range(self.n_layers) if channel in self.path_channels(l)]))
        return get_module(self.attention_module(layer), self.qkv_proj[channel])

    def output_gate(self, layer: int, kind: str, layer_kwargs: dict[str, Any]) -> torch.Tensor | None:
        """What multiplies the output of layer ``layer``'s attention (``kind="attn"``) or MLP (``"mlp"``) module on
        its way into the residual stream, given the keyword arguments the decoder layer was called with; None where
        the output is added as it is (every family but Llama-3.2-Vision, whose cross-attention layers gate both).
        ``hook_attn_out`` / ``hook_mlp_out`` are the gated outputs: what the layer adds."""
        return None

    def residual_scale(self, layer: int) -> torch.Tensor | None:
        """What decoder layer ``layer`` multiplies the whole residual stream by once it has added its attention and
        MLP outputs (Gemma-4's ``layer_scalar``), so that ``hook_resid_post = scale * (hook_resid_pre +
        hook_attn_out + hook_mlp_out)``; None where the layer only adds (every other family). Path patching, which
        adds a sender's write to a later layer's input as it is, refuses a model with one."""
        return None

    def write_sources(self, layer: int, kind: str) -> tuple[nn.Module, ...]:
        """Modules of layer ``layer`` whose outputs, in the same forward, :meth:`residual_write` needs besides the
        attention (``kind="attn"``) or MLP (``"mlp"``) output: none by default; Qwen4-Exp's hyper-connection (its
        per-stream write weights) and per-layer n-gram embedding."""
        return ()

    def residual_write(self, layer: int, kind: str, output: torch.Tensor, layer_kwargs: dict[str, Any],
                       sources: Sequence[Any] = ()) -> torch.Tensor:
        """What layer ``layer``'s attention (``kind="attn"``) or MLP (``"mlp"``) adds to the residual stream, given
        its module's ``output``, the keyword arguments the decoder layer was called with and the outputs of
        :meth:`write_sources` in this forward: ``hook_attn_out`` / ``hook_mlp_out``. The output times
        :meth:`output_gate` by default."""
        gate = self.output_gate(layer, kind, layer_kwargs)
        return output if gate is None else gate.to(output.dtype) * output

    def layer_error(self, layer: int, what: str, present: list[int]) -> str:
        """The message of a per-layer capability that layer ``layer`` lacks: its kind and the layers that have it."""
        return (f"layer {layer} of this {self.display_name} model ({self.layer_kind(layer)}) has no {what}; layers "
                f"{present} have them")

    def layer_kind(self, layer: int) -> str:
        """What mixes tokens in layer ``layer``: ``config.layer_types`` where the text config has it."""
        types = getattr(self.text_config, "layer_types", None)
        return str(types[layer]) if types else "full_attention"

    # ---- modules --------------------------------------------------------------------------------------------
    def layer(self, layer: int) -> nn.Module:
        return get_module(self.model, self.text_layers)[layer]

    def attention_module(self, layer: int) -> nn.Module:
        return get_module(self.layer(layer), self.attention)

    def o_proj_module(self, layer: int) -> nn.Module:
        return get_module(self.attention_module(layer), self.o_proj)

    def mlp_module(self, layer: int) -> nn.Module:
        return get_module(self.layer(layer), self.mlp)

    def o_proj_path(self, layer: int) -> str:
        """Dotted path of layer ``layer``'s o_proj from the model root (for nnsight or ``get_submodule``)."""
        return f"{self.text_layers}.{layer}.{self.attention}.{self.o_proj}"

    def attn_out_module(self, layer: int) -> nn.Module:
        return get_module(self.layer(layer), self.attn_out) if self.attn_out else self.attention_module(layer)

    def mlp_out_module(self, layer: int) -> nn.Module:
        return get_module(self.layer(layer), self.mlp_out) if self.mlp_out else self.mlp_module(layer)

    def vision_block(self, layer: int) -> nn.Module:
        return get_module(self.model, self.vision_blocks)[layer]

    def final_norm_module(self) -> nn.Module:
        """The language model's final norm: :attr:`final_norm` inside the decoder whose layers are
        :attr:`text_layers` (``model.language_model.norm`` for ``model.language_model.layers``). The unembedding
        (``model.get_output_embeddings()``) reads its output; the logit lens decodes a residual stream through both."""
        decoder = self.text_layers.rpartition(".")[0]
        return get_module(self.model, f"{decoder}.{self.final_norm}" if decoder else self.final_norm)

    def final_logit_softcap(self) -> float | None:
        """The cap ``c`` of the tanh softcapping the family's forward applies to the final logits
        (``c * tanh(logits / c)``), or None: the text config's ``final_logit_softcapping`` (PaliGemma 2's Gemma-2);
        a family whose forward ignores that setting overrides this."""
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        return None if cap is None else float(cap)

    def projector_module(self) -> nn.Module:
        return get_module(self.model, self.projector)

    def projector_call_has_image_rows(self, args: tuple) -> bool:
        """Whether one call of the projector module, with positional arguments ``args``, makes image-token rows
        (what ``projector.hook_out`` keeps): every call by default; a family whose projector module is also called
        on something else overrides this (Ovis2's visual embedding table also embeds the visual indicator ids)."""
        return True

    def deepstack_merger_module(self, injection: int) -> nn.Module:
        """The module whose output (``N d_model``, laid out as the projector's) is DeepStack injection
        ``injection``: the ``deepstack.{injection}.hook_out`` site.

        Raises:
            SiteError: the family has no DeepStack injections (families with them override this).
        """
        raise SiteError(f"DeepStack injection {injection} does not exist: {self.display_name} has no DeepStack "
                        "injections")

    def declared_paths(self) -> dict[str, nn.Module]:
        """Every declared module path resolved on this model (the adapter contract tests call this)."""
        return {
            "text_layers": get_module(self.model, self.text_layers),
            "attention": self.attention_module(0),
            "o_proj": self.o_proj_module(0),
            "mlp": self.mlp_module(0),
            "vision_blocks": get_module(self.model, self.vision_blocks),
            "projector": self.projector_module(),
            "final_norm": self.final_norm_module(),
        }

    # ---- tokens ---------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def image_token_id(self) -> int:
        tid = getattr(self.config, self.image_token_attr, None)
        if tid is None:
            tid = getattr(self.config, "image_token_index", None)
        return int(tid)

    def build_prompt(self, prompt: str, n_images: int) -> str:
        """Raw (non-chat) text: one placeholder per image, then the prompt."""
        return self.image_placeholder * n_images + prompt

    def roles(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Role of every position of one row: ``image``, ``special``, ``text`` or ``pad``."""
        special = set(self.tokenizer.all_special_ids) | set(self.extra_special_ids())
        roles = np.full(len(input_ids), "text", dtype=ROLE_DTYPE)  # wide enough for every role name
        roles[np.isin(input_ids, list(special))] = "special"
        roles[input_ids == self.image_token_id] = "image"
        roles[attention_mask == 0] = "pad"
        return roles

    def extra_special_ids(self) -> list[int]:
        """Ids of the family's added tokens that the tokenizer does not list as special (override if needed)."""
        return [i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special]

    def image_grids(
        self,
        inputs: dict[str, torch.Tensor],
        row: int,
        roles: np.ndarray,
        image_ids: list[int],
        image_sizes: list[tuple[int, int]],
    ) -> list[ImageGrid]:
        """The image-token grids of batch row ``row``.

        Args:
            inputs: the processor's outputs for the whole batch.
            row: the batch row.
            roles: ``P`` roles of the row (image positions are where ``roles == "image"``).
            image_ids: batch-global indices of this row's images, in prompt order (index ``image_grid_thw`` etc.).
            image_sizes: ``(width, height)`` of each of this row's original images.

        Returns:
            One :class:`ImageGrid` per grid, with each cell's position and original-image pixel box.
        """
        raise NotImplementedError

    def key_grids(self, inputs: dict[str, torch.Tensor], row: int, image_ids: list[int],
                  image_sizes: list[tuple[int, int]]) -> list[ImageGrid]:
        """Grids over the cross-attention image keys of batch row ``row`` (positions: key indices, the last axis of
        ``cross_attn.hook_pattern``); empty for families whose image sits in the sequence."""
        return []

    def processor_images(self, rows: list[list[Any]]) -> list[Any]:
        """The ``images`` argument of the processor call for a batch whose row ``i`` has the images ``rows[i]``.

        Flat (all images in prompt order) by default; a family whose processor reads a flat list as the images of
        one prompt (Gemma-3) overrides this to pass one list per prompt.
        """
        return [im for row in rows for im in row]

    def processor_kwargs(self, chat: bool) -> dict[str, Any]:
        """Extra keyword arguments of the processor call; ``chat``: the texts came from the chat template.

        Empty by default; a family whose chat template already writes the BOS token that its tokenizer also adds
        (Gemma-3) returns ``{"add_special_tokens": False}`` for chat texts, as ``apply_chat_template`` does.
        """
        return {}

    def resized_size(self, inputs: dict[str, torch.Tensor], image_id: int) -> tuple[int, int] | None:
        """``(width, height)`` in pixels of image ``image_id`` as the processor resized it, where the family writes
        points in that frame (Qwen2.5-VL); None otherwise."""
        return None

    def vision_row_tokens(self, inputs: dict[str, torch.Tensor], image_id: int) -> np.ndarray | None:
        """For each row of image ``image_id`` at a vision-block site, the image token (its index in the image's
        raster order of language-model tokens) that the row is merged into; None where the family does not declare
        it (then vision-block rows cannot be pooled per object or per token)."""
        return None

    def forward_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Extra keyword arguments the family's forward needs beyond the processor's outputs."""
        return {}

    def bidirectional_positions(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Positions of row 0 of the forward's ``inputs`` that may attend to later positions (bidirectional
        blocks): by default those marked nonzero in any ``*token_type_ids`` input (Gemma-3's and Molmo2's image
        blocks). A family whose mask marks them otherwise (PaliGemma's prefix LM) overrides this; the exact patching
        method reuses no cached prefix that ends before the last of them."""
        marked = [torch.nonzero(value[0]).flatten() for key, value in inputs.items()
                  if key.endswith("token_type_ids") and isinstance(value, torch.Tensor)]
        return torch.cat(marked) if marked else torch.zeros(0, dtype=torch.long)

    def position_ids(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Full-length position ids of a batch when the family's are not ``0..P-1`` per row (Qwen's 3-D M-RoPE),
        else None (the model derives them from the cache position). Runs a forward on part of a sequence needs
        them sliced from the full sequence, never recomputed from the part."""
        return None

    @classmethod
    def model_class_for(cls, config: Any) -> str:
        """The transformers class (by name) that loads a checkpoint with ``config``: :attr:`model_class_name`, unless
        a family whose model types have classes of their own overrides this (GLM-4.1V / GLM-4.6V)."""
        return cls.model_class_name

    @classmethod
    def default_attn_implementation(cls, config: Any) -> str:
        """The attention a checkpoint with ``config`` loads with when the caller names none: ``sdpa``, unless the
        family's text model lacks it (PaliGemma 2's Gemma-2: eager)."""
        return "sdpa"

    # ---- description ----------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "display_name": self.display_name,
            "layers": self.n_layers,
            "heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "d_head": self.d_head,
            "d_model": self.d_model,
            "vision_layers": self.n_vision_layers,
        }
