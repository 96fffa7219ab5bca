"""Per-parameter optimizer storage: the DP shard a rank owns, its master copy, state and gradient.

Layout: a parameter is flattened; with ZeRO (``shard_world > 1``) the flat tensor is cut
into ``shard_world`` equal chunks of ``ceil(numel / shard_world)`` elements and DP rank
``r`` owns chunk ``r`` (the last chunks may be short or empty). Without ZeRO a rank owns
the whole tensor. Master weights, optimizer state and (ZeRO-2) the reduced gradient
exist only for the owned elements, so their bytes shrink with the DP size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from scaling.nn import Float8Weight, ParameterMeta
from scaling.optim._compat import foreach_copy_


class ParamSlot:
    """What the optimizer keeps for one trainable parameter on this rank.

    Args:
        name: the parameter's name in its group.
        param: the (TP-local) parameter; must be contiguous.
        meta: its :class:`~scaling.nn.ParameterMeta`.
        group_index: index of its parameter group.
        shard_world: number of DP ranks the optimizer storage is split over (1 = none).
        shard_rank: this rank's DP coordinate.
        master_weights: keep an fp32 master copy when the parameter is not fp32.
        state_names: names of the update rule's state tensors.
        offload: keep the master copy (then always made, fp32 parameters included) and
            the state in host memory, pinned when the parameter is on CUDA.
        rule: the update rule (``_update.update_rule``): "adamw", "adam", "sgd" or "muon".
    """

    def __init__(
        self,
        name: str,
        param: torch.nn.Parameter,
        meta: ParameterMeta,
        group_index: int,
        shard_world: int,
        shard_rank: int,
        master_weights: bool,
        state_names: tuple[str, ...],
        offload: bool = False,
        rule: str = "adamw",
    ) -> None:
        if not param.is_contiguous():
            raise ValueError(f"parameter {name!r} is not contiguous; the optimizer updates flat views of parameters")
        self.name, self.param, self.meta, self.group_index = name, param, meta, group_index
        self.rule = rule
        self.numel = param.numel()
        self.chunk = math.ceil(self.numel / shard_world) if self.numel else 0
        self.start = min(shard_rank * self.chunk, self.numel)
        self.end = min(self.start + self.chunk, self.numel)
        self.shard_world = shard_world
        has_master = offload or (master_weights and param.dtype != torch.float32)
        self.compute_dtype = torch.float32 if master_weights or offload else param.dtype
        # Where the master copy and the state live: host memory under offload.
        device = torch.device("cpu") if offload else param.device
        pin = offload and param.device.type == "cuda"
        flat = param.detach().view(-1)
        self.master: torch.Tensor | None = None
        if has_master:
            self.master = torch.empty(self.length, dtype=torch.float32, device=device, pin_memory=pin)
            self.master.copy_(flat[self.start : self.end])
        self.state = {
            n: torch.zeros(self.length, dtype=self.compute_dtype, device=device, pin_memory=pin) for n in state_names
        }
        # ZeRO-2/3: the DP-reduced gradient shard, accumulated over micro-batches.
        self.grad_shard: torch.Tensor | None = None
        # ZeRO-3: the owned elements of the parameter in its own dtype; the parameter's
        # storage is freed between uses (see _zero3.py).
        self.param_shard: torch.Tensor | None = None
        # ZeRO-3 float8 all-gathers: the whole weight in float8 (filled and freed with the
        # parameter) that the linear's products use; None for the other parameters.
        self.float8_weight: Float8Weight | None = None
        # Whether this rank counts this parameter in the global gradient norm (TP
        # replicas and pipeline-tied copies count once).
        self.counts_in_norm = True

    @property
    def length(self) -> int:
        """Number of elements this rank owns."""
        return self.end - self.start

    def flat_param(self) -> torch.Tensor:
        return self.param.detach().view(-1)

    def work_param(self) -> torch.Tensor:
        """The tensor the update writes: the fp32 master shard or a view of the parameter."""
        if self.master is not None:
            return self.master
        if self.param_shard is not None:
            return self.param_shard
        return self.flat_param()[self.start : self.end]

    def owned_grad(self) -> torch.Tensor:
        """The DP-reduced gradient of the owned elements in the dtype it has (zeros without one);
        :func:`owned_grads` casts them to the compute dtype."""
        if self.grad_shard is not None:
            return self.grad_shard
        grad = self.param.grad
        if grad is None:
            return torch.zeros(self.length, dtype=self.compute_dtype, device=self.param.device)
        return grad.reshape(-1)[self.start : self.end]

    def padded_chunk(self, source: torch.Tensor) -> torch.Tensor:
        """``source`` (the owned elements) padded to the chunk size, in the parameter dtype and device."""
        out = source.to(device=self.param.device, dtype=self.param.dtype)
        if self.length < self.chunk:
            out = torch.cat([out, out.new_zeros(self.chunk - self.length)])
        return out

    def padded_flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` flattened and padded to ``chunk * shard_world`` elements."""
        flat = tensor.reshape(-1)
        pad = self.chunk * self.shard_world - self.numel
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()

    def state_bytes(self) -> int:
        """Bytes of the master copy, state, gradient shard and (ZeRO-3) parameter shard held here."""
        tensors = [*self.state.values(), self.master, self.grad_shard, self.param_shard]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __repr__(self) -> str:
        return (
            f"ParamSlot({self.meta.key}, local {list(self.param.shape)}, owns [{self.start}, {self.end}) of "
            f"{self.numel}, master={'fp32' if self.master is not None else 'param'}, state={sorted(self.state)})"
        )


def owned_grads(slots: Sequence[ParamSlot]) -> list[torch.Tensor]:
    """Each slot's :meth:`ParamSlot.owned_grad` in its compute dtype, the casts made as one
    multi-tensor copy per device and dtype into one new buffer (on a GPU one launch instead of
    one per parameter: with bf16 parameters and fp32 master weights every gradient is cast)."""
    grads = [s.owned_grad() for s in slots]
    to_cast: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (slot, grad) in enumerate(zip(slots, grads)):
        if grad.dtype != slot.compute_dtype:
            to_cast.setdefault((grad.device, slot.compute_dtype), []).append(i)
    for (device, dtype), indices in to_cast.items():
        flat = torch.empty(sum(grads[i].numel() for i in indices), dtype=dtype, device=device)
        casts = list(flat.split([grads[i].numel() for i in indices]))
        foreach_copy_(casts, [grads[i] for i in indices])
        for i, cast in zip(indices, casts):
            grads[i] = cast
    return grads
