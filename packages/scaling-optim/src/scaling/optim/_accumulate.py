"""16-bit gradients accumulated in fp32 over a step's micro-batches (ZeRO 0 and 1).

Autograd accumulates a parameter's gradients in ``.grad``, in the parameter's dtype: over
``n`` micro-batches a bf16 ``.grad`` is rounded to 8 significant bits ``n - 1`` times.
Megatron-LM accumulates into an fp32 ``main_grad`` instead (its
``accumulate_allreduce_grads_in_fp32``, on for bf16); under ZeRO 2 and 3 this optimizer's
fp32 gradient shards do the same (they reduce in every pass). For ZeRO 0 and 1, which
reduce once per step, :class:`GradientAccumulator` moves ``.grad`` into an fp32 sum after
every pass but the step's last (``.grad`` is then None, as Megatron's after it adds into
``main_grad``) and, in the last, puts the sum plus that pass's gradient back into ``.grad``,
rounded once, before the DP reduction (in fp32 too, ``_reducer.py``) reads it. Its hooks
run before the reducer's (registered first). With one pass per step it does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from scaling.optim._reducer import SIXTEEN_BIT, check_backward_passes
from scaling.optim._slots import ParamSlot
from scaling.optim._weak import weak_hook


class GradientAccumulator:
    """fp32 sums of the 16-bit gradients of ``slots`` over a step's backward passes.

    Args:
        slots: the parameters to accumulate; those that are not 16-bit or whose update is
            not in fp32 (no master weights) are left to autograd.
    """

    def __init__(self, slots: Sequence[ParamSlot]) -> None:
        self.slots = [s for s in slots if s.param.dtype in SIXTEEN_BIT and s.compute_dtype == torch.float32]
        self.passes = 1
        self._seen = [0] * len(self.slots)
        self._sums: list[torch.Tensor | None] = [None] * len(self.slots)
        self.handles = [s.param.register_post_accumulate_grad_hook(self._hook(i)) for i, s in enumerate(self.slots)]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(acc: GradientAccumulator, param: torch.Tensor) -> None:
            grad = param.grad
            if acc.passes == 1 or grad is None:
                return
            acc._seen[index] += 1
            total = acc._sums[index]
            if acc._seen[index] < acc.passes:
                acc._sums[index] = grad.float() if total is None else total.add_(grad)
                param.grad = None
            else:  # the step's last pass: the sum goes back, rounded once, for the reduction
                acc._put_back(index)

        return weak_hook(self, hook)

    def _put_back(self, index: int) -> None:
        param, total = self.slots[index].param, self._sums[index]
        if total is not None:
            if param.grad is not None:
                total.add_(param.grad)
            param.grad = total.to(param.dtype)
        self._sums[index] = None
        self._seen[index] = 0

    def accumulate(self, passes: int) -> None:
        """Each step has ``passes`` backward passes (the trainer's micro-batches); 1: do nothing."""
        check_backward_passes(passes, "passes")
        self.passes = passes

    def flush(self) -> None:
        """Put back the sums of parameters that missed a pass (no gradient in some micro-batch)."""
        for index, total in enumerate(self._sums):
            if total is not None:
                self._put_back(index)

    def discard(self) -> None:
        """Drop the sums (``zero_grad``)."""
        self._sums = [None] * len(self.slots)
        self._seen = [0] * len(self.slots)
