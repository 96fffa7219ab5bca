"""Every tensor-parallel layer builds from its axis (``tp=topology.axis("tp")``, ``device=``) as it
does from the walkthrough's ``topology=`` (#48): the same parameters, metas and outputs."""

import pytest
import torch

from scaling.nn import (
    BottleneckAdapter,
    ColumnParallelLinear,
    LayerNorm,
    ParallelMLP,
    ParallelSwiGLUMLP,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_parameter_meta,
)
from scaling.testing import make_topology, run_distributed
from scaling.topology import Topology, TopologyConfig

HIDDEN = 8
LAYERS = {
    "column": (lambda **kw: ColumnParallelLinear(HIDDEN, 12, **kw), lambda: torch.randn(3, HIDDEN)),
    "row": (lambda **kw: RowParallelLinear(12, HIDDEN, parallel_input=False, **kw), lambda: torch.randn(3, 12)),
    "embedding": (lambda **kw: VocabParallelEmbedding(10, HIDDEN, **kw), lambda: torch.randint(0, 10, (2, 5))),
    "layernorm": (lambda **kw: LayerNorm(HIDDEN, **kw), lambda: torch.randn(3, HIDDEN)),
    "rmsnorm": (lambda **kw: RMSNorm(HIDDEN, **kw), lambda: torch.randn(3, HIDDEN)),
    "mlp": (lambda **kw: ParallelMLP(HIDDEN, 16, **kw), lambda: torch.randn(3, HIDDEN)),
    "swiglu": (lambda **kw: ParallelSwiGLUMLP(HIDDEN, 16, **kw), lambda: torch.randn(3, HIDDEN)),
    "adapter": (lambda **kw: BottleneckAdapter(HIDDEN, 4, **kw), lambda: torch.randn(3, HIDDEN)),
}


def _state(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, object]:
    params = {name: p.detach().clone() for name, p in layer.named_parameters()}
    metas = {name: get_parameter_meta(p) for name, p in layer.named_parameters()}
    return {"params": params, "metas": metas, "out": layer(x).detach()}


def _both_ways(name: str) -> tuple[dict[str, object], dict[str, object]]:
    topo = make_topology(model_parallel_size=2)
    build, data = LAYERS[name]
    torch.manual_seed(1)
    x = data()
    torch.manual_seed(0)
    from_topology = _state(build(topology=topo), x)
    torch.manual_seed(0)
    from_axis = _state(build(tp=topo.axis("tp"), device=topo.device), x)
    return from_topology, from_axis


@pytest.mark.distributed
def test_every_tensor_parallel_layer_builds_from_its_axis():
    for name in LAYERS:
        for rank, (a, b) in enumerate(run_distributed(_both_ways, 2, name, timeout_seconds=120)):
            assert a["metas"] == b["metas"], (name, rank)
            for key in a["params"]:
                assert torch.equal(a["params"][key], b["params"][key]), (name, rank, key)
            assert torch.equal(a["out"], b["out"]), (name, rank)


def test_topology_with_an_axis_is_refused_by_name():
    topo = Topology(TopologyConfig(world_size=1, device="cpu"), 0)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: topology= and tp= are both given; pass the topology"):
        ColumnParallelLinear(4, 4, topology=topo, tp=topo.axis("tp"))
    with pytest.raises(ValueError, match=r"RMSNorm: topology= and device= are both given"):
        RMSNorm(4, topology=topo, device="cpu")
    # One rank's axis (or none) is one device: the layer is a plain one there.
    layer = RowParallelLinear(4, 4, tp=topo.axis("tp"), device="cpu")
    assert layer.weight.shape == (4, 4) and layer.weight.device == torch.device("cpu")
