"""The update rules: element-wise AdamW, Adam and SGD on fp32 shards, Muon on whole matrices, and
which rule updates a parameter.

The rules are element-wise, so applying them to a flat shard of a parameter gives,
element for element, the same result as applying them to the whole parameter; that is
what makes ZeRO sharding exact.

:func:`apply_updates` runs Adam(W) on fp32/fp64 shards of a CPU or CUDA device as one
fused multi-tensor kernel per parameter group (``torch.optim``'s ``fused=True`` kernel:
one pass over memory instead of one per operation, about 4x less CPU time than the
single-tensor form on CPU); it agrees with ``torch.optim.AdamW(foreach=False)`` to
rounding (~1e-10 relative per step). Everything else (SGD, fp16/bf16 work tensors
without master weights, other devices) takes :func:`apply_update`, whose arithmetic
follows ``torch.optim``'s single-tensor implementations operation for operation.

Muon (:func:`muon_updates`) orthogonalises each whole matrix by a Newton-Schulz iteration. The
arithmetic is torch.optim.Muon's (torch >= 2.9; Keller Jordan's reference): an exponential
moving average of the gradient, its Nesterov blend, five quintic Newton-Schulz steps on the
matrix divided by its Frobenius norm, decoupled weight decay, and a learning rate scaled by the
matrix's shape. Unlike the element-wise rules, the orthogonalisation needs the
whole logical matrix: ``LogicalFrame.gather_whole`` (``_whole.py``) gathers it from every rank's owned
elements (ZeRO shards, TP pieces) and ``LogicalFrame.owned_part`` takes this rank's elements
of the result back, so every layout applies the same update to the same elements. Every rank of
a matrix's group orthogonalises it (the same product on each; DistMuon's assignment of matrices
to ranks would divide that work and is not done here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from scaling.optim import _compat
from scaling.optim._config import MuonConfig, OptimizerConfig

_FUSED_DTYPES = (torch.float32, torch.float64)
_FUSED_DEVICES = ("cpu", "cuda")


class UpdateItem(NamedTuple):
    """One shard to update: the fp32 work tensor, its gradient, state and group hyper-parameters."""

    param: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    lr: float
    weight_decay: float
    independent_weight_decay: bool
    #: The rule (``update_rule``); None: ``config.method``.
    method: str | None = None
    #: The slot's index in ``DataParallel.slots`` (Muon gathers the whole matrix by it).
    slot: int = -1


def _method(config: OptimizerConfig, item: UpdateItem) -> str:
    return item.method or config.method


def _fusable(config: OptimizerConfig, item: UpdateItem) -> bool:
    p = item.param
    return (
        _method(config, item) in ("adamw", "adam")
        and p.dtype in _FUSED_DTYPES
        and p.device.type in _FUSED_DEVICES
        and item.grad.dtype == p.dtype
        and p.is_contiguous()
        and item.grad.is_contiguous()
    )


@torch.no_grad()
def apply_updates(
    config: OptimizerConfig, items: Sequence[UpdateItem], step: int, whole: WholeMatrices | None = None
) -> None:
    """Update every ``item.param`` in place; same rule and arguments as :func:`apply_update`.

    Adam(W) items that share dtype, device, LR and weight decay go through one fused
    kernel call; Muon's go to ``muon_updates`` (whole matrices, gathered through ``whole``:
    every rank holding them calls this alike); the rest are updated one by one with
    :func:`apply_update`.
    """
    batches: dict[tuple[str, torch.dtype, torch.device, float, float, bool], list[UpdateItem]] = {}
    muon = [item for item in items if _method(config, item) == "muon"]
    if muon:
        if whole is None:
            raise ValueError("apply_updates: Muon items need the calls that gather their matrices (whole=)")
        muon_updates(config.muon, muon, whole)
    for item in items:
        method = _method(config, item)
        if not item.param.numel() or method == "muon":
            continue
        if not _fusable(config, item):
            apply_update(
                config, item.param, item.grad, item.state, step, item.lr, item.weight_decay,
                item.independent_weight_decay, method,
            )  # fmt: skip
            continue
        key = (method, item.param.dtype, item.param.device, item.lr, item.weight_decay, item.independent_weight_decay)
        batches.setdefault(key, []).append(item)
    for (method, _, device, lr, weight_decay, independent), batch in batches.items():
        params = [i.param for i in batch]
        kernel_decay = weight_decay
        if method == "adamw" and independent and weight_decay != 0:
            # Decay by weight_decay itself, not lr * weight_decay: outside the kernel.
            _compat.foreach_mul_(params, 1 - weight_decay)
            kernel_decay = 0.0
        fused = _compat.fused_adamw_ if method == "adamw" else _compat.fused_adam_
        # The kernel reads the step count (bias correction) from a tensor and does not change it.
        steps = [torch.full((), float(step), dtype=torch.float32, device=device)] * len(batch)
        no_max_exp_avg_sqs: list[torch.Tensor] = []  # amsgrad is off
        fused(
            params,
            [i.grad for i in batch],
            [i.state["exp_avg"] for i in batch],
            [i.state["exp_avg_sq"] for i in batch],
            no_max_exp_avg_sqs,
            steps,
            lr=lr,
            beta1=config.beta1,
            beta2=config.beta2,
            weight_decay=kernel_decay,
            eps=config.eps,
            amsgrad=False,
            maximize=False,
        )


def update_rule(config: OptimizerConfig, group_method: str | None, logical_shape: Sequence[int]) -> str:
    """The rule updating a parameter of ``logical_shape``: its group's method, else the optimizer's;
    Muon updates matrices only, the other parameters of its groups take AdamW (the reference recipe)."""
    method = group_method or config.method
    return "adamw" if method == "muon" and len(logical_shape) != 2 else method


def state_names(config: OptimizerConfig, method: str | None = None) -> tuple[str, ...]:
    """Names of the per-parameter state tensors of ``method`` (default ``config.method``)."""
    method = method or config.method
    if method == "muon":
        return ("momentum_buffer",)
    if method == "sgd":
        return ("momentum_buffer",) if config.momentum > 0 else ()
    return ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def apply_update(
    config: OptimizerConfig,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    step: int,
    lr: float,
    weight_decay: float,
    independent_weight_decay: bool,
    method: str | None = None,
) -> None:
    """Update ``param`` (an fp32 shard, in place) from ``grad`` and ``state`` by an element-wise rule.

    Args:
        config: method and hyper-parameters.
        param: the fp32 master shard.
        grad: the unscaled, clipped fp32 gradient shard (not modified).
        state: the shard's state tensors (updated in place).
        step: 1-based count of updates applied to this parameter, this one included.
        lr: learning rate of this update.
        weight_decay: the group's weight decay.
        independent_weight_decay: decay by ``weight_decay`` instead of ``lr * weight_decay``.
        method: ``"adamw"``, ``"adam"`` or ``"sgd"`` (default ``config.method``); Muon is
            ``muon_updates``'s (it needs whole matrices).
    """
    method = method or config.method
    if method == "muon":
        raise ValueError("apply_update: Muon orthogonalises whole matrices; update Muon items with muon_updates")
    decay = weight_decay if independent_weight_decay else lr * weight_decay
    if method == "adamw":
        if weight_decay != 0:
            param.mul_(1 - decay)
        _adam(config, param, grad, state, step, lr)
    elif method == "adam":
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        _adam(config, param, grad, state, step, lr)
    else:
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if config.momentum > 0:
            buf = state["momentum_buffer"]
            if step == 1:
                buf.copy_(grad)
            else:
                buf.mul_(config.momentum).add_(grad)
            grad = buf
        param.add_(grad, alpha=-lr)


def _adam(
    config: OptimizerConfig,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    step: int,
    lr: float,
) -> None:
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    beta1, beta2 = config.beta1, config.beta2
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(config.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


# ---------------------------------------------------------------------------- Muon
class WholeMatrices(NamedTuple):
    """The sharding component's calls between a slot's owned elements and its logical matrix
    (``DataParallel.whole_matrices()``: a ``_whole.LogicalFrame``'s ``orthogonaliser``, ``gather_whole``, ``owned_part`` and the
    slot's logical shape)."""

    owner: Callable[[int, int], int | None]
    gather: Callable[[int, torch.Tensor, int | None], torch.Tensor | None]
    part: Callable[[int, torch.Tensor | None, int | None], torch.Tensor]
    shape: Callable[[int], tuple[int, ...]]


def newton_schulz(matrix: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """``matrix`` (2-D) orthogonalised: ``U S' V^T`` with ``S'`` near 1, in ``config.ns_dtype``."""
    a, b, c = config.ns_coefficients
    x = matrix.to(getattr(torch, config.ns_dtype))
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=config.eps))
    for _ in range(config.ns_steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, shape: Sequence[int], config: MuonConfig) -> float:
    """The learning rate of a matrix of logical ``shape`` (``config.adjust_lr``)."""
    rows, cols = shape[0], shape[1]
    if config.adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if config.adjust_lr == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr


@torch.no_grad()
def muon_updates(config: MuonConfig, items: Sequence[UpdateItem], whole: WholeMatrices) -> None:
    """Update each of ``items`` (the owned elements of slot ``item.slot``) by Muon.

    Every rank holding a piece of these matrices calls it with the same slots in the same order
    (their gathers are collectives over the slots' shard groups and TP). A sharded matrix is
    gathered on one rank of its shard group, round-robin, which orthogonalises it and scatters the
    result (DistMuon's division of the work): each rank holds about 1 / DP of the matrices whole at
    once and runs their Newton-Schulz alone; an unsharded one (ZeRO-0) is orthogonalised on every
    rank holding it.
    """
    owners, matrices = [], []
    for k, item in enumerate(items):
        buf = item.state["momentum_buffer"]
        buf.lerp_(item.grad, 1 - config.momentum)
        blend = item.grad.lerp(buf, config.momentum) if config.nesterov else buf
        owners.append(whole.owner(item.slot, k))
        matrices.append(whole.gather(item.slot, blend, owners[-1]))
    orthos = [None if m is None else newton_schulz(m, config) for m in matrices]
    for item, owner, ortho in zip(items, owners, orthos):
        part = whole.part(item.slot, ortho, owner)
        decay = item.weight_decay if item.independent_weight_decay else item.lr * item.weight_decay
        if decay != 0:
            item.param.mul_(1 - decay)
        item.param.add_(part.to(item.param.dtype), alpha=-adjusted_lr(item.lr, whole.shape(item.slot), config))
