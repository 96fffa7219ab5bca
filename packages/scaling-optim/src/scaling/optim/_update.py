"""Element-wise update rules on fp32 shards (AdamW, Adam, SGD).

The rules are element-wise, so applying them to a flat shard of a parameter gives,
element for element, the same result as applying them to the whole parameter; that is
what makes ZeRO sharding exact. The arithmetic follows ``torch.optim``'s single-tensor
implementations operation for operation.
"""

from __future__ import annotations

import torch

from scaling.optim._config import OptimizerConfig


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
