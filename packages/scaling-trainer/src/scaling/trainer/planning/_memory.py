"""Model-state bytes per rank: parameters, gradients, master weights and optimizer state.

Predicted from the parameters' metadata and the layout alone (no model is built and no process
group started), by the rules the packages allocate with:

- a parameter split by TP holds ``ceil(n / tp)`` rows of its split dimension on each rank
  (``ParameterMeta.local_size``); pipeline stage ``s`` holds the layers of its virtual stages
  (``scaling.pipeline.partition_layers``), a tied weight once per stage that holds one of its
  layers; an expert lives on one expert-parallel rank (``num_experts / ep`` each, in order);
- the optimizer's storage for a trainable parameter (``scaling.optim``'s ``ParamSlot``) is the
  rank's ZeRO chunk of its flat TP piece: ``ceil(numel / world)`` elements, the last chunks short
  or empty, ``world`` the shard group (ZeRO >= 1: DP × CP, or the HSDP shard size; experts: their
  expert-data-parallel ranks, DP × CP / ep), one chunk holding everything without ZeRO;
- parameters in their dtype, the owned chunk only under ZeRO-3 (frozen ones too); gradients as
  ``.grad`` in the parameter's dtype (ZeRO 0-1, and a tied weight's at ZeRO-2) or as the reduced
  chunk in the update's dtype (ZeRO 2-3); an fp32 master copy of
  the chunk for 16-bit parameters (``master_weights``) and always under ``cpu_offload``; the
  update rule's state tensors (AdamW 2, Muon and SGD with momentum 1) of the chunk, in fp32 with
  master weights or offload, else in the parameter's dtype; master and state in host memory
  under ``cpu_offload``.

Measured after the backward and the DP reduction, before the update (the step's steady state;
transient buffers, bounded by the bucket size, and activations are not model state).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from scaling.nn import LayerSpec, ParameterMeta, named_parameters_with_meta, set_layer_index
from scaling.optim import OptimizerConfig, state_names, update_rule
from scaling.pipeline import partition_layers, virtual_stage

_EXPERT = re.compile(r"experts\.(\d+)\.")


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter of the whole model: its metadata (logical shape, TP split dimension,
    ``layer_index``, expert or not, ``tied_key``), dtype, and whether it trains. For an expert,
    ``expert`` is its index among its layer's ``num_experts``."""

    meta: ParameterMeta
    dtype: torch.dtype
    trainable: bool = True
    expert: int | None = None

    def local_numel(self, tp: int) -> int:
        """Elements each TP rank of ``tp`` holds: ``ceil(n / tp)`` rows of the split dimension."""
        shape = list(self.meta.logical_shape)
        if self.meta.parallel_dim is not None and tp > 1:
            shape[self.meta.parallel_dim] = -(-shape[self.meta.parallel_dim] // tp)
        return math.prod(shape)


@dataclass(frozen=True)
class MemoryLayout:
    """The layout, as far as model state goes.

    Attributes:
        tp, pp, dp, cp, ep: the sizes (``ep`` divides DP × CP and each MoE layer's experts).
        num_layers: pipeline layers of the model (``LayerSpec``s), for the partition.
        num_experts: experts per MoE layer (0 without MoE).
        num_virtual_stages: model chunks per stage (interleaved 1F1B; ZB-V's 2).
        placement: where a stage's chunks sit, the schedule's (``"loop"``, or ZB-V's ``"v"``:
            ``scaling.pipeline.virtual_stage``).
        partition_method, partition_boundaries: as ``ParallelModule``'s (``"uniform"`` by default).
        dp_shard: HSDP's shard group size (None: ZeRO shards over all of DP × CP).
    """

    num_layers: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    num_experts: int = 0
    num_virtual_stages: int = 1
    placement: str = "loop"
    partition_method: str = "uniform"
    partition_boundaries: tuple[int, ...] | None = None
    dp_shard: int | None = None

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The virtual stage (index into the partition) local ``chunk`` of ``stage`` holds."""
        return virtual_stage(stage, chunk, self.pp, self.placement)


@dataclass(frozen=True)
class RankMemory:
    """Model-state bytes of one rank: on the device (``parameters``, ``gradients``, ``master``,
    ``state``) and in host memory (``host``: master and state under ``cpu_offload``)."""

    stage: int
    shard_rank: int
    expert_shard_rank: int
    ep_rank: int
    parameters: int
    gradients: int
    master: int
    state: int
    host: int

    @property
    def device(self) -> int:
        return self.parameters + self.gradients + self.master + self.state


def parameter_specs(
    layer_specs: Sequence[LayerSpec],
    dtype: torch.dtype | None = None,
    adapt: Callable[[int, torch.nn.Module], object] | None = None,
) -> list[ParameterSpec]:
    """The whole model's parameters from its ``LayerSpec``\\ s built for one process on the meta device
    (no memory; a layer whose spec repeats an earlier one's is not built again). ``dtype``: the
    parameters' dtype when the layers are built in another (default: as built). ``adapt(index,
    layer)``: changes a built layer as the app does before training (adapters added, the base frozen:
    ``requires_grad`` says what trains)."""
    out: list[ParameterSpec] = []
    built: dict[str, list[ParameterSpec]] = {}
    with torch.device("meta"):
        for index, spec in enumerate(layer_specs):
            key = repr(spec)
            if key not in built:
                layer = set_layer_index(spec.initialize(), index)
                if adapt is not None:
                    adapt(index, layer)
                built[key] = [
                    ParameterSpec(meta, dtype or param.dtype, param.requires_grad, _expert_of(meta))
                    for _, param, meta in named_parameters_with_meta(layer)
                ]
            out += [dataclasses.replace(p, meta=dataclasses.replace(p.meta, layer_index=index)) for p in built[key]]
    return out


def _expert_of(meta: ParameterMeta) -> int | None:
    found = _EXPERT.search(meta.local_name) if meta.is_expert else None
    return int(found.group(1)) if found else None


def _owned(numel: int, world: int, rank: int) -> int:
    """The elements of a flat tensor of ``numel`` that shard ``rank`` of ``world`` owns."""
    chunk = math.ceil(numel / world) if numel else 0
    start = min(rank * chunk, numel)
    return min(start + chunk, numel) - start


def rank_memory(
    parameters: Sequence[ParameterSpec],
    layout: MemoryLayout,
    optimizer: OptimizerConfig,
    stage: int = 0,
    shard_rank: int = 0,
    expert_shard_rank: int = 0,
    ep_rank: int = 0,
    method_of: Callable[[ParameterMeta], str | None] | None = None,
) -> RankMemory:
    """The model-state bytes of the rank at pipeline ``stage``, index ``shard_rank`` in the dense ZeRO
    shard group (``topology.axis("dp_shard")``), ``expert_shard_rank`` in the experts' one
    (``axis("edp")``) and ``ep_rank``. Every TP rank holds the same amounts (a padded dimension's rows
    included). ``method_of(meta)``: the update rule of a parameter's group, None for the optimizer's
    (a Muon recipe's AdamW groups)."""
    lay = layout
    weights = None
    if lay.partition_method == "parameters":  # ParallelModule's count_parameters: each layer's numel
        weights = [0.0] * lay.num_layers
        for spec in parameters:
            if spec.meta.layer_index is not None:
                weights[spec.meta.layer_index] += math.prod(spec.meta.logical_shape)
    partition = partition_layers(
        lay.num_layers,
        lay.pp,
        lay.partition_method,
        num_virtual=lay.num_virtual_stages,
        weights=weights,
        boundaries=list(lay.partition_boundaries) if lay.partition_boundaries is not None else None,
    )
    held_layers = {i for c in range(lay.num_virtual_stages) for i in partition[lay.virtual_stage(stage, c)]}
    zero = optimizer.zero_stage
    dense_world = (lay.dp_shard or lay.dp * lay.cp) if zero >= 1 else 1
    expert_world = lay.dp * lay.cp // lay.ep if zero >= 1 else 1
    local_experts = lay.num_experts // lay.ep if lay.num_experts else 1
    params = grads = master = state = host = 0
    tied_seen: set[tuple[str, str]] = set()
    for spec in parameters:
        meta = spec.meta
        if meta.layer_index not in held_layers:
            continue
        if meta.tied_key is not None:
            if (meta.tied_key, meta.local_name) in tied_seen:
                continue
            tied_seen.add((meta.tied_key, meta.local_name))
        if spec.expert is not None and spec.expert // local_experts != ep_rank:
            continue
        size = spec.dtype.itemsize
        numel = spec.local_numel(lay.tp)
        if spec.expert is not None:
            owned = _owned(numel, expert_world, expert_shard_rank % expert_world)
        else:
            owned = _owned(numel, dense_world, shard_rank % dense_world)
        params += (owned if zero == 3 else numel) * size  # ZeRO-3 shards frozen parameters too
        if not spec.trainable:
            continue
        compute = 4 if optimizer.master_weights or optimizer.cpu_offload else size
        # ZeRO 2-3 keep the reduced chunk in the update's dtype; ZeRO-2 leaves a pipeline-tied weight's
        # whole .grad (it is summed over the stages after the reduction).
        keeps_grad = zero < 2 or (zero == 2 and meta.tied_key is not None)
        grads += numel * size if keeps_grad else owned * compute
        has_master = optimizer.cpu_offload or (optimizer.master_weights and spec.dtype != torch.float32)
        rule = update_rule(optimizer, method_of(meta) if method_of is not None else None, meta.logical_shape)
        owned_master = owned * 4 if has_master else 0
        owned_state = len(state_names(optimizer, rule)) * owned * compute
        if optimizer.cpu_offload:
            host += owned_master + owned_state
        else:
            master += owned_master
            state += owned_state
    return RankMemory(stage, shard_rank, expert_shard_rank, ep_rank, params, grads, master, state, host)


def peak_rank_memory(
    parameters: Sequence[ParameterSpec],
    layout: MemoryLayout,
    optimizer: OptimizerConfig,
    method_of: Callable[[ParameterMeta], str | None] | None = None,
) -> RankMemory:
    """The rank holding the most device bytes: the first shard of each group (ZeRO's first chunks
    are full) on the pipeline stage with the most."""
    stages = [rank_memory(parameters, layout, optimizer, s, method_of=method_of) for s in range(layout.pp)]
    return max(stages, key=lambda m: (m.device, m.host))
