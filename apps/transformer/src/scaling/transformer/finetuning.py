"""Fine-tuning switched on by config: LoRA, BitFit, bottleneck adapters, and training groups.

``finetuning.method`` adds adapters to every transformer block (module names relative to a
block, e.g. ``attention.qkv``, ``mlp.down_proj``) and freezes the base model;
``training.groups`` then splits what is trainable into optimizer groups by regexes over the
parameter names (``layers.{i}.attention.qkv.weight``, ``layers.{i}.attention.qkv.lora_A.weight``),
each with its own learning rate and weight decay. Parameters in no group are frozen.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from scaling.nn import (
    ColumnParallelLinear,
    LoRAConfig,
    ParameterMeta,
    RowParallelLinear,
    apply_bottleneck_adapters,
    apply_lora,
    set_layer_index,
)
from scaling.optim import (
    LearningRateSchedulerConfig,
    OptimizerParamGroup,
    OptimizerParamGroupConfig,
    build_parameter_groups,
)
from scaling.transformer.config import FinetuningConfig, TrainingGroupConfig
from scaling.transformer.model import TransformerBlock

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.topology import RNGTracker, Topology

NamedParam = tuple[str, torch.nn.Parameter, ParameterMeta]
LORA_MARKERS = (".lora_A.", ".lora_B.")
# Adapter seeds sit apart from the base layers' (seed + layer index, as in ParallelModule).
ADAPTER_SEED_OFFSET = 10_000


def _block_targets(block: TransformerBlock, pattern: str, kind: str) -> list[str]:
    linear = (ColumnParallelLinear, RowParallelLinear, torch.nn.Linear)
    names = [n for n, m in block.named_modules() if n and (kind != "lora" or isinstance(m, linear))]
    hits = [n for n in names if re.fullmatch(pattern, n)]
    if not hits:
        raise ValueError(
            f"finetuning.target_modules={pattern!r} matches no module of a transformer block for "
            f"method={kind!r}; candidates are {names}"
        )
    return hits


def apply_finetuning(
    layers: Iterable[tuple[int, torch.nn.Module]],
    config: FinetuningConfig,
    topology: Topology | None = None,
    sequence_parallel: bool = False,
    rng_tracker: RNGTracker | None = None,
    seed: int = 42,
) -> None:
    """Add the adapters of ``config`` to the blocks among ``(layer_index, layer)`` and freeze the base.

    Layer ``i``'s adapters are initialised from ``seed + ADAPTER_SEED_OFFSET + i``, so every
    pipeline layout (each stage holds other layers) draws the one-process values.

    Raises:
        ValueError: when ``finetuning.target_modules`` matches no module of a block.
    """
    layers = list(layers)
    for index, layer in layers:
        if not isinstance(layer, TransformerBlock):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + ADAPTER_SEED_OFFSET + index)
            if config.method == "lora":
                targets = _block_targets(layer, config.target_modules or ".*", "lora")
                lora = LoRAConfig(rank=config.rank, alpha=config.alpha, dropout=config.dropout, target_modules=targets)
                apply_lora(layer, lora, rng_tracker=rng_tracker)
            elif config.method == "adapter":
                targets = _block_targets(layer, config.target_modules or "attention|mlp", "adapter")
                apply_bottleneck_adapters(layer, targets, config.adapter_size, topology, sequence_parallel)
        set_layer_index(layer, index)
    if config.method == "none":
        return
    for _, layer in layers:
        for name, param in layer.named_parameters():
            param.requires_grad_(is_adapter_parameter(name, config.method))


def is_adapter_parameter(name: str, method: str) -> bool:
    """Whether ``name`` is trained (not frozen) by fine-tuning ``method``."""
    if method == "lora":
        return any(m in name for m in LORA_MARKERS)
    if method == "adapter":
        return ".adapter." in name
    if method == "bitfit":
        return name.endswith(".bias")
    return True


def _scaled_schedule(base: LearningRateSchedulerConfig, lr: float | None) -> LearningRateSchedulerConfig:
    if lr is None:
        return base
    ratio = lr / base.learning_rate if base.learning_rate > 0 else 0.0
    return base.model_copy(update={"learning_rate": lr, "learning_rate_minimum": base.learning_rate_minimum * ratio})


def training_groups(
    params: list[NamedParam],
    groups: list[TrainingGroupConfig],
    schedule: LearningRateSchedulerConfig,
    weight_decay: float,
    process_group: ProcessGroup | None = None,
) -> list[OptimizerParamGroup]:
    """Optimizer groups of the trainable ``params`` by ``training.groups``; the rest is frozen.

    Raises:
        ValueError: for overlapping patterns (naming the parameter and both groups), a pattern
            that matches nothing, or duplicate group names.
    """
    configs = [
        OptimizerParamGroupConfig(
            name=g.name,
            weight_decay=weight_decay if g.weight_decay is None else g.weight_decay,
            learning_rate_scheduler=_scaled_schedule(schedule, g.learning_rate),
            parameters_include=tuple(g.include),
            parameters_exclude=tuple(g.exclude),
            method=g.method,
        )
        for g in groups
    ]
    trainable = [t for t in params if t[1].requires_grad]
    grouped = [
        t
        for t in trainable
        if any(
            any(re.search(p, t[0]) for p in c.parameters_include)
            and not any(re.search(p, t[0]) for p in c.parameters_exclude)
            for c in configs
        )
    ]
    for _, param, _ in trainable:
        if not any(param is g[1] for g in grouped):
            param.requires_grad_(False)
    try:
        return build_parameter_groups(grouped, configs, process_group=process_group)
    except ValueError as err:
        raise ValueError(f"training.groups: {err}") from err
