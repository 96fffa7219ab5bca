"""Element-wise update rules on fp32 shards (AdamW, Adam, SGD).

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from scaling.optim import _compat
from scaling.optim._config import OptimizerConfig

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


def _fusable(config: OptimizerConfig, item: UpdateItem) -> bool:
    p = item.param
    return (
        config.method in ("adamw", "adam")
        and p.dtype in _FUSED_DTYPES
        and p.device.type in _FUSED_DEVICES
        and item.grad.dtype == p.dtype
        and p.is_contiguous()
        and item.grad.is_contiguous()
    )


@torch.no_grad()
def apply_updates(config: OptimizerConfig, items: Sequence[UpdateItem], step: int) -> None:
    """Update every ``item.param`` in place; same rule and arguments as :func:`apply_update`.

    Adam(W) items that share dtype, device, LR and weight decay go through one fused
    kernel call; the rest are updated one by one with :func:`apply_update`.
    """
    batches: dict[tuple[torch.dtype, torch.device, float, float, bool], list[UpdateItem]] = {}
    for item in items:
        if not item.param.numel():
            continue
        if not _fusable(config, item):
            apply_update(config, *item[:3], step, *item[3:])
            continue
        key = (item.param.dtype, item.param.device, item.lr, item.weight_decay, item.independent_weight_decay)
        batches.setdefault(key, []).append(item)
    for (_, device, lr, weight_decay, independent), batch in batches.items():
        params = [i.param for i in batch]
        kernel_decay = weight_decay
        if config.method == "adamw" and independent and weight_decay != 0:
            # Decay by weight_decay itself, not lr * weight_decay: outside the kernel.
            _compat.foreach_mul_(params, 1 - weight_decay)
            kernel_decay = 0.0
        fused = _compat.fused_adamw_ if config.method == "adamw" else _compat.fused_adam_
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


def state_names(config: OptimizerConfig) -> tuple[str, ...]:
    """Names of the per-parameter state tensors of ``config.method``."""
    if config.method == "sgd":
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
) -> None:
    """Update ``param`` (an fp32 shard, in place) from ``grad`` and ``state``.

    Args:
        config: method and hyper-parameters.
        param: the fp32 master shard.
        grad: the unscaled, clipped fp32 gradient shard (not modified).
        state: the shard's state tensors (updated in place).
        step: 1-based count of updates applied to this parameter, this one included.
        lr: learning rate of this update.
        weight_decay: the group's weight decay.
        independent_weight_decay: decay by ``weight_decay`` instead of ``lr * weight_decay``.
    """
    decay = weight_decay if independent_weight_decay else lr * weight_decay
    if config.method == "adamw":
        if weight_decay != 0:
            param.mul_(1 - decay)
        _adam(config, param, grad, state, step, lr)
    elif config.method == "adam":
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
