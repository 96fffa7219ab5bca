"""torch.compile and float8 linears on one GPU: the CUDA side of what CI checks on CPU.

``torch._scaled_mm`` on CUDA wants its operands laid out row-major / column-major, sizes in
multiples of 16 and (rowwise) a bf16 output: these tests run the recipe there. Each runs
one rank through ``scaling.testing`` (forked from a process that never touched CUDA).
"""

import pytest
import torch
from transformer_testlib import losses, tiny_config, train_worker

from scaling.testing import assert_parity, run_distributed

pytestmark = pytest.mark.gpu
CUDA = {"device": "cuda", "backend": "nccl"}


def _float8_products(scaling: str) -> list[float]:
    from scaling.nn import Float8Config, float8_linear

    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = float8_linear(x, w, None, Float8Config(enabled=True, scaling=scaling))
    y.float().square().mean().backward()
    exact = x.detach().float() @ w.detach().float().t()
    errors = [(y.float() - exact).abs().max() / exact.abs().max()]
    errors.append((x.grad.float() - (2 * exact / exact.numel()) @ w.detach().float()).abs().max() / x.grad.abs().max())
    return [float(e) for e in errors]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_float8_products_on_cuda(scaling):
    (errors,) = run_distributed(_float8_products, 1, scaling, timeout_seconds=120)
    assert all(e < 0.1 for e in errors), errors  # float8 rounding (2^-4 per operand), not garbage


FP8_ARCH = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "precision": "bf16"}


def _run(gpu_corpus, optimizer=None, steps=20, deterministic=False, **training):
    cfg = tiny_config(gpu_corpus, steps=steps, training=training, optimizer=optimizer or {})
    cfg["topology"].update(CUDA)
    cfg["transformer_architecture"].update(FP8_ARCH)
    cfg["trainer"].update(log_interval=1, deterministic=deterministic)
    return losses(run_distributed(train_worker, 1, cfg, backend="nccl", timeout_seconds=600)[0])


def test_compiled_and_float8_transformer_on_cuda(gpu_corpus):
    eager = _run(gpu_corpus)
    compiled = _run(gpu_corpus, compile={"enabled": True})
    fp8 = _run(gpu_corpus, compile={"enabled": True}, fp8={"enabled": True})
    assert eager[-1] < 0.8 * eager[0], eager
    # bf16: inductor's fused kernels round differently from eager's, so a bf16 tolerance
    assert_parity(compiled, eager, rtol=2e-2, name="compiled vs eager (bf16)")
    assert_parity(fp8, eager, rtol=5e-2, name="fp8 compiled vs bf16 eager")


def test_float8_all_gather_under_zero3_on_cuda(gpu_corpus):
    """ZeRO-3 (one rank: the shards are whole, yet the weights go through float8 as with more) with
    fp8.all_gather: the products take the gathered float8 weight (``_scaled_mm`` with it as the
    column-major right operand, and row-major, copied, in the input gradient) and train bit for bit
    as quantising the weight in each product (as on CPU). Deterministic kernels: otherwise CUDA's
    atomic-add backwards (embedding, attention) differ run to run in the last bits by themselves."""
    zero3 = {"zero_stage": 3}
    fp8 = {"enabled": True, "min_features": 16}
    gathered = _run(gpu_corpus, zero3, 10, True, fp8={**fp8, "all_gather": True})
    assert gathered == _run(gpu_corpus, zero3, 10, True, fp8=fp8)
    assert gathered[-1] < gathered[0], gathered
