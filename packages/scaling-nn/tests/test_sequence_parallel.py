"""Sequence parallelism: a transformer block with SP on matches SP off (TP = 2 and 4)."""

import os
import sys

import pytest
import torch

from scaling.nn import (
    AttentionConfig,
    LayerNorm,
    ParallelSelfAttention,
    ParallelSwiGLUMLP,
    RMSNorm,
    VocabParallelEmbedding,
    get_parameter_meta,
    reduce_sequence_parallel_gradients,
)
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import close, full_tensor  # noqa: E402

H, S, VOCAB = 16, 8, 13


class Block(torch.nn.Module):
    def __init__(self, topology, sequence_parallel, num_kv_heads):
        super().__init__()
        sp = dict(topology=topology, sequence_parallel=sequence_parallel)
        self.embedding = VocabParallelEmbedding(VOCAB, H, **sp)
        self.norm1 = LayerNorm(H, **sp)
        self.attention = ParallelSelfAttention(
            AttentionConfig(H, 4, num_kv_heads, fused_qkv=num_kv_heads == 4, sequence_parallel=sequence_parallel),
            topology=topology,
        )
        self.norm2 = RMSNorm(H, **sp)
        self.mlp = ParallelSwiGLUMLP(H, 16, bias=True, **sp)

    def forward(self, ids, cu_seqlens=None):
        x = self.embedding(ids)
        x = x + self.attention(self.norm1(x), cu_seqlens=cu_seqlens)
        return x + self.mlp(self.norm2(x))


def _sp_parity(tp):
    topo = make_topology(model_parallel_size=tp)
    group, rank = topo.axis("tp").group, topo.axis("tp").rank
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, S, H, generator=torch.Generator().manual_seed(2))
    for num_kv_heads in (4, 1):
        for cu in (None, torch.tensor([0, 5, 8, 11, 16])):
            torch.manual_seed(0)
            ref = Block(topo, False, num_kv_heads)
            torch.manual_seed(0)
            sp = Block(topo, True, num_kv_heads)
            y_ref = ref(ids, cu)
            y_ref.backward(grad)
            y = sp(ids, cu)
            close(y, y_ref.chunk(tp, dim=1)[rank], "sp output shard")
            y.backward(grad.chunk(tp, dim=1)[rank].contiguous())
            reduced = reduce_sequence_parallel_gradients(sp, group)
            flagged = [n for n, p in sp.named_parameters() if get_parameter_meta(p).reduce_over_tp]
            assert reduced == len(flagged) and "norm1.weight" in flagged and "mlp.down_proj.bias" in flagged
            ref_params = dict(ref.named_parameters())
            for name, p in sp.named_parameters():
                close(
                    full_tensor(p, group, p.grad),
                    full_tensor(ref_params[name], group, ref_params[name].grad),
                    f"grad {name}",
                )
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_matches_sequence_parallel_off(tp):
    assert run_distributed(_sp_parity, tp, tp, timeout_seconds=90) == [True] * tp
