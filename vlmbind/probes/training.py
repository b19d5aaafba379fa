"""The shared probe training recipe: Adam, mini-batches, training to convergence on a validation loss.

Design: every probe in this package (the autoregressive probes and the pairwise IsSameObject probes) is a small
``torch.nn.Module`` trained by :func:`fit`: Adam, learning rate 1e-3, weight decay 1e-4 (Adam's L2 form,
``torch.optim.Adam(weight_decay=...)``), batch 512, as in FBP. By default (``epochs=None``) it trains to convergence:
the learning rate is multiplied by ``lr_gamma`` whenever the validation loss has not improved for ``plateau`` epochs,
and training stops after ``patience`` epochs without improvement (or at ``max_epochs``), restoring the best
validation state. A fixed budget (``epochs=N``: FBP's 40 epochs with a step decay at ``lr_milestones``) is kept for
reproducing the paper's recipe; on a few thousand examples it stops after a few hundred steps, far from
convergence, and under-reports information. The probes start from the training prior (their output biases at the
training split's log-odds), so an uninformative representation starts at the prior's cross-entropy, not above it.
The trainer never sees data directly: the caller hands it a ``batch_loss(indices)`` closure and a ``val_loss()``
closure, so the same loop serves pooled vectors, spatial tokens and token pairs, and data stays in its stored dtype
(half-precision captures are cast per batch, never copied whole).
All randomness (initialisation and shuffling) comes from one ``torch.Generator`` seeded by ``ProbeConfig.seed`` and
the global RNG is never touched, so the same seed gives the same numbers on CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import TrainingError

LN2 = math.log(2.0)
ATTENTION_STARTS = ("cold", "mean")


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """Training and architecture settings shared by every probe family.

    Attributes:
        epochs: a fixed number of passes over the training split with the step decay (FBP: 40); ``None`` (default):
            train to convergence (see the module docstring).
        max_epochs: the most passes when training to convergence.
        plateau: epochs without a better validation loss before the learning rate drops (to convergence).
        batch_size: mini-batch size (FBP: 512).
        lr: Adam learning rate (FBP: 1e-3).
        weight_decay: Adam L2 weight decay (FBP: 1e-4).
        lr_milestones: fractions of ``epochs`` after which the learning rate is multiplied by ``lr_gamma``
            (the step decay); ``()`` keeps it constant.
        lr_gamma: the step-decay factor.
        patience: stop after this many epochs without a better validation loss; ``None`` runs every epoch. Either
            way the parameters with the best validation loss are restored.
        seed: seeds initialisation and shuffling (a private generator; the global RNG is untouched).
        rank: rank of the low-rank symmetric quadratic forms (quadratic, shared_factor, attention readout,
            pairwise quadratic; ``None`` in the pairwise quadratic means a full symmetric matrix).
        hidden: hidden width of each per-output MLP of the ``dnn`` family.
        dnn_layers: number of linear layers of each per-output MLP (GELU between them; FBP: 4).
        query_rank: rank of the map from the conditioning code o_<k to the attention probe's query.
        standardize: z-score every representation dimension with training-split statistics (an invertible affine
            map, so it changes no information; it only makes one learning rate fit every site's scale).
        attention_starts: where the attention probe's fit starts; with more than one, each is trained and the one
            with the lower validation loss is kept. ``cold``: its initialisation (query and quadratic readout at
            zero). ``mean``: first only its readout of the tokens' mean (uniform attention, no quadratic term: the
            linear probe on the mean pool, which the family nests), then every parameter from there. Each wins
            somewhere: on a few thousand images a cold start's quadratic readout memorises the training codes
            within a few dozen epochs, before the linear part has learnt, and its bound falls far below the pooled
            linear probe's; where one token holds the answer, the cold start's query finds it and the mean start's
            readout, fitted to the diluted mean, keeps the attention broad.
        device: ``"cpu"``, ``"cuda"``, ... or ``None`` for CUDA when available, else CPU.
    """

    epochs: int | None = None
    max_epochs: int = 2000
    plateau: int = 5
    batch_size: int = 512
    lr: float = 1e-3
    weight_decay: float = 1e-4
    lr_milestones: tuple[float, ...] = (0.5, 0.75)
    lr_gamma: float = 0.1
    patience: int | None = 20
    seed: int = 0
    rank: int | None = 16
    hidden: int = 64
    dnn_layers: int = 4
    query_rank: int = 16
    standardize: bool = True
    attention_starts: tuple[str, ...] = ("cold", "mean")
    device: str | None = None

    def __post_init__(self) -> None:
        for name in ("epochs", "max_epochs", "plateau", "batch_size", "hidden", "dnn_layers", "query_rank"):
            v = getattr(self, name)
            if name == "epochs" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TrainingError(f"ProbeConfig.{name} must be a positive int, got {v!r}")
        if self.dnn_layers < 2:
            raise TrainingError(f"ProbeConfig.dnn_layers={self.dnn_layers} must be >= 2 (an MLP, not a linear probe)")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 1):
            raise TrainingError(f"ProbeConfig.rank must be a positive int or None, got {self.rank!r}")
        if self.patience is not None and (not isinstance(self.patience, int) or self.patience < 1):
            raise TrainingError(f"ProbeConfig.patience must be a positive int or None, got {self.patience!r}")
        for name in ("lr", "lr_gamma"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise TrainingError(f"ProbeConfig.{name} must be a positive number, got {v!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise TrainingError(f"ProbeConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if any(not 0 < m < 1 for m in self.lr_milestones):
            raise TrainingError(f"ProbeConfig.lr_milestones are fractions of the run in (0, 1), got "
                                f"{self.lr_milestones!r}")
        if (not isinstance(self.attention_starts, tuple) or not self.attention_starts
                or any(x not in ATTENTION_STARTS for x in self.attention_starts)
                or len(set(self.attention_starts)) != len(self.attention_starts)):
            raise TrainingError(f"ProbeConfig.attention_starts must be a tuple of distinct starts from "
                                f"{ATTENTION_STARTS}, got {self.attention_starts!r}")
        if not isinstance(self.seed, int):
            raise TrainingError(f"ProbeConfig.seed must be an int, got {self.seed!r}")

    def resolved_device(self) -> torch.device:
        """The device probes train on."""
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as e:
            raise TrainingError(f"ProbeConfig.device={self.device!r} is not a torch device; use 'cpu' or 'cuda'") from e


@dataclass(frozen=True)
class FitInfo:
    """What :func:`fit` did.

    Attributes:
        epochs_run: epochs actually run (fewer than configured when early stopping fired).
        best_epoch: the (1-based) epoch whose parameters were kept.
        best_val_loss: the validation loss of the kept parameters (the caller's unit: bits for the probes here).
        seconds: wall time of the training loop.
        steps: optimiser steps taken.
        converged: training stopped because the validation loss stopped improving (not at the epoch limit).
        final_lr: the learning rate at the end.
        start: the attention probe's start that was kept (``ProbeConfig.attention_starts``); ``None`` for the
            other families.
        start_val_losses: the best validation loss of every start tried (attention probe only). With more than one
            start, ``epochs_run``, ``steps`` and ``seconds`` count all of them; ``best_epoch`` is the kept one's.
    """

    epochs_run: int
    best_epoch: int
    best_val_loss: float
    seconds: float
    steps: int = 0
    converged: bool = False
    final_lr: float = 0.0
    start: str | None = None
    start_val_losses: dict[str, float] | None = None


def fit(module: torch.nn.Module, batch_loss: Callable[[torch.Tensor], torch.Tensor], val_loss: Callable[[], float],
        n_train: int, config: ProbeConfig, generator: torch.Generator) -> FitInfo:
    """Train ``module`` in place with the FBP recipe and restore its best-validation parameters.

    Args:
        module: the probe (already on the training device).
        batch_loss: maps a 1-D int64 tensor of training-row indices to the scalar mean loss of those rows.
        val_loss: the mean validation loss of the current parameters (called under ``torch.no_grad``).
        n_train: number of training rows (indices ``0 .. n_train - 1``).
        config: the recipe.
        generator: CPU generator for the shuffles.

    Returns:
        A :class:`FitInfo`.

    Raises:
        TrainingError: no training rows, or the loss became NaN / infinite.
    """
    if n_train < 1:
        raise TrainingError("the training split is empty; give at least one training example")
    t0 = time.perf_counter()
    opt = torch.optim.Adam(module.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    to_convergence = config.epochs is None
    if to_convergence:
        n_epochs = config.max_epochs
        sched: Any = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=config.lr_gamma, patience=config.plateau,
                                                                threshold=0.0)
    else:
        n_epochs = config.epochs
        milestones = sorted({max(1, int(round(m * config.epochs))) for m in config.lr_milestones})
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=config.lr_gamma)

    def snapshot() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    module.eval()
    with torch.no_grad():
        best_loss = float(val_loss())  # the initial parameters are a candidate too: never worse than doing nothing
    best_state, best_epoch, since_best, epoch, steps, converged = snapshot(), 0, 0, 0, 0, False
    for epoch in range(1, n_epochs + 1):
        module.train()
        order = torch.randperm(n_train, generator=generator)
        for start in range(0, n_train, config.batch_size):
            loss = batch_loss(order[start:start + config.batch_size])
            if not torch.isfinite(loss):
                raise TrainingError(f"probe loss became {loss.item()} at epoch {epoch}; lower ProbeConfig.lr "
                                    f"(now {config.lr}) or check the representations for inf/NaN")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        module.eval()
        with torch.no_grad():
            current = float(val_loss())
        if to_convergence:
            sched.step(current)
        else:
            sched.step()
        if current < best_loss:
            best_loss, best_state, best_epoch, since_best = current, snapshot(), epoch, 0
        else:
            since_best += 1
            if config.patience is not None and since_best >= config.patience:
                converged = True
                break
    module.load_state_dict(best_state)
    module.eval()
    return FitInfo(epochs_run=epoch, best_epoch=best_epoch, best_val_loss=best_loss,
                   seconds=time.perf_counter() - t0, steps=steps, converged=converged,
                   final_lr=float(opt.param_groups[0]["lr"]))


def feature_stats(rows: Callable[[torch.Tensor], torch.Tensor], n: int, dim: int, *,
                  token_mask: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                  chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and standard deviation over ``n`` rows, accumulated in float64 chunk by chunk.

    Args:
        rows: maps row indices to float tensors ``[b, dim]`` or ``[b, T, dim]``.
        n: number of rows.
        dim: the last dimension.
        token_mask: for ``[b, T, dim]`` rows, maps indices to a ``[b, T]`` bool mask of the tokens to count.
        chunk: rows per chunk.

    Returns:
        ``(mean, std)``, float32 ``[dim]``; a constant dimension gets std 1 (it is then only centred).
    """
    s = torch.zeros(dim, dtype=torch.float64)
    s2 = torch.zeros(dim, dtype=torch.float64)
    count = 0
    for start in range(0, n, chunk):
        idx = torch.arange(start, min(n, start + chunk))
        x = rows(idx).double().cpu()
        if x.dim() == 3:
            m = token_mask(idx) if token_mask is not None else None
            x = x.reshape(-1, dim) if m is None else x[m.cpu()]
        s += x.sum(0)
        s2 += (x * x).sum(0)
        count += x.shape[0]
    mean = s / max(count, 1)
    var = (s2 / max(count, 1) - mean * mean).clamp_min(0.0)
    std = var.sqrt()
    std = torch.where(std > 1e-8 * (1.0 + mean.abs()), std, torch.ones_like(std))
    return mean.float(), std.float()
