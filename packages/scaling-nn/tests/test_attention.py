"""ParallelSelfAttention vs an explicit-softmax reference, KV cache, and TP parity."""

import math
import os
import sys

import pytest
import torch

from scaling.nn import AttentionConfig, KVCache, ParallelSelfAttention
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import check_layer_parity, close  # noqa: E402

H, NQ = 16, 4  # head_dim 4


def rope_reference(x, positions, rotary_dim, interleaved, base=10000.0):
    """RoPE written independently: complex rotation of channel pairs."""
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = positions.double()[:, None, :, None] * inv  # [b, 1, s, r/2]
    rot = x[..., :rotary_dim].double()
    if interleaved:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], -1, 2).contiguous())
        out = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    else:
        half = rotary_dim // 2
        c = torch.complex(rot[..., :half], rot[..., half:]) * torch.polar(torch.ones_like(angle), angle)
        out = torch.cat([c.real, c.imag], dim=-1)
    return torch.cat([out.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def reference_attention(layer, x, cu_seqlens=None):
    """softmax(QK^T / sqrt(d) + mask) V from the layer's (TP=1) weights, loops over documents."""
    b, s, _ = x.shape
    d, nq, nkv = layer.head_dim, layer.num_attention_heads, layer.num_kv_heads
    if layer.fused_qkv:
        qkv = layer.qkv(x).view(b, s, nkv, nq // nkv + 2, d)
        q, k, v = qkv[:, :, :, :-2].reshape(b, s, nq, d), qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        q, k, v = layer.query(x).view(b, s, nq, d), layer.key(x).view(b, s, nkv, d), layer.value(x).view(b, s, nkv, d)
    if layer.qk_norm:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.q_norm
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.k_norm
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    allowed = torch.ones(b, s, s, dtype=torch.bool)
    positions = torch.arange(s).repeat(b, 1)
    if cu_seqlens is not None:
        allowed[:] = False
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            row, a, e = start // s, start % s, start % s + (end - start)
            allowed[row, a:e, a:e] = True
            positions[row, a:e] = torch.arange(end - start)
    if layer.causal:
        allowed &= torch.ones(s, s, dtype=torch.bool).tril()
    if layer.rotary is not None:
        q = rope_reference(q, positions, layer.rotary.rotary_dim, layer.rotary.interleaved)
        k = rope_reference(k, positions, layer.rotary.rotary_dim, layer.rotary.interleaved)
    k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = scores.softmax(-1) @ v
    return layer.dense(out.transpose(1, 2).reshape(b, s, nq * d))


CONFIGS = [
    dict(num_kv_heads=4, fused_qkv=True, causal=True, rotary_percentage=1.0),
    dict(num_kv_heads=2, fused_qkv=False, causal=False, rotary_percentage=0.5, rotary_interleaved=True),
    dict(num_kv_heads=1, fused_qkv=True, causal=True, qk_norm=True, rotary_interleaved=True),
    dict(num_kv_heads=2, fused_qkv=True, causal=True, rotary_percentage=0.0, bias=False),
]
CU_SEQLENS = torch.tensor([0, 3, 6, 7, 12, 14])  # b=2, s=7: docs [3, 3, 1] and [5, 2]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("packed", [False, True])
def test_matches_explicit_softmax_reference(config, packed):
    torch.manual_seed(0)
    layer = ParallelSelfAttention(AttentionConfig(H, NQ, **config))
    x = torch.randn(2, 7, H)
    cu = CU_SEQLENS if packed else None
    close(layer(x, cu_seqlens=cu), reference_attention(layer, x, cu), "attention", rtol=1e-5)


def test_packed_documents_are_checked_once_per_batch_not_per_layer(monkeypatch):
    """The cu_seqlens check reads the tensor on the host (a device sync per call on a GPU):
    every layer of a forward gets the same tensor, so it runs for the first one only."""
    from scaling.nn import _rotary

    calls = []
    check = _rotary._check_cu_seqlens
    monkeypatch.setattr(_rotary, "_check_cu_seqlens", lambda *args: calls.append(1) or check(*args))
    torch.manual_seed(0)
    layers = [ParallelSelfAttention(AttentionConfig(H, NQ, **CONFIGS[0])) for _ in range(3)]
    x, cu = torch.randn(2, 7, H), CU_SEQLENS.clone()
    for layer in layers:
        x = layer(x, cu_seqlens=cu)
    assert len(calls) == 1
    layers[0](x, cu_seqlens=cu.clone())  # a new batch's tensor is checked again
    assert len(calls) == 2
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 3, 13\] must increase from 0 to batch_size"):
        layers[0](x, cu_seqlens=torch.tensor([0, 3, 13]))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_flash_attention_call_traces_on_the_meta_device(causal, kv_heads):
    """The CUDA path of packed documents (flash's variable-length kernel), traced with torch's
    meta kernels: shapes and dtypes forward and backward, GQA included (the values are the
    gpu tier's: tests/gpu/test_attention_cuda.py)."""
    from scaling.nn import _attention_kernels as kernels

    q = torch.empty(2, 4, 7, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(2, kv_heads, 7, 16, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    out = kernels.packed_flash_attention(q, k, v, CU_SEQLENS.to("meta"), causal)
    assert (out.shape, out.dtype) == (q.shape, torch.bfloat16)
    out.sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    assert not kernels.packed_flash_available(torch.empty(2, 4, 7, 16, dtype=torch.bfloat16), 0.0)  # CPU


@pytest.mark.parametrize("config", [c for c in CONFIGS if c["causal"]])
def test_kv_cache_matches_full_forward_token_by_token(config):
    torch.manual_seed(0)
    layer = ParallelSelfAttention(AttentionConfig(H, NQ, **config))
    x = torch.randn(2, 7, H)
    full = layer(x)
    cache = KVCache()
    steps = [layer(x[:, :3], kv_cache=cache)] + [layer(x[:, i : i + 1], kv_cache=cache) for i in range(3, 7)]
    assert cache.seq_len == 7
    close(torch.cat(steps, dim=1), full, "kv cache", rtol=1e-5)


def test_errors_name_values_and_choices():
    with pytest.raises(ValueError, match=r"num_attention_heads=3 does not divide hidden_size=16"):
        ParallelSelfAttention(AttentionConfig(16, 3))
    with pytest.raises(
        ValueError, match=r"num_kv_heads=3 does not divide num_attention_heads=4; choose num_kv_heads in \[1, 2, 4\]"
    ):
        ParallelSelfAttention(AttentionConfig(16, 4, 3))
    with pytest.raises(
        ValueError,
        match=r"cu_seqlens=\[0, 5, 14\] must increase from 0 to batch_size \* seq_len = 14.*rows crossed by a document: \[7\]",
    ):
        ParallelSelfAttention(AttentionConfig(16, 4))(torch.randn(2, 7, 16), cu_seqlens=torch.tensor([0, 5, 14]))
    with pytest.raises(ValueError, match=r"cannot be used with kv_cache"):
        ParallelSelfAttention(AttentionConfig(16, 4))(
            torch.randn(1, 7, 16), cu_seqlens=torch.tensor([0, 7]), kv_cache=KVCache()
        )
    with pytest.raises(ValueError, match=r"kv_cache needs causal=True"):
        ParallelSelfAttention(AttentionConfig(16, 4, causal=False))(torch.randn(1, 2, 16), kv_cache=KVCache())
    with pytest.raises(ValueError, match=r"rotary_percentage=0.1 with head_dim=4 rotates 0 channels"):
        ParallelSelfAttention(AttentionConfig(16, 4, rotary_percentage=0.1))


TP_CONFIGS = [
    dict(num_attention_heads=8, num_kv_heads=8, fused_qkv=True),
    dict(num_attention_heads=8, num_kv_heads=4, fused_qkv=True, qk_norm=True),
    dict(num_attention_heads=8, num_kv_heads=2, fused_qkv=False, qk_norm=True),  # kv heads < TP at TP=4
    dict(num_attention_heads=8, num_kv_heads=1, fused_qkv=False, causal=False, rotary_interleaved=True),  # MQA
]


def _tp_parity(tp):
    topo = make_topology(model_parallel_size=tp)
    for i, config in enumerate(TP_CONFIGS):
        if config["num_kv_heads"] % tp and config["fused_qkv"]:
            continue
        for cu in (None, CU_SEQLENS):
            torch.manual_seed(i)
            layer = ParallelSelfAttention(AttentionConfig(32, **config), topology=topo)
            torch.manual_seed(i)
            ref = ParallelSelfAttention(AttentionConfig(32, **config))
            x_ref = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
            x = x_ref.detach().clone().requires_grad_(True)
            y, y_ref = layer(x, cu_seqlens=cu), ref(x_ref, cu_seqlens=cu)
            grad = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2))
            y.backward(grad)
            y_ref.backward(grad)
            check_layer_parity(layer, ref, [y], [y_ref], [x], [x_ref], topo.axis("tp").group)
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_process(tp):
    assert run_distributed(_tp_parity, tp, tp, timeout_seconds=90) == [True] * tp


def _bad_tp():
    topo = make_topology(model_parallel_size=4)
    msgs = []
    for kwargs in (
        dict(num_attention_heads=6),
        dict(num_attention_heads=8, num_kv_heads=2),
        dict(num_attention_heads=8, num_kv_heads=2, fused_qkv=False, attention_dropout=0.1),
    ):
        try:
            ParallelSelfAttention(AttentionConfig(48, **kwargs), topology=topo)
        except ValueError as e:
            msgs.append(str(e))
    # Keep every rank until all have built their subgroups (a fast rank leaving early can
    # close gloo connections a slow peer is still opening).
    torch.distributed.barrier()
    return msgs


@pytest.mark.distributed
def test_heads_not_divisible_by_tp_name_valid_sizes():
    m = run_distributed(_bad_tp, 4, timeout_seconds=60)[0]
    assert len(m) == 3
    with pytest.raises(
        ValueError,
        match=r"model_parallel_size=4 cannot shard num_attention_heads=6, num_kv_heads=6 \(fused_qkv=True\); choose model_parallel_size in \[1, 2, 3, 6\]$",
    ):
        raise ValueError(m[0])
    with pytest.raises(
        ValueError,
        match=r"num_kv_heads=2 \(fused_qkv=True\); choose model_parallel_size in \[1, 2\] or fused_qkv=False",
    ):
        raise ValueError(m[1])
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 with model_parallel_size=4 needs rng_tracker"):
        raise ValueError(m[2])
