"""The transformer app's memory per rank for a config, without allocating the model: model state
(``scaling.trainer.planning``; ``scaling-transformer memory``) and activations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from scaling.nn import ParameterMeta
from scaling.pipeline import partition_layers, virtual_stage
from scaling.trainer.planning import (
    MemoryLayout,
    ParameterSpec,
    RankMemory,
    in_flight_peak,
    parameter_specs,
    rank_memory,
)
from scaling.transformer.config import TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.finetuning import apply_finetuning
from scaling.transformer.model import layer_specs

#: Schedules whose backward is split into an input pass and a weight pass.
ZERO_BUBBLE_SCHEDULES = ("zb_h1", "zb_v")


def memory_inputs(config: TransformerConfig) -> tuple[list[ParameterSpec], MemoryLayout]:
    """The whole model's parameters (built on the meta device, with ``finetuning``'s adapters and
    its frozen base) and the config's layout.

    Raises:
        ValueError: for what the prediction does not cover yet: ``training.groups`` choosing an
            update rule per group.
    """
    if any(group.method is not None for group in config.training.groups):
        raise ValueError("training.groups with a method: the model-state prediction knows the default groups only")
    arch, top = config.transformer_architecture, config.topology
    tuning = config.finetuning

    def adapt(index: int, layer: torch.nn.Module) -> None:
        apply_finetuning([(index, layer)], tuning, sequence_parallel=arch.sequence_parallel)

    specs = parameter_specs(layer_specs(arch, None), adapt=adapt if tuning.method != "none" else None)
    layout = MemoryLayout(
        num_layers=arch.num_layers + 2,
        tp=top.model_parallel_size or 1,
        pp=top.pipe_parallel_size or 1,
        dp=top.data_parallel_size or 1,
        cp=top.context_parallel_size,
        ep=top.expert_parallel_size,
        num_experts=arch.moe.num_experts if arch.moe is not None else 0,
        num_virtual_stages=config.training.chunks_per_stage,
        placement=config.training.placement,
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


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes of one pipeline stage's rank: the peak when a backward begins
    (``peak``), what one micro-batch leaves held on each local model chunk (``per_chunk``), and
    a dense block's and a mixture-of-experts block's terms by name (``block``, ``moe_block``: None
    without MoE; the same on every rank of a layout)."""

    stage: int
    peak: int
    per_chunk: tuple[int, ...]
    block: dict[str, int]
    moe_block: dict[str, int] | None = None


def _refuse_unmodelled(config: TransformerConfig) -> None:
    arch = config.transformer_architecture
    unmodelled = {
        "transformer_architecture.moe with sequence_parallel": (arch.moe is not None and arch.sequence_parallel, False),
        "transformer_architecture.latent_attention with sequence_parallel": (
            arch.latent_attention is not None and arch.sequence_parallel,
            False,
        ),
        "transformer_architecture.rotary_percentage": (arch.rotary_percentage, 1.0),
        "transformer_architecture.attention_dropout": (arch.attention_dropout, 0.0),
        "training.fp8.enabled": (config.training.fp8.enabled, False),
        "training.compile.enabled": (config.training.compile.enabled, False),
        "finetuning.dropout": (config.finetuning.dropout, 0.0),
    }
    for field, (value, modelled) in unmodelled.items():
        if value != modelled:
            raise ValueError(
                f"{field}={value!r}: the activation prediction models {field}={modelled!r} only so far (#52)"
            )


#: Bytes ``torch.utils.checkpoint`` keeps per region: the CPU generator's state (Mersenne Twister),
#: and on CUDA the device generator's seed and offset besides.
RNG_STATE_BYTES = {"cpu": 5056, "cuda": 5056 + 16}


def _norm_bytes(arch: TransformerArchitectureConfig, stream: int, frozen: bool = False) -> int:
    """A norm's own saved tensors over ``stream`` tokens (its output is counted by its consumers):
    RMSNorm (torch's composite) its input (an fp32 copy when 16-bit), ``input x rsqrt`` in fp32
    (for its weight's gradient: not when ``frozen``) and the fp32 rsqrt; LayerNorm its input in ``e``
    and fp32 mean and rstd."""
    if arch.norm == "rmsnorm":
        return 4 * arch.hidden_size * stream * (1 if frozen else 2) + 4 * stream
    return arch.dtype.itemsize * arch.hidden_size * stream + 8 * stream


def _lora(config: TransformerConfig) -> bool:
    """LoRA on every linear of the blocks, the base frozen (what the activation terms model)."""
    tuning = config.finetuning
    if tuning.method not in ("none", "lora") or (tuning.method == "lora" and tuning.target_modules is not None):
        raise ValueError(
            f"finetuning.method={tuning.method!r} (target_modules={tuning.target_modules!r}): the activation "
            "prediction models full training and LoRA on every linear layer only so far (#52)"
        )
    return tuning.method == "lora"


def _latent_attention_terms(
    arch: TransformerArchitectureConfig, b: int, s: int, tp: int, positions: int, device: str
) -> dict[str, int]:
    """Multi-head latent attention's terms (``tp`` heads split): the query and key/value latents'
    norms (input and ``input x rsqrt`` in fp32, output in ``e``, rsqrt; the key/value projection's
    whole output in fp32), RoPE's tables for the shared key. CPU SDPA runs the math kernel (queries and
    keys of another width than values) in fp32: scaled queries and keys, the ``b n s^2`` softmax, the
    values; CUDA's efficient kernel keeps q, k, the key/value projection, the output and log-sum-exp
    (by analogy, not yet measured)."""
    latent = arch.latent_attention
    assert latent is not None
    e, tokens = arch.dtype.itemsize, b * s
    n = arch.num_attention_heads // tp
    dqk, dv, dr = latent.qk_nope_head_dim + latent.qk_rope_head_dim, latent.v_head_dim, latent.qk_rope_head_dim
    kvr, ql = latent.kv_lora_rank, latent.q_lora_rank
    latents = 4 * tokens * kvr * 2 + (4 * tokens * dr if e == 4 else 0) + e * tokens * kvr + 4 * tokens
    if ql is not None:
        latents += 4 * tokens * ql * 2 + e * tokens * ql + 4 * tokens
    if device == "cpu":
        core = 4 * tokens * n * (2 * dqk + dv) + 4 * b * n * s * s
    else:
        core = e * tokens * n * (2 * dqk + latent.qk_nope_head_dim + 2 * dv) + 4 * b * n * s
    return {
        "qkv": latents,
        "rotary": 2 * 2 * 4 * positions * s * (dr // 2),
        "attention": core,
        "attention_projection_input": e * tokens * n * dv,
    }


def _refuse_with_operators(config: TransformerConfig, moe: bool) -> None:
    arch = config.transformer_architecture
    clashes = {
        "transformer_architecture.moe": moe,
        "transformer_architecture.latent_attention": arch.latent_attention is not None,
        "topology.context_parallel_size > 1": config.topology.context_parallel_size > 1,
        "finetuning.method=lora": config.finetuning.method == "lora",
        "transformer_architecture.qk_norm": arch.qk_norm,
        "transformer_architecture.hidden_dropout > 0": arch.hidden_dropout > 0,
    }
    for what, clash in clashes.items():
        if clash:
            raise ValueError(
                f"transformer_architecture.activation_checkpointing='operators' with {what}: the activation "
                "prediction does not model it yet (#52)"
            )


def without_checkpointing(config: TransformerConfig) -> TransformerConfig:
    """``config`` with ``activation_checkpointing: none``: what a block's forward makes before any is
    dropped (a recomputed block; the element-wise work of the step-time model)."""
    arch = config.transformer_architecture
    return config.model_copy(
        update={"transformer_architecture": arch.model_copy(update={"activation_checkpointing": "none"})}
    )


def block_activation_terms(config: TransformerConfig, device: str = "cpu", moe: bool = False) -> dict[str, int]:
    """What one dense block's forward leaves held for the backward, per micro-batch and rank, by term.

    ``T`` local tokens (micro-batch x sequence), ``T_s`` of the residual stream (``T / tp`` under
    sequence parallelism), ``e`` the parameters' bytes, heads and the MLP split over TP. Each norm
    keeps its own tensors (``_norm_bytes``) and its output in ``e`` for each projection that reads it
    (one copy, or one gathered copy per column-parallel linear under sequence parallelism: SwiGLU's
    gate and up gather separately); attention keeps the fused QKV projection, the rotated queries
    and keys, RoPE's fp32 cos/sin, the kernel's output and fp32 log-sum-exp (recomputed under
    ``selective``) and the output projection's input; documents keep their ids and positions (int64)
    and a ``b s^2 e`` mask where the kernel is not CUDA's variable-length one; SwiGLU keeps gate, up,
    SiLU and their product, GELU up and GELU; QK-norm each head's input and ``input x rsqrt`` in fp32
    and the rsqrt, for queries and keys; hidden dropout a mask per residual branch (the input's dtype
    on the CPU, bool on CUDA). ``every_layer`` keeps the block's input only. Each checkpointed region
    keeps the generators' states.

    ``moe``: a mixture-of-experts block, whose routed tokens are assumed balanced over the expert-
    parallel ranks (each processes ``T k`` pairs: exact for their mean); its ``mlp`` term is the
    router's fp32 scores and int64 choices, the pairs' rows in expert order and their outputs in
    token order (``2 e T k h``), each expert's SwiGLU over its rows (``4 e T k f_e``), and the
    shared experts' SwiGLU.
    """
    _refuse_unmodelled(config)
    arch, top = config.transformer_architecture, config.topology
    assert top.micro_batch_size is not None and top.model_parallel_size is not None
    tp, cp, b = top.model_parallel_size, top.context_parallel_size, top.micro_batch_size
    seq = config.data.sequence_length
    s = seq // cp  # this rank's part of each sequence
    e, h, d = arch.dtype.itemsize, arch.hidden_size, arch.head_size
    tokens = b * s
    stream = tokens // tp if arch.sequence_parallel else tokens
    rng_state = RNG_STATE_BYTES[device]
    if arch.activation_checkpointing == "every_layer":
        return {"input": e * h * stream, "rng_state": rng_state}
    nq, nkv, ffn = arch.num_attention_heads // tp, arch.kv_heads // tp, -(-arch.ffn_size // tp)
    swiglu = arch.mlp_type == "swiglu"
    if arch.activation_checkpointing == "operators":
        _refuse_with_operators(config, moe)
        # The input, each product's output (QKV; the projection's and the MLP's down, whole rows of
        # partial sums under TP; gate and up, or up), attention's output and log-sum-exp.
        products = (nq + 2 * nkv) * d + 2 * h + (2 if swiglu else 1) * ffn
        return {
            "input": e * h * stream,
            "products": e * tokens * products,
            "attention": e * tokens * nq * d + 4 * b * nq * s,
            "rng_state": rng_state,
        }
    readers = (1 + (2 if swiglu else 1)) if arch.sequence_parallel else 2
    # RoPE's angles per call (queries, keys): [b, s, r/2] with per-sequence positions (documents).
    positions = b if arch.document_masking else 1
    lora = _lora(config)
    terms = {
        "norms": 2 * _norm_bytes(arch, stream, frozen=lora) + readers * e * h * tokens,
        "qkv": e * tokens * (nq + 2 * nkv) * d,
        "rotary": e * tokens * (nq + nkv) * d + 2 * 2 * 4 * positions * s * (d // 2),
        "attention": e * tokens * nq * d + 4 * b * nq * s,
        "attention_projection_input": e * tokens * nq * d,
        "documents": 0,
        "mlp": (4 if swiglu else 2) * e * tokens * ffn,
        "rng_state": 0,
    }
    if arch.latent_attention is not None:
        terms.update(_latent_attention_terms(arch, b, s, tp, positions, device))
    if lora:  # each adapted linear keeps its A projection's output (its input is kept already)
        terms["lora"] = (5 if swiglu else 4) * e * tokens * config.finetuning.rank
    if arch.qk_norm:  # over each head: the input (fp32), input x rsqrt (fp32) and rsqrt of q and k
        terms["qk_norm"] = 4 * tokens * nq * d + (4 * tokens * nkv * d if e != 4 else 0)
        terms["qk_norm"] += 4 * tokens * (nq + nkv) * (d + 1)
    if arch.hidden_dropout > 0:  # a mask per residual branch: the input's dtype on CPU, bool on CUDA
        terms["dropout"] = 2 * (e if device == "cpu" else 1) * h * stream
    if moe and arch.moe is not None:
        k, experts = arch.moe.top_k, arch.moe.num_experts
        expert_ffn = arch.moe.ffn_size or arch.ffn_size
        pairs = tokens * k
        router = 4 * tokens * experts + 32 * pairs + 4 * tokens
        shared = 4 * e * tokens * -(-arch.moe.num_shared_experts * expert_ffn // tp)
        expert_ffn = -(-expert_ffn // tp)
        terms["mlp"] = router + 2 * e * pairs * h + 4 * e * pairs * expert_ffn + shared
    if cp > 1:
        # int64 positions of the zigzag pieces; documents: ids and positions of the whole sequences.
        terms["documents"] = 3 * 8 * tokens + (2 * 8 * b * seq if arch.document_masking else 0)
        if arch.context_parallel_method == "all_to_all":
            terms["documents"] += 2 * 8 * seq  # the zigzag order and its inverse
            if arch.activation_checkpointing != "selective":  # heads over CP: the kernel's own q, k, v
                terms["qkv"], terms["rotary"] = 0, 2 * 2 * 4 * positions * s * (d // 2)
                terms["attention"] += e * tokens * (nq + 2 * nkv) * d
    elif arch.document_masking:
        varlen = device == "cuda" and e == 2 and d % 8 == 0 and d <= 256
        terms["documents"] = 2 * 8 * tokens + (0 if varlen else e * b * s * s)
    if arch.activation_checkpointing == "selective":
        terms["attention"], terms["rng_state"] = 0, rng_state
    return terms


def routed_rows(config: TransformerConfig, spec: ParameterSpec, tokens: int) -> int | None:
    """The rows a parameter's product takes on the first expert-parallel rank: ``tokens``, or for an
    expert its routed share (balanced: ``ep T k / E``), None for another rank's expert."""
    moe, ep = config.transformer_architecture.moe, config.topology.expert_parallel_size
    if spec.expert is None or moe is None:
        return tokens
    if spec.expert // (moe.num_experts // ep):
        return None
    return ep * tokens * moe.top_k // moe.num_experts


def weight_pass_bytes(config: TransformerConfig, specs: list[ParameterSpec], layers: set[int]) -> int:
    """What a zero-bubble input pass over ``layers`` keeps for its weight pass, per micro-batch: the
    gradient of each trained parameter's operator output (``scaling.pipeline``'s weight pass starts
    there): a matrix's ``rows x out`` (TP-local; the head's logits, an expert's routed rows), a norm
    weight's ``rows x h`` (the stream's rows under sequence parallelism), in the parameters' dtype; a
    bias shares its matrix's product."""
    arch, top = config.transformer_architecture, config.topology
    assert top.micro_batch_size is not None and top.model_parallel_size is not None
    tp, e = top.model_parallel_size, arch.dtype.itemsize
    tokens = top.micro_batch_size * config.data.sequence_length // top.context_parallel_size
    stream = tokens // tp if arch.sequence_parallel else tokens
    kept = 0
    for spec in specs:  # (the head's weight is the last layer's, tied to the embedding or not)
        meta = spec.meta
        if meta.layer_index not in layers or not spec.trainable or meta.local_name.endswith("bias"):
            continue
        shape = meta.logical_shape
        rows = routed_rows(config, spec, tokens)
        if len(shape) == 2 and rows is not None and meta.layer_index != 0:  # an embedding is a look-up
            out = -(-shape[0] // tp) if meta.parallel_dim == 0 and tp > 1 else shape[0]
            kept += e * rows * out
        elif len(shape) == 1:
            kept += e * stream * shape[0]
    return kept


def activation_memory(
    config: TransformerConfig,
    stage: int = 0,
    device: str = "cpu",
    after_first: int = 0,
    weight_pass_gradients: bool = False,
) -> ActivationMemory:
    """The activation bytes of pipeline ``stage``'s ranks for ``config``: the blocks' terms
    (``block_activation_terms``), the head's norm and fp32 cross-entropy (log-softmax in one TP rank,
    shifted logits and their exponentials over a vocabulary block), a chunk's received input (when
    16-bit) and sent output held by the pipeline, a received gradient when a backward begins; summed
    over the micro-batches in flight (``scaling.trainer.planning.in_flight_peak``). ``after_first``:
    bytes counted with them from the stage's first backward on (``peak_memory``'s gradients).
    Under a zero-bubble schedule a micro-batch's chunk is held until its weight pass; with
    ``weight_pass_gradients`` (``peak_memory``'s) the gradients its input pass keeps for that pass
    (``weight_pass_bytes``) count too.

    Raises:
        ValueError: naming a setting the prediction does not model yet (MoE or latent attention
            with sequence parallelism, attention dropout, float8, compile, finetuning other than LoRA
            on every linear...).
    """
    arch, top = config.transformer_architecture, config.topology
    assert top.micro_batch_size is not None and top.model_parallel_size is not None
    assert top.pipe_parallel_size is not None and top.gradient_accumulation_steps is not None
    block = block_activation_terms(config, device)
    moe_block = block_activation_terms(config, device, moe=True) if arch.moe is not None else None
    tp, pp = top.model_parallel_size, top.pipe_parallel_size
    e, h = arch.dtype.itemsize, arch.hidden_size
    tokens = top.micro_batch_size * config.data.sequence_length // top.context_parallel_size
    stream = tokens // tp if arch.sequence_parallel else tokens
    vocab = -(-arch.vocab_size // tp)
    # fp32 log-softmax in one rank; over TP the shifted logits, their exponentials and per-token masks.
    loss = 4 * tokens * vocab if tp == 1 else 8 * tokens * vocab + 26 * tokens
    lora = _lora(config)
    # A frozen head (LoRA) keeps its norm's input and rsqrt only: its product needs no input.
    head = _norm_bytes(arch, stream, frozen=lora) + (0 if lora else e * h * tokens) + loss
    embedding = (e if device == "cpu" else 1) * h * stream if arch.embedding_dropout > 0 else 0  # the mask
    # A frozen embedding's output needs no gradient: the first block's first norm keeps only its output.
    first_norm = _norm_bytes(arch, stream, frozen=True) if lora and "norms" in block else 0
    # On gloo each send's packed copy (an activation's with its int64 positions) lives until the step
    # ends (scaling.trainer.planning.in_flight_peak); NCCL's finished sends are freed as they go.
    packed = e * h * stream + (8 * tokens if arch.document_masking else 0)
    kept_sends = (packed, e * h * stream) if device == "cpu" else (0, 0)
    virtual, placement = config.training.chunks_per_stage, config.training.placement
    partition = partition_layers(arch.num_layers + 2, pp, num_virtual=virtual)
    chunks = [set(partition[virtual_stage(stage, chunk, pp, placement)]) for chunk in range(virtual)]
    last = arch.num_layers + 1
    per_chunk = []
    for layers in chunks:
        held = sum(
            sum((moe_block if moe_block is not None and arch.is_moe_block(i - 1) else block).values())
            for i in layers
            if 0 < i < last
        )
        held += head if last in layers else 0
        held += embedding if 0 in layers else 0
        held -= first_norm if 1 in layers else 0
        if 0 not in layers and e != 4 and arch.norm == "rmsnorm":  # kept besides the norm's fp32 copy
            held += e * h * stream
        held += e * h * stream if last not in layers else 0  # the output, kept for its backward
        per_chunk.append(held)
    received_gradient = e * h * stream if stage < pp - 1 or virtual > 1 else 0
    weight_pass: list[int] = []
    if config.training.schedule in ZERO_BUBBLE_SCHEDULES:
        # (0 bytes: the first chunk's input needs no gradient, so its weight pass is a whole backward)
        specs, _ = memory_inputs(config)
        weight_pass = [
            0 if 0 in layers or not weight_pass_gradients else weight_pass_bytes(config, specs, layers)
            for layers in chunks
        ]
    peak = in_flight_peak(
        per_chunk,
        config.training.schedule,
        pp,
        top.gradient_accumulation_steps,
        stage,
        received_gradient,
        kept_sends,
        after_first,
        weight_pass,
    )
    return ActivationMemory(stage, peak, tuple(per_chunk), block, moe_block)


@dataclass(frozen=True)
class PeakMemory:
    """The most device bytes a rank of pipeline ``stage`` holds in a step (``peak``) and its parts:
    model state at rest, activations (with the gradients already made, when the peak is at a later
    backward) and the moment's transient (``transient``): the loss's gradient on the last stage in
    the backward, the DP reduction's buckets at its end, or the optimizer step's fp32 gradient
    copies, whichever moment holds more (``moment``)."""

    stage: int
    peak: int
    model_state: RankMemory
    activations: int
    transient: int
    moment: str


def _zero3_gathered(specs: list[ParameterSpec], layout: MemoryLayout, stage: int) -> int:
    """ZeRO-3's whole parameters in a backward: two adjacent blocks of the stage (the one running and
    the one prefetched) and a tied embedding (whole from the head's backward to the embedding's)."""
    held = partition_layers(layout.num_layers, layout.pp, num_virtual=layout.num_virtual_stages)
    layers = {i for c in range(layout.num_virtual_stages) for i in held[layout.virtual_stage(stage, c)]}
    per_layer: dict[int, int] = {}
    tied = 0
    for spec in specs:
        index = spec.meta.layer_index
        if index not in layers:
            continue
        size = spec.local_numel(layout.tp) * spec.dtype.itemsize
        if spec.meta.tied_key is not None:
            tied = max(tied, size)
        else:
            per_layer[index] = per_layer.get(index, 0) + size
    ordered = sorted(per_layer)
    pairs = [per_layer[a] + per_layer[b] for a, b in zip(ordered, ordered[1:])] or [0]
    return max(pairs) + tied


def peak_memory(config: TransformerConfig, stage: int = 0, device: str = "cpu") -> PeakMemory:
    """The peak device bytes of the first rank of pipeline ``stage`` (``model_state_memory`` and
    ``activation_memory``; see ``PeakMemory``).

    In the backward the step holds the parameters and optimizer state (the gradients of the last
    step were dropped), the activations of the micro-batches in flight, the gradients made by the
    stage's earlier backwards, and on the last stage the loss's fp32 gradient over the logits (the
    log-softmax's and its input's; over TP the shifted logits' too). When the backward ends it holds
    the whole model state and, over DP x CP, the reduction's flat buckets, all kept until the
    reduction finishes (every gradient in fp32, and once more in a 16-bit parameter's dtype; ZeRO 1-2
    the reduce-scatters' outputs, ZeRO-2 the last bucket's gradients). At the optimizer step it holds
    the whole model state and, with 16-bit parameters, the reduced gradients' fp32 copies (as large
    as the master weights). With ``every_layer`` checkpointing the backward's transient is the larger
    of that gradient and a block's activations, recomputed. Under ZeRO-3 the backward adds two adjacent
    blocks and a tied embedding made whole, and there is no reduction moment. Under ``cpu_offload`` on a CPU device (host memory
    is the device's) each moment adds the offloaded state, and the last two the reduced gradients'
    host copy.

    Raises:
        ValueError: as ``activation_memory``, and for ZeRO-3 keeping layers whole after their
            forward (``zero3_reshard_after_forward=false``) or under pipeline parallelism (not
            modelled yet).
    """
    opt = config.optimizer
    if opt.zero_stage == 3 and not opt.zero3_reshard_after_forward:
        raise ValueError(
            "optimizer.zero3_reshard_after_forward=false: the peak prediction models ZeRO-3 with each layer freed "
            "after its forward only (the default)"
        )
    if opt.zero_stage == 3 and (config.topology.pipe_parallel_size or 1) > 1:
        raise ValueError(
            "optimizer.zero_stage=3 with topology.pipe_parallel_size > 1: the peak prediction does not model "
            "ZeRO-3's gathers and reduce-scatters under a pipeline schedule yet (measured up to 22 % more)"
        )
    specs, layout = memory_inputs(config)
    state = rank_memory(specs, layout, opt, stage, method_of=method_of(config))
    arch, top = config.transformer_architecture, config.topology
    assert top.model_parallel_size is not None and top.micro_batch_size is not None
    assert top.pipe_parallel_size is not None
    tp = top.model_parallel_size
    tokens = top.micro_batch_size * config.data.sequence_length // top.context_parallel_size
    vocab = -(-arch.vocab_size // tp)
    last = stage == top.pipe_parallel_size - 1
    transient = (2 if tp == 1 else 3) * 4 * tokens * vocab if last else 0
    activations = activation_memory(config, stage, device, state.gradients, weight_pass_gradients=True).peak
    if opt.zero_stage == 3:  # a layer whole, the next one prefetched, a tied embedding whole meanwhile
        transient += _zero3_gathered(specs, layout, stage)
    if arch.activation_checkpointing in ("every_layer", "operators"):  # a block recomputed in its backward
        transient = max(transient, sum(block_activation_terms(without_checkpointing(config), device).values()))
    # The DP x CP reduction (scaling.optim's GradientReducer): each bucket's flat copy is kept until
    # finish() waits for it, every gradient in fp32 and with 16-bit parameters once more in theirs;
    # ZeRO 1-2 add each reduce-scatter's output (1/world of it, fp32), and ZeRO-2 the last bucket's
    # whole gradients, alive while it launches.
    e, zero = arch.dtype.itemsize, opt.zero_stage
    world = (top.data_parallel_size or 1) * top.context_parallel_size
    # The reduced elements: the trained ones (ZeRO 0-1 keep their whole .grad; ZeRO-2's shards do not
    # tell, so every parameter counts: exact without finetuning).
    numel = (state.gradients if zero < 2 else state.parameters) // e
    buckets = 0
    if world > 1 and zero < 3:  # ZeRO-3 reduce-scatters layer by layer as the backward goes
        buckets = (4 + (e if e != 4 else 0)) * numel + (4 * numel // world if zero in (1, 2) else 0)
        buckets += min(numel * e, opt.allreduce_bucket_size) if zero == 2 else 0
    fp32_copies = state.master if e != 4 else 0
    # Offload copies the reduced gradient shards to the host (fp32); on a CPU device host memory is the
    # device's, so the offloaded state counts too.
    offloaded = 4 * numel // (world if zero >= 1 else 1) if opt.cpu_offload else 0
    host, later = (state.host, offloaded) if device == "cpu" else (0, 0)
    moments = {
        "backward": (state.device - state.gradients + activations + transient + host, transient),
        "reduction": (state.device + buckets + host + later, buckets + later),
        "optimizer": (state.device + fp32_copies + host + later, fp32_copies + later),
    }
    moment = max(moments, key=lambda name: moments[name][0])
    peak, extra = moments[moment]
    return PeakMemory(stage, peak, state, activations, extra, moment)
