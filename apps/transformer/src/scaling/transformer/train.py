"""The training script every process runs (started by the runner through torchrun).

Context, the model's LayerSpecs in a ParallelModule, an Optimizer over two parameter
groups (matrices with weight decay; norms, biases and RoPE-free vectors without), the
packed token data, and a BaseTrainer given the model's FLOPs per sample (tokens/s, TFLOP/s and MFU).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from scaling.collectives import all_reduce
from scaling.config import JsonDict, Metrics
from scaling.nn import ParallelMoE, ParameterMeta, enable_float8
from scaling.optim import Optimizer, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.pipeline import ParallelModule
from scaling.runner import load_payload
from scaling.topology import Topology
from scaling.trainer import BaseContext, BaseTrainer
from scaling.transformer.config import TransformerConfig
from scaling.transformer.datasets import build_datasets
from scaling.transformer.finetuning import apply_finetuning, training_groups
from scaling.transformer.model import TransformerLoss, flops_per_token, layer_specs

FLOPS_FORMULA = "FLOPs/token = 6*N + 12*L*H*S"
# Checkpoint keys of the adapters each fine-tuning method adds.
ADAPTER_KEYS = {"lora": r".*\.lora_[AB]\.weight$", "adapter": r".*\.adapter\..*"}


class TransformerContext(BaseContext[TransformerConfig]):
    """Topology, config and counters of a transformer run."""


class TransformerTrainer(BaseTrainer[TransformerContext]):
    """BaseTrainer plus tokens/s and the mixture-of-experts metrics.

    TFLOP/s per device and MFU (against ``trainer.peak_flops_per_second`` or a known GPU's bf16 peak;
    none on CPU) are the
    BaseTrainer's, from ``flops_per_sample``: ``6 N + 12 L H S`` FLOPs per token (N active
    parameters, L layers, H hidden, S sequence length) times ``S``.
    """

    @functools.cached_property
    def _moe_layers(self) -> list[ParallelMoE]:
        """This rank's mixture-of-experts blocks (found once: the model does not change)."""
        return [m for m in self.parallel_module.modules() if isinstance(m, ParallelMoE)]

    def train_step(self) -> Metrics:
        moe_layers = self._moe_layers
        # The injected balancing-loss gradient is scaled as the loss is: loss scale over micro-batches.
        micro_batches = self.context.config.topology.gradient_accumulation_steps or 1
        scale = self.optimizer.loss_scaler.scale / micro_batches
        for layer in moe_layers:
            layer.aux_loss_scale, layer.load_total, layer.aux_loss_total = scale, None, None
        metrics = super().train_step()
        # Aux-loss-free balancing moves each bias once per step, by the step's load, before a
        # checkpoint can be taken (under ZeRO-3 with the biases' layers gathered for it).
        biases = [layer.expert_bias for layer in moe_layers if layer.balancing == "aux_loss_free"]
        if biases:
            with self.optimizer.data_parallel.whole(biases):
                for layer in moe_layers:
                    layer.end_step()
        config = self.context.config
        if config.transformer_architecture.moe is not None and self.logs_step(self.context.iterations):
            metrics.update(self._moe_metrics(moe_layers, micro_batches))
        metrics["runtime/tokens_per_second"] = metrics["runtime/samples_per_second"] * config.data.sequence_length
        return metrics

    def _moe_metrics(self, moe_layers: list[ParallelMoE], micro_batches: int) -> dict[str, float]:
        """The MoE blocks of every pipeline stage over the step, as one process reports them: the mean
        balancing loss of their micro-batches, and the largest and smallest expert load relative to
        the mean, the loads summed over the data-parallel ranks (each routes its own samples; the
        context-parallel ranks' tokens are summed in the layer). One all-reduce over DP and two small
        ones over the stages, on logged steps only."""
        topology = self.context.topology
        device, dp = topology.device, topology.axis("dp")
        pairs = [(m.aux_loss_total, m.load_total) for m in moe_layers]
        # A row per block: its balancing losses summed over the step's micro-batches, then its experts' loads.
        rows = [
            torch.cat([aux.reshape(1), load]).float() for aux, load in pairs if aux is not None and load is not None
        ]
        table = torch.stack(rows).to(device) if rows else torch.zeros(0, 1, device=device)
        if dp.size > 1:
            all_reduce(table, dp.group)
        ratios = table[:, 1:] / table[:, 1:].mean(-1, keepdim=True)
        count = len(rows) * micro_batches * dp.size
        sums = torch.tensor([float(table[:, 0].sum()), count], dtype=torch.float64, device=device)
        extremes = torch.tensor(
            [float(ratios.max()) if rows else -math.inf, -float(ratios.min()) if rows else math.inf],
            dtype=torch.float64,
            device=device,
        )
        if topology.axis("pp").size > 1:
            all_reduce(sums, topology.axis("pp").group)
            all_reduce(extremes, topology.axis("pp").group, dist.ReduceOp.MAX)
        total, count = sums.tolist()
        high, low = extremes.tolist()
        return {
            "moe/aux_loss": total / max(count, 1),
            "moe/max_load_ratio": high if math.isfinite(high) else 0.0,
            "moe/min_load_ratio": -low if math.isfinite(low) else 0.0,
        }


def parameter_groups(
    parallel_module: ParallelModule, config: TransformerConfig, topology: Topology | None = None
) -> list[OptimizerParamGroup]:
    """``training.groups`` if set; otherwise matrices decay and vectors (norms, biases, QK-norm) do not.

    With ``optimizer.method=muon`` the embedding's and the head's matrices form a group of their
    own (``embedding_head``) updated by AdamW; the blocks' matrices take Muon, the vectors AdamW.

    Frozen parameters (fine-tuning's base model) join no group.
    """
    params = list(parallel_module.named_parameters_with_meta())
    if config.training.groups:
        pipe = topology.axis("replica").group if topology is not None and topology.axis("pp").size > 1 else None
        return training_groups(
            params, config.training.groups, config.learning_rate_scheduler, config.training.weight_decay, pipe
        )
    # Muon (optimizer.method=muon) updates the blocks' matrices; the embedding and the head (the
    # first and last layers) stay with AdamW, as the reference recipe has it.
    muon = config.optimizer.method == "muon"
    outer = (0, len(parallel_module.layer_specs) - 1)
    members: dict[str, list[tuple[str, torch.nn.Parameter, ParameterMeta]]] = {"decay": [], "no_decay": []}
    for name, param, meta in params:
        if param.requires_grad:
            key = "no_decay" if len(meta.logical_shape) < 2 else "decay"
            if muon and key == "decay" and meta.layer_index in outer:
                key = "embedding_head"
            members.setdefault(key, []).append((name, param, meta))
    groups = []
    for group_name, group_params in members.items():
        if group_params:
            groups.append(
                OptimizerParamGroup(
                    named_parameters_with_meta=group_params,
                    config=OptimizerParamGroupConfig(
                        name=group_name,
                        weight_decay=0.0 if group_name == "no_decay" else config.training.weight_decay,
                        learning_rate_scheduler=config.learning_rate_scheduler,
                        method="adamw" if group_name == "embedding_head" else None,
                    ),
                )
            )
    return groups


def build_trainer(config: TransformerConfig, topology: Topology) -> TransformerTrainer:
    """Everything of one rank, ready for ``run_training()``."""
    context = TransformerContext(config=config, topology=topology)
    context.initialize(seed=config.trainer.seed)
    arch = config.transformer_architecture
    dataset, dataset_evaluation = build_datasets(config)

    parallel_module = ParallelModule(
        layer_specs=layer_specs(arch, topology, rng_tracker=context.rng_tracker),
        topology=topology,
        schedule=config.training.schedule,
        num_virtual_stages=config.training.chunks_per_stage,
        seed=config.trainer.seed,
        static_shapes=config.training.static_shapes,
        compile=config.training.compile,
    )
    # Float8 products in the blocks' linears (the embedding and head layers have none).
    enable_float8(parallel_module, config.training.fp8, setting="training.fp8")
    apply_finetuning(
        [(int(i), layer) for i, layer in parallel_module.layers.items()],
        config.finetuning,
        topology=topology,
        sequence_parallel=arch.sequence_parallel,
        rng_tracker=context.rng_tracker,
        seed=config.trainer.seed,
    )
    optimizer = Optimizer(
        config=config.optimizer,
        parameter_groups=parameter_groups(parallel_module, config, topology),
        topology=topology,
        model=parallel_module,
    )
    trainer_config = config.trainer
    if config.finetuning.method in ADAPTER_KEYS and trainer_config.load_dir is not None:
        # Fine-tuning starts from a base checkpoint, which has no adapters yet.
        missing = [*trainer_config.allowed_missing_keys_in_checkpoint, ADAPTER_KEYS[config.finetuning.method]]
        trainer_config = trainer_config.model_copy(update={"allowed_missing_keys_in_checkpoint": missing})
    return TransformerTrainer(
        config=trainer_config,
        context=context,
        parallel_module=parallel_module,
        optimizer=optimizer,
        dataset=dataset,
        dataset_evaluation=dataset_evaluation,
        sync_batch_to_model_parallel=dataset.sync_batch_to_model_parallel,
        metrics_aggregation_fn=None,
        loss_function=TransformerLoss(arch.vocab_size, topology),
        flops_per_sample=flops_per_token(arch, config.data.sequence_length) * config.data.sequence_length,
    )


def main(payload: JsonDict | None = None) -> list[Metrics]:
    """Train with the config in ``payload`` (default: the one the runner handed over)."""
    config = TransformerConfig.from_dict(payload if payload is not None else load_payload())
    topology = Topology.from_env(config.topology)
    trainer = build_trainer(config, topology)
    if topology.global_rank == 0:
        trainer.metrics_logger.console(f"throughput metrics use {FLOPS_FORMULA}")
    history = trainer.run_training(return_metrics=True) or []
    topology.destroy()
    return history


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # torchrun then reports this rank's exception, and scaling-run names it in its summary.
    record(main)()
