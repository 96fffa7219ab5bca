"""Parity helpers shared by the scaling-nn tests (imported by path; not a test module).

"Within 1e-6 relative" means ``|actual - expected| <= 1e-6 * (|expected| + max|expected|)``
element-wise: relative to each element, with the tensor's scale as the floor, because
sums reordered across ranks can leave a tiny absolute error on elements near zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scaling.nn import get_parameter_meta
from scaling.testing import assert_parity

RTOL = 1e-6


def close(actual: torch.Tensor, expected: torch.Tensor, name: str, rtol: float = RTOL) -> None:
    expected = expected.detach()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    assert_parity(actual.detach(), expected, rtol=rtol, atol=rtol * scale, name=name)


def full_tensor(param: torch.Tensor, group, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The unsharded value of ``tensor`` (default: ``param``) laid out like ``param``'s meta says."""
    meta = get_parameter_meta(param)
    t = (param if tensor is None else tensor).detach()
    if meta.parallel_dim is None or group is None or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    full = torch.cat(parts, dim=meta.parallel_dim)
    return full.narrow(meta.parallel_dim, 0, meta.logical_shape[meta.parallel_dim])


def check_layer_parity(layer, ref, outputs, ref_outputs, inputs, ref_inputs, group, rtol: float = RTOL) -> None:
    """Compare outputs, input grads and every parameter and its grad of ``layer`` (sharded) with ``ref``."""
    for i, (o, e) in enumerate(zip(outputs, ref_outputs)):
        close(o, e, f"output[{i}]", rtol)
    for i, (x, e) in enumerate(zip(inputs, ref_inputs)):
        if e.grad is not None:
            close(x.grad, e.grad, f"input_grad[{i}]", rtol)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in layer.named_parameters()]
    assert sorted(names) == sorted(ref_params), (names, list(ref_params))
    for name, p in layer.named_parameters():
        close(full_tensor(p, group), ref_params[name], f"param {name}", rtol)
        close(full_tensor(p, group, p.grad), ref_params[name].grad, f"grad {name}", rtol)
