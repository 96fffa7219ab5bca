"""Tensor-parallel LoRA on column-, row-parallel, QKV and plain linear layers.

``y = W x + (alpha / r) * B A dropout(x)``. The adapters are added to the target module
itself (``<module>.lora_A.weight``, ``<module>.lora_B.weight``) and applied by a forward
hook, so the base parameter names do not change. Sharding follows the base layer:

* column-parallel: ``A`` replicated, ``B`` split along its output dim like ``W``; the
  rank-``r`` activation ``A x`` enters the TP region (all-reduce of its gradient, or a
  sequence all-gather under sequence parallelism);
* row-parallel: ``A`` split along its input dim like ``W``; the partial ``A x`` is summed
  over TP (all-reduce, or reduce-scatter under sequence parallelism); ``B`` replicated;
* replicated key/value projections (fewer kv heads than TP ranks): both replicated,
  their gradients summed over TP in the backward.

Under sequence parallelism the replicated factor sees one sequence shard per rank, so
its meta says ``reduce_over_tp`` (as for norms).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from pydantic import Field

from scaling.collectives import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
)
from scaling.config import BaseConfig
from scaling.nn._attention import _ReplicatedLinear
from scaling.nn._init import TPInfo, default_weight_init, sharded_parameter
from scaling.nn._layer import attach_parameter_metas
from scaling.nn._linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from scaling.topology import RNGTracker

LORA_TYPES = (ColumnParallelLinear, RowParallelLinear, _ReplicatedLinear, torch.nn.Linear)


class LoRAConfig(BaseConfig):
    """Which linear layers get LoRA adapters, and their shape."""

    rank: int = Field(8, gt=0, description="Adapter rank r (inner size of B A), > 0.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: the update is (alpha / rank) * B A x.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input during training, in [0, 1).")
    target_modules: list[str] = Field(
        description="Module names to adapt; a module matches when its dotted name equals an entry or ends "
        "with '.' + entry (peft's rule), e.g. ['qkv', 'dense'] or ['query', 'key', 'value'].",
    )

    @property
    def scaling(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank


class _LoRAFactor(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _tp_of(module: torch.nn.Module) -> TPInfo:
    tp = getattr(module, "_tp", None)
    return tp if tp is not None else TPInfo(1, 0, None, module.get_parameter("weight").device)


# ``module`` is Any here and in the hook: it gains plain ``lora_*`` attributes, which
# ``torch.nn.Module.__setattr__``/``__getattr__`` type as tensors or modules only.
def _add_adapter(module: Any, config: LoRAConfig, rng_tracker: RNGTracker | None) -> None:
    tp = _tp_of(module)
    base_meta = getattr(module.weight, "parameter_meta", None)
    full_out, full_in = tuple(base_meta.logical_shape) if base_meta is not None else tuple(module.weight.shape)
    dtype, sp = module.weight.dtype, bool(getattr(module, "sequence_parallel", False))
    kind = (
        "column"
        if isinstance(module, ColumnParallelLinear)
        else "row"
        if isinstance(module, RowParallelLinear)
        else "replicated"
    )
    a_dim = 1 if kind == "row" else None
    b_dim = 0 if kind == "column" else None
    module.lora_A = _LoRAFactor(
        sharded_parameter(
            (config.rank, full_in),
            default_weight_init,
            tp,
            a_dim,
            dtype,
            "weight",
            reduce_over_tp=sp and kind == "column",
        )
    )
    module.lora_B = _LoRAFactor(
        sharded_parameter(
            (full_out, config.rank), None, tp, b_dim, dtype, "weight", reduce_over_tp=sp and kind == "row"
        )
    )
    if base_meta is not None and base_meta.layer_index is not None:
        for factor in (module.lora_A.weight, module.lora_B.weight):
            replace(factor.parameter_meta, layer_index=base_meta.layer_index).attach(factor)
    module.lora_kind, module.lora_scaling, module.lora_dropout = kind, config.scaling, config.dropout
    module.lora_rng_tracker, module.lora_merged = rng_tracker, False
    module._lora_hook = module.register_forward_hook(_lora_forward_hook)


def _lora_delta(module: Any, x: torch.Tensor) -> torch.Tensor:  # Any: see _add_adapter
    tp, kind = _tp_of(module), module.lora_kind
    group, sp = tp.group, bool(getattr(module, "sequence_parallel", False))
    a_w, b_w = module.lora_A.weight, module.lora_B.weight
    if module.training and module.lora_dropout > 0.0:
        # A row-parallel input is sharded over TP: its mask comes from the per-rank stream.
        tracker = module.lora_rng_tracker if kind == "row" and tp.size > 1 else None
        with tracker.fork() if tracker is not None else contextlib.nullcontext():
            x = F.dropout(x, module.lora_dropout)
    if kind == "column":
        a = F.linear(x, a_w)
        a = gather_from_sequence_parallel_region(a, group) if sp else copy_to_model_parallel_region(a, group)
        delta = F.linear(a, b_w)
        return delta if module.parallel_output else gather_from_model_parallel_region(delta, group)
    if kind == "row":
        if not module.parallel_input:
            x = scatter_to_model_parallel_region(x, group)
        a = F.linear(x, a_w)
        a = reduce_scatter_to_sequence_parallel_region(a, group) if sp else reduce_from_model_parallel_region(a, group)
        return F.linear(a, b_w)
    if isinstance(module, _ReplicatedLinear):
        start, end = module.rows
        a = F.linear(x, copy_to_model_parallel_region(a_w, group))
        return F.linear(a, copy_to_model_parallel_region(b_w, group)[start:end])
    return F.linear(F.linear(x, a_w), b_w)


# Any: see _add_adapter.
def _lora_forward_hook(module: Any, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    if module.lora_merged:
        return output
    return output + module.lora_scaling * _lora_delta(module, args[0])


def lora_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module carrying a LoRA adapter."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A")]


def apply_lora(model: torch.nn.Module, config: LoRAConfig, rng_tracker: RNGTracker | None = None) -> list[str]:
    """Add LoRA adapters to the modules of ``model`` named by ``config.target_modules``.

    ``A`` is initialised like ``torch.nn.Linear`` (kaiming-uniform, drawn whole and
    sliced), ``B`` with zeros, so the model's output is unchanged until ``B`` trains.
    Metas are re-attached so the adapter parameters carry their local names. Pass
    ``rng_tracker`` for LoRA dropout on row-parallel layers (TP-sharded inputs).

    Returns:
        The adapted module names.

    Raises:
        ValueError: when a target matches no linear module (the message lists the
            candidates) or a matched module is not a linear layer.
    """
    names = []
    candidates = [n for n, m in model.named_modules() if isinstance(m, LORA_TYPES)]
    for target in config.target_modules:
        hits = [n for n, _ in model.named_modules() if _matches(n, [target])]
        if not hits:
            leaves = sorted({re.sub(r"^.*\.", "", n) for n in candidates})
            raise ValueError(
                f"LoRAConfig.target_modules: {target!r} matches no module; linear modules are {leaves} "
                f"(full names: {candidates})"
            )
    for name, module in model.named_modules():
        if not _matches(name, config.target_modules) or hasattr(module, "lora_A"):
            continue
        if not isinstance(module, LORA_TYPES):
            raise ValueError(
                f"LoRAConfig.target_modules: {name!r} is a {type(module).__name__}, not a linear layer; "
                f"choose among {candidates}"
            )
        if (
            config.dropout > 0
            and isinstance(module, RowParallelLinear)
            and _tp_of(module).size > 1
            and rng_tracker is None
        ):
            raise ValueError(
                f"LoRAConfig.dropout={config.dropout} on row-parallel {name!r} (TP-sharded input) needs "
                "apply_lora(..., rng_tracker=...) so each TP rank draws its own mask"
            )
        _add_adapter(module, config, rng_tracker)
        names.append(name)
    attach_parameter_metas(model)
    return names


@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> None:
    """Fold every adapter into its base weight (``W += scaling * B A``, per shard); the hook then adds nothing."""
    _fold(model, +1.0)


@torch.no_grad()
def unmerge_lora(model: torch.nn.Module) -> None:
    """Undo :func:`merge_lora` (``W -= scaling * B A``)."""
    _fold(model, -1.0)


def _fold(model: torch.nn.Module, sign: float) -> None:
    for _, m in lora_modules(model):
        _fold_module(m, sign)


def _fold_module(module: Any, sign: float) -> None:  # Any: see _add_adapter
    if module.lora_merged == (sign > 0):
        return
    # Each rank folds its own shards: the product of the shards is this rank's block of B A.
    module.weight.add_(sign * module.lora_scaling * (module.lora_B.weight @ module.lora_A.weight))
    module.lora_merged = sign > 0


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Adapter-only state dict (this rank's shards): ``{"<module>.lora_A.weight": ..., ...}``."""
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def mark_only_lora_trainable(model: torch.nn.Module) -> int:
    """Freeze everything but the adapters; returns the number of trainable parameters."""
    count = 0
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
        count += p.numel() if p.requires_grad else 0
    return count
