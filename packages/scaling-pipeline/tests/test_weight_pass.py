"""The zero-bubble weight pass starts where the parameters' paths leave the input chain: the input
pass's work is not done twice, and the gradients equal a whole backward's, bitwise."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaling.pipeline._weight_pass import WeightPass


class _Operators(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _split(model: torch.nn.Module, x: torch.Tensor, forward=None):  # type: ignore[no-untyped-def]
    """A whole backward's gradients, then the input pass and the weight pass's (with their operators)."""
    params = list(model.parameters())
    out = (forward or model)(x)
    grad = torch.randn_like(out)
    inputs = [x] if x.requires_grad else []
    whole = torch.autograd.grad(out, inputs + params, grad, retain_graph=True, allow_unused=True)
    weights = WeightPass([out], inputs, params)
    with _Operators() as input_ops:
        got = torch.autograd.grad([out], inputs, [grad], retain_graph=True) if inputs else ()
    weights.stop_capturing()
    with _Operators() as weight_ops:
        weights.run([out], [grad])
    return whole, list(got), [p.grad for p in params], input_ops.names, weight_ops.names, weights


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )


def test_the_weight_pass_runs_only_the_weights_products_and_matches_a_whole_backward_bitwise():
    x = torch.randn(5, 8, requires_grad=True)
    whole, got, grads, input_ops, weight_ops, weights = _split(_mlp(), x)
    assert torch.equal(got[0], whole[0])
    assert all(torch.equal(g, w) for g, w in zip(grads, whole[1:]))
    assert not weights.replay
    assert input_ops.count("mm.default") == 3 and "tanh_backward.default" in input_ops  # each layer's dX
    assert weight_ops.count("mm.default") == 3  # each weight's dW
    assert "tanh_backward.default" not in weight_ops  # and not the input chain again


def test_a_weight_used_twice_is_one_group_whose_junctions_are_not_counted_twice():
    torch.manual_seed(0)
    shared = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    whole, _, grads, _, weight_ops, _ = _split(shared, x, forward=lambda t: shared(torch.tanh(shared(t))))
    assert all(torch.allclose(g, w, rtol=0, atol=1e-6) for g, w in zip(grads, whole[1:]))


def test_without_an_input_needing_a_gradient_the_weight_pass_is_the_whole_backward():
    x = torch.randn(5, 8)  # the first stage's input: token ids, or data
    whole, got, grads, input_ops, _, weights = _split(_mlp(), x)
    assert weights.replay and got == [] and input_ops == []
    assert all(torch.equal(g, w) for g, w in zip(grads, whole))


def test_a_parameter_whose_gradient_bypasses_the_input_chain_falls_back_to_the_whole_backward():
    torch.manual_seed(0)
    model = _mlp()
    offset = torch.nn.Parameter(torch.randn(4))
    model.register_parameter("offset", offset)
    x = torch.randn(5, 8, requires_grad=True)
    whole, _, grads, _, _, weights = _split(model, x, forward=lambda t: model(t) * offset.exp())
    assert not weights.replay  # offset meets the chain at the product with the model's output
    assert all(torch.allclose(g, w, rtol=0, atol=1e-6) for g, w in zip(grads, whole[1:]))
    # A second output that only a parameter makes (an auxiliary term): its gradient never meets the
    # input chain, so the weight pass is the whole backward.
    torch.manual_seed(0)
    model = _mlp()
    aux = torch.nn.Parameter(torch.randn(4))
    params = [*model.parameters(), aux]
    roots = [model(x), aux * 2]
    grads_out = [torch.randn(5, 4), torch.randn(4)]
    whole = torch.autograd.grad(roots, params, grads_out, retain_graph=True)
    weights = WeightPass(roots, [x], params)
    torch.autograd.grad(roots, [x], grads_out, retain_graph=True)
    weights.stop_capturing()
    assert weights.replay
    weights.run(roots, grads_out)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, whole))


def test_the_weight_pass_accumulates_into_grad_and_runs_post_accumulate_hooks():
    model = _mlp()
    seen: list[torch.Tensor] = []
    for p in model.parameters():
        p.grad = torch.ones_like(p)
        p.register_post_accumulate_grad_hook(seen.append)
    x = torch.randn(5, 8, requires_grad=True)
    whole, _, grads, _, _, _ = _split(model, x)
    assert len(seen) == len(list(model.parameters()))
    assert all(torch.equal(g, w + 1) for g, w in zip(grads, whole[1:]))
