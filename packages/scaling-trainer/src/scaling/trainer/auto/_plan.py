"""Plan: the plain-data result of :func:`generate_plan` (printable, YAML round-trip)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from scaling.config import JsonDict

#: TP styles a module can get. ``column``/``row``: Megatron pair (output / input dim
#: split); ``column_fused``: a fused projection (GPT-2 ``c_attn``) whose output holds
#: ``chunks`` equal parts (q, k, v), each split over TP; ``vocab``: embedding split over
#: the vocabulary; ``vocab_head``: LM head split over the vocabulary, logits gathered.
TP_STYLES = ("column", "column_fused", "row", "vocab", "vocab_head")
#: Pipeline schedules a plan can name (run by ``scaling.pipeline``'s executor).
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
#: Parameter dtypes a plan can name.
PRECISIONS = ("float32", "bfloat16", "float16")
#: How attention is split over the context-parallel ranks (see ``scaling.nn``).
CONTEXT_PARALLEL_METHODS = ("ring", "all_to_all")


@dataclass
class ModuleSharding:
    """How one module is split over TP.

    Attributes:
        style: one of :data:`TP_STYLES`.
        transposed: weight stored ``[in, out]`` (``transformers`` ``Conv1D``).
        chunks: equal parts of the output dim split separately (``column_fused``).
        attributes: module attributes to divide by the TP size after the split, as
            ``{path: full_value}`` (e.g. GPT-2's ``attn.split_size``).
    """

    style: str
    transposed: bool = False
    chunks: int = 1
    attributes: dict[str, int] = field(default_factory=dict)


@dataclass
class Plan:
    """An nD-parallel plan for one model: sizes, pipeline split points, TP sharding.

    Attributes:
        data_parallel_size, model_parallel_size, pipe_parallel_size: sizes per axis.
        context_parallel_size: ranks each sequence is split over (a ``transformers``
            model's attention runs by ``context_parallel_method``: ``ring`` or ``all_to_all``).
        global_batch_size: samples per optimizer step over all DP ranks.
        seed: seed of the deferred initialisation.
        split_method: ``flops``, ``parameters`` or ``uniform``.
        blocks_path: the ``ModuleList`` the pipeline splits (``""`` when not split).
        split_points: module paths where stages 1..pp-1 begin.
        pipeline_schedule: ``1f1b`` or ``gpipe`` (pipelined plans).
        num_micro_batches: micro-batches per DP rank and step (pipelined plans).
        static_shapes: the stages' messages keep their shapes (pipelined plans; see
            ``scaling.pipeline.ParallelModule(static_shapes=...)``).
        zero_stage: ZeRO stage over DP (0: plain DP; 1, 2, 3: through ``scaling.optim``;
            3 gathers the model itself and each of its blocks one at a time).
        data_parallel_shard_size: HSDP: ZeRO-3 shards over this many DP ranks and
            replicates across the groups (``None``: over all of DP).
        cpu_offload: optimizer state and fp32 master shards in host memory, the update there.
        precision: parameter dtype, ``float32``, ``bfloat16`` or ``float16`` (the last two
            keep fp32 master weights in ``scaling.optim``; ``float16`` scales the loss).
        sharding_policy: ``megatron``.
        module_sharding: ``{module_path: ModuleSharding}``; absent modules are replicated.
        parameter_sharding: ``{parameter_path: "Shard(d)" or "Replicate()"}`` (readable
            summary, derived from ``module_sharding``).
    """

    data_parallel_size: int = 1
    model_parallel_size: int = 1
    pipe_parallel_size: int = 1
    context_parallel_size: int = 1
    context_parallel_method: str = "ring"
    global_batch_size: int = 1
    seed: int = 42
    split_method: str = "parameters"
    blocks_path: str = ""
    split_points: list[str] = field(default_factory=list)
    pipeline_schedule: str = "1f1b"
    num_micro_batches: int = 1
    static_shapes: bool = False
    zero_stage: int = 0
    data_parallel_shard_size: int | None = None
    cpu_offload: bool = False
    precision: str = "float32"
    sharding_policy: str = "megatron"
    module_sharding: dict[str, ModuleSharding] = field(default_factory=dict)
    parameter_sharding: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """``dp * tp * pp * cp``."""
        return self.data_parallel_size * self.model_parallel_size * self.pipe_parallel_size * self.context_parallel_size

    def to_dict(self) -> JsonDict:
        """Plain dicts, lists and scalars only."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonDict) -> Plan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown keys (named, with the valid ones).
        """
        valid = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"plan has unknown keys {unknown}; valid keys: {sorted(valid)}")
        data = dict(data)
        data["module_sharding"] = {k: ModuleSharding(**v) for k, v in data.get("module_sharding", {}).items()}
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write the plan as YAML."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        return cls.from_dict(yaml.safe_load(Path(path).read_text()))

    def __str__(self) -> str:
        lines = [
            f"sizes : dp={self.data_parallel_size} tp={self.model_parallel_size} pp={self.pipe_parallel_size} "
            f"cp={self.context_parallel_size} (world_size={self.world_size}), "
            f"global_batch_size={self.global_batch_size}, seed={self.seed}",
            f"context_parallel.method : {self.context_parallel_method}",
            f"pipeline_parallel.split_method : {self.split_method}",
            f"pipeline_parallel.split_points : {self.split_points}",
            f"pipeline_parallel.schedule : {self.pipeline_schedule}, num_micro_batches={self.num_micro_batches}, "
            f"static_shapes={self.static_shapes}",
            f"optimizer : zero_stage={self.zero_stage}, precision={self.precision}, "
            f"data_parallel_shard_size={self.data_parallel_shard_size}, cpu_offload={self.cpu_offload}",
            f"tensor_parallel.sharding_policy : {self.sharding_policy}",
            "tensor_parallel.sharding_plan :",
        ]
        lines += [f"  {name} : [{placement}]" for name, placement in self.parameter_sharding.items()]
        return "\n".join(lines)
