"""Packed documents on CUDA: flash attention's variable-length kernel (the branch a CPU run cannot reach).

On CUDA in bf16/fp16 ``ParallelSelfAttention`` attends within the documents of ``cu_seqlens``
with flash attention's variable-length kernel instead of SDPA with a dense document mask;
here both are run on the same inputs, forward and backward, causal and bidirectional, with GQA.
"""

import pytest
import torch
import torch.nn.functional as F

from scaling.nn import AttentionConfig, ParallelSelfAttention
from scaling.nn._attention_kernels import packed_flash_attention, packed_flash_available
from scaling.nn._rotary import document_ids_and_positions, packed_attention_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present on this machine"),
]
CU = [0, 100, 256, 300, 512, 520, 1024]  # b = 2 rows of 512 tokens: documents of 100, 156, 44, 212 | 8, 504


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_packed_flash_attention_matches_sdpa_with_the_document_mask(causal, kv_heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, grad = (torch.randn(2, 8, 512, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, 512, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor(CU, device="cuda")
    assert packed_flash_available(q, 0.0)
    leaves = [t.clone().float().requires_grad_() for t in (q, k, v)]
    mask = packed_attention_mask(document_ids_and_positions(cu, 2, 512)[0], causal)
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=kv_heads != 8)
    ref.backward(grad.float())
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    out = packed_flash_attention(*ours, cu, causal)
    out.backward(grad)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for mine, theirs in zip(ours, leaves):
        torch.testing.assert_close(mine.grad.float(), theirs.grad, atol=5e-2, rtol=5e-2)


def test_attention_layer_with_packed_documents_on_cuda_matches_cpu():
    """The layer end to end (RoPE restarting per document, GQA, output projection): bf16 on
    CUDA through the variable-length kernel against fp32 on CPU through the dense mask."""
    torch.manual_seed(0)
    layer = ParallelSelfAttention(AttentionConfig(512, 8, num_kv_heads=2))
    x = torch.randn(2, 512, 512, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor(CU)
    expected = layer(x, cu_seqlens=cu)
    cuda = layer.to("cuda", torch.bfloat16)
    out = cuda(x.to("cuda", torch.bfloat16), cu_seqlens=cu.to("cuda"))
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)
