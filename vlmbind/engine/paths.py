"""Path patching: the effect of one head on another through one of its inputs, or on the logits directly.

An edge ``(sender, receiver, channel)`` carries the counterfactual from the sender head's output z at the sender
positions into the receiver head's query, key or value input (``channel`` ``q``, ``k``, ``v``) and nowhere else:
every other attention and MLP output after the sender stays at its clean value, so the residual stream the receiver
reads differs from the clean one by what the sender writes and nothing more. The receiver's new output, at the
receiver positions, is then patched into a clean run where everything downstream of it runs freely, and the logit
difference ``logit[a*] - logit[a]`` at the scored position is read. Channel ``logits`` (receiver None) is the
direct path: the sender's change reaches the unembedding with every later component frozen.

Two implementations give the same numbers:

- :func:`naive_path_diffs`, the reference: per edge, four plain forwards (clean; sender patched, its write into
  the residual stream read off; the clean run with that write added to the receiver layer's input and the other two
  projections held at their clean outputs, the receiver's z read off; the clean run with the receiver patched).
- :func:`exact_path_diffs`: per sender and channel one forward from the sender's layer with everything after it
  frozen gives every later head's path-patched z at once (the direct path's logits come with it); the receivers'
  effects are then node patches, run by :func:`vlmbind.engine.patching.exact_diffs` (prefix-cache reuse, many
  receivers packed in one pass, receivers whose z did not change skipped exactly).

:func:`attribution_path_diffs` estimates the same numbers to first order (EAP, or EAP-IG with ``steps``);
:func:`atp_star_path_diffs` computes each receiver's change exactly and only what follows it to first order (AtP*'s
QK fix at edge level, with GradDrop).

A receiver's other heads in the same layer and grouped-query key/value sharing do not matter: a head's z is read
from its own slice, so patching the shared key of a group into the layer changes only that head's slice that is
used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..core.choices import PATH_CHANNELS as CHANNELS
from ..core.errors import InputError, UnsupportedModelError
from .hooks import ATTENTION_IMPL, STATE_EDITS, HookSession, attention_implementation
from .interventions import PatchHeads
from .patching import (
    PatchTask,
    _atp_star_pass,
    _diff,
    exact_diffs,
    first_output,
    head_writes,
    rows_without_prefix,
    sequence_keys,
    start_at_layer,
    with_first_output,
)

LOGITS = "logits"


class Edge(NamedTuple):
    """Sender head ``(layer, head)`` into receiver head ``(layer, head)`` through ``channel`` (``q``, ``k``, ``v``),
    or into the logits directly (receiver None, channel ``logits``)."""

    sender: tuple[int, int]
    receiver: tuple[int, int] | None
    channel: str

    @property
    def label(self) -> str:
        s = f"{self.sender[0]}.{self.sender[1]}"
        if self.receiver is None:
            return f"{s} -> logits"
        return f"{s} -> {self.receiver[0]}.{self.receiver[1]} ({self.channel})"


@dataclass
class PathTask:
    """One clean prompt to path-patch.

    Attributes:
        batch: the clean prompt, one row.
        sender_positions: sorted positions where senders take their counterfactual output.
        receiver_positions: sorted positions where receivers take their path-patched output.
        values: sender layer -> ``n H D`` counterfactual head outputs at the sender positions.
        score_position: where the logits are read.
        a: the clean answer's token id.
        a_star: the counterfactual answer's token id.
    """

    batch: Any
    sender_positions: np.ndarray
    receiver_positions: np.ndarray
    values: dict[int, torch.Tensor]
    score_position: int
    a: int
    a_star: int

    @classmethod
    def from_counterfactual(cls, vlm: Any, clean: Any, counterfactual: Any, sender_positions: Any,
                            receiver_positions: Any, layers: Sequence[int], a: int, a_star: int) -> PathTask:
        """Senders of ``layers`` take ``counterfactual``'s (one row, lined up with ``clean``) head outputs at the
        sender positions; scored at the clean prompt's last position."""
        positions = np.asarray(sender_positions)
        z = vlm.capture(counterfactual, [vlm.adapter.z_site(l) for l in layers])
        values = {l: z[vlm.adapter.z_site(l)][0, positions] for l in layers}
        return cls(clean, positions, np.asarray(receiver_positions), values, clean.index[0].last_position, a, a_star)

    def __post_init__(self) -> None:
        if len(self.batch) != 1:
            raise InputError(f"a PathTask holds one clean prompt, got a batch of {len(self.batch)}")
        for name in ("sender_positions", "receiver_positions"):
            positions = np.unique(np.asarray(getattr(self, name), dtype=np.int64))
            if positions.size == 0:
                raise InputError(f"a PathTask needs at least one of its {name.replace('_', ' ')}")
            setattr(self, name, positions)


def check_edges(vlm: Any, task: PathTask, edges: Sequence[Edge]) -> None:
    """Raise :class:`InputError` (or the layer's :class:`~vlmbind.core.errors.SiteError`) unless every edge fits
    ``vlm`` and ``task``: heads in range, receivers after their senders, a channel the receiver's layer reads the
    residual stream through, positions inside the prompt and sender values of shape ``n H D``.

    Raises:
        UnsupportedModelError: what a layer writes depends on more than its attention and MLP outputs
            (``adapter.write_sources``: Qwen4-Exp's hyper-connections), which path patching cannot hold, or a layer
            rescales the residual stream (``adapter.residual_scale``: Gemma-4's layer scalars).
    """
    n_layers, n_heads = vlm.n_layers, vlm.n_heads
    adapter = vlm.adapter
    if any(adapter.write_sources(l, kind) for l in range(n_layers) for kind in ("attn", "mlp")):
        raise UnsupportedModelError(
            f"path patching holds every later attention and MLP output at its clean value; {adapter.display_name}'s "
            "layers write them into the residual stream with weights read from it (hyper-connections), which it "
            "cannot hold: not supported on this family")
    scaled = [l for l in range(n_layers) if adapter.residual_scale(l) is not None]
    if scaled:
        raise UnsupportedModelError(
            f"path patching adds a sender's write to a later layer's input as it is; {adapter.display_name}'s layers "
            f"rescale the whole residual stream (layers {scaled[:3]}{'...' if len(scaled) > 3 else ''}: "
            "adapter.residual_scale), which it does not model: not supported on this family")
    seq = task.batch.seq_len
    for edge in edges:
        heads = [edge.sender] + ([edge.receiver] if edge.receiver is not None else [])
        if any(not (0 <= l < n_layers and 0 <= h < n_heads) for l, h in heads):
            raise InputError(f"edge {edge.label}: heads must lie inside the model's {n_layers} layers x {n_heads} "
                             "heads")
        if edge.receiver is None:
            if edge.channel != LOGITS:
                raise InputError(f"edge {edge.label}: an edge into the logits has channel {LOGITS!r}, got "
                                 f"{edge.channel!r}")
            continue
        if edge.channel not in CHANNELS:
            raise InputError(f"edge {edge.label}: channel must be one of {', '.join(CHANNELS)}, got {edge.channel!r}")
        if edge.receiver[0] <= edge.sender[0]:
            raise InputError(f"edge {edge.label}: the receiver's layer must come after the sender's")
        vlm.adapter.channel_module(edge.receiver[0], edge.channel)
    for name in ("sender_positions", "receiver_positions"):
        positions = getattr(task, name)
        if positions.min() < 0 or positions.max() >= seq:
            raise InputError(f"{name.replace('_', ' ')} {positions.tolist()} must lie inside the prompt of {seq} "
                             "tokens")
    if not 0 <= task.score_position < seq:
        raise InputError(f"score position {task.score_position} must lie inside the prompt of {seq} tokens")
    want = (task.sender_positions.size, n_heads, vlm.adapter.d_head)
    absent = vlm.adapter.absent_sites()
    for layer in sorted({e.sender[0] for e in edges}):
        error = absent.get(vlm.adapter.z_site(layer))
        if error is not None:
            raise type(error)(f"cannot patch heads of layer {layer}: {error}")
        value = task.values.get(layer)
        if value is None or tuple(value.shape) != want:
            got = None if value is None else tuple(value.shape)
            raise InputError(f"sender values of layer {layer} must have shape (positions, heads, d_head) = {want}, "
                             f"got {got}")


@contextlib.contextmanager
def _hooks(registrations: Sequence[tuple[torch.nn.Module, Any]]) -> Iterator[None]:
    """Register forward hooks ``(module, hook)``; all removed on exit, also after an error."""
    handles = []
    try:
        for module, hook in registrations:
            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _record(into: dict[Any, torch.Tensor], key: Any) -> Any:
    def hook(module: Any, args: tuple, output: Any) -> None:
        into[key] = first_output(output).detach()
    return hook


def _hold(value: torch.Tensor) -> Any:
    """A forward hook making a module return ``value`` (its clean output) in place of what it computed."""
    def hook(module: Any, args: tuple, output: Any) -> Any:
        return with_first_output(output, value)
    return hook


def _add_to_output(delta: torch.Tensor) -> Any:
    """A forward hook adding ``delta`` to a decoder layer's output hidden states."""
    def hook(module: Any, args: tuple, output: Any) -> Any:
        return with_first_output(output, first_output(output) + delta)
    return hook


def _add_to_input(delta: torch.Tensor) -> Any:
    """A forward pre-hook (with kwargs) adding ``delta`` to a decoder layer's input hidden states."""
    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (args[0] + delta, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + delta}
    return hook


@dataclass
class _CleanRun:
    """What the exact method keeps of the clean forward: logit difference, residual entering each sender layer, and
    every later layer's attention and MLP outputs and q / k / v projections, and the clean z (``P H D``) of the
    senders' and receivers' layers."""

    diff: float
    resid: dict[int, torch.Tensor]
    z: dict[int, torch.Tensor]
    attn: dict[int, torch.Tensor]
    mlp: dict[int, torch.Tensor]
    proj: dict[tuple[int, str], torch.Tensor]


def _clean_run(vlm: Any, task: PathTask, first: int) -> _CleanRun:
    adapter = vlm.adapter
    senders = sorted(task.values)
    attn: dict[int, torch.Tensor] = {}
    mlp: dict[int, torch.Tensor] = {}
    proj: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for layer in range(first, vlm.n_layers):
        hooks.append((adapter.attn_out_module(layer), _record(attn, layer)))
        hooks.append((adapter.mlp_out_module(layer), _record(mlp, layer)))
        for channel in adapter.path_channels(layer):
            hooks.append((adapter.channel_module(layer, channel), _record(proj, (layer, channel))))
    z_layers = [l for l in range(first, vlm.n_layers) if l in senders or adapter.path_channels(l)]
    sites = vlm.sites([f"blocks.{l}.hook_resid_pre" for l in senders] + [adapter.z_site(l) for l in z_layers])
    with _hooks(hooks), HookSession(adapter, sites) as session:
        logits = vlm.model(**vlm.model_inputs(task.batch), use_cache=False,
                           logits_to_keep=torch.tensor([task.score_position])).logits
    resid = {l: session.captured[f"blocks.{l}.hook_resid_pre"][0] for l in senders}
    z = {l: session.captured[adapter.z_site(l)][0][0] for l in z_layers}
    return _CleanRun(float(_diff(logits[0, 0], task.a, task.a_star)), resid, z, attn, mlp, proj)


def _sender_run(vlm: Any, task: PathTask, clean: _CleanRun, sender: tuple[int, int], channel: str | None
                ) -> tuple[float, dict[int, torch.Tensor]]:
    """One forward from the sender's layer: the sender patched at the sender positions, every attention output
    after its layer and every MLP output from its layer on held at the clean values, and each later layer's
    projections other than ``channel`` held too. Returns the logit difference (the direct path's) and each later
    head layer's z (``P H D``), every head's computed with ``channel`` read from the patched residual stream."""
    adapter = vlm.adapter
    layer, head = sender
    hooks = [(adapter.mlp_out_module(layer), _hold(clean.mlp[layer]))]
    z_layers = []
    for later in range(layer + 1, vlm.n_layers):
        hooks += [(adapter.attn_out_module(later), _hold(clean.attn[later])),
                  (adapter.mlp_out_module(later), _hold(clean.mlp[later]))]
        channels = adapter.path_channels(later)
        if channel in channels:
            z_layers.append(later)
            hooks += [(adapter.channel_module(later, other), _hold(clean.proj[(later, other)]))
                      for other in channels if other != channel]
    patch = PatchHeads(layer=layer, heads=[head], positions=task.sender_positions,
                       values=task.values[layer][:, [head]][None])
    sites = vlm.sites([adapter.z_site(l) for l in z_layers]) if z_layers else []
    with start_at_layer(adapter, layer, clean.resid[layer]), _hooks(hooks), \
            HookSession(adapter, sites, [patch]) as session:
        logits = vlm.model(**_inputs_from_layer(vlm, task.batch), use_cache=False,
                           logits_to_keep=torch.tensor([task.score_position])).logits
    z = {l: session.captured[adapter.z_site(l)][0][0] for l in z_layers}
    return float(_diff(logits[0, 0], task.a, task.a_star)), z


def _sender_groups(edges: Sequence[Edge]) -> dict[tuple[tuple[int, int], str], list[int]]:
    """The indices of ``edges`` by sender and channel: one sender run serves each group."""
    groups: dict[tuple[tuple[int, int], str], list[int]] = {}
    for i, edge in enumerate(edges):
        groups.setdefault((edge.sender, edge.channel), []).append(i)
    return groups


def _inputs_from_layer(vlm: Any, batch: Any) -> dict[str, Any]:
    """The forward's inputs for a run that starts at a later layer: where the image enters the text model only at
    its input (:func:`~vlmbind.engine.patching.rows_without_prefix`), the tokens and position ids alone, so the
    vision tower does not run again; else everything."""
    inputs = vlm.model_inputs(batch)
    if not rows_without_prefix(vlm):
        return inputs
    position_ids = vlm.adapter.position_ids(inputs)
    out = {k: v for k, v in inputs.items() if k in sequence_keys(inputs) or k == "attention_mask"}
    return out if position_ids is None else {**out, "position_ids": position_ids}


def exact_path_diffs(vlm: Any, task: PathTask, edges: Sequence[Edge], **exact_kwargs: Any
                     ) -> tuple[float, np.ndarray]:
    """The naive numbers, fast (see the module docstring): one forward per sender and channel, then the receivers
    of that sender and channel as node patches on :func:`~vlmbind.engine.patching.exact_diffs` (``exact_kwargs``
    are passed to it).

    Returns:
        ``(clean difference, len(edges) path-patched differences)``.
    """
    check_edges(vlm, task, edges)
    out = np.zeros(len(edges))
    with torch.no_grad():
        clean = _clean_run(vlm, task, min(e.sender[0] for e in edges) if edges else 0)
        for (sender, channel), members in _sender_groups(edges).items():
            layer, head = sender
            own = clean.z[layer][task.sender_positions, head]
            if torch.equal(task.values[layer][:, head].to(own), own):
                out[members] = clean.diff  # a sender patched with its own clean output changes nothing
                continue
            logits_diff, z = _sender_run(vlm, task, clean, sender, None if channel == LOGITS else channel)
            if channel == LOGITS:
                out[members] = logits_diff
                continue
            receivers = [edges[i].receiver for i in members]
            layers = sorted({r[0] for r in receivers})
            # a receiver position whose z the path left exactly as it was is an identity patch: leave it out, so
            # that the node patches start as late as they can (and reuse the longest prefix)
            at = task.receiver_positions
            changed = torch.zeros(len(at), dtype=torch.bool, device=z[layers[0]].device)
            for l in layers:
                changed |= (z[l][at] != clean.z[l][at]).flatten(1).any(1)
            at = at[changed.cpu().numpy()]
            if not at.size:
                out[members] = clean.diff
                continue
            node = PatchTask(task.batch, at, {l: z[l][at] for l in layers}, task.score_position, task.a, task.a_star)
            _, patched = exact_diffs(vlm, node, receivers, **exact_kwargs)
            out[members] = patched
    return clean.diff, out


# ----------------------------------------------------------------------------------------------------------------
# the reference: four plain forwards per edge
# ----------------------------------------------------------------------------------------------------------------
def naive_path_diffs(vlm: Any, task: PathTask, edges: Sequence[Edge]) -> tuple[float, np.ndarray]:
    """The reference, one edge at a time: (1) the clean run; (2) the sender patched, its attention output's change
    being what it writes into the residual stream; (3) the clean run with that change added to the receiver layer's
    input (to the last layer's output for the logits) and the receiver layer's other two projections held at their
    clean outputs, reading the receiver's z; (4) the clean run with the receiver's z patched at the receiver
    positions.

    Returns:
        ``(clean difference, len(edges) path-patched differences)``.
    """
    check_edges(vlm, task, edges)
    adapter = vlm.adapter
    at = [task.score_position]
    out = np.zeros(len(edges))
    with torch.no_grad():
        clean = float(_diff(vlm.logits(task.batch, at=at)[0, 0], task.a, task.a_star))
        for i, edge in enumerate(edges):
            s_layer, s_head = edge.sender
            attn_site = f"blocks.{s_layer}.hook_attn_out"
            before = vlm.capture(task.batch, [attn_site])[attn_site]
            patch = PatchHeads(layer=s_layer, heads=[s_head], positions=task.sender_positions,
                               values=task.values[s_layer][:, [s_head]][None])
            written = vlm.run(task.batch, sites=[attn_site], interventions=[patch], logits_at=[0]).cache[attn_site]
            written = written - before
            if edge.receiver is None:
                with _hooks([(adapter.layer(vlm.n_layers - 1), _add_to_output(written))]):
                    out[i] = float(_diff(vlm.logits(task.batch, at=at)[0, 0], task.a, task.a_star))
                continue
            r_layer, r_head = edge.receiver
            others = [c for c in adapter.path_channels(r_layer) if c != edge.channel]
            held: dict[Any, torch.Tensor] = {}
            with _hooks([(adapter.channel_module(r_layer, c), _record(held, c)) for c in others]):
                vlm.logits(task.batch, at=at)
            z_site = adapter.z_site(r_layer)
            handle = adapter.layer(r_layer).register_forward_pre_hook(_add_to_input(written), with_kwargs=True)
            try:
                with _hooks([(adapter.channel_module(r_layer, c), _hold(held[c])) for c in others]):
                    z = vlm.capture(task.batch, [z_site])[z_site]
            finally:
                handle.remove()
            receiver_patch = PatchHeads(layer=r_layer, heads=[r_head], positions=task.receiver_positions,
                                        values=z[0, task.receiver_positions][:, [r_head]][None])
            out[i] = float(_diff(vlm.logits(task.batch, [receiver_patch], at=at)[0, 0], task.a, task.a_star))
    return clean, out


def all_edges(vlm: Any, senders: Sequence[tuple[int, int]] | None = None,
              receivers: Sequence[tuple[int, int]] | None = None, channels: Sequence[str] = CHANNELS,
              logits: bool = True) -> list[Edge]:
    """Every edge between head-bearing layers: each sender into each receiver of a later layer through each channel
    that layer reads (and into the logits when ``logits``). ``senders`` / ``receivers`` default to every head of a
    layer with heads."""
    adapter = vlm.adapter
    every = [(l, h) for l in adapter.head_layers() for h in range(vlm.n_heads)]
    senders = every if senders is None else [tuple(s) for s in senders]
    receivers = every if receivers is None else [tuple(r) for r in receivers]
    bad = [c for c in channels if c not in CHANNELS]
    if bad:
        raise InputError(f"channels {bad} are not among {', '.join(CHANNELS)}")
    edges = []
    for sender in senders:
        for channel in channels:
            edges += [Edge(sender, r, channel) for r in receivers
                      if r[0] > sender[0] and channel in adapter.path_channels(r[0])]
        if logits:
            edges.append(Edge(sender, None, LOGITS))
    return edges


# ----------------------------------------------------------------------------------------------------------------
# attribution: first-order estimates of every edge from one forward and backward (EAP), or averaged along the path
# from the clean to the counterfactual sender outputs (EAP-IG)
# ----------------------------------------------------------------------------------------------------------------
def _head_of(state: torch.Tensor, channel: str, head: int, n_heads: int) -> torch.Tensor:
    """One query head's slice of a receiver state: the query projection's output is ``B P (H X)`` head-major, the
    per-head keys and values ``B H P D``."""
    return state.view(*state.shape[:2], n_heads, -1)[:, :, head] if channel == "q" else state[:, head]


def _receiver_gradients(vlm: Any, task: PathTask, receivers: dict[int, tuple[str, ...]], sender_layers: list[int],
                        alpha: float) -> tuple[float, dict[tuple[int, int, str], torch.Tensor], torch.Tensor,
                                            dict[int, torch.Tensor]]:
    """One forward and backward of the clean prompt, every sender layer's heads moved ``alpha`` of the way to their
    counterfactual outputs at the sender positions. Returns the logit difference, per ``(layer, head, channel)`` the
    gradient of the metric, through that head's output at the receiver positions and that channel alone, with respect
    to the residual stream the layer reads (``P d_model``), the metric's gradient with respect to the last layer's
    output (the direct path), and each sender layer's z at the sender positions."""
    adapter = vlm.adapter
    inputs = vlm.model_inputs(task.batch)
    pos = torch.as_tensor(task.sender_positions)
    received = torch.as_tensor(task.receiver_positions)
    seen_z: dict[int, torch.Tensor] = {}
    deltas: dict[int, torch.Tensor] = {}
    states: dict[int, dict[str, torch.Tensor]] = {}
    last = vlm.n_layers - 1

    def shift_senders(layer: int) -> Any:
        def hook(module: Any, args: tuple) -> tuple | None:
            x = args[0]
            seen_z[layer] = x
            if layer not in sender_layers or not alpha:
                return None
            target = task.values[layer].reshape(len(pos), -1).to(x)
            x = x.clone()
            x[0, pos] = x[0, pos] + alpha * (target - x[0, pos].detach())
            seen_z[layer] = x
            return (x, *args[1:])
        return hook

    def open_input(layer: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            hidden = args[0] if args else kwargs["hidden_states"]
            deltas[layer] = torch.zeros_like(hidden, requires_grad=True)
            hidden = hidden + deltas[layer]
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        return hook

    def open_output(module: Any, args: tuple, output: Any) -> Any:
        deltas[-1] = torch.zeros_like(first_output(output), requires_grad=True)
        return with_first_output(output, first_output(output) + deltas[-1])

    def keep_states(layer: int) -> Any:
        def edit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # each query head's own key and value (repeated over its group): B H P D
            states[layer] = {**states.get(layer, {}), "k": k, "v": v}
            return q, k, v
        return edit

    def keep_queries(layer: int) -> Any:
        def hook(module: Any, args: tuple, output: torch.Tensor) -> None:
            # the query projection's output (B P H*X, head-major: a head's query, and its output gate where the family
            # gates heads by a second half of the projection, Qwen3.5)
            states[layer] = {**states.get(layer, {}), "q": output}
        return hook

    z_layers = sorted(set(receivers) | set(sender_layers))
    handles = [adapter.o_proj_module(l).register_forward_pre_hook(shift_senders(l)) for l in z_layers]
    handles += [adapter.layer(l).register_forward_pre_hook(open_input(l), with_kwargs=True) for l in receivers]
    handles.append(adapter.layer(last).register_forward_hook(open_output))
    handles += [adapter.channel_module(l, "q").register_forward_hook(keep_queries(l)) for l in receivers
                if "q" in receivers[l]]
    modules = [adapter.attention_module(l) for l in receivers]
    for layer, module in zip(receivers, modules):
        setattr(module, STATE_EDITS, [keep_states(layer)])
    try:
        with torch.enable_grad(), attention_implementation(adapter, ATTENTION_IMPL):
            keep = torch.tensor([task.score_position], device=vlm.device)
            logits = vlm.model(**inputs, use_cache=False, logits_to_keep=keep).logits
            metric = _diff(logits[0, 0], task.a, task.a_star)
            layers = sorted(receivers)
            grads = torch.autograd.grad(metric, [seen_z[l] for l in layers] + [deltas[-1]], retain_graph=True)
            out: dict[tuple[int, int, str], torch.Tensor] = {}
            for layer, dz in zip(layers, grads):
                # the metric through this layer's outputs at the receiver positions only; downstream runs freely
                mask = torch.zeros_like(dz)
                mask[0, received] = 1.0
                channels = receivers[layer]
                state = states[layer]
                by_state = torch.autograd.grad(seen_z[layer], [state[c] for c in channels],
                                               grad_outputs=dz * mask, retain_graph=True)
                for channel, g in zip(channels, by_state):
                    for head in range(vlm.n_heads):
                        (gx,) = torch.autograd.grad(_head_of(state[channel], channel, head, vlm.n_heads),
                                                    deltas[layer], grad_outputs=_head_of(g, channel, head, vlm.n_heads),
                                                    retain_graph=True)
                        out[(layer, head, channel)] = gx[0].detach().float()
            direct = grads[-1][0].detach().float()
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            module.__dict__.pop(STATE_EDITS, None)
    return float(metric.detach()), out, direct, {l: seen_z[l].detach()[0, pos] for l in sender_layers}


def attribution_path_diffs(vlm: Any, task: PathTask, edges: Sequence[Edge], *, steps: int | None = None
                           ) -> tuple[float, np.ndarray]:
    """First-order estimates of the path-patched differences (EAP; with ``steps``, EAP-IG): an edge's estimate is
    what its sender writes into the residual stream at the sender positions (exactly, through ``o_proj``, post-norm
    and gate) times the gradient of ``logit[a*] - logit[a]`` with respect to the residual stream its receiver reads
    through the edge's channel, through the receiver's output at the receiver positions (the direct edge: with
    respect to the last layer's output). EAP takes the gradient at the clean run (one forward and backward); EAP-IG
    averages it over ``steps`` points ``alpha = (k + 1/2) / steps`` on the path where every sender layer's heads move
    together from their clean to their counterfactual outputs.

    Returns:
        ``(clean difference, len(edges) estimated differences)``.

    Raises:
        InputError: ``steps`` is not None or an int >= 1, or an edge does not fit the model and task.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise InputError(f"integrated gradients steps must be an int >= 1, got {steps!r}")
    check_edges(vlm, task, edges)
    receivers: dict[int, tuple[str, ...]] = {}
    for edge in edges:
        if edge.receiver is not None:
            receivers[edge.receiver[0]] = vlm.adapter.path_channels(edge.receiver[0])
    sender_layers = sorted({e.sender[0] for e in edges})
    alphas = [0.0] if steps is None else [(k + 0.5) / steps for k in range(steps)]
    total: dict[tuple[int, int, str], torch.Tensor] = {}
    direct_total = None
    clean, clean_z = None, None
    for alpha in ([0.0] if 0.0 in alphas else [0.0, *alphas]):
        diff, grads, direct, z = _receiver_gradients(vlm, task, receivers, sender_layers, alpha)
        if alpha == 0.0 and clean is None:
            clean, clean_z = diff, z
        if alpha not in alphas:
            continue
        for key, g in grads.items():
            total[key] = g if key not in total else total[key] + g
        direct_total = direct if direct_total is None else direct_total + direct
    at = torch.as_tensor(task.sender_positions)
    with torch.no_grad():
        writes = {l: head_writes(vlm, l, clean_z[l].reshape(len(at), vlm.n_heads, -1), task.values[l]).float()
                  for l in sender_layers}
    out = np.zeros(len(edges))
    for i, edge in enumerate(edges):
        layer, head = edge.sender
        written = writes[layer][head]
        gradient = direct_total if edge.receiver is None else total[(*edge.receiver, edge.channel)]
        out[i] = clean + float((written * gradient[at].to(written) / len(alphas)).sum())
    return clean, out


# ----------------------------------------------------------------------------------------------------------------
# AtP* at edge level: the receiver's change exact (its attention pattern recomputed: the QK fix), what follows it to
# first order, with GradDrop
# ----------------------------------------------------------------------------------------------------------------
def atp_star_path_diffs(vlm: Any, task: PathTask, edges: Sequence[Edge], *, grad_drop: bool = True
                        ) -> tuple[float, np.ndarray]:
    """AtP* (Kramar et al. 2024) at edge level. An edge's estimate is the exact change of its receiver's output at the
    receiver positions when it reads the sender's counterfactual write through the edge's channel (the first stage of
    :func:`exact_path_diffs`: the receiver's attention pattern, value and gate recomputed, so a saturated softmax is
    no longer linearised; this is AtP*'s QK fix, applied to the edge's receiver) times the gradient of
    ``logit[a*] - logit[a]`` with respect to that output (what follows the receiver, to first order). A direct edge
    into the logits is exact. With ``grad_drop`` the gradient is taken again with the gradient through each decoder
    layer's attention and MLP outputs cut in turn, and the score is the mean of the absolute estimates over the cuts
    of the layers other than the receiver's (a magnitude, as AtP* ranks and does not sign; a direct edge's is its
    absolute exact effect); without it the estimate is signed (one backward).

    Returns:
        ``(clean difference, len(edges) clean + score)``.
    """
    check_edges(vlm, task, edges)
    adapter = vlm.adapter
    receiver_layers = sorted({e.receiver[0] for e in edges if e.receiver is not None})
    node = PatchTask(task.batch, task.receiver_positions, {}, task.score_position, task.a, task.a_star)
    at = torch.as_tensor(task.receiver_positions)
    n, h, d = len(at), vlm.n_heads, adapter.d_head
    changes: dict[int, torch.Tensor] = {}  # edge -> the change of its receiver's z, P_r D
    direct: dict[int, float] = {}
    with torch.no_grad():
        clean = _clean_run(vlm, task, min(e.sender[0] for e in edges) if edges else 0)
        for (sender, channel), members in _sender_groups(edges).items():
            logits_diff, z = _sender_run(vlm, task, clean, sender, None if channel == LOGITS else channel)
            for i in members:
                if channel == LOGITS:
                    direct[i] = logits_diff - clean.diff
                else:
                    layer, head = edges[i].receiver
                    changes[i] = (z[layer][at, head] - clean.z[layer][at, head]).float()
    drops: list[int | None] = list(range(vlm.n_layers)) if grad_drop else [None]
    per_drop = np.zeros((len(drops), len(edges)))
    for k, drop in enumerate(drops):
        _, _, grads, *_ = _atp_star_pass(vlm, node, receiver_layers, drop) if receiver_layers else (0, 0, {})
        for i, edge in enumerate(edges):
            if edge.receiver is None:
                per_drop[k, i] = direct[i]
                continue
            layer, head = edge.receiver
            g = grads[layer].reshape(n, h, d)[:, head]
            per_drop[k, i] = float((changes[i].to(g) * g).sum())
    if not grad_drop:
        return clean.diff, clean.diff + per_drop[0]
    own = np.array([[e.receiver is not None and e.receiver[0] == drop for e in edges] for drop in drops])
    score = np.where(own, 0.0, np.abs(per_drop)).sum(0) / np.maximum((~own).sum(0), 1)
    return clean.diff, clean.diff + score
