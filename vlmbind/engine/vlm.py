"""Running models: the :class:`VLM` wrapper (:func:`vlmbind.engine.loading.load` makes one).

A :class:`VLM` holds the HF model, its processor and the family adapter. ``prepare`` turns images and prompts into a
:class:`Batch` (processor outputs plus one :class:`~vlmbind.core.tokens.TokenIndex` per row); ``run`` does one real
forward with chosen sites captured and interventions applied, and removes every hook afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from .. import adapters as _adapters  # noqa: F401  (registers the families)
from ..adapters.base import ModelAdapter, adapter_class_for_config
from ..core.choices import ABLATION_MODES, PROMPT_FORMATS
from ..core.errors import InputError, close_matches
from ..core.images import to_rgb
from ..core.sites import Site, parse_heads, resolve_sites
from ..core.tokens import TokenIndex, decode_generated, text_offsets
from ..stimuli.answers import FRAMES, frames_for
from .batches import Batch, RunOutput, append_tokens
from .decoding import generate_ids
from .hooks import AblateHeads, HookSession, Intervention, ZeroImageAttention

TRAINING_FILE = "vlmbind_training.json"
# PROMPT_FORMATS (from vlmbind.core.choices): how a task's prompt reaches the model: ``raw`` (image placeholders then
# the prompt, as the organisms are trained) or ``chat`` (a user turn of the processor's chat template, then the
# assistant turn the answer starts)


class VLM:
    """A loaded vision-language model with its processor and family adapter.

    Attributes:
        model: the Hugging Face model (eval mode).
        processor: its processor.
        adapter: the family adapter bound to both.
        name: the name or path it was loaded from.
        source: where the weights came from (``"tiny (random, seed 0)"``, a directory, a hub id).
    """

    def __init__(self, model: torch.nn.Module, processor: Any, name: str, source: str):
        self.model = model.eval()
        self.processor = processor
        self.adapter: ModelAdapter = adapter_class_for_config(model.config)(model, processor)
        self.name = name
        self.source = source
        # the interventions of the open intervene() / ablate() blocks, applied to every run and generate
        self.active: list[Intervention] = []
        # how the model was trained, for models vlmbind trained (task pools, image size), else None
        self.training: dict[str, Any] | None = None
        self._prompt_format: str | None = None  # None: default_prompt_format

    def __repr__(self) -> str:
        a = self.adapter
        return f"VLM({self.name!r}, family={a.family}, layers={a.n_layers}, heads={a.n_heads})"

    # ---- shapes --------------------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def n_layers(self) -> int:
        return self.adapter.n_layers

    @property
    def n_heads(self) -> int:
        return self.adapter.n_heads

    @property
    def device(self) -> torch.device:
        """Where inputs go: the device the input embeddings run on.

        Under accelerate's offload (``device_map`` with ``"cpu"`` / ``"disk"`` entries) parameters wait on the meta
        device and the module's ``AlignDevicesHook`` says where it executes, so the hook's ``execution_device`` wins
        over the parameters' device.
        """
        embeddings = self.model.get_input_embeddings()
        hook = getattr(embeddings, "_hf_hook", None)
        for h in (hook, *getattr(hook, "hooks", ())):  # a SequentialHook chains several
            device = getattr(h, "execution_device", None)
            if device is not None:
                return torch.device(device)
        for param in (*embeddings.parameters(), *self.model.parameters()):
            if param.device.type != "meta":
                return param.device
        return torch.device("cpu")

    def sites(self, patterns: str | Sequence[str | Site]) -> list[Site]:
        """Resolve site names and ``*`` patterns against this model."""
        a = self.adapter
        return resolve_sites(patterns, a.n_layers, a.n_vision_layers, n_deepstack=a.n_deepstack,
                             absent=a.absent_sites(), cross_layers=a.cross_attention_layers())

    # ---- inputs ----------------------------------------------------------------------------------------------
    def prepare(
        self,
        images: Image.Image | Sequence[Image.Image | Sequence[Image.Image]],
        prompts: str | Sequence[str],
        *,
        chat: bool | None = None,
    ) -> Batch:
        """Turn images and prompts into a model batch (left-padded) with a TokenIndex per row.

        Args:
            images: one image per prompt (or a list of images per prompt); PIL images of any still mode are
                converted to RGB, transparency composited on white (:func:`vlmbind.core.images.to_rgb`).
            prompts: the text after the image(s).
            chat: wrap each prompt in the processor's chat template (real instruction-tuned checkpoints); None:
                as :attr:`active_prompt_format` says (chat for checkpoints with a template, raw for organisms and
                the tiny models, unless :meth:`use_prompt_format` chose).

        Raises:
            InputError: counts do not match, a prompt is empty, or an image is not a PIL image or is animated.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(images, Image.Image):
            images = [images]
        prompts, images = list(prompts), list(images)
        if not prompts:
            raise InputError("no prompts given: pass at least one prompt")
        if len(images) != len(prompts):
            raise InputError(f"{len(images)} images for {len(prompts)} prompts: pass one image (or list) per prompt")
        rows: list[list[Image.Image]] = []
        for i, (img, prompt) in enumerate(zip(images, prompts)):
            if not isinstance(prompt, str) or not prompt.strip():
                raise InputError(f"prompt {i} is empty: every example needs text after its image")
            group = [img] if isinstance(img, Image.Image) else list(img)
            if not group:
                raise InputError(f"example {i} has no image; vlmbind analyses image-conditioned prompts")
            for im in group:
                if not isinstance(im, Image.Image):
                    raise InputError(f"example {i}: expected a PIL image, got {type(im).__name__}")
            rows.append([to_rgb(im, f"example {i}'s image") for im in group])
        if chat is None:
            chat = self.active_prompt_format == "chat"
        texts = [self.prompt_text(p, len(r), chat) for p, r in zip(prompts, rows)]
        tok = self.adapter.tokenizer
        old_side = tok.padding_side
        tok.padding_side = "left"
        try:
            inputs = self.processor(
                images=self.adapter.processor_images(rows), text=texts, return_tensors="pt", padding=True,
                **self.adapter.processor_kwargs(chat),
            )
        finally:
            tok.padding_side = old_side
        inputs = {k: v for k, v in inputs.items() if k not in self.adapter.dropped_inputs}
        index = self.token_index(inputs, rows)
        return Batch(inputs=inputs, index=index, prompts=prompts, images=rows)

    def prompt_text(self, prompt: str, n_images: int, chat: bool) -> str:
        """The text the processor gets for one prompt with ``n_images`` images (raw placeholders, or the chat
        template's user turn)."""
        if not chat:
            return self.adapter.build_prompt(prompt, n_images)
        if getattr(self.processor, "chat_template", None) is None:
            raise InputError(f"{self.name} has no chat template; call prepare(..., chat=False)")
        content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": prompt}]
        return self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.processor, "chat_template", None) is not None

    @property
    def default_prompt_format(self) -> str:
        """``chat`` for checkpoints with a chat template; ``raw`` for those without one, for models vlmbind trained
        (they saw raw prompts) and for the registered random tiny models (their templates are stand-ins; pass
        ``chat`` to exercise the template path)."""
        built_here = self.training is not None or self.source.startswith("tiny (")
        return "raw" if built_here or not self.has_chat_template else "chat"

    @property
    def active_prompt_format(self) -> str:
        """The format :meth:`prepare` uses when not told: set by :meth:`use_prompt_format` (every command's
        ``--prompt-format``), else :attr:`default_prompt_format`."""
        return self._prompt_format or self.default_prompt_format

    def use_prompt_format(self, value: str | None) -> str:
        """Make ``value`` (checked as :meth:`prompt_format` checks it; None: the default) the format every prompt
        of this model is rendered in from now on; returns it."""
        self._prompt_format = None if value is None else self.prompt_format(value)
        return self.active_prompt_format

    def prompt_format(self, value: str | None) -> str:
        """``value`` checked (None: :attr:`active_prompt_format`).

        Raises:
            InputError: an unknown format, or ``chat`` for a model without a chat template.
        """
        if value is None:
            return self.active_prompt_format
        if value not in PROMPT_FORMATS:
            raise InputError(f"unknown prompt format {value!r}; formats: {', '.join(PROMPT_FORMATS)}")
        if value == "chat" and not self.has_chat_template:
            raise InputError(f"{self.name} has no chat template; use the raw prompt format")
        return value

    def answer_separator(self, chat: bool) -> str:
        """What comes between the prompt and the answer's first word: a space after a raw prompt (``... and a``
        then `` red``); in a chat reply nothing after a template that opens the reply on a new line (ChatML's
        ``assistant\n``, Gemma-3's ``model\n``) or with a marker token (Gemma-4's ``<channel|>``, Kimi's
        ``<|im_middle|>``, Cohere's ``<|CHATBOT_TOKEN|>``), and a space after one that ends on a word (LLaVA's
        ``ASSISTANT:``)."""
        if not chat:
            return " "
        cached = getattr(self, "_chat_separator", None)
        if cached is None:  # rendered once: every pair asks
            rendered = self.prompt_text("x", 1, chat=True)
            markers = [t.content for t in self.adapter.tokenizer.added_tokens_decoder.values() if t.content.strip()]
            ends_on_marker = any(rendered.endswith(m) for m in markers)
            cached = self._chat_separator = "" if rendered[-1:].isspace() or ends_on_marker else " "
        return cached

    def answer_ids(self, answer: str, chat: bool) -> list[int]:
        """The token ids of ``answer`` as it continues a prompt in the given format (see :meth:`answer_separator`).

        Raises:
            InputError: the answer is empty or gives no token.
        """
        if not isinstance(answer, str) or not answer.strip():
            raise InputError(f"answer must be a non-empty string, got {answer!r}")
        ids = self.adapter.tokenizer(self.answer_separator(chat) + answer.strip(),
                                     add_special_tokens=False)["input_ids"]
        if not ids:
            raise InputError(f"answer {answer!r} gives no token")
        return [int(i) for i in ids]

    def extend(self, batch: Batch, ids: Sequence[int]) -> Batch:
        """A one-row ``batch`` with ``ids`` appended as text tokens (attention 1, token types 0), token index
        rebuilt. Tokens are appended by id, never re-tokenised from decoded text (a decoded SentencePiece prefix
        loses its leading space)."""
        if len(batch) != 1:
            raise InputError(f"extend takes a one-row batch, got {len(batch)} rows")
        extra = torch.as_tensor(list(ids), dtype=batch.inputs["input_ids"].dtype)[None]
        inputs = append_tokens(self.adapter, batch.inputs, extra)
        return Batch(inputs=inputs, index=self.token_index(inputs, batch.images), prompts=batch.prompts,
                     images=batch.images)

    def token_index(self, inputs: dict[str, torch.Tensor], rows: list[list[Image.Image]]) -> list[TokenIndex]:
        """One TokenIndex per row of processor ``inputs`` (also of inputs extended by appended tokens)."""
        ids = inputs["input_ids"].cpu().numpy()
        mask = inputs["attention_mask"].cpu().numpy()
        index, next_image = [], 0
        for r, row_images in enumerate(rows):
            roles = self.adapter.roles(ids[r], mask[r])
            sizes = [im.size for im in row_images]
            image_ids = list(range(next_image, next_image + len(row_images)))
            next_image += len(row_images)
            grids = self.adapter.image_grids(inputs, r, roles, image_ids, sizes)
            key_grids = self.adapter.key_grids(inputs, r, image_ids, sizes)
            offsets, text = text_offsets(self.adapter.tokenizer, ids[r], roles)
            index.append(TokenIndex(ids[r], roles, grids, offsets, text, sizes, key_grids))
        return index

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """The forward's keyword arguments for ``batch``: its tensors on :attr:`device` plus the family's extras."""
        device = self.device
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.inputs.items()}
        inputs.update(self.adapter.forward_kwargs(inputs))
        return inputs

    # ---- running ----------------------------------------------------------------------------------------------
    def run(
        self,
        batch: Batch,
        *,
        sites: str | Sequence[str | Site] = (),
        interventions: Sequence[Intervention] = (),
        grad: bool = False,
        logits_at: Sequence[int] | None = None,
    ) -> RunOutput:
        """One forward with ``sites`` captured and ``interventions`` (plus any active ones) applied.

        Args:
            logits_at: compute the logits only at these positions (``logits_to_keep``): a real vocabulary's logits
                over every position take ~0.8 GB a row at 1,300 tokens, where a score needs one position.

        Returns:
            RunOutput with ``logits`` ``B P V`` (``B len(logits_at) V`` with ``logits_at``) and ``cache`` site name
            -> tensor (shapes in :mod:`vlmbind.core.sites`).
        """
        resolved = self.sites(sites) if sites else []
        session = HookSession(
            self.adapter, resolved, [*self.active, *interventions], index=batch.index, detach=not grad
        )
        with contextlib.ExitStack() as stack:
            if not grad:
                stack.enter_context(torch.no_grad())
            stack.enter_context(session)
            keep = {} if logits_at is None else {"logits_to_keep": torch.as_tensor(list(logits_at), dtype=torch.long,
                                                                               device=self.device)}
            out = self.model(**self.model_inputs(batch), use_cache=False, **keep)
        cache = {name: (vals[0] if len(vals) == 1 else torch.cat(vals, 0)) for name, vals in session.captured.items()}
        return RunOutput(logits=out.logits, cache=cache)

    def logits(self, batch: Batch, interventions: Sequence[Intervention] = (),
               at: Sequence[int] | None = None) -> torch.Tensor:
        """``B P V`` logits of one forward (``B len(at) V``: only at the positions ``at``)."""
        return self.run(batch, interventions=interventions, logits_at=at).logits

    def capture(self, batch: Batch, sites: str | Sequence[str | Site]) -> dict[str, torch.Tensor]:
        """Captured activations for ``sites`` (site name -> tensor). The unembedding runs at one position only: the
        logits are not returned, and over every position of a real vocabulary they would take ~0.8 GB a row."""
        return self.run(batch, sites=sites, logits_at=[0]).cache

    def head_means(self, batch: Batch, layer: int, heads: Sequence[int], per_position: bool = False,
                   by_role: bool = False) -> Any:
        """Mean z of ``heads`` at ``layer`` over the batch (for :class:`AblateHeads`), padding excluded.

        Returns ``h D``; ``P h D`` with ``per_position``; with ``by_role``, role -> ``h D``, the mean over the
        batch's tokens of each role present (``image``, ``text``, ``special``; see :class:`TokenIndex`).
        """
        if per_position and by_role:
            raise InputError("head_means: choose per_position or by_role, not both")
        site = self.adapter.z_site(layer)
        z = self.capture(batch, site)[site][:, :, list(heads)]
        if by_role:
            roles = np.stack([ti.roles for ti in batch.index])
            out = {}
            for role in sorted(set(roles.ravel().tolist()) - {"pad"}):
                mask = torch.as_tensor(roles == role, device=z.device)
                out[role] = z[mask].mean(0)
            return out
        mask = batch.inputs["attention_mask"].to(z.device, z.dtype)[:, :, None, None]
        if per_position:
            return (z * mask).sum(0) / mask.sum(0).clamp_min(1)
        return (z * mask).sum((0, 1)) / mask.sum((0, 1)).clamp_min(1)

    @contextlib.contextmanager
    def intervene(self, interventions: Sequence[Intervention]) -> Iterator[VLM]:
        """Apply interventions to every run and generate inside the block; they are checked on entry."""
        interventions = list(interventions)
        for i in interventions:
            i.check(self.adapter)
        self.active.extend(interventions)
        try:
            yield self
        finally:
            for i in interventions:
                self.active.remove(i)

    def ablate(
        self,
        heads: Any,
        mode: str = "image_attention",
        *,
        renormalize: bool = False,
        means: dict[int, torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager[VLM]:
        """Context manager ablating heads in every run inside it.

        Args:
            heads: ``[(layer, head), ...]`` or ``"12.3,14.0"``.
            mode: ``image_attention`` (zero attention to image tokens after the softmax), ``zero``, ``mean`` or
                ``role_mean`` (z; see :class:`AblateHeads`).
            renormalize: for ``image_attention``: renormalise the remaining attention.
            means: for ``mean``: layer -> ``h D`` means of that layer's listed heads, in the order given; for
                ``role_mean``: layer -> role -> ``h D`` (:meth:`head_means` with ``by_role``).
        """
        by_layer: dict[int, list[int]] = {}
        for layer, head in parse_heads(heads):
            by_layer.setdefault(layer, []).append(head)
        modes = ABLATION_MODES
        if mode not in modes:
            raise InputError(f"ablation mode {mode!r} is not one of {modes}.{close_matches(mode, modes)}")
        items: list[Intervention] = []
        for layer, hs in sorted(by_layer.items()):
            if mode == "image_attention":
                items.append(ZeroImageAttention(layer=layer, heads=hs, renormalize=renormalize))
            elif mode == "zero":
                items.append(AblateHeads(layer=layer, heads=hs, mode="zero"))
            else:
                if means is None or layer not in means:
                    raise InputError(f"{mode} ablation of layer {layer} needs means[{layer}] (see VLM.head_means)")
                items.append(AblateHeads(layer=layer, heads=hs, mode=mode, means=means[layer]))
        return self.intervene(items)

    def generate(
        self,
        batch: Batch,
        max_new_tokens: int = 16,
        *,
        interventions: Sequence[Intervention] = (),
        sites: str | Sequence[str | Site] = (),
        **kwargs: Any,
    ) -> tuple[list[str], dict[str, list[torch.Tensor]]]:
        """Greedy generation with interventions applied at every step.

        Returns:
            The decoded continuations, and site name -> list of per-step captures.
        """
        resolved = self.sites(sites) if sites else []
        session = HookSession(self.adapter, resolved, [*self.active, *interventions], index=batch.index)
        out = generate_ids(self, batch, max_new_tokens, session, **kwargs)
        new = out[:, batch.seq_len :]
        texts = [decode_generated(self.adapter.tokenizer, row.tolist()) for row in new]
        return texts, session.captured

    def point_frames(self, frame: str | None = None) -> dict[str, str | None]:
        """The coordinate frame of each point format this model writes (see :mod:`vlmbind.stimuli.answers`).

        Qwen2-VL boxes and Molmo tags carry their frame; plain ``(x, y)`` tuples are canvas cells for a model
        vlmbind trained (it learned the Point-to-Answer format), the family declares the rest (Qwen2.5-VL JSON:
        resized pixels), and ``frame`` (a user's ``--point-frame``) sets every format that is still unknown.
        """
        declared: dict[str, str | None] = dict(self.adapter.point_frames)
        if self.training is not None:
            declared.setdefault("tuple", "canvas")
        frames = frames_for(declared)
        if frame is not None:
            if frame not in FRAMES:
                raise InputError(f"unknown point frame {frame!r}; frames: {', '.join(FRAMES)}"
                                 f"{close_matches(frame, FRAMES)}")
            frames = {f: (v if v is not None else frame) for f, v in frames.items()}
        return frames

    def nnsight(self) -> Any:
        """An ``nnsight.NNsight`` wrapper of the same model object, for ad-hoc traces beside vlmbind's analyses."""
        from nnsight import NNsight

        return NNsight(self.model)

    @staticmethod
    def nnsight_module(nn_model: Any, path: str) -> Any:
        """The envoy at a dotted module path (e.g. ``vlm.adapter.o_proj_path(3)``) inside an nnsight wrapper."""
        envoy = nn_model
        for part in path.split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        return envoy

    def describe(self) -> dict[str, Any]:
        d = self.adapter.describe()
        d.update(name=self.name, source=self.source)
        return d


__all__ = ["VLM", "Batch", "RunOutput", "TRAINING_FILE"]
