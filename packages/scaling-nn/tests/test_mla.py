"""Multi-head latent attention: transformers' DeepseekV3Attention in one process, and one process's
outputs and gradients at tp2 (with and without sequence parallelism, packed documents)."""

import os
import sys

import pytest
import torch

from scaling.nn import MLAConfig, MultiHeadLatentAttention, reduce_sequence_parallel_gradients
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import check_layer_parity, close, full_tensor  # noqa: E402

H, HEADS = 32, 4
SHAPE = dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
CU_SEQLENS = torch.tensor([0, 3, 6, 7, 12, 14])  # b=2, s=7: docs [3, 3, 1] and [5, 2]


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q-latent", "no-q-latent"])
def test_matches_transformers_deepseek_v3_attention(q_lora_rank):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_module

    config = transformers.DeepseekV3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                           q_lora_rank=q_lora_rank, rope_theta=500.0, rms_norm_eps=1e-6,
                                           rope_interleave=True, **SHAPE)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = hf_module.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = MultiHeadLatentAttention(MLAConfig(H, HEADS, q_lora_rank=q_lora_rank, rotary_base=500.0, **SHAPE))
    with torch.no_grad():
        if q_lora_rank is None:
            ours.q.weight.copy_(hf.q_proj.weight)
        else:
            ours.q_a.copy_(hf.q_a_proj.weight)
            ours.q_a_norm.weight.copy_(hf.q_a_layernorm.weight)
            ours.q_b.weight.copy_(hf.q_b_proj.weight)
        ours.kv_a.copy_(hf.kv_a_proj_with_mqa.weight)
        ours.kv_a_norm.weight.copy_(hf.kv_a_layernorm.weight)
        ours.kv_b.weight.copy_(hf.kv_b_proj.weight)
        ours.dense.weight.copy_(hf.o_proj.weight)
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        expected, _ = hf(x, hf_module.DeepseekV3RotaryEmbedding(config)(x, positions), None)
        close(ours(x), expected, "MLA output", rtol=1e-5)
        # Generation: the prompt, then one token at a time through the KV cache, gives the same outputs.
        from scaling.nn import KVCache

        cache = KVCache()
        steps = [ours(x[:, :5], kv_cache=cache), *(ours(x[:, t : t + 1], kv_cache=cache) for t in range(5, 9))]
        close(torch.cat(steps, dim=1), expected, "MLA output through the KV cache", rtol=1e-5)


def _tp_parity(tp, sequence_parallel):
    topo = make_topology(model_parallel_size=tp)
    group, rank = topo.axis("tp").group, topo.axis("tp").rank
    for q_lora_rank in (16, None):
        for cu in (None, CU_SEQLENS):
            config = MLAConfig(H, HEADS, q_lora_rank=q_lora_rank, sequence_parallel=sequence_parallel, **SHAPE)
            torch.manual_seed(0)
            layer = MultiHeadLatentAttention(config, topology=topo)
            torch.manual_seed(0)
            ref = MultiHeadLatentAttention(MLAConfig(H, HEADS, q_lora_rank=q_lora_rank, **SHAPE))
            x_ref = torch.randn(2, 8 if cu is None else 7, H, generator=torch.Generator().manual_seed(1))
            x_ref.requires_grad_(True)
            grad = torch.randn(x_ref.shape, generator=torch.Generator().manual_seed(2))
            ref(x_ref, cu_seqlens=cu).backward(grad)
            if not sequence_parallel:
                x = x_ref.detach().clone().requires_grad_(True)
                y = layer(x, cu_seqlens=cu)
                y.backward(grad)
                check_layer_parity(layer, ref, [y], [ref(x_ref, cu_seqlens=cu)], [x], [x_ref], group)
                continue
            if cu is not None:  # sequence parallelism splits the 8-token windows; the packed case runs without
                continue
            mine = slice(rank * 8 // tp, (rank + 1) * 8 // tp)
            x = x_ref.detach()[:, mine].clone().requires_grad_(True)
            y = layer(x)
            y.backward(grad[:, mine])
            reduce_sequence_parallel_gradients(layer, group)
            close(y, ref(x_ref)[:, mine], "output slice")
            close(x.grad, x_ref.grad[:, mine], "input gradient slice")
            ref_params = dict(ref.named_parameters())
            for name, p in layer.named_parameters():
                close(full_tensor(p, group, p.grad), ref_params[name].grad, f"grad {name}")
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_matches_one_process(sequence_parallel):
    assert run_distributed(_tp_parity, 2, 2, sequence_parallel, timeout_seconds=90) == [True, True]


def test_heads_not_divisible_by_tp_and_context_parallelism_are_refused():
    from scaling.topology import Axis

    tp3 = Axis("tp", 3, 0, [0, 1, 2], "tp", lambda: None)
    with pytest.raises(
        ValueError, match=r"model_parallel_size=3 cannot shard num_attention_heads=4; choose .* \[1, 2, 4\]"
    ):
        MultiHeadLatentAttention(MLAConfig(H, HEADS, **SHAPE), tp=tp3)
    cp2 = Axis("cp", 2, 0, [0, 1], "cp", lambda: None)
    with pytest.raises(ValueError, match="context_parallel_size=2 is not supported yet"):
        MultiHeadLatentAttention(MLAConfig(H, HEADS, **SHAPE), cp=cp2)
