"""ParallelMLP, ParallelSwiGLUMLP, LayerNorm, RMSNorm: parity with one-process twins."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from scaling.nn import LayerNorm, ParallelMLP, ParallelSwiGLUMLP, RMSNorm, get_parameter_meta
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import check_layer_parity, close  # noqa: E402

H, FF = 8, 16


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(H, FF), torch.nn.Linear(FF, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TorchSwiGLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(H, FF, bias=False)
        self.up_proj = torch.nn.Linear(H, FF, bias=False)
        self.down_proj = torch.nn.Linear(FF, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_norms_match_torch():
    x = torch.randn(2, 3, H)
    ln, ref = LayerNorm(H), torch.nn.LayerNorm(H)
    with torch.no_grad():
        ln.weight.uniform_()
        ln.bias.uniform_()
        ref.weight.copy_(ln.weight)
        ref.bias.copy_(ln.bias)
    close(ln(x), ref(x), "layer norm")
    rms = RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        rms.weight.uniform_()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    close(rms(x), expected, "rms norm")
    assert get_parameter_meta(RMSNorm(H, sequence_parallel=True).weight).reduce_over_tp
    assert not get_parameter_meta(LayerNorm(H).bias).reduce_over_tp


def test_mlp_errors():
    with pytest.raises(ValueError, match=r"gelu_approximate='relu'; choose 'none' or 'tanh'"):
        ParallelMLP(H, FF, gelu_approximate="relu")


def _mlp_parity(tp):
    topo = make_topology(model_parallel_size=tp)
    for cls, ref_cls in ((ParallelMLP, TorchMLP), (ParallelSwiGLUMLP, TorchSwiGLU)):
        torch.manual_seed(0)
        layer = cls(H, FF, topology=topo)
        torch.manual_seed(0)
        ref = ref_cls()
        torch.manual_seed(1)
        x_ref = torch.randn(2, 3, H, requires_grad=True)
        x = x_ref.detach().clone().requires_grad_(True)
        y, y_ref = layer(x), ref(x_ref)
        grad = torch.randn_like(y_ref)
        y.backward(grad)
        y_ref.backward(grad)
        check_layer_parity(layer, ref, [y], [y_ref], [x], [x_ref], topo.axis("tp").group)
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mlps_match_torch(tp):
    assert run_distributed(_mlp_parity, tp, tp, timeout_seconds=60) == [True] * tp


def _bad_mlp():
    topo = make_topology(model_parallel_size=2)
    try:
        ParallelSwiGLUMLP(H, 9, topology=topo)
        message = None
    except ValueError as e:
        message = str(e)
    # Keep every rank until all have built their subgroups (a fast rank leaving early can
    # close gloo connections a slow peer is still opening).
    torch.distributed.barrier()
    return message


@pytest.mark.distributed
def test_mlp_intermediate_not_divisible():
    msg = run_distributed(_bad_mlp, 2, timeout_seconds=60)[0]
    with pytest.raises(
        ValueError,
        match=r"ParallelSwiGLUMLP: model_parallel_size=2 does not divide intermediate_size=9; choose model_parallel_size in \[1, 3, 9\]",
    ):
        raise ValueError(msg)
