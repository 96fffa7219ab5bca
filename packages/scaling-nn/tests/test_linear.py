"""ColumnParallelLinear / RowParallelLinear: init, metas, and TP parity against torch.nn.Linear."""

import os
import sys

import pytest
import torch

from scaling.nn import ColumnParallelLinear, RowParallelLinear, get_parameter_meta
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import check_layer_parity, close  # noqa: E402

IN, OUT = 8, 12


def test_tp1_initialisation_equals_torch_linear():
    for cls in (ColumnParallelLinear, RowParallelLinear):
        torch.manual_seed(5)
        layer = cls(IN, OUT)
        torch.manual_seed(5)
        ref = torch.nn.Linear(IN, OUT)
        assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)


def test_dtype_and_custom_init():
    layer = ColumnParallelLinear(IN, OUT, dtype=torch.float64, init_method=torch.nn.init.ones_, bias=False)
    assert layer.weight.dtype == torch.float64 and bool((layer.weight == 1).all()) and layer.bias is None
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype"):
        RowParallelLinear(IN, OUT, dtype=torch.int64)


CASES = [("column", True, True), ("column", False, True), ("row", True, True), ("row", False, True)]
CASES += [("column", True, False), ("row", True, False)]


def _linear_parity_all(tp):
    topo = make_topology(model_parallel_size=tp)
    return [_linear_parity(topo, tp, *case) for case in CASES]


def _linear_parity(topo, tp, kind, flag, bias):
    group = topo.axis("tp").group
    torch.manual_seed(0)
    if kind == "column":
        layer = ColumnParallelLinear(IN, OUT, bias=bias, parallel_output=flag, topology=topo)
    else:
        layer = RowParallelLinear(IN, OUT, bias=bias, parallel_input=flag, topology=topo)
    torch.manual_seed(0)
    ref = torch.nn.Linear(IN, OUT, bias=bias)
    torch.manual_seed(1)
    x_ref = torch.randn(3, 5, IN, requires_grad=True)
    grad_out = torch.randn(3, 5, OUT)
    y_ref = ref(x_ref)
    y_ref.backward(grad_out)
    rank = topo.axis("tp").rank
    x = x_ref.detach().clone()
    if kind == "row" and flag:  # input arrives split over TP
        x = x.chunk(tp, dim=-1)[rank].contiguous()
    x.requires_grad_(True)
    y = layer(x)
    expected_y, g = y_ref, grad_out
    if kind == "column" and flag:  # output stays split over TP
        expected_y, g = y_ref.chunk(tp, dim=-1)[rank], grad_out.chunk(tp, dim=-1)[rank]
    y.backward(g.contiguous())
    expected_x = x_ref if not (kind == "row" and flag) else None
    if expected_x is None:
        close(x.grad, x_ref.grad.chunk(tp, dim=-1)[rank], "input_grad")
    check_layer_parity(layer, ref, [y], [expected_y], [x], [expected_x] if expected_x is not None else [], group)
    meta = get_parameter_meta(layer.weight)
    return meta.parallel_dim, meta.model_parallel_size, meta.logical_shape, tuple(layer.weight.shape)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_linear_matches_torch_linear(tp):
    """Forward, input grad, weight and bias grads for both layers, both flags, with and without bias."""
    out = run_distributed(_linear_parity_all, tp, tp, timeout_seconds=60)
    expected = []
    for kind, _, _ in CASES:
        dim = 0 if kind == "column" else 1
        shape = (OUT // tp, IN) if kind == "column" else (OUT, IN // tp)
        expected.append((dim, tp, (OUT, IN), shape))
    assert out == [expected] * tp


def _bad_size(tp):
    topo = make_topology(model_parallel_size=tp)
    errors = []
    for cls, field in ((ColumnParallelLinear, "out_features"), (RowParallelLinear, "in_features")):
        try:
            cls(9, 9, topology=topo)
        except ValueError as e:
            errors.append((field, str(e)))
    # Keep every rank until all have built their subgroups (a fast rank leaving early can
    # close gloo connections a slow peer is still opening).
    torch.distributed.barrier()
    return errors


@pytest.mark.distributed
def test_not_divisible_names_value_and_choices():
    errors = run_distributed(_bad_size, 2, 2, timeout_seconds=60)[0]
    assert [f for f, _ in errors] == ["out_features", "in_features"]
    for field, msg in errors:
        with pytest.raises(
            ValueError,
            match=rf"model_parallel_size=2 does not divide {field}=9; choose model_parallel_size in \[1, 3, 9\]",
        ):
            raise ValueError(msg)
