"""apply_updates (one fused multi-tensor kernel per group) against apply_update (single-tensor, torch.optim's arithmetic)."""

import pytest
import torch

from scaling.optim import OptimizerConfig
from scaling.optim._update import UpdateItem, apply_update, apply_updates, state_names


def _run(method, independent, dtype, batched, steps=3):
    config = OptimizerConfig(method=method, beta1=0.8, beta2=0.95, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in (7, 64, 1)]
    states = [{k: torch.zeros_like(p) for k in state_names(config)} for p in params]
    for step in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) for p in params]
        # two groups: different LR and weight decay
        hyper = [(1e-2, 0.1), (1e-2, 0.1), (3e-3, 0.0)]
        items = [UpdateItem(p, gr, s, lr, wd, independent) for p, gr, s, (lr, wd) in zip(params, grads, states, hyper)]
        if batched:
            apply_updates(config, items, step)
        else:
            for item in items:
                apply_update(config, *item[:3], step, *item[3:6])
    return params, states


@pytest.mark.parametrize("method", ["adamw", "adam"])
@pytest.mark.parametrize("independent", [False, True])
def test_fused_updates_match_the_single_tensor_rule(method, independent):
    fused, fused_states = _run(method, independent, torch.float32, batched=True)
    single, single_states = _run(method, independent, torch.float32, batched=False)
    for a, b in zip(fused, single):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(fused_states, single_states):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    start, _ = _run(method, independent, torch.float32, batched=True, steps=0)
    assert all((a - b).abs().min() > 0 for a, b in zip(start, fused))  # every element moved


def test_bf16_work_tensors_keep_the_single_tensor_rule():
    # no fp32 master: bf16 shards are not fused (the kernel would compute in fp32 and round once)
    batched, _ = _run("adamw", False, torch.bfloat16, batched=True)
    single, _ = _run("adamw", False, torch.bfloat16, batched=False)
    assert all(torch.equal(a, b) for a, b in zip(batched, single))
