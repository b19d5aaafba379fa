"""Autoregressive code probes q(o|z) = prod_k q(o_k | o_<k, z) (FBP) in five families, trained by teacher forcing.

Design: every family computes the K logits ``l_k(x_k)``, ``x_k = [z, m_k * c]``, in ONE forward pass. ``c`` is the
ground-truth code, centred by its training-split mean and divided by its training-split standard deviation (a
constant bit is only centred): the train mean rather than 0.5 keeps the conditioning inputs zero-mean for sparse
codes such as ColorShape's O (18 of 64 bits on), and the unit scale, like the z-scored representations, lets Adam
reach within the recipe's steps the large logits that near-certain dependencies between bits need. ``m_k`` is
column k of the strictly upper-triangular mask ``M[i, k] = 1 iff i < k``, applied to the weights that read the code,
so output k never sees ``o_k`` or a later bit: teacher forcing gives all K conditionals of the chain rule at once and
the summed binary cross-entropy of the ground truth is exactly ``-log2 q(o|z)``. Families (docs/methods.md section 6):
``linear`` ``w_k . x_k + b_k``; ``quadratic``, the linear term plus a per-output low-rank symmetric form
``sum_r s_kr (u_kr . x_k)^2`` (rank ``ProbeConfig.rank`` = 16; ``s`` takes either sign, so this spans every symmetric
matrix of that rank, and containing the linear family keeps the ladder monotone); ``dnn``, a separate MLP per output
(``dnn_layers`` = 4 linear layers, GELU between them, width ``hidden``) evaluated for all K outputs at once with
grouped weights; ``shared_factor``, the linear term plus ``(U_c x_k) . (V_s x_k)``, i.e. ``W_k = U_colour(k)^T
V_shape(k)`` with factors shared by the outputs of one colour or one shape (map defaults to the row-major
sqrt(K) x sqrt(K) grid, ColorShape's ``bit = colour * 8 + shape``; the linear term stays per output, so only the
second-order part is factorised); ``attention`` over spatial tokens, one query per output ``q_k = Q_k + P^T L_k
(m_k * c)`` conditioned on o_<k, ``a_kt = softmax_t(q_k . s_t)`` over the valid tokens, no key or value projection,
then the linear + quadratic readout of the pooled vector; its weights ``[n, K, T]`` are kept for plotting.
Representations are z-scored per dimension with training statistics (tokens: over the valid training tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as nnf

from ..core.errors import InputError, TrainingError, close_matches
from .training import LN2, FitInfo, ProbeConfig, feature_stats, fit

FAMILIES = ("linear", "quadratic", "dnn", "shared_factor", "attention")
POOLED_FAMILIES = ("linear", "quadratic", "dnn", "shared_factor")

ArrayLike = Any  # numpy array, torch tensor or nested lists


# ------------------------------------------------------------------------------------------------------------------
# Input handling
# ------------------------------------------------------------------------------------------------------------------
def as_tensor(x: ArrayLike, name: str) -> torch.Tensor:
    """``x`` as a CPU tensor without copying when possible (float64 becomes float32; other float dtypes are kept)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
    else:
        try:
            t = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"{name} must be a numeric array or tensor, got {type(x).__name__}") from e
    if t.dtype == torch.float64:
        t = t.float()
    return t.cpu()


def check_code(o: ArrayLike, name: str, n: int | None = None) -> torch.Tensor:
    """A binary code matrix ``[n, K]`` as float32, checked to hold only 0 and 1."""
    t = as_tensor(o, name)
    if t.dim() != 2 or t.shape[1] < 1:
        raise InputError(f"{name} must be a 2-D 0/1 array [n, K], got shape {tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise InputError(f"{name} has {t.shape[0]} rows but the representations have {n}; pass one code per example")
    t = t.float()
    if not bool(((t == 0) | (t == 1)).all()):
        bad = t[(t != 0) & (t != 1)][:3].tolist()
        raise InputError(f"{name} must contain only 0 and 1 (binary codes), found values such as {bad}")
    return t


def check_representations(z: ArrayLike, name: str, mask: ArrayLike | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Representations ``[n, d]`` or ``[n, T, d]`` (float) and an optional ``[n, T]`` bool token mask."""
    t = as_tensor(z, name)
    if t.dim() not in (2, 3):
        raise InputError(f"{name} must be [n, d] pooled vectors or [n, T, d] spatial tokens, got shape "
                         f"{tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.float()
    if mask is None:
        return t, None
    if t.dim() != 3:
        raise InputError(f"a token mask was given for {name}, but {name} is [n, d] pooled vectors; drop the mask "
                         f"or pass [n, T, d] tokens")
    m = as_tensor(mask, f"{name} mask")
    if tuple(m.shape) != tuple(t.shape[:2]):
        raise InputError(f"the token mask of {name} must be [n, T] = {tuple(t.shape[:2])}, got {tuple(m.shape)}")
    m = m.bool()
    empty = (~m.any(1)).nonzero().flatten()
    if len(empty):
        raise InputError(f"rows {empty[:5].tolist()} of {name} have no valid token in the mask; every example needs "
                         f"at least one token")
    return t, m


def check_family(family: str) -> str:
    """``family`` if it names an autoregressive family, else a :class:`TrainingError` with close matches."""
    if family not in FAMILIES:
        raise TrainingError(f"unknown probe family {family!r}; use one of {', '.join(FAMILIES)}."
                            f"{close_matches(str(family), FAMILIES)}")
    return family


def default_factor_map(n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """The row-major grid map ``k -> (k // n, k % n)`` for ``K = n * n`` outputs (ColorShape: colour * 8 + shape).

    Raises:
        InputError: ``K`` is not a perfect square (then pass ``factor_map`` explicitly).
    """
    n = math.isqrt(n_out)
    if n * n != n_out:
        raise InputError(f"shared_factor needs a map from the {n_out} outputs to (colour, shape) factors; {n_out} is "
                         f"not a square grid, so pass factor_map=(colour_of_output, shape_of_output)")
    k = np.arange(n_out)
    return k // n, k % n


def check_factor_map(factor_map: tuple[Sequence[int], Sequence[int]] | None, n_out: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated ``(colour_of_output, shape_of_output)`` as int64 tensors of length K, groups numbered from 0."""
    if factor_map is None:
        a, b = default_factor_map(n_out)
    else:
        if len(factor_map) != 2:
            raise InputError("factor_map must be a pair (colour_of_output, shape_of_output) of length-K int sequences")
        a, b = (np.asarray(v) for v in factor_map)
    out = []
    for name, v in (("colour", a), ("shape", b)):
        if v.shape != (n_out,) or not np.issubdtype(v.dtype, np.integer) or (v < 0).any():
            raise InputError(f"factor_map's {name} part must be {n_out} non-negative ints (one group id per output), "
                             f"got shape {v.shape} dtype {v.dtype}")
        out.append(torch.as_tensor(v, dtype=torch.long))
    return out[0], out[1]


class _Rows:
    """Standardised float32 rows of a stored array, fetched per batch (the stored array is never copied whole)."""

    def __init__(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, device: torch.device) -> None:
        self.x, self.device = x, device
        self.mean, self.std = mean.to(device), std.to(device)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.x[idx].to(self.device, torch.float32) - self.mean) / self.std


# ------------------------------------------------------------------------------------------------------------------
# Families
# ------------------------------------------------------------------------------------------------------------------
def _uniform(g: torch.Generator, fan_in: int, *shape: int) -> nn.Parameter:
    bound = 1.0 / math.sqrt(max(fan_in, 1))
    return nn.Parameter((torch.rand(*shape, generator=g) * 2 - 1) * bound)


def _normal(g: torch.Generator, std: float, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=g) * std)


class AutoregressiveProbe(nn.Module):
    """Base class: K outputs, the strictly upper-triangular conditioning mask and the code centring.

    Subclasses implement :meth:`logits_from`; :meth:`forward` centres the code and returns ``[n, K]`` logits (and,
    for the attention family, the ``[n, K, T]`` attention weights).
    """

    family: str = ""

    def __init__(self, n_out: int, dim: int, centre: torch.Tensor) -> None:
        super().__init__()
        self.n_out, self.dim = n_out, dim
        # cond_mask[i, k] = 1 iff i < k: output k reads only the bits before it (strictly upper triangular).
        self.register_buffer("cond_mask", torch.triu(torch.ones(n_out, n_out), diagonal=1))
        self.register_buffer("centre", centre.float().clone())
        self.register_buffer("code_scale", torch.ones(n_out))  # 1 / std_train(o); set by build_probe

    def forward(self, z: torch.Tensor, o: torch.Tensor, token_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of all K conditionals from one pass.

        Args:
            z: standardised representations ``[n, d]`` (or ``[n, T, d]`` for the attention family).
            o: ground-truth codes ``[n, K]`` (0/1 floats), the teacher-forcing inputs.
            token_mask: ``[n, T]`` bool, True for tokens the attention may use (attention family only).

        Returns:
            ``(logits [n, K], attention [n, K, T] or None)``.
        """
        return self.logits_from(z, (o - self.centre) * self.code_scale, token_mask)

    def logits_from(self, z: torch.Tensor, c: torch.Tensor, token_mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _cond(self, c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``sum_i c_i M[i, k] w[i, k, ...]``: the masked read of the code, ``[n, K, ...]``, from ``w [K, K, ...]``."""
        shape = w.shape[2:]
        wm = w * self.cond_mask.view(self.n_out, self.n_out, *([1] * len(shape)))
        return (c @ wm.reshape(self.n_out, -1)).view(c.shape[0], self.n_out, *shape)

    def n_params(self) -> int:
        """Number of trainable parameters (masked-out conditioning weights included)."""
        return sum(p.numel() for p in self.parameters())

    def output_bias(self) -> nn.Parameter:
        """The ``[K]`` bias added to every output's logit (set to the training prior's log-odds before training)."""
        return self.bias


class LinearProbe(AutoregressiveProbe):
    """``l_k = w_k . z + v_k . (m_k * c) + b_k``."""

    family = "linear"

    def __init__(self, n_out: int, dim: int, centre: torch.Tensor, config: ProbeConfig, g: torch.Generator,
                 **_: Any) -> None:
        super().__init__(n_out, dim, centre)
        self.w_z = _uniform(g, dim + n_out, dim, n_out)
        self.w_c = _uniform(g, dim + n_out, n_out, n_out)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def logits_from(self, z, c, token_mask):
        return z @ self.w_z + self._cond(c, self.w_c) + self.bias, None


class QuadraticProbe(AutoregressiveProbe):
    """``l_k = w_k . x_k + sum_r s_kr (u_kr . x_k)^2 + b_k`` with ``x_k = [z, m_k * c]`` (per-output rank R)."""

    family = "quadratic"

    def __init__(self, n_out: int, dim: int, centre: torch.Tensor, config: ProbeConfig, g: torch.Generator,
                 **_: Any) -> None:
        super().__init__(n_out, dim, centre)
        r = config.rank or 16
        self.rank = r
        self.w_z = _uniform(g, dim + n_out, dim, n_out)
        self.w_c = _uniform(g, dim + n_out, n_out, n_out)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.u_z = _normal(g, 1.0 / math.sqrt(dim + n_out), dim, n_out * r)
        self.u_c = _normal(g, 1.0 / math.sqrt(dim + n_out), n_out, n_out, r)
        self.scale = _normal(g, 0.1 / math.sqrt(r), n_out, r)

    def logits_from(self, z, c, token_mask):
        proj = (z @ self.u_z).view(-1, self.n_out, self.rank) + self._cond(c, self.u_c)
        quad = (proj * proj * self.scale).sum(-1)
        return z @ self.w_z + self._cond(c, self.w_c) + quad + self.bias, None


class DNNProbe(AutoregressiveProbe):
    """A separate GELU MLP per output on ``x_k = [z, m_k * c]``, all K evaluated at once with grouped weights."""

    family = "dnn"

    def __init__(self, n_out: int, dim: int, centre: torch.Tensor, config: ProbeConfig, g: torch.Generator,
                 **_: Any) -> None:
        super().__init__(n_out, dim, centre)
        h = config.hidden
        self.hidden = h
        self.w_in_z = _uniform(g, dim + n_out, dim, n_out * h)
        self.w_in_c = _uniform(g, dim + n_out, n_out, n_out, h)
        self.b_in = nn.Parameter(torch.zeros(n_out, h))
        self.w_mid = nn.ParameterList([_uniform(g, h, n_out, h, h) for _ in range(config.dnn_layers - 2)])
        self.b_mid = nn.ParameterList([nn.Parameter(torch.zeros(n_out, h)) for _ in range(config.dnn_layers - 2)])
        self.w_out = _uniform(g, h, n_out, h)
        self.b_out = nn.Parameter(torch.zeros(n_out))

    def logits_from(self, z, c, token_mask):
        x = (z @ self.w_in_z).view(-1, self.n_out, self.hidden) + self._cond(c, self.w_in_c) + self.b_in
        x = nnf.gelu(x)
        for w, b in zip(self.w_mid, self.b_mid):
            x = nnf.gelu(torch.einsum("nkh,khg->nkg", x, w) + b)
        return (x * self.w_out).sum(-1) + self.b_out, None

    def output_bias(self) -> nn.Parameter:
        return self.b_out


class SharedFactorProbe(AutoregressiveProbe):
    """``l_k = w_k . x_k + (U_colour(k) x_k) . (V_shape(k) x_k) + b_k``: W_k = U_c^T V_s, factors shared by group."""

    family = "shared_factor"

    def __init__(self, n_out: int, dim: int, centre: torch.Tensor, config: ProbeConfig, g: torch.Generator, *,
                 factor_map: tuple[Sequence[int], Sequence[int]] | None = None, **_: Any) -> None:
        super().__init__(n_out, dim, centre)
        colour_of, shape_of = check_factor_map(factor_map, n_out)
        self.register_buffer("colour_of", colour_of)
        self.register_buffer("shape_of", shape_of)
        n_c, n_s = int(colour_of.max()) + 1, int(shape_of.max()) + 1
        r = config.rank or 16
        self.rank, self.n_colour, self.n_shape = r, n_c, n_s
        std = 1.0 / math.sqrt(dim + n_out)
        self.w_z = _uniform(g, dim + n_out, dim, n_out)
        self.w_c = _uniform(g, dim + n_out, n_out, n_out)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.u_z = _normal(g, std, dim, n_c * r)
        self.u_c = _normal(g, std, n_out, n_c, r)
        # Small V at init so the bilinear term starts near 0 (as the quadratic family's small scales do).
        self.v_z = _normal(g, 0.1 * std / math.sqrt(r), dim, n_s * r)
        self.v_c = _normal(g, 0.1 * std / math.sqrt(r), n_out, n_s, r)

    def logits_from(self, z, c, token_mask):
        n = z.shape[0]
        pu = (z @ self.u_z).view(n, self.n_colour, self.rank)[:, self.colour_of]
        pu = pu + self._cond(c, self.u_c[:, self.colour_of])  # [n, K, R]: U_colour(k) x_k
        pv = (z @ self.v_z).view(n, self.n_shape, self.rank)[:, self.shape_of]
        pv = pv + self._cond(c, self.v_c[:, self.shape_of])  # [n, K, R]: V_shape(k) x_k
        return z @ self.w_z + self._cond(c, self.w_c) + (pu * pv).sum(-1) + self.bias, None


class AttentionProbe(AutoregressiveProbe):
    """Per-output query attention over spatial tokens with a quadratic readout of the pooled vector.

    ``q_k = Q_k + P^T (L_k (m_k * c))`` (rank ``query_rank``), ``a_kt = softmax_t(q_k . s_t)`` over valid tokens (no
    key or value projection, no temperature: the query's norm is the temperature), ``s_k = sum_t a_kt s_t``, and
    ``l_k = w_k . s_k + sum_r e_kr (u_kr . s_k)^2 + v_k . (m_k * c) + b_k``.
    """

    family = "attention"

    def __init__(self, n_out: int, dim: int, centre: torch.Tensor, config: ProbeConfig, g: torch.Generator,
                 **_: Any) -> None:
        super().__init__(n_out, dim, centre)
        r, qr = config.rank or 16, config.query_rank
        self.rank, self.query_rank = r, qr
        # Initialisation decides which basin the attention falls into. The query's first gradients are the readout's
        # weights times the token content: with a random readout, a random share of them pushes the query along the
        # value directions (attend where the bit is 1 - a poorer, self-reinforcing solution). Starting the query, the
        # readout of the pooled vector and the conditioning path at zero makes the readout learn what to read (from
        # the uniform mean) before the query moves, and the query then moves toward where that content sits.
        self.query = nn.Parameter(torch.zeros(n_out, dim))
        self.q_c = nn.Parameter(torch.zeros(n_out, n_out, qr))
        self.q_proj = _normal(g, 1.0 / math.sqrt(dim), qr, dim)
        self.w_s = nn.Parameter(torch.zeros(n_out, dim))
        self.w_c = _uniform(g, dim + n_out, n_out, n_out)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.u = _normal(g, 1.0 / math.sqrt(dim), n_out, r, dim)
        self.scale = nn.Parameter(torch.zeros(n_out, r))

    def logits_from(self, z, c, token_mask):
        if z.dim() == 2:  # a pooled vector is one token: the attention is then trivially 1
            z = z[:, None]
        q = self.query + self._cond(c, self.q_c) @ self.q_proj  # [n, K, d]
        scores = torch.einsum("nkd,ntd->nkt", q, z)
        if token_mask is not None:
            scores = scores.masked_fill(~token_mask[:, None, :], float("-inf"))
        att = torch.softmax(scores, dim=-1)
        pooled = torch.einsum("nkt,ntd->nkd", att, z)
        proj = torch.einsum("nkd,krd->nkr", pooled, self.u)
        logits = (pooled * self.w_s).sum(-1) + (proj * proj * self.scale).sum(-1) + self._cond(c, self.w_c) + self.bias
        return logits, att


FAMILY_CLASSES: dict[str, type[AutoregressiveProbe]] = {
    "linear": LinearProbe, "quadratic": QuadraticProbe, "dnn": DNNProbe, "shared_factor": SharedFactorProbe,
    "attention": AttentionProbe,
}


def build_probe(family: str, n_out: int, dim: int, *, config: ProbeConfig | None = None,
                centre: torch.Tensor | None = None, code_std: torch.Tensor | None = None,
                factor_map: tuple[Sequence[int], Sequence[int]] | None = None) -> AutoregressiveProbe:
    """An untrained probe of ``family`` (deterministic from ``config.seed``).

    Args:
        family: one of :data:`FAMILIES`.
        n_out: K, the code length.
        dim: d, the representation width.
        config: architecture settings (rank, hidden width, layers, seed).
        centre: ``[K]`` code centring (default 0.5 for every bit).
        code_std: ``[K]`` code scale (default 1: only centred); a bit with std 0 is only centred.
        factor_map: ``(colour_of_output, shape_of_output)`` for ``shared_factor``.
    """
    config = config or ProbeConfig()
    check_family(family)
    g = torch.Generator().manual_seed(config.seed)
    centre = torch.full((n_out,), 0.5) if centre is None else centre
    probe = FAMILY_CLASSES[family](n_out, dim, centre, config, g, factor_map=factor_map)
    if code_std is not None:
        probe.code_scale.copy_(torch.where(code_std > 0, 1.0 / code_std.clamp_min(1e-12), torch.ones_like(code_std)))
    return probe


# ------------------------------------------------------------------------------------------------------------------
# Training and evaluation
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class TrainedProbe:
    """A trained autoregressive probe with its input standardisation.

    Attributes:
        family: the probe family.
        module: the trained :class:`AutoregressiveProbe`.
        mean, std: ``[d]`` standardisation of the representations (training statistics).
        config: the recipe it was trained with.
        fit_info: epochs run, best epoch, best validation loss (bits), seconds.
    """

    family: str
    module: AutoregressiveProbe
    mean: torch.Tensor
    std: torch.Tensor
    config: ProbeConfig
    fit_info: FitInfo
    spatial: bool = field(default=False)

    @property
    def device(self) -> torch.device:
        """The device the probe's parameters live on."""
        return self.module.cond_mask.device

    def _inputs(self, z: ArrayLike, o: ArrayLike, token_mask: ArrayLike | None
                ) -> tuple[_Rows, torch.Tensor, torch.Tensor | None]:
        zt, mt = check_representations(z, "Z", token_mask)
        ot = check_code(o, "O", zt.shape[0])
        if ot.shape[1] != self.module.n_out or zt.shape[-1] != self.module.dim:
            raise InputError(f"this probe was trained on d={self.module.dim}, K={self.module.n_out}; got "
                             f"d={zt.shape[-1]}, K={ot.shape[1]}")
        if self.spatial != (zt.dim() == 3):
            raise InputError(f"this probe was trained on {'[n, T, d] tokens' if self.spatial else '[n, d] vectors'}"
                             f", got shape {tuple(zt.shape)}")
        return _Rows(zt, self.mean, self.std, self.device), ot, mt

    @torch.no_grad()
    def logits(self, z: ArrayLike, o: ArrayLike, token_mask: ArrayLike | None = None) -> torch.Tensor:
        """Teacher-forced logits ``[n, K]`` of q(o_k = 1 | o_<k, z) (CPU float32)."""
        return self._run(z, o, token_mask)[0]

    @torch.no_grad()
    def attention(self, z: ArrayLike, o: ArrayLike, token_mask: ArrayLike | None = None) -> torch.Tensor:
        """The attention probe's weights ``[n, K, T]`` (teacher-forced with the ground-truth code).

        Raises:
            InputError: the probe is not of the attention family.
        """
        if self.family != "attention":
            raise InputError(f"attention weights exist only for the attention family, this probe is {self.family!r}")
        return self._run(z, o, token_mask, keep_attention=True)[1]

    @torch.no_grad()
    def bits_per_output(self, z: ArrayLike, o: ArrayLike, token_mask: ArrayLike | None = None) -> torch.Tensor:
        """Mean cross-entropy of each conditional, ``[K]`` bits: ``-E log2 q(o_k | o_<k, z)``."""
        return self._run(z, o, token_mask)[2]

    @torch.no_grad()
    def per_example_bits(self, z: ArrayLike, o: ArrayLike, token_mask: ArrayLike | None = None) -> torch.Tensor:
        """``[n]`` bits of each example, ``-log2 q(o|z)`` summed over the K outputs (their mean is the CE)."""
        return self._run(z, o, token_mask)[3]

    @torch.no_grad()
    def cross_entropy(self, z: ArrayLike, o: ArrayLike, token_mask: ArrayLike | None = None) -> float:
        """Mean over examples of ``-log2 q(o|z)`` (bits, summed over the K outputs): the CE that bounds H(O|Z)."""
        return float(self.bits_per_output(z, o, token_mask).sum())

    def _run(self, z: ArrayLike, o: ArrayLike, token_mask: ArrayLike | None, keep_attention: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        rows, ot, mt = self._inputs(z, o, token_mask)
        n = ot.shape[0]
        logits, atts, examples = [], [], []
        total = torch.zeros(self.module.n_out, dtype=torch.float64)
        for start in range(0, n, self.config.batch_size):
            idx = torch.arange(start, min(n, start + self.config.batch_size))
            ob = ot[idx].to(self.device)
            lg, att = self.module(rows(idx), ob, None if mt is None else mt[idx].to(self.device))
            bce = nnf.binary_cross_entropy_with_logits(lg, ob, reduction="none").double().cpu()
            total += bce.sum(0)
            examples.append(bce.sum(1) / LN2)
            logits.append(lg.cpu())
            if keep_attention and att is not None:
                atts.append(att.cpu())
        per_output = (total / max(n, 1) / LN2).float()
        return (torch.cat(logits), (torch.cat(atts) if atts else None), per_output,
                torch.cat(examples) if examples else torch.zeros(0, dtype=torch.float64))


def _masked_means(rows: _Rows, mask: torch.Tensor | None, n: int, batch: int) -> torch.Tensor:
    """``[n, d]``: each example's mean over its valid standardised tokens, what uniform attention pools."""
    out = []
    for start in range(0, n, batch):
        idx = torch.arange(start, min(n, start + batch))
        x = rows(idx)
        if mask is None:
            out.append(x.mean(1))
        else:
            m = mask[idx].to(x.device, x.dtype)[..., None]
            out.append((x * m).sum(1) / m.sum(1).clamp_min(1.0))
    return torch.cat(out)


def _fit_mean_readout(module: AttentionProbe, train_rows: _Rows, val_rows: _Rows, mask_train: torch.Tensor | None,
                      mask_val: torch.Tensor | None, o_train: torch.Tensor, o_val: torch.Tensor, config: ProbeConfig,
                      generator: torch.Generator) -> FitInfo:
    """The first phase of the attention probe's fit: its query and quadratic readout held at their start (uniform
    attention, zero quadratic term), so it is the linear probe on the tokens' mean; trained on the mean itself.

    The mean is standardised with its own training statistics while it trains, as the linear probe's input is (the
    mean of token-standardised tokens has a far smaller spread, which at one learning rate would take many times
    the steps), and the readout is then rewritten exactly into the token-standardised units phase two uses.
    """
    n_train, n_val = o_train.shape[0], o_val.shape[0]
    pooled_train = _masked_means(train_rows, mask_train, n_train, config.batch_size)
    pooled_val = _masked_means(val_rows, mask_val, n_val, config.batch_size)
    centre = pooled_train.mean(0)
    spread = pooled_train.std(0, unbiased=False)
    spread = torch.where(spread > 1e-8 * (1.0 + centre.abs()), spread, torch.ones_like(spread))
    pooled_train, pooled_val = (pooled_train - centre) / spread, (pooled_val - centre) / spread
    held = [module.query, module.q_c, module.q_proj, module.u, module.scale]
    for p in held:  # frozen, not merely zero-gradient: Adam's weight decay would still move them
        p.requires_grad_(False)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        idx_d = idx.to(pooled_train.device)
        logits, _ = module(pooled_train[idx_d], o_train[idx_d])
        return nnf.binary_cross_entropy_with_logits(logits, o_train[idx_d], reduction="sum") / (len(idx) * LN2)

    def val_loss() -> float:
        logits, _ = module(pooled_val, o_val)
        return float(nnf.binary_cross_entropy_with_logits(logits, o_val, reduction="sum")) / (n_val * LN2)

    try:
        info = fit(module, batch_loss, val_loss, n_train, config, generator)
    finally:
        for p in held:
            p.requires_grad_(True)
    with torch.no_grad():  # w . (m - c) / s + b  ==  (w / s) . m + (b - w . c / s)
        module.bias -= (module.w_s * centre / spread).sum(-1)
        module.w_s /= spread
    return info


def prior_log_odds(p: torch.Tensor, n: int) -> torch.Tensor:
    """The log-odds of each bit's training frequency ``p`` over ``n`` examples, kept finite by add-half smoothing
    (a bit that is always 1 gets ``log((n + 0.5) / 0.5)``, not infinity)."""
    p = (p.double() * n + 0.5) / (n + 1.0)
    return torch.log(p / (1 - p)).float()


def fit_autoregressive(family: str, z_train: ArrayLike, o_train: ArrayLike, z_val: ArrayLike, o_val: ArrayLike, *,
                       mask_train: ArrayLike | None = None, mask_val: ArrayLike | None = None,
                       config: ProbeConfig | None = None,
                       factor_map: tuple[Sequence[int], Sequence[int]] | None = None) -> TrainedProbe:
    """Train one autoregressive probe with teacher forcing and early stopping on the validation split.

    Args:
        family: one of :data:`FAMILIES`.
        z_train: ``[n, d]`` pooled vectors, or ``[n, T, d]`` tokens for ``attention`` (any float dtype; cast per batch).
        o_train: ``[n, K]`` 0/1 codes.
        z_val, o_val: the validation split, same layout.
        mask_train, mask_val: optional ``[n, T]`` bool token masks (True = a token the probe may attend to).
        config: the training recipe (default :class:`ProbeConfig`).
        factor_map: ``(colour_of_output, shape_of_output)`` for ``shared_factor`` (default: sqrt(K) grid).

    Returns:
        A :class:`TrainedProbe` holding the best-validation parameters.

    Raises:
        InputError: malformed arrays, or [n, T, d] tokens given to a pooled-vector family.
        TrainingError: unknown family or bad config.
    """
    config = config or ProbeConfig()
    check_family(family)
    zt, mt = check_representations(z_train, "Z_train", mask_train)
    zv, mv = check_representations(z_val, "Z_val", mask_val)
    ot = check_code(o_train, "O_train", zt.shape[0])
    ov = check_code(o_val, "O_val", zv.shape[0])
    if zt.shape[1:] != zv.shape[1:] and not (zt.dim() == 3 and zv.dim() == 3 and zt.shape[2] == zv.shape[2]):
        raise InputError(f"Z_train {tuple(zt.shape)} and Z_val {tuple(zv.shape)} differ in layout or width")
    if ot.shape[1] != ov.shape[1]:
        raise InputError(f"O_train has K={ot.shape[1]} bits but O_val has K={ov.shape[1]}")
    if zt.dim() == 3 and family != "attention":
        raise InputError(f"family {family!r} reads one pooled vector per example but Z is [n, T, d] tokens "
                         f"{tuple(zt.shape)}; pool the tokens first or use family='attention'")
    if zt.shape[0] < 1 or zv.shape[0] < 1:
        raise InputError(f"the train and validation splits need examples, got {zt.shape[0]} and {zv.shape[0]}")
    device = config.resolved_device()
    n_out, dim = ot.shape[1], zt.shape[-1]

    if config.standardize:
        mean, std = feature_stats(lambda i: zt[i], zt.shape[0], dim,
                                  token_mask=None if mt is None else (lambda i: mt[i]))
        if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
            raise InputError("Z_train contains inf or NaN values; clean the representations before probing")
    else:
        mean, std = torch.zeros(dim), torch.ones(dim)
    module = build_probe(family, n_out, dim, config=config, centre=ot.mean(0), code_std=ot.std(0, unbiased=False),
                         factor_map=factor_map)
    with torch.no_grad():  # start at the training prior: an uninformative Z then costs nothing over the prior
        module.output_bias().copy_(prior_log_odds(ot.mean(0), ot.shape[0]))
    module = module.to(device)
    train_rows, val_rows = _Rows(zt, mean, std, device), _Rows(zv, mean, std, device)
    ot_d, ov_d = ot.to(device), ov.to(device)
    mt_d = None if mt is None else mt.to(device)
    mv_d = None if mv is None else mv.to(device)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        idx_d = idx.to(device)
        logits, _ = module(train_rows(idx), ot_d[idx_d], None if mt_d is None else mt_d[idx_d])
        # Summed over the K outputs, averaged over examples, in bits: the reported quantity itself.
        return nnf.binary_cross_entropy_with_logits(logits, ot_d[idx_d], reduction="sum") / (len(idx) * LN2)

    def val_loss() -> float:
        total = 0.0
        for start in range(0, zv.shape[0], config.batch_size):
            idx = torch.arange(start, min(zv.shape[0], start + config.batch_size), device=device)
            logits, _ = module(val_rows(idx.cpu()), ov_d[idx], None if mv_d is None else mv_d[idx])
            total += float(nnf.binary_cross_entropy_with_logits(logits, ov_d[idx], reduction="sum"))
        return total / (zv.shape[0] * LN2)

    generator = torch.Generator().manual_seed(config.seed + 1)
    if family != "attention":
        info = fit(module, batch_loss, val_loss, zt.shape[0], config, generator)
    else:
        initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
        tried: dict[str, tuple[FitInfo, dict[str, torch.Tensor]]] = {}
        for start in config.attention_starts:
            module.load_state_dict(initial)
            readout = (_fit_mean_readout(module, train_rows, val_rows, mt, mv, ot_d, ov_d, config, generator)
                       if start == "mean" else None)
            run = fit(module, batch_loss, val_loss, zt.shape[0], config, generator)
            if readout is not None:
                run = replace(run, epochs_run=readout.epochs_run + run.epochs_run, steps=readout.steps + run.steps,
                              best_epoch=readout.epochs_run + run.best_epoch if run.best_epoch else readout.best_epoch,
                              seconds=readout.seconds + run.seconds)
            tried[start] = (run, {k: v.detach().clone() for k, v in module.state_dict().items()})
        kept = min(tried, key=lambda k: tried[k][0].best_val_loss)  # ties keep the first start listed
        best, state = tried[kept]
        module.load_state_dict(state)
        info = replace(best, start=kept, start_val_losses={k: v[0].best_val_loss for k, v in tried.items()},
                       epochs_run=sum(v[0].epochs_run for v in tried.values()),
                       steps=sum(v[0].steps for v in tried.values()),
                       seconds=sum(v[0].seconds for v in tried.values()))
    return TrainedProbe(family=family, module=module, mean=mean, std=std, config=config, fit_info=info,
                        spatial=zt.dim() == 3)
