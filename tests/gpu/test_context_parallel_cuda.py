"""Context parallelism's attention blocks on CUDA (the branch a CPU run cannot reach).

The ring itself needs two GPUs (NCCL refuses two ranks on one device); on one GPU the
block kernels that each ring step calls on CUDA are checked against torch's fused
attention there, forward, log-sum-exp and backward, in fp32 and bf16.
"""

import pytest
import torch
import torch.nn.functional as F

from scaling.nn._context_parallel import block_attention_backward, block_attention_forward

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present on this machine")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_block_attention_on_cuda_matches_sdpa(dtype, tol):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 64, 32, generator=g, device="cuda", dtype=dtype) for _ in range(4))
    mask = torch.rand(2, 1, 64, 64, generator=g, device="cuda") > 0.3
    mask[..., 0] = True
    for m, causal in ((mask, False), (None, True), (None, False)):
        leaves = [t.clone().float().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=causal, scale=0.25)
        ref.backward(grad.float())
        out, lse = block_attention_forward(q, k, v, m, causal, 0.25)
        assert out.device.type == "cuda" and lse.dtype == torch.float32
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        for a, b in zip(block_attention_backward(grad, q, k, v, out, lse, m, causal, 0.25), leaves):
            torch.testing.assert_close(a.float(), b.grad, atol=tol * 10, rtol=tol * 10)
