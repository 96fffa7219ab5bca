"""generate_plan: sizes, pipeline split points and TP sharding under user constraints."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

import torch

from scaling.nn import check_context_parallel
from scaling.trainer.auto._plan import CONTEXT_PARALLEL_METHODS, PIPELINE_SCHEDULES, PRECISIONS, Plan
from scaling.trainer.auto._policy import apply_overrides, check_divisible, megatron_policy, out_in, shard_dim
from scaling.trainer.auto._split import find_blocks, split_blocks

if TYPE_CHECKING:
    from scaling.config import JsonMapping

CONSTRAINT_KEYS = (
    "data_parallel_size",
    "tensor_parallel.size",
    "tensor_parallel.sharding_policy",
    "tensor_parallel.overrides",
    "pipeline_parallel.size",
    "pipeline_parallel.split_method",
    "pipeline_parallel.split_points",
    "pipeline_parallel.forbidden_split_points",
    "pipeline_parallel.schedule",
    "pipeline_parallel.num_micro_batches",
    "pipeline_parallel.static_shapes",
    "zero_stage",
    "data_parallel_shard_size",
    "cpu_offload",
    "context_parallel.size",
    "context_parallel.method",
    "precision",
    "global_batch_size",
    "seed",
)


def _positive(constraints: JsonMapping, key: str, default: int) -> int:
    value = constraints.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"constraint {key}={value!r} must be an int >= 1")
    return value


T = TypeVar("T")


def _choice(constraints: JsonMapping, key: str, choices: tuple[T, ...]) -> T:
    value = constraints.get(key, choices[0])
    if value not in choices:
        raise ValueError(f"constraint {key}={value!r} is invalid; choose one of {list(choices)}")
    return value


def _pipeline_and_optimizer(constraints: JsonMapping, plan: Plan) -> None:
    plan.pipeline_schedule = _choice(constraints, "pipeline_parallel.schedule", PIPELINE_SCHEDULES)
    per_rank = plan.global_batch_size // plan.data_parallel_size
    # Default: one micro-batch per stage where the per-rank batch allows it (gcd: always a divisor).
    default = math.gcd(plan.pipe_parallel_size, per_rank)
    plan.num_micro_batches = _positive(constraints, "pipeline_parallel.num_micro_batches", default)
    if per_rank % plan.num_micro_batches:
        raise ValueError(
            f"pipeline_parallel.num_micro_batches={plan.num_micro_batches} does not divide the per-DP-rank batch "
            f"global_batch_size/data_parallel_size={per_rank}; choose a divisor of {per_rank}"
        )
    static = constraints.get("pipeline_parallel.static_shapes", False)
    if not isinstance(static, bool):
        raise ValueError(f"constraint pipeline_parallel.static_shapes={static!r} must be true or false")
    plan.static_shapes = static
    stage = constraints.get("zero_stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"constraint zero_stage={stage!r} is invalid; choose 0, 1, 2 or 3")
    plan.zero_stage = stage
    plan.precision = _choice(constraints, "precision", PRECISIONS)
    shard = constraints.get("data_parallel_shard_size")
    if shard is not None:
        dp = plan.data_parallel_size
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 1 or dp % shard:
            raise ValueError(
                f"constraint data_parallel_shard_size={shard!r} must divide data_parallel_size={dp} "
                "(HSDP: DP ranks = shard × replicate)"
            )
        if shard < dp and (stage != 3 or shard == 1):
            raise ValueError(
                f"constraint data_parallel_shard_size={shard} (HSDP) needs zero_stage=3 and a shard size above 1, "
                f"got zero_stage={stage}; set zero_stage=3, or leave data_parallel_shard_size out"
            )
    plan.data_parallel_shard_size = shard
    offload = constraints.get("cpu_offload", False)
    if not isinstance(offload, bool):
        raise ValueError(f"constraint cpu_offload={offload!r} must be true or false")
    plan.cpu_offload = offload


def _check_heads(model: torch.nn.Module, plan: Plan) -> None:
    """Column splits inside an attention block must keep whole heads on each rank."""
    tp = plan.model_parallel_size
    modules = dict(model.named_modules())
    for path, sharding in plan.module_sharding.items():
        parent = modules.get(path.rpartition(".")[0])
        head_dim = getattr(parent, "head_dim", None)
        if sharding.style not in ("column", "column_fused") or not isinstance(head_dim, int) or head_dim <= 0:
            continue
        heads = out_in(modules[path])[0] // sharding.chunks // head_dim
        if heads % tp:
            raise ValueError(
                f"tensor_parallel.size={tp} does not divide the {heads} attention heads of {path} "
                f"(head_dim={head_dim}); choose a size dividing {heads}"
            )


def _tp_plan(model: torch.nn.Module, constraints: JsonMapping, plan: Plan) -> None:
    policy = constraints.get("tensor_parallel.sharding_policy", "megatron")
    if policy != "megatron":
        raise ValueError(f"constraint tensor_parallel.sharding_policy={policy!r} is not supported; choose 'megatron'")
    plan.sharding_policy = policy
    styles = megatron_policy(model)
    styles = apply_overrides(model, styles, dict(constraints.get("tensor_parallel.overrides", {})))
    modules = dict(model.named_modules())
    for path, sharding in styles.items():
        check_divisible(path, modules[path], sharding, plan.model_parallel_size)
    plan.module_sharding = dict(sorted(styles.items()))
    _check_heads(model, plan)
    seen: dict[int, str] = {}
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{path}.{name}" if path else name
            module_sharding = styles.get(path)
            dim = None if module_sharding is None else shard_dim(module_sharding, name)
            if id(param) in seen:
                if plan.parameter_sharding[seen[id(param)]] != (placement := _placement(dim)):
                    raise ValueError(
                        f"tied parameter {full} is {placement} but {seen[id(param)]} is "
                        f"{plan.parameter_sharding[seen[id(param)]]}; shard both the same way with tensor_parallel.overrides"
                    )
                continue
            seen[id(param)] = full
            plan.parameter_sharding[full] = _placement(dim)


def _context_parallel(model: torch.nn.Module, constraints: JsonMapping, plan: Plan) -> None:
    plan.context_parallel_size = cp = _positive(constraints, "context_parallel.size", 1)
    plan.context_parallel_method = _choice(constraints, "context_parallel.method", CONTEXT_PARALLEL_METHODS)
    if cp == 1:
        return
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"context_parallel.size={cp} needs a transformers model (its attention is replaced through "
            f"transformers' AttentionInterface); {type(model).__name__} is not one"
        )
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if isinstance(heads, int):
        check_context_parallel(heads // plan.model_parallel_size, cp, plan.context_parallel_method, 0.0)


def _placement(dim: int | None) -> str:
    return "Replicate()" if dim is None else f"Shard(dim={dim})"


def generate_plan(model: torch.nn.Module, constraints: JsonMapping | None = None) -> Plan:
    """Propose an nD-parallel :class:`Plan` for ``model`` under ``constraints``.

    Works on a model from :func:`deferred_init` (meta device) without allocating it. The
    high-level API RFC's order, ``generate_plan(constraints, model)``, is accepted too (the
    argument types tell them apart).

    Args:
        model: the (unmodified) model.
        constraints: flat dotted keys, all optional: ``data_parallel_size``,
            ``tensor_parallel.size``, ``pipeline_parallel.size`` (default 1 each),
            ``pipeline_parallel.split_method`` (``flops``, ``parameters`` or ``uniform``),
            ``pipeline_parallel.split_points`` (explicit module paths),
            ``pipeline_parallel.forbidden_split_points`` (module paths never split before),
            ``tensor_parallel.sharding_policy`` (``megatron``),
            ``tensor_parallel.overrides`` (``{module_path: style or "replicate"}``),
            ``pipeline_parallel.schedule`` (``1f1b`` or ``gpipe``),
            ``pipeline_parallel.num_micro_batches`` (per DP rank and step; divides
            ``global_batch_size / data_parallel_size``; default its gcd with the pipeline size),
            ``pipeline_parallel.static_shapes`` (``True``: every micro-batch has the same
            shapes, so stage hand-offs carry no header; default ``False``),
            ``zero_stage`` (0, 1, 2 or 3), ``data_parallel_shard_size`` (HSDP with ZeRO-3:
            shard over this many DP ranks, replicate across the groups), ``cpu_offload``
            (optimizer state in host memory, the update there),
            ``context_parallel.size`` (ranks each sequence is split over; a
            ``transformers`` causal LM) and
            ``context_parallel.method`` (``ring`` or ``all_to_all``),
            ``precision`` (``float32``, ``bfloat16``, ``float16``),
            ``global_batch_size`` (default ``data_parallel_size``) and ``seed`` (default 42).

    Returns:
        The plan (plain data; ``print(plan)``, ``plan.save(path)``).

    Raises:
        TypeError: the arguments are not a module and a mapping.
        ValueError: an unknown constraint, a TP size not dividing a sharded dim (the module
            is named), more stages than blocks, or split points the constraints forbid.

    Example::

        >>> plan = generate_plan(model, {"tensor_parallel.size": 2, "data_parallel_size": 2})
        >>> plan = generate_plan({"tensor_parallel.size": 2}, model)  # the RFC's order
    """
    if isinstance(model, Mapping) and isinstance(constraints, torch.nn.Module):
        model, constraints = constraints, model  # the RFC's order: generate_plan(constraints, model)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"generate_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - set(CONSTRAINT_KEYS))
    if unknown:
        raise ValueError(f"unknown constraints {unknown}; valid keys: {list(CONSTRAINT_KEYS)}")
    dp = _positive(constraints, "data_parallel_size", 1)
    plan = Plan(
        data_parallel_size=dp,
        model_parallel_size=_positive(constraints, "tensor_parallel.size", 1),
        pipe_parallel_size=_positive(constraints, "pipeline_parallel.size", 1),
        global_batch_size=_positive(constraints, "global_batch_size", dp),
        seed=int(constraints.get("seed", 42)),
        split_method=constraints.get("pipeline_parallel.split_method", "parameters"),
    )
    if plan.global_batch_size % dp:
        raise ValueError(
            f"global_batch_size={plan.global_batch_size} is not divisible by data_parallel_size={dp}; "
            f"choose a multiple of {dp}"
        )
    _pipeline_and_optimizer(constraints, plan)
    _tp_plan(model, constraints, plan)
    _context_parallel(model, constraints, plan)
    if plan.pipe_parallel_size > 1 or "pipeline_parallel.split_points" in constraints:
        plan.blocks_path, blocks = find_blocks(model)
        plan.split_points = split_blocks(
            model,
            plan.blocks_path,
            blocks,
            plan.pipe_parallel_size,
            plan.split_method,
            explicit=constraints.get("pipeline_parallel.split_points"),
            forbidden=constraints.get("pipeline_parallel.forbidden_split_points", ()),
        )
    return plan
