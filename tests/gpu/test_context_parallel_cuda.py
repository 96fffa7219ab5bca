"""Context parallelism's attention blocks on CUDA (the branch a CPU run cannot reach).

The ring itself needs two GPUs (NCCL refuses two ranks on one device); on one GPU the
block kernels that each ring step calls on CUDA (the flash kernel for bf16 blocks without
a mask, the memory-efficient one for fp32 or a mask) are checked against torch's fused
attention there: forward, log-sum-exp and backward, with block sizes that are and are not
multiples of the kernels' tiles, and with as many or more keys than queries.
"""

import pytest
import torch
import torch.nn.functional as F

from scaling.nn._attention_kernels import _kernel, block_attention_backward, block_attention_forward

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present on this machine")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("sq", "sk"), [(64, 64), (48, 48), (48, 80)])
def test_block_attention_on_cuda_matches_sdpa(dtype, tol, sq, sk):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, grad = (torch.randn(2, 4, sq, 32, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 4, sk, 32, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    mask = torch.rand(2, 1, sq, sk, generator=g, device="cuda") > 0.3
    mask[..., 0] = True
    cases = [(mask, False), (None, False)] + ([(None, True)] if sq == sk else [])
    for m, causal in cases:
        expected = "flash" if m is None and dtype == torch.bfloat16 else "efficient"
        assert _kernel(q, m) == expected
        leaves = [t.clone().float().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=causal, scale=0.25)
        ref.backward(grad.float())
        visible = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril() if causal else m
        scores = (leaves[0] @ leaves[1].transpose(-1, -2)).detach() * 0.25
        ref_lse = (scores if visible is None else scores.masked_fill(~visible, float("-inf"))).logsumexp(-1)
        out, lse = block_attention_forward(q, k, v, m, causal, 0.25)
        assert out.device.type == "cuda" and lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
        for a, b in zip(block_attention_backward(grad, q, k, v, out, lse, m, causal, 0.25), leaves):
            torch.testing.assert_close(a.float(), b.grad, atol=tol * 10, rtol=tol * 10)
