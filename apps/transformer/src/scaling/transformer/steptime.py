"""The transformer app's seconds per training step for a config on a machine (``scaling.trainer.planning``'s
``MachineProfile``), without building the model: what ranks layouts by speed (#52).

One micro-batch's forward and backward of each pipeline stage's chunk are priced from the parts
the step runs:

- **products**: every linear weight of the chunk's layers (the meta-built parameters, TP-local) is
  one ``2 T k n`` product forward, and two backward (input and weight gradients; one for a frozen
  weight); an expert's weight multiplies the rows routed to it (balanced: ``ep T k / E``); the head
  ``2 T V h / tp``; attention's core ``4 b s_q s_kv n_q d / tp`` (half where CUDA's kernels skip
  the causal mask's zeros), backward twice that; each at the profile's rate for its dtype and size;
- **element-wise work**: three times the bytes the block saves for the backward (written once, read
  twice: ``scaling.transformer.memory.block_activation_terms`` without checkpointing) forward and
  twice that backward, at the profile's memory bandwidth, plus a fixed cost per operator
  (``OPERATORS``: counted in this app's step by ``apps/transformer/tests/test_planning_time.py``);
- **recomputation**: ``every_layer`` runs the forward again in the backward, ``selective``
  attention's core, ``operators`` the element-wise work;
- **communication inside the chunk**: tensor parallelism's all-reduces (or sequence parallelism's
  all-gathers and reduce-scatters) of the residual stream, two per block each way; context
  parallelism's ring (``cp - 1`` key/value shifts each way, and backward ``cp`` of their fp32
  gradients) or all-to-all
  (q, k, v and the output each way); expert parallelism's dispatch and combine all-to-alls; the
  pipeline's send of the chunk's output (or its input's gradient).

A zero-bubble schedule's input and weight passes cost half a backward each. The stage's makespan
comes from the schedule's own programs
(``scaling.trainer.planning.pipeline_seconds``); the slowest stage's chunk costs stand for every
stage. Where a node has more ranks than ``compute_slots`` (a CPU's cores), its ranks' computation
over its slots bounds the step too (a pipeline's idle stages leave their cores to the others). After it: the data-parallel reduction (fp32 by default: an all-reduce, ZeRO 1-2's
reduce-scatter and all-gather of the updated parameters, ZeRO-3's reduce-scatter, with its
all-gathers per micro-batch priced in the forward and backward), hidden behind the last backward
where the profile overlaps communication, and the update (the model state read and written once,
and ``OPTIMIZER_OPERATORS`` per parameter tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaling.pipeline import partition_layers
from scaling.trainer.planning import MachineProfile, ParameterSpec, pipeline_seconds, spans_nodes
from scaling.transformer.config import TransformerConfig
from scaling.transformer.memory import block_activation_terms, memory_inputs, routed_rows, without_checkpointing
from scaling.transformer.model import attention_width

#: Operators one block's forward and backward run (aten operators, views included; counted in this
#: app's step at ``document_masking`` on, fp32): dense, mixture-of-experts; the embedding, head and
#: loss together; context parallelism's ring adds ``ring_step`` per step of the ring (``cp`` a block),
#: its all-to-all ``all_to_all`` a block; per parameter tensor in the update.
OPERATORS = {"dense": (97, 125), "moe": (170, 245), "ends": (55, 35), "ring_step": (7, 42), "all_to_all": (37, 45)}
OPTIMIZER_OPERATORS = 5

_DTYPE_NAMES = {4: "fp32", 2: "bf16"}


@dataclass(frozen=True)
class ChunkSeconds:
    """One micro-batch through one model chunk of a stage, by part (seconds)."""

    forward_compute: float
    backward_compute: float
    forward_communication: float
    backward_communication: float

    @property
    def forward(self) -> float:
        return self.forward_compute + self.forward_communication

    @property
    def backward(self) -> float:
        return self.backward_compute + self.backward_communication


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds (every stage runs the slowest stage's chunk costs).

    Attributes:
        chunk: the slowest chunk's costs per micro-batch.
        pipeline: the schedule's makespan (all micro-batches, every chunk).
        reduction: the data-parallel gradient reduction left after the last backward.
        optimizer: the update.
        total: their sum.
        tokens_per_second_per_device: the global batch's tokens over ``total``, per rank.
    """

    chunk: ChunkSeconds
    pipeline: float
    reduction: float
    optimizer: float
    total: float
    tokens_per_second_per_device: float


def _reduce_bytes(config: TransformerConfig) -> int:
    """Bytes per element of a gradient the data-parallel reduction moves."""
    e = config.transformer_architecture.dtype.itemsize
    return 4 if (config.optimizer.grad_reduce_in_fp32 or e == 4) else e


def _linear_weights(specs: list[ParameterSpec], blocks: list[int]) -> list[ParameterSpec]:
    """The blocks' matrices (the embedding is a look-up; the head is priced on its own)."""
    return [s for s in specs if s.meta.layer_index in blocks and len(s.meta.logical_shape) == 2]


def _chunk_seconds(
    config: TransformerConfig, profile: MachineProfile, layers: set[int], specs: list[ParameterSpec]
) -> ChunkSeconds:
    arch, top = config.transformer_architecture, config.topology
    zero3 = config.optimizer.zero_stage == 3
    reduce_bytes = _reduce_bytes(config)
    assert top.micro_batch_size is not None and top.model_parallel_size is not None
    assert top.pipe_parallel_size is not None and top.data_parallel_size is not None
    tp, cp, pp, dp, ep = (
        top.model_parallel_size,
        top.context_parallel_size,
        top.pipe_parallel_size,
        top.data_parallel_size,
        top.expert_parallel_size,
    )
    b, seq = top.micro_batch_size, config.data.sequence_length
    s = seq // cp
    tokens, e, h = b * s, arch.dtype.itemsize, arch.hidden_size
    dtype = _DTYPE_NAMES.get(e, "fp32")
    last = arch.num_layers + 1
    blocks = [i for i in layers if 0 < i < last]
    moe = arch.moe

    # Products: forward once; backward the input's and the weight's gradients.
    forward = backward = 0.0
    for spec in _linear_weights(specs, blocks):
        rows = routed_rows(config, spec, tokens)
        if rows is None:
            continue  # another expert-parallel rank's expert
        flops = 2.0 * rows * spec.local_numel(tp)
        forward += profile.matmul_seconds(flops, dtype)
        backward += profile.matmul_seconds(flops, dtype, 2 if spec.trainable else 1)
    if last in layers:  # the head (tied or not)
        flops = 2.0 * tokens * -(-arch.vocab_size // tp) * h
        forward += profile.matmul_seconds(flops, dtype)
        backward += profile.matmul_seconds(flops, dtype, 2)
    causal = 0.5 if profile.device == "cuda" and arch.causal else 1.0
    heads = arch.num_attention_heads // tp
    per_head = 4.0 * b * s * seq * attention_width(arch) / arch.num_attention_heads * causal
    attention = profile.matmul_seconds(per_head, dtype, heads * len(blocks))
    forward += attention
    backward += 2 * attention

    # Element-wise work and operators.
    none = without_checkpointing(config)
    kinds = {arch.is_moe_block(i - 1) for i in blocks}  # a dense and a MoE block's terms, once each
    block_saved = {kind: sum(block_activation_terms(none, profile.device, moe=kind).values()) for kind in kinds}
    saved = 0.0
    operators = [0.0, 0.0]
    for i in blocks:
        is_moe = arch.is_moe_block(i - 1)
        saved += block_saved[is_moe]
        fwd_ops, bwd_ops = OPERATORS["moe" if is_moe else "dense"]
        if cp > 1:
            ring = arch.context_parallel_method == "ring"
            extra_fwd, extra_bwd = OPERATORS["ring_step" if ring else "all_to_all"]
            fwd_ops, bwd_ops = fwd_ops + extra_fwd * (cp if ring else 1), bwd_ops + extra_bwd * (cp if ring else 1)
        operators[0] += fwd_ops
        operators[1] += bwd_ops
    if 0 in layers or last in layers:
        operators[0] += OPERATORS["ends"][0]
        operators[1] += OPERATORS["ends"][1]
    if last in layers:  # the fp32 loss over the vocabulary block
        saved += 8.0 * tokens * -(-arch.vocab_size // tp)
    elementwise_forward = profile.elementwise_seconds(3 * saved, operators[0])
    elementwise_backward = profile.elementwise_seconds(6 * saved, operators[1])
    forward += elementwise_forward
    backward += elementwise_backward
    recompute = {
        "every_layer": forward,
        "selective": attention,
        "operators": elementwise_forward,
    }.get(arch.activation_checkpointing, 0.0)
    backward += recompute

    # Communication inside the chunk (per micro-batch).
    node = min(tp * cp * pp * dp, profile.devices_per_node)

    def comm(kind: str, nbytes: float, group: int, stride: int) -> float:
        across = spans_nodes(group, stride, profile.devices_per_node)
        return profile.collective_seconds(kind, nbytes, group, across, node)

    comm_forward = comm_backward = 0.0
    stream = e * tokens * h  # one residual stream, whole over TP
    if tp > 1:
        if arch.sequence_parallel:
            per_block = 2 * (comm("all_gather", stream, tp, 1) + comm("reduce_scatter", stream, tp, 1))
        else:
            per_block = 2 * comm("all_reduce", stream, tp, 1)
        comm_forward += per_block * len(blocks)
        comm_backward += per_block * len(blocks)
    if cp > 1:
        kv = 2 * e * tokens * arch.kv_heads * arch.head_size / tp
        if arch.context_parallel_method == "ring":
            # Forward: cp - 1 key/value shifts. Backward: the key/values again, and their fp32
            # gradients' shift after every step, the last one bringing them home.
            comm_forward += (cp - 1) * comm("send", kv, 2, tp) * len(blocks)
            comm_backward += ((cp - 1) * comm("send", kv, 2, tp) + cp * comm("send", kv * 4 / e, 2, tp)) * len(blocks)
        else:
            qkvo = e * tokens * (2 * arch.num_attention_heads + 2 * arch.kv_heads) * arch.head_size / tp
            per_block = comm("all_to_all", qkvo, cp, tp)
            comm_forward += per_block * len(blocks)
            comm_backward += per_block * len(blocks)
    if moe is not None and ep > 1:
        per_block = 2 * comm("all_to_all", ep * e * tokens * moe.top_k * h, ep, tp * cp)
        moe_blocks = sum(arch.is_moe_block(i - 1) for i in blocks)
        comm_forward += per_block * moe_blocks
        comm_backward += per_block * moe_blocks
    if pp > 1:
        send = comm("send", stream / (tp if arch.sequence_parallel else 1), 2, tp * cp * dp)
        comm_forward += send
        comm_backward += send
    if zero3 and dp * cp > 1:
        # Each layer gathered for the forward and again for the backward, its gradients
        # reduce-scattered as its backward ends.
        for layer in layers:
            params = [s for s in specs if s.meta.layer_index == layer]
            whole = sum(s.local_numel(tp) for s in params) * e
            grads = sum(s.local_numel(tp) for s in params if s.trainable) * reduce_bytes
            comm_forward += comm("all_gather", whole, dp * cp, tp)
            comm_backward += comm("all_gather", whole, dp * cp, tp) + comm("reduce_scatter", grads, dp * cp, tp)
    return ChunkSeconds(forward, backward, comm_forward, comm_backward)


def step_time(config: TransformerConfig, profile: MachineProfile) -> StepTime:
    """The predicted seconds of one training step of ``config`` on ``profile``'s machine.

    Raises:
        ValueError: naming a setting the activation model does not cover (the element-wise work is
            priced from it): see ``scaling.transformer.memory.activation_memory``.
    """
    arch, top, opt = config.transformer_architecture, config.topology, config.optimizer
    assert top.pipe_parallel_size is not None and top.gradient_accumulation_steps is not None
    assert top.model_parallel_size is not None and top.data_parallel_size is not None
    assert top.global_batch_size is not None
    specs, layout = memory_inputs(config)
    pp, virtual = layout.pp, layout.num_virtual_stages
    partition = partition_layers(arch.num_layers + 2, pp, num_virtual=virtual)
    chunks = [
        _chunk_seconds(config, profile, set(partition[layout.virtual_stage(stage, chunk)]), specs)
        for stage in range(pp)
        for chunk in range(virtual)
    ]
    slowest = max(chunks, key=lambda c: c.forward + c.backward)
    m = top.gradient_accumulation_steps
    pipeline = pipeline_seconds(config.training.schedule, pp, m, slowest.forward, slowest.backward, virtual)
    # More ranks than the node computes at once (a CPU's cores): the node's work over its slots
    # bounds the step from below, besides the critical path.
    world = layout.tp * layout.cp * pp * layout.dp
    crowding = min(world, profile.devices_per_node) / profile.compute_slots
    if crowding > 1:  # a rank's mean work (the stages' differ), its own communication
        compute = m * sum(c.forward_compute + c.backward_compute for c in chunks) / pp
        communication = m * sum(c.forward_communication + c.backward_communication for c in chunks) / pp
        pipeline = max(pipeline, crowding * compute + communication)

    # The data-parallel reduction and the update, on the stage holding the most parameters.
    group = layout.dp * layout.cp
    e = arch.dtype.itemsize
    reduce_bytes = _reduce_bytes(config)
    stage_specs = [
        [s for s in specs if s.meta.layer_index in {i for c in range(virtual) for i in partition[c * pp + st]}]
        for st in range(pp)
    ]
    heaviest = max(stage_specs, key=lambda ss: sum(s.local_numel(layout.tp) for s in ss))
    trainable = sum(s.local_numel(layout.tp) for s in heaviest if s.trainable)
    nodes = spans_nodes(group, layout.tp, profile.devices_per_node)
    node = min(world, profile.devices_per_node)
    reduction = 0.0
    if group > 1 and opt.zero_stage < 3:  # ZeRO-3's is in the backward
        grads = reduce_bytes * trainable
        if opt.zero_stage == 0:
            reduction = profile.collective_seconds("all_reduce", grads, group, nodes, node)
        else:
            reduction = profile.collective_seconds("reduce_scatter", grads, group, nodes, node)
            reduction += profile.collective_seconds("all_gather", e * trainable, group, nodes, node)
        if profile.overlap:  # hidden behind the last micro-batch's backward, but for its last bucket
            reduction = max(reduction - slowest.backward * virtual, reduction / max(arch.num_layers // pp, 1))
    shard = group if opt.zero_stage >= 1 else 1
    master = 4 if (e != 4 and opt.master_weights) else 0
    state_bytes = trainable / shard * (e + reduce_bytes + master + 2 * max(e, 4 if master else e))
    tensors = sum(1 for s in heaviest if s.trainable)
    optimizer = profile.elementwise_seconds(2 * state_bytes, OPTIMIZER_OPERATORS * tensors)
    optimizer *= max(crowding, 1.0)
    total = pipeline + reduction + optimizer
    tokens = top.global_batch_size * config.data.sequence_length
    return StepTime(slowest, pipeline, reduction, optimizer, total, tokens / total / world)
