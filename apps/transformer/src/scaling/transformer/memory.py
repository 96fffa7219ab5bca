"""The transformer app's model-state bytes per rank for a config, without allocating the model
(``scaling.trainer.planning``; ``scaling-transformer memory``)."""

from __future__ import annotations

from collections.abc import Callable

from scaling.nn import ParameterMeta
from scaling.trainer.planning import MemoryLayout, ParameterSpec, RankMemory, parameter_specs, rank_memory
from scaling.transformer.config import TransformerConfig
from scaling.transformer.model import layer_specs


def memory_inputs(config: TransformerConfig) -> tuple[list[ParameterSpec], MemoryLayout]:
    """The whole model's parameters (built on the meta device) and the config's layout.

    Raises:
        ValueError: for what the prediction does not cover yet: ``finetuning`` (its adapters and
            frozen base) and ``training.groups`` choosing an update rule per group.
    """
    if config.finetuning.method != "none":
        raise ValueError(
            f"finetuning.method={config.finetuning.method!r}: the model-state prediction covers full "
            "training only (adapters and a frozen base are not modelled yet)"
        )
    if any(group.method is not None for group in config.training.groups):
        raise ValueError("training.groups with a method: the model-state prediction knows the default groups only")
    arch, top = config.transformer_architecture, config.topology
    specs = parameter_specs(layer_specs(arch, None))
    layout = MemoryLayout(
        num_layers=arch.num_layers + 2,
        tp=top.model_parallel_size or 1,
        pp=top.pipe_parallel_size or 1,
        dp=top.data_parallel_size or 1,
        cp=top.context_parallel_size,
        ep=top.expert_parallel_size,
        num_experts=arch.moe.num_experts if arch.moe is not None else 0,
        num_virtual_stages=config.training.num_virtual_stages,
        dp_shard=top.data_parallel_shard_size,
    )
    return specs, layout


def method_of(config: TransformerConfig) -> Callable[[ParameterMeta], str | None]:
    """The update rule of a parameter's group as ``train.parameter_groups`` forms them: with Muon the
    embedding's and the head's matrices are AdamW's (None: the optimizer's own)."""
    last = config.transformer_architecture.num_layers + 1
    muon = config.optimizer.method == "muon"

    def rule(meta: ParameterMeta) -> str | None:
        return "adamw" if muon and meta.layer_index in (0, last) else None

    return rule


def model_state_memory(
    config: TransformerConfig, stage: int = 0, shard_rank: int = 0, expert_shard_rank: int = 0, ep_rank: int = 0
) -> RankMemory:
    """The model-state bytes of one rank of ``config``'s layout (see ``rank_memory``)."""
    specs, layout = memory_inputs(config)
    return rank_memory(
        specs, layout, config.optimizer, stage, shard_rank, expert_shard_rank, ep_rank, method_of(config)
    )
