"""BitFit (bias-only training) and bottleneck adapters (Houlsby et al., 2019), TP-aware."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from scaling.nn._init import InitMethod
from scaling.nn._layer import attach_parameter_metas
from scaling.nn._linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from scaling.topology import Axis, Topology


def mark_only_bias_trainable(model: torch.nn.Module) -> int:
    """BitFit: freeze every parameter except biases; returns the number of trainable elements.

    Raises:
        ValueError: when ``model`` has no bias at all (nothing would train).
    """
    count = 0
    for name, p in model.named_parameters():
        p.requires_grad_(name == "bias" or name.endswith(".bias"))
        count += p.numel() if p.requires_grad else 0
    if count == 0:
        raise ValueError(
            f"mark_only_bias_trainable: {type(model).__name__} has no bias parameters; build it with bias=True"
        )
    return count


class BottleneckAdapter(torch.nn.Module):
    """``x + up(gelu(down(x)))`` with ``down`` column- and ``up`` row-parallel.

    ``up`` starts at zero, so the adapter is the identity until it trains.

    Args:
        hidden_size: input and output size.
        bottleneck_size: inner size (divisible by the TP size).
        topology: a :class:`scaling.topology.Topology` or ``None`` (one device).
        dtype: parameter dtype.
        sequence_parallel: input and output split along dim 1 over TP.

    ``tp`` and ``device`` (keyword-only): the tensor-parallel axis and the parameters' device,
    instead of ``topology`` (see :class:`ColumnParallelLinear`).
    """

    def __init__(
        self,
        hidden_size: int,
        bottleneck_size: int,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.down = ColumnParallelLinear(
            hidden_size,
            bottleneck_size,
            topology=topology,
            dtype=dtype,
            sequence_parallel=sequence_parallel,
            init_method=init_method,
            tp=tp,
            device=device,
        )
        self.up = RowParallelLinear(
            bottleneck_size,
            hidden_size,
            topology=topology,
            dtype=dtype,
            sequence_parallel=sequence_parallel,
            init_method=torch.nn.init.zeros_,
            bias_init_method=torch.nn.init.zeros_,
            tp=tp,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(F.gelu(self.down(x)))


def _adapter_hook(module: torch.nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
    return module.get_submodule("adapter")(output)


def apply_bottleneck_adapters(
    model: torch.nn.Module,
    target_modules: list[str],
    bottleneck_size: int,
    topology: Topology | None = None,
    sequence_parallel: bool = False,
) -> list[str]:
    """Insert a :class:`BottleneckAdapter` after each named module (``<module>.adapter``),
    e.g. after the attention and MLP of every block. Returns the adapted names.

    Raises:
        ValueError: when a target matches no module (the message lists the candidates).
    """
    named = dict(model.named_modules())
    hits = [n for n in named if any(n == t or n.endswith("." + t) for t in target_modules)]
    for target in target_modules:
        if not any(n == target or n.endswith("." + target) for n in hits):
            raise ValueError(
                f"apply_bottleneck_adapters: target {target!r} matches no module; modules are {[n for n in named if n]}"
            )
    for name in hits:
        module = named[name]
        width = _output_width(module)
        module.adapter = BottleneckAdapter(
            width, bottleneck_size, topology=topology, sequence_parallel=sequence_parallel
        )
        module.register_forward_hook(_adapter_hook)
    attach_parameter_metas(model)
    return hits


def _output_width(module: torch.nn.Module) -> int:
    # Rejected at every TP size, so a model that works at TP = 1 does not break at TP = 2.
    if isinstance(module, ColumnParallelLinear) and module.parallel_output:
        raise ValueError(
            "apply_bottleneck_adapters: a column-parallel layer with parallel_output=True returns a TP shard; "
            "target the block output (attention, MLP or a row-parallel layer) instead"
        )
    for attr in ("hidden_size", "out_features"):
        if isinstance(getattr(module, attr, None), int):
            return int(getattr(module, attr))
    raise ValueError(
        f"apply_bottleneck_adapters: cannot tell the output width of {type(module).__name__}; "
        "target a module with hidden_size or out_features (attention, MLP output projection)"
    )
