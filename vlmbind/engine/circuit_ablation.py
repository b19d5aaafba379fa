"""Running a circuit: the clean prompt with every scored edge outside the circuit ablated, the faithfulness test of
edge circuits.

An ablated edge ``sender -> receiver (channel)`` means the receiver head, at the receiver positions, reads through
``channel`` a residual stream in which the sender's write at the sender positions is the counterfactual one (the
sender's :class:`~vlmbind.engine.paths.PathTask` value) instead of what the sender writes in this run; an ablated
``sender -> logits`` edge means the unembedding reads that counterfactual write. Edges inside the circuit, and every
edge not scored at all (MLPs, embeddings and norms are not nodes: their inputs and outputs flow as they are), carry
the run's own values. A receiver's changed output is carried downstream by the residual stream, and a sender's "own
value" is what it computes in this run, so ablations compose through the layers (the graph semantics of edge
attribution benchmarks: a receiver's input is its residual stream plus the sum, over its ablated incoming edges, of
counterfactual minus actual sender writes).

One forward per circuit: each receiver layer is run again, inside the forward, once per distinct set of ablated
senders its heads read (and once more to assemble a head whose q, k and v read different sets); the receivers'
outputs at the receiver positions are spliced into the forward. With only one edge ablated this is path patching
of that edge (:func:`~vlmbind.engine.paths.naive_path_diffs`), which the tests check; with none, it is the plain
forward. Where a family normalises the attention output before the residual stream (Gemma-3's post-norms), several
senders of one layer ablated together add their single-head write changes, a first-order sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..core.errors import InputError
from .hooks import ATTENTION_IMPL, STATE_EDITS, attention_implementation
from .patching import _diff, first_output, head_writes, rows_without_prefix, start_at_layer, with_first_output
from .paths import Edge, PathTask, _inputs_from_layer, check_edges

Sender = tuple[int, int]


def circuit_diffs(vlm: Any, task: PathTask, edges: Sequence[Edge], circuits: Sequence[Any]
                  ) -> tuple[float, np.ndarray]:
    """``logit[a*] - logit[a]`` at the score position with every edge of ``edges`` outside each circuit ablated.

    Args:
        vlm: a loaded VLM.
        task: the clean prompt, positions and counterfactual sender values.
        edges: the scored edges.
        circuits: boolean masks over ``edges`` (True: in the circuit, kept).

    Returns:
        ``(unablated difference, one difference per circuit)``.

    Raises:
        InputError: a mask whose length is not the number of edges, or an edge that does not fit ``vlm`` and
            ``task`` (:func:`~vlmbind.engine.paths.check_edges`).
    """
    check_edges(vlm, task, edges)
    masks = [np.asarray(c, dtype=bool) for c in circuits]
    for mask in masks:
        if mask.shape != (len(edges),):
            raise InputError(f"a circuit is a mask over the {len(edges)} edges, got one of shape {mask.shape}")
    with torch.no_grad():
        entering: dict[str, torch.Tensor] = {}
        full = _ablated_diff(vlm, task, [], keep_input=entering)
        # the image encoder's work is the same in every circuit's run: start them at the first decoder layer
        out = np.array([_ablated_diff(vlm, task, [e for e, kept in zip(edges, m) if not kept], start=entering["x"])
                        for m in masks])
    return full, out


class _AblatedForward:
    """The hooks of one forward with ``ablated`` edges (see the module docstring)."""

    def __init__(self, vlm: Any, task: PathTask, ablated: Sequence[Edge]) -> None:
        self.vlm, self.task = vlm, task
        adapter = vlm.adapter
        self.n_heads, self.d_head = vlm.n_heads, adapter.d_head
        self.reads: dict[int, dict[int, dict[str, frozenset[Sender]]]] = {}  # layer -> head -> channel -> senders
        self.to_logits: set[Sender] = set()
        for edge in ablated:
            if edge.receiver is None:
                self.to_logits.add(edge.sender)
                continue
            layer, head = edge.receiver
            channels = self.reads.setdefault(layer, {}).setdefault(head, {})
            channels[edge.channel] = channels.get(edge.channel, frozenset()) | {edge.sender}
        self.senders = {e.sender for e in ablated}
        self.delta: dict[Sender, torch.Tensor] = {}  # counterfactual minus actual write, n d_model
        self.splice: dict[int, dict[int, torch.Tensor]] = {}  # layer -> head -> z at the receiver positions
        self.nested = False
        self.seen: dict[str, torch.Tensor] = {}

    # ---- the main forward -----------------------------------------------------------------------------------
    def on_z(self, layer: int) -> Any:
        """o_proj pre-hook: splice the receivers' outputs, then record what the layer's ablated senders change."""
        def hook(module: Any, args: tuple) -> tuple | None:
            z = args[0]
            if self.nested:
                self.seen["z"] = z
                return None
            heads = self.splice.get(layer)
            if heads:
                z = z.clone()
                view = z.view(*z.shape[:2], self.n_heads, -1)
                at = torch.as_tensor(self.task.receiver_positions, device=z.device)
                for head, value in heads.items():
                    view[0, at, head] = value.to(z)
            mine = sorted(h for l, h in self.senders if l == layer)
            if mine:
                at = torch.as_tensor(self.task.sender_positions, device=z.device)
                now = z[0, at].reshape(len(at), self.n_heads, -1)
                self.nested = True  # head_writes calls o_proj again
                try:
                    writes = head_writes(self.vlm, layer, now, self.task.values[layer])
                finally:
                    self.nested = False
                for head in mine:
                    self.delta[(layer, head)] = writes[head]
            return (z, *args[1:]) if heads else None
        return hook

    def on_layer(self, layer: int) -> Any:
        """Decoder-layer pre-hook: compute the receivers' outputs from their ablated inputs (nested calls)."""
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if self.nested:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            self.nested = True
            try:
                self.splice[layer] = self._receivers(module, layer, hidden, args, kwargs)
            finally:
                self.nested = False
        return hook

    def on_last(self, module: Any, args: tuple, output: Any) -> Any:
        """Last decoder layer's forward hook: the unembedding reads the ablated direct edges' counterfactuals."""
        if self.nested:
            return None
        hidden = first_output(output).clone()
        at = torch.as_tensor(self.task.sender_positions, device=hidden.device)
        hidden[0, at] += sum(self.delta[s] for s in sorted(self.to_logits)).to(hidden)
        return with_first_output(output, hidden)

    # ---- the receivers of one layer -------------------------------------------------------------------------
    def _receivers(self, module: Any, layer: int, hidden: torch.Tensor, args: tuple, kwargs: dict
                   ) -> dict[int, torch.Tensor]:
        channels = self.vlm.adapter.path_channels(layer)
        reads = {head: {c: sets.get(c, frozenset()) for c in channels} for head, sets in self.reads[layer].items()}
        variants = {s for sets in reads.values() for s in sets.values() if s}
        states = {senders: self._run(module, layer, self._ablated_input(hidden, senders), args, kwargs, capture=True)
                  for senders in sorted(variants, key=sorted)}
        out: dict[int, torch.Tensor] = {}
        at = torch.as_tensor(self.task.receiver_positions, device=hidden.device)
        mixed = {}
        for head, sets in reads.items():
            distinct = set(sets.values())
            if len(distinct) == 1 and frozenset() not in distinct:  # every channel reads the same ablated stream
                z = states[distinct.pop()]["z"]
                out[head] = z.view(*z.shape[:2], self.n_heads, -1)[0, at, head]
            elif distinct != {frozenset()}:
                mixed[head] = sets
        if mixed:
            z = self._run(module, layer, hidden, args, kwargs, capture=False, assemble=(mixed, states))["z"]
            for head in mixed:
                out[head] = z.view(*z.shape[:2], self.n_heads, -1)[0, at, head]
        return out

    def _ablated_input(self, hidden: torch.Tensor, senders: frozenset[Sender]) -> torch.Tensor:
        x = hidden.clone()
        at = torch.as_tensor(self.task.sender_positions, device=x.device)
        x[0, at] += sum(self.delta[s] for s in sorted(senders)).to(x)
        return x

    def _run(self, module: Any, layer: int, hidden: torch.Tensor, args: tuple, kwargs: dict, *, capture: bool,
             assemble: tuple[dict, dict] | None = None) -> dict[str, torch.Tensor]:
        """Layer ``layer`` on ``hidden``: its query projection's output, each query head's key and value (``B H P D``)
        and z; with ``assemble``, each mixed head's q, k and v taken from the runs of the sets it reads them from."""
        adapter = self.vlm.adapter
        seen: dict[str, torch.Tensor] = {}
        channels = adapter.path_channels(layer)

        def states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if capture:
                seen["k"], seen["v"] = k, v
            if assemble is not None:
                mixed, runs = assemble
                k, v = k.clone(), v.clone()
                for head, sets in mixed.items():
                    for name, tensor in (("k", k), ("v", v)):
                        if name in channels and sets[name]:
                            tensor[:, head] = runs[sets[name]][name][:, head]
            return q, k, v

        def queries(proj: Any, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if capture:
                seen["q"] = output
            if assemble is None:
                return None
            mixed, runs = assemble
            output = output.clone()
            view = output.view(*output.shape[:2], self.n_heads, -1)  # head-major, with Qwen3.5's gate
            for head, sets in mixed.items():
                if sets.get("q"):
                    q = runs[sets["q"]]["q"]
                    view[:, :, head] = q.view(*q.shape[:2], self.n_heads, -1)[:, :, head]
            return output

        attention = adapter.attention_module(layer)
        setattr(attention, STATE_EDITS, [states])
        handle = adapter.channel_module(layer, "q").register_forward_hook(queries) if "q" in channels else None
        self.seen.clear()
        try:
            if args:
                module(hidden, *args[1:], **kwargs)
            else:
                module(*args, **{**kwargs, "hidden_states": hidden})
        finally:
            attention.__dict__.pop(STATE_EDITS, None)
            if handle is not None:
                handle.remove()
        seen["z"] = self.seen.pop("z")
        return seen


def _ablated_diff(vlm: Any, task: PathTask, ablated: Sequence[Edge], keep_input: dict | None = None,
                  start: torch.Tensor | None = None) -> float:
    """The clean prompt's logit difference with ``ablated`` edges ablated (one forward); ``keep_input`` receives
    the residual stream entering the first decoder layer (``"x"``), ``start`` is one to begin at."""
    adapter = vlm.adapter
    run = _AblatedForward(vlm, task, ablated)
    handles = []
    stack = contextlib.ExitStack()
    try:
        if keep_input is not None:
            handles.append(adapter.layer(0).register_forward_pre_hook(_keep_input(keep_input), with_kwargs=True))
        inputs = vlm.model_inputs(task.batch)
        if start is not None and rows_without_prefix(vlm):
            stack.enter_context(start_at_layer(adapter, 0, start))
            inputs = _inputs_from_layer(vlm, task.batch)
        for layer in sorted({l for l, _ in run.senders} | set(run.reads)):
            handles.append(adapter.o_proj_module(layer).register_forward_pre_hook(run.on_z(layer)))
        for layer in sorted(run.reads):
            handles.append(adapter.layer(layer).register_forward_pre_hook(run.on_layer(layer), with_kwargs=True))
        if run.to_logits:
            handles.append(adapter.layer(vlm.n_layers - 1).register_forward_hook(run.on_last))
        with attention_implementation(adapter, ATTENTION_IMPL):
            logits = vlm.model(**inputs, use_cache=False, logits_to_keep=torch.tensor([task.score_position])).logits
    finally:
        stack.close()
        for handle in handles:
            handle.remove()
    return float(_diff(logits[0, 0], task.a, task.a_star))


def _keep_input(into: dict[str, torch.Tensor]) -> Any:
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        into["x"] = (args[0] if args else kwargs["hidden_states"]).detach()
    return hook
