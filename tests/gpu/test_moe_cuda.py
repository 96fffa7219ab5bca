"""Grouped experts on CUDA: ``torch._grouped_mm`` (CUTLASS on Hopper) against the per-expert loop.

On CUDA in bf16 ``ParallelMoE`` runs its experts as three grouped matrix multiplies by
default; a CPU run takes the loop unless forced (and is checked bitwise there). Here both
run on the GPU on the same inputs, forward and backward (12 routing slots for 16 experts: some idle).
"""

import pytest
import torch

from scaling.nn import MoEConfig, ParallelMoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present on this machine"),
    pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm"),
]


def test_grouped_experts_on_cuda_match_the_loop():
    runs = []
    for grouped in (None, False):  # the default on CUDA (grouped), then the loop
        torch.manual_seed(0)
        moe = ParallelMoE(MoEConfig(256, 512, 16, top_k=2, dtype=torch.bfloat16, grouped_gemm=grouped)).cuda()
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, 6, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        y = moe(x)
        y.backward(torch.randn(y.shape, device="cuda", dtype=torch.bfloat16, generator=g))
        runs.append([y.detach(), x.grad, *(p.grad for p in moe.parameters() if p.grad is not None)])
    for grouped, loop in zip(*runs):
        torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)
