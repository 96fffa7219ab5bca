"""A tiny hand-sharded 'model' and 'optimizer state' for checkpoint tests.

Four layers, each with a column-split weight and bias (TP dim 0) and a replicated
norm weight. ``stage_layers`` emulates a pipeline split by giving each stage a subset.
"""

from __future__ import annotations

import torch

from scaling.nn import ParameterMeta
from scaling.trainer.checkpoint import model_state_dict

NUM_LAYERS = 4
SHAPES = {"linear.weight": ((8, 4), 0), "linear.bias": ((8,), 0), "norm.weight": ((4,), None)}


def full_tensors() -> dict[str, torch.Tensor]:
    """The unsharded values: random with a fixed seed, so a bitwise compare means something."""
    gen = torch.Generator().manual_seed(1234)
    out = {}
    for i in range(NUM_LAYERS):
        for name, (shape, _) in SHAPES.items():
            out[f"layers.{i}.{name}"] = torch.randn(shape, generator=gen)
    return out


def stage_layers(pp_rank: int, pp_size: int) -> list[int]:
    per = NUM_LAYERS // pp_size
    return list(range(pp_rank * per, (pp_rank + 1) * per))


def build_params(tp_rank: int, tp_size: int, layers: list[int], fill: bool = True) -> list:
    """``(name, param, meta)`` for ``layers``, sharded by hand for ``tp_rank``; zeros if not ``fill``."""
    full = full_tensors()
    out = []
    for i in layers:
        for name, (shape, dim) in SHAPES.items():
            meta = ParameterMeta(name, shape, parallel_dim=dim, model_parallel_size=tp_size, layer_index=i)
            value = full[meta.key]
            if dim is not None and tp_size > 1:
                value = value.chunk(tp_size, dim)[tp_rank]
            p = torch.nn.Parameter(value.clone() if fill else torch.zeros_like(value))
            out.append((meta.key, meta.attach(p), meta))
    return out


def optimizer_state(params: list, topology, fill: bool = True) -> dict:
    """An Adam-like state of DTensors with the parameters' placements, plus scalars."""
    model = model_state_dict([(n, p * 2 if fill else torch.zeros_like(p), m) for n, p, m in params], topology)
    return {"state": {k: {"exp_avg": v} for k, v in model.items()}, "step": 7 if fill else 0, "lr": 0.5}


def gather_full(state: dict, topology) -> dict[str, torch.Tensor]:
    """Full tensors of a ``{key: DTensor}`` dict (collective over TP)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}
