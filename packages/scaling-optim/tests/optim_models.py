"""A small model for the optimizer's tests: two linears with their metas, in one parameter group."""

import torch

from scaling.nn import ParameterMeta
from scaling.optim import OptimizerParamGroup, OptimizerParamGroupConfig


def model() -> tuple[torch.nn.Sequential, list[OptimizerParamGroup]]:
    """``Linear(6, 5), Tanh, Linear(5, 3)`` (seeded) and one group ``"all"`` over its parameters."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    for index, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            ParameterMeta(name, tuple(p.shape), layer_index=index).attach(p)
    triples = [(p.parameter_meta.key, p, p.parameter_meta) for p in layers.parameters()]
    return layers, [OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="all"))]
