"""Column- and row-parallel linear layers (Megatron-LM semantics).

Activations are batch-first ``[b, s, h]``; under sequence parallelism they are split
along ``s`` (dim 1) outside the tensor-parallel region.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scaling.collectives import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
)
from scaling.nn._float8 import Float8Config, Float8Weight, float8_linear
from scaling.nn._init import (
    InitMethod,
    LayerInputError,
    TPInfo,
    check_divisible,
    check_dtype,
    default_bias_init,
    default_weight_init,
    sharded_parameter,
    tp_info,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.topology import Axis, Topology


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: ProcessGroup | None,
    *,
    sequence_parallel: bool = False,
    gather_output: bool = False,
    float8: Float8Config | None = None,
    float8_weight: Float8Weight | None = None,
) -> torch.Tensor:
    """The column-parallel product: ``x`` enters the TP region, ``y = x W_r^T + b_r`` on this rank's rows.

    The one implementation of the math, used by :class:`ColumnParallelLinear` and by the
    auto API's wrappers of unmodified modules (``scaling.trainer.auto``).

    Args:
        x: ``[..., in]`` (``[b, s/tp, in]`` with ``sequence_parallel``: all-gathered along dim 1).
        weight: this rank's ``[out/tp, in]`` rows; bias: its ``[out/tp]`` part, or None.
        group: the TP process group (None: one rank).
        gather_output: all-gather the output to ``[..., out]`` (else it stays split).
        float8: multiply in float8 under this config (None: in the parameters' dtype).
        float8_weight: ``weight`` already in float8 (ZeRO-3's float8 all-gather), used in its place.
    """
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, group)
    else:
        x = copy_to_model_parallel_region(x, group)
    y = float8_linear(x, weight, bias, float8, float8_weight)
    return gather_from_model_parallel_region(y, group) if gather_output else y


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: ProcessGroup | None,
    *,
    sequence_parallel: bool = False,
    float8: Float8Config | None = None,
    float8_weight: Float8Weight | None = None,
) -> torch.Tensor:
    """The row-parallel product: partial ``x_r W_r^T`` summed over TP, then the replicated bias once.

    Args:
        x: this rank's ``[..., in/tp]`` split of the input.
        weight: this rank's ``[out, in/tp]`` columns; bias: the replicated ``[out]``, or None.
        group: the TP process group (None: one rank).
        sequence_parallel: reduce-scatter the sum along dim 1 (else all-reduce it).
        float8: multiply in float8 under this config (None: in the parameters' dtype).
        float8_weight: ``weight`` already in float8 (ZeRO-3's float8 all-gather), used in its place.
    """
    y = float8_linear(x, weight, None, float8, float8_weight)
    if sequence_parallel:
        y = reduce_scatter_to_sequence_parallel_region(y, group)
    else:
        y = reduce_from_model_parallel_region(y, group)
    return y if bias is None else y + bias


class _SplitLinear(torch.nn.Module):
    """What the column- and row-parallel linears share: their group, and what float8's rule reads."""

    _split = "?"  # "column" or "row"
    _tp: TPInfo
    weight: torch.nn.Parameter

    @property
    def model_parallel_group(self) -> ProcessGroup | None:
        """The TP process group (None without TP)."""
        return self._tp.group

    @property
    def tensor_parallel_split(self) -> str:
        """``"column"`` or ``"row"``: what float8's layer rule reads (see ``scaling.nn.TensorParallelLinear``)."""
        return self._split

    @property
    def linear_shape(self) -> tuple[int, int]:
        """The weight's ``[out, in]`` shape (this rank's part)."""
        out_features, in_features = self.weight.shape
        return out_features, in_features


class ColumnParallelLinear(_SplitLinear):
    """``y = x W^T + b`` with ``W`` split along its output dim over the TP ranks.

    Args:
        in_features: size of the input's last dim.
        out_features: full output size; must be divisible by the TP size.
        bias: add a (TP-split) bias.
        parallel_output: keep the output split over TP (``[..., out/tp]``) for a following
            :class:`RowParallelLinear`; ``False`` all-gathers it to ``[..., out]``.
        topology: a :class:`scaling.topology.Topology` (its ``axis("tp")`` and ``device`` are
            taken at once); ``None`` means one device on CPU, or the ``tp`` axis below.
        dtype: parameter dtype.
        init_method: fills the full ``[out, in]`` weight in place (default: ``torch.nn.Linear``'s).
        sequence_parallel: the input is split along dim 1 (sequence) and is all-gathered
            here instead of being copied into the TP region.
        bias_init_method: fills the full bias (default: ``torch.nn.Linear``'s).
        tp: the tensor-parallel axis (``topology.axis("tp")``), instead of ``topology``.
        device: where the parameters live, with ``tp`` (default: torch's default device).

    Raises:
        ValueError: when the TP size does not divide ``out_features``, or ``topology`` is
            given with ``tp`` or ``device``.
    """

    _split = "column"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        parallel_output: bool = True,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        init_method: InitMethod | None = None,
        sequence_parallel: bool = False,
        bias_init_method: InitMethod | None = None,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._tp = tp_info(topology, tp, device, "ColumnParallelLinear")
        check_divisible("out_features", out_features, self._tp.size, "ColumnParallelLinear")
        check_dtype(dtype, "ColumnParallelLinear")
        self.in_features = in_features
        self.out_features = out_features
        self.parallel_output = parallel_output
        self.sequence_parallel = sequence_parallel
        #: Float8 products (set by :func:`~scaling.nn.enable_float8`); None = the parameter dtype.
        self.float8: Float8Config | None = None
        #: The weight already in float8, set by ZeRO-3's float8 all-gather; None = quantised per product.
        self.float8_weight: Float8Weight | None = None
        self.weight = sharded_parameter(
            (out_features, in_features), init_method or default_weight_init, self._tp, 0, dtype, "weight"
        )
        if bias:
            init = bias_init_method or default_bias_init(in_features)
            self.bias: torch.nn.Parameter | None = sharded_parameter((out_features,), init, self._tp, 0, dtype, "bias")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in]`` (``[b, s/tp, in]`` under sequence parallelism)."""
        group = self._tp.group
        if x.shape[-1] != self.in_features:
            raise LayerInputError(
                f"ColumnParallelLinear({self.in_features} -> {self.out_features}) got an input of shape "
                f"{list(x.shape)}; it takes the whole input, [..., {self.in_features}] (a split input, "
                f"[..., {self.in_features // self._tp.size}] at model_parallel_size={self._tp.size}, goes to a "
                "RowParallelLinear with parallel_input=True)"
            )
        return column_parallel_linear(
            x,
            self.weight,
            self.bias,
            group,
            sequence_parallel=self.sequence_parallel,
            gather_output=not self.parallel_output,
            float8=self.float8,
            float8_weight=self.float8_weight,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"parallel_output={self.parallel_output}, model_parallel_size={self._tp.size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_SplitLinear):
    """``y = x W^T + b`` with ``W`` split along its input dim over the TP ranks.

    The partial products are summed over TP (all-reduce, or reduce-scatter along the
    sequence under sequence parallelism); the replicated bias is added after that sum so
    it is counted once. Under sequence parallelism the bias sees only this rank's
    sequence shard, so its meta has ``reduce_over_tp=True``.

    Args:
        in_features: full input size; must be divisible by the TP size.
        out_features: output size.
        bias: add a replicated bias.
        parallel_input: the input is already split over TP (``[..., in/tp]``, e.g. from a
            :class:`ColumnParallelLinear`); ``False`` splits a full input here.
        topology, dtype, init_method, sequence_parallel, bias_init_method, tp, device: as for
            :class:`ColumnParallelLinear`; with ``sequence_parallel`` the output is split
            along dim 1.

    Raises:
        ValueError: when the TP size does not divide ``in_features``.
    """

    _split = "row"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        parallel_input: bool = True,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        init_method: InitMethod | None = None,
        sequence_parallel: bool = False,
        bias_init_method: InitMethod | None = None,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._tp = tp_info(topology, tp, device, "RowParallelLinear")
        check_divisible("in_features", in_features, self._tp.size, "RowParallelLinear")
        check_dtype(dtype, "RowParallelLinear")
        self.in_features = in_features
        self.out_features = out_features
        self.parallel_input = parallel_input
        self.sequence_parallel = sequence_parallel
        #: Float8 products (set by :func:`~scaling.nn.enable_float8`); None = the parameter dtype.
        self.float8: Float8Config | None = None
        #: The weight already in float8, set by ZeRO-3's float8 all-gather; None = quantised per product.
        self.float8_weight: Float8Weight | None = None
        self.weight = sharded_parameter(
            (out_features, in_features), init_method or default_weight_init, self._tp, 1, dtype, "weight"
        )
        if bias:
            init = bias_init_method or default_bias_init(in_features)
            self.bias: torch.nn.Parameter | None = sharded_parameter(
                (out_features,), init, self._tp, None, dtype, "bias", reduce_over_tp=sequence_parallel
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in/tp]`` (or ``[..., in]`` with ``parallel_input=False``)."""
        group = self._tp.group
        expected = self.in_features if not self.parallel_input else self.in_features // self._tp.size
        if x.shape[-1] != expected:
            raise LayerInputError(self._input_error(x))
        if not self.parallel_input:
            x = scatter_to_model_parallel_region(x, group)
        return row_parallel_linear(
            x,
            self.weight,
            self.bias,
            group,
            sequence_parallel=self.sequence_parallel,
            float8=self.float8,
            float8_weight=self.float8_weight,
        )

    def _input_error(self, x: torch.Tensor) -> str:
        tp, part = self._tp.size, self.in_features // self._tp.size
        head = f"RowParallelLinear({self.in_features} -> {self.out_features}) got an input of shape {list(x.shape)}"
        if self.parallel_input and x.shape[-1] == self.in_features:
            return (
                f"{head}, the whole input; with parallel_input=True it takes this rank's split, [..., {part}] at "
                f"model_parallel_size={tp}: pass parallel_input=False to split a whole input here, or feed it "
                "a ColumnParallelLinear with parallel_output=True"
            )
        want = f"[..., {self.in_features}]" if not self.parallel_input else f"[..., {part}] (split over TP)"
        return f"{head}; expected {want} (in_features={self.in_features}, model_parallel_size={tp})"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"parallel_input={self.parallel_input}, model_parallel_size={self._tp.size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
