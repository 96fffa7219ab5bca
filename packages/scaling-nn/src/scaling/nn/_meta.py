"""ParameterMeta: the layout-independent identity of a parameter, attached to it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

_ATTR = "parameter_meta"


@dataclass(frozen=True)
class ParameterMeta:
    """What the optimizer, clipping, ZeRO and checkpoints need to know about a parameter.

    Attributes:
        local_name: name inside its layer, e.g. ``"linear.weight"``.
        layer_index: global index of the layer in the LayerSpec list (None until the
            ParallelModule builds the layer).
        parallel_dim: tensor dim split over TP ranks, or None when replicated over TP.
        model_parallel_size: TP degree the parameter was split for.
        logical_shape: the full, unsharded shape.
        tied_key: key of the tied group (e.g. input embedding and LM head), or None.
        reduce_over_tp: True for a TP-replicated parameter used inside a
            sequence-parallel region; its gradient must be all-reduced over TP.
        is_expert: True for a mixture-of-experts expert's parameter: under expert
            parallelism only some data-parallel ranks hold it (``ParallelMoE``).
    """

    local_name: str
    logical_shape: tuple[int, ...]
    parallel_dim: int | None = None
    model_parallel_size: int = 1
    layer_index: int | None = None
    tied_key: str | None = None
    reduce_over_tp: bool = False
    is_expert: bool = False

    @property
    def is_model_parallel(self) -> bool:
        """True when the parameter is split over TP ranks."""
        return self.parallel_dim is not None and self.model_parallel_size > 1

    def local_size(self, tp_rank: int) -> tuple[int, int]:
        """Along ``parallel_dim``: ``(rows held, rows of them that are logical)`` on TP rank ``tp_rank``.

        A dimension that does not divide by the TP size (a vocabulary) is padded to a multiple of
        it: each rank holds ``ceil(n / tp)`` rows, the padding at the end of the last ranks, so the
        logical rows are ``torch.chunk``'s (and a DTensor ``Shard``'s) pieces."""
        assert self.parallel_dim is not None
        n = self.logical_shape[self.parallel_dim]
        held = -(-n // self.model_parallel_size)
        return held, max(0, min(held, n - tp_rank * held))

    @property
    def key(self) -> str:
        """Layout-independent key ``layers.{layer_index}.{local_name}`` (or ``local_name``)."""
        if self.layer_index is None:
            return self.local_name
        return f"layers.{self.layer_index}.{self.local_name}"

    def with_layer_index(self, layer_index: int, prefix: str = "") -> ParameterMeta:
        """A copy placed at ``layer_index`` (``prefix`` is prepended to ``local_name``)."""
        return replace(self, layer_index=layer_index, local_name=prefix + self.local_name)

    def with_expert(self) -> ParameterMeta:
        """A copy marked as an expert's parameter."""
        return replace(self, is_expert=True)

    def attach(self, param: torch.Tensor) -> torch.Tensor:
        """Attach this meta to ``param`` (as ``param.parameter_meta``) and return it."""
        setattr(param, _ATTR, self)
        return param

    def __repr__(self) -> str:
        split = (
            "replicated" if self.parallel_dim is None else f"split dim {self.parallel_dim}/{self.model_parallel_size}"
        )
        return f"ParameterMeta({self.key}, {list(self.logical_shape)}, {split}, tied={self.tied_key})"


def get_parameter_meta(param: torch.Tensor) -> ParameterMeta:
    """The :class:`ParameterMeta` of ``param``.

    Raises:
        ValueError: when the parameter carries none (it was not created by a Scaling layer
            and not registered with :meth:`ParameterMeta.attach`).
    """
    meta = getattr(param, _ATTR, None)
    if meta is None:
        raise ValueError(
            f"parameter of shape {list(param.shape)} has no ParameterMeta; create it with a scaling.nn "
            "layer or attach one with ParameterMeta(...).attach(param)"
        )
    return meta
