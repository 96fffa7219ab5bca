"""Context-parallel attention (ring and all-to-all) against one process's attention.

Each rank holds its zigzag slice of the same seeded sequence; its output and its slices
of the query/key/value gradients must equal those of ``F.scaled_dot_product_attention``
on the whole sequence, within 1e-6 relative (fp32).
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaling.nn import (
    AttentionConfig,
    KVCache,
    ParallelSelfAttention,
    check_context_parallel,
    reduce_sequence_parallel_gradients,
)
from scaling.nn._attention_kernels import (
    _aligned_bias,
    block_attention_backward,
    block_attention_forward,
    math_attention_backward,
    math_attention_forward,
)
from scaling.nn._context_parallel import TokenLayout, all_to_all_attention, ring_attention
from scaling.nn._rotary import document_ids_and_positions, packed_attention_mask
from scaling.testing import make_topology, run_distributed, shard
from scaling.topology import split_sequence

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import check_layer_parity  # noqa: E402

B, S, D = 2, 32, 8
# (query heads, key/value heads, mask): MHA and GQA; causal, causal packed documents, bidirectional packed.
CASES = [(4, 4, "causal"), (4, 2, "causal"), (4, 4, "packed"), (4, 1, "packed"), (4, 2, "packed_bidirectional")]
CU_SEQLENS = torch.tensor([0, 5, 19, 32, 45, 46, 64])  # documents over the flattened b * S tokens


def _reference(nq, nkv, kind):
    g = torch.Generator().manual_seed(nq * 10 + nkv)
    q = torch.randn(B, nq, S, D, generator=g, dtype=torch.float32)
    k, v = (torch.randn(B, nkv, S, D, generator=g) for _ in range(2))
    grad = torch.randn(B, nq, S, D, generator=g)
    causal = kind != "packed_bidirectional"
    docs = document_ids_and_positions(CU_SEQLENS, B, S)[0] if kind != "causal" else None
    mask = None if docs is None else packed_attention_mask(docs, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True)
    out.backward(grad)
    return (q, k, v, grad), (out.detach(), *(t.grad for t in leaves)), causal, docs


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _cp_errors(method):
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    errors = {}
    for nq, nkv, kind in CASES:
        inputs, expected, causal, docs = _reference(nq, nkv, kind)
        q, k, v = (split_sequence(t, 2, rank, size).requires_grad_() for t in inputs[:3])
        layout = TokenLayout(S, rank, size, causal, docs)
        attention = ring_attention if method == "ring" else all_to_all_attention
        out = attention(q, k, v, layout, group)
        out.backward(split_sequence(inputs[3], 2, rank, size))
        got = (out, q.grad, k.grad, v.grad)
        errors[(nq, nkv, kind)] = max(_rel(a, split_sequence(e, 2, rank, size)) for a, e in zip(got, expected))
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["ring", pytest.param("all_to_all", marks=pytest.mark.slow)])
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_attention_matches_one_process(method, cp):
    for rank_errors in run_distributed(_cp_errors, cp, method, timeout_seconds=120):
        for case, err in rank_errors.items():
            assert err < 1e-6, (method, cp, case, err)


def test_ring_blocks_are_worked_out_once_per_process_or_per_batch_of_documents():
    """The ring's (rows, columns, mask) of a block reads the mask on the host (syncs on a GPU):
    without documents it depends only on sizes and ranks, so every layer and step shares it;
    with packed documents every layer and the backward of one batch share it."""
    from scaling.nn._context_parallel import _block, _block_without_documents

    layout = TokenLayout(16, 1, 2, True)
    first = [_block(layout, src, torch.device("cpu")) for src in range(2)]
    misses = _block_without_documents.cache_info().misses
    with torch.inference_mode():  # a later call may be under inference mode, or record autograd
        again = [_block(TokenLayout(16, 1, 2, True), src, torch.device("cpu")) for src in range(2)]
    assert all(a is b for a, b in zip(again, first))
    assert _block_without_documents.cache_info().misses == misses
    # Packed documents change per batch: worked out once per batch's document ids (the tensor
    # every layer gets), equal to the shared path's result when every token is in one document.
    ids = torch.zeros(1, 16, dtype=torch.long)
    fresh = _block(TokenLayout(16, 1, 2, True, ids), 0, torch.device("cpu"))
    assert fresh is _block(TokenLayout(16, 1, 2, True, ids), 0, torch.device("cpu"))  # another layer
    assert fresh is not _block(TokenLayout(16, 1, 2, True, ids.clone()), 0, torch.device("cpu"))  # next batch
    assert fresh is not None and first[0] is not None and fresh.causal == first[0].causal
    # The layers of one batch get the same document ids from its cu_seqlens tensor.
    cu = torch.tensor([0, 5, 16])
    assert document_ids_and_positions(cu, 1, 16)[0] is document_ids_and_positions(cu, 1, 16)[0]
    assert document_ids_and_positions(cu.clone(), 1, 16)[0] is not document_ids_and_positions(cu, 1, 16)[0]


@pytest.mark.parametrize("head_dim_stride_1", [True, False])
def test_block_kernel_matches_the_written_out_math(head_dim_stride_1):
    """The CPU flash kernel path and the fp32 path other devices take agree with SDPA, also for
    inputs whose head dim is not the innermost one in memory (RoPE's ``torch.cat`` can make them
    at a head dim of 2): called directly, torch's CPU flash kernel read other memory for them."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(4))
    if not head_dim_stride_1:  # the same values, the head dim outermost in memory but for the batch
        q, k, v, grad = (t.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1) for t in (q, k, v, grad))
        assert q.stride(-1) != 1
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.4
    mask[..., 0] = True  # every row sees a key
    for m, causal in ((mask, False), (None, True), (None, False)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=causal, scale=0.5)
        ref.backward(grad)
        visible = torch.ones(6, 6, dtype=torch.bool).tril() if causal else (m if m is not None else True)
        ref_lse = ((q @ k.transpose(-1, -2)) * 0.5).masked_fill(~torch.as_tensor(visible), float("-inf")).logsumexp(-1)
        for forward, backward in (
            (block_attention_forward, block_attention_backward),
            (math_attention_forward, math_attention_backward),
        ):
            out, lse = forward(q, k, v, m, causal, 0.5)
            assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-6)
            for a, b in zip(backward(grad, q, k, v, out, lse, m, causal, 0.5), leaves):
                assert torch.allclose(a, b.grad, atol=1e-5)


@pytest.mark.parametrize(
    ("kernel", "sq", "sk", "masked", "causal"),
    [
        ("flash", 48, 48, False, True),
        ("flash", 48, 80, False, False),
        ("efficient", 48, 48, False, True),
        ("efficient", 48, 80, True, False),
        ("efficient", 64, 64, False, False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_block_kernels_calls_trace_on_the_meta_device(kernel, sq, sk, masked, causal, dtype):
    """The CUDA branch's kernel calls, traced with torch's meta kernels (shapes and dtypes:
    the arguments each op's schema takes, the log-sum-exp cut to the block's rows, the
    efficient kernel's padded layout); their values are the gpu tier's to check."""
    q = torch.empty(2, 4, sq, 32, device="meta", dtype=dtype)
    k = torch.empty(2, 4, sk, 32, device="meta", dtype=dtype)
    mask = torch.empty(2, 1, sq, sk, dtype=torch.bool, device="meta") if masked else None
    out, lse = block_attention_forward(q, k, k, mask, causal, 0.25, kernel)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (2, 4, sq), torch.float32)
    grads = block_attention_backward(out, q, k, k, out, lse, mask, causal, 0.25, kernel)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype), (k.shape, dtype), (k.shape, dtype)]
    if masked:
        bias = _aligned_bias(mask, q)
        assert bias.shape == (2, 4, sq, sk) and bias.stride(2) % 16 == 0 and bias.stride(-1) == 1


ATTENTION_CONFIGS = [
    dict(num_attention_heads=8, num_kv_heads=8, fused_qkv=True, qk_norm=True),
    dict(num_attention_heads=8, num_kv_heads=2, fused_qkv=False, rotary_interleaved=True),  # GQA, kv < tp·cp
]


def _layer_parity(tp, method, sequence_parallel):
    topo = make_topology(model_parallel_size=tp, context_parallel_size=dist.get_world_size() // tp)
    cp, cp_rank, tp_rank = topo.axis("cp").size, topo.axis("cp").rank, topo.axis("tp").rank

    def local(full):  # this rank's zigzag slice, then its sequence-parallel part
        mine = split_sequence(full, 1, cp_rank, cp)
        return shard(mine, 1, tp_rank, tp) if sequence_parallel else mine

    for i, config in enumerate(ATTENTION_CONFIGS):
        for cu in (None, CU_SEQLENS):
            torch.manual_seed(i)
            layer = ParallelSelfAttention(
                AttentionConfig(32, sequence_parallel=sequence_parallel, context_parallel_method=method, **config),
                topology=topo,
            )
            torch.manual_seed(i)
            ref = ParallelSelfAttention(AttentionConfig(32, **config))
            x_ref = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
            grad = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(2))
            y_ref = ref(x_ref, cu_seqlens=cu)
            y_ref.backward(grad)
            x = local(x_ref.detach()).requires_grad_(True)
            y = layer(x, cu_seqlens=cu)
            y.backward(local(grad))
            for p in layer.parameters():  # each CP rank holds its tokens' share of the gradient
                dist.all_reduce(p.grad, group=topo.axis("cp").group)
            if sequence_parallel:
                reduce_sequence_parallel_gradients(layer, topo.axis("tp").group)
            x_local = local(x_ref.detach())
            x_local.grad = local(x_ref.grad)
            check_layer_parity(layer, ref, [y], [local(y_ref)], [x], [x_local], topo.axis("tp").group)
    return True


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize(
    ("world", "tp", "sequence_parallel"),
    [(2, 1, False), (4, 2, True), (4, 1, False)],
)
def test_attention_layer_with_context_parallelism_matches_one_process(method, world, tp, sequence_parallel):
    assert run_distributed(_layer_parity, world, tp, method, sequence_parallel, timeout_seconds=120) == [True] * world


def _bad_context_parallel():
    topo = make_topology(context_parallel_size=2)
    msgs = []
    for kwargs in (dict(num_attention_heads=3, context_parallel_method="all_to_all"), dict(attention_dropout=0.1)):
        try:
            ParallelSelfAttention(AttentionConfig(48, **{"num_attention_heads": 4, **kwargs}), topology=topo)
        except ValueError as e:
            msgs.append(str(e))
    try:
        ParallelSelfAttention(AttentionConfig(48, 4), topology=topo)(torch.randn(1, 8, 48), kv_cache=KVCache())
    except ValueError as e:
        msgs.append(str(e))
    dist.barrier()
    return msgs


@pytest.mark.distributed
def test_context_parallel_refusals_name_values_and_fix():
    m = run_distributed(_bad_context_parallel, 2, timeout_seconds=60)[0]
    assert len(m) == 3
    assert "the 3 query heads of each tensor-parallel rank to divide by context_parallel_size=2" in m[0]
    assert "use context_parallel_method='ring'" in m[0]
    assert "attention_dropout=0.1 with context_parallel_size=2" in m[1] and "set attention_dropout=0" in m[1]
    assert "kv_cache (generation) with context_parallel_size > 1" in m[2]
    with pytest.raises(ValueError, match=r"context_parallel_method='zigzag'; choose one of \['ring', 'all_to_all'\]"):
        check_context_parallel(4, 1, "zigzag", 0.0)
