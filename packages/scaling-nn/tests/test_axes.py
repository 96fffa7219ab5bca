"""Every tensor-parallel layer builds from its axis (``tp=topology.axis("tp")``, ``device=``) as it
does from the walkthrough's ``topology=`` (#48): the same parameters, metas and outputs. Attention
(tp, cp) and MoE (tp, ep, cp, dp_cp) take a small config plus their axes the same way."""

import pytest
import torch

from scaling.nn import (
    AttentionConfig,
    BottleneckAdapter,
    ColumnParallelLinear,
    LayerNorm,
    MoEConfig,
    ParallelMLP,
    ParallelMoE,
    ParallelSelfAttention,
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


#: name: (build from keywords, input, the axes it takes, topology sizes over 4 ranks)
BLOCKS = {
    "attention": (
        lambda **kw: ParallelSelfAttention(AttentionConfig(HIDDEN, 4, num_kv_heads=2, qk_norm=True), **kw),
        lambda: torch.randn(2, 4, HIDDEN),
        ("tp", "cp"),
        dict(model_parallel_size=2, context_parallel_size=2),
    ),
    "moe": (
        lambda **kw: ParallelMoE(MoEConfig(HIDDEN, 16, num_experts=4, num_shared_experts=1), **kw),
        lambda: torch.randn(2, 3, HIDDEN),
        ("tp", "ep", "cp", "dp_cp"),
        dict(model_parallel_size=2, expert_parallel_size=2),
    ),
}


def _block_both_ways(name: str) -> tuple[dict[str, object], dict[str, object]]:
    build, data, axes, sizes = BLOCKS[name]
    topo = make_topology(**sizes)
    torch.manual_seed(1 + topo.axis("dp_cp").rank)  # each data-parallel rank its own tokens
    x = data()
    torch.manual_seed(0)
    from_topology = _state(build(topology=topo), x)
    torch.manual_seed(0)
    from_axes = _state(build(device=topo.device, **{axis: topo.axis(axis) for axis in axes}), x)
    torch.distributed.barrier()
    return from_topology, from_axes


@pytest.mark.distributed
@pytest.mark.parametrize("name", BLOCKS)
def test_attention_and_moe_build_from_their_axes(name):
    for rank, (a, b) in enumerate(run_distributed(_block_both_ways, 4, name, timeout_seconds=120)):
        assert a["metas"] == b["metas"], rank
        assert a["params"].keys() == b["params"].keys(), rank
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), (rank, key)
        assert torch.equal(a["out"], b["out"]), rank


def test_topology_with_an_axis_is_refused_by_name():
    topo = Topology(TopologyConfig(world_size=1, device="cpu"), 0)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: topology= and tp= are both given; pass the topology"):
        ColumnParallelLinear(4, 4, topology=topo, tp=topo.axis("tp"))
    with pytest.raises(ValueError, match=r"RMSNorm: topology= and device= are both given"):
        RMSNorm(4, topology=topo, device="cpu")
    with pytest.raises(ValueError, match=r"ParallelSelfAttention: topology= and cp= are both given"):
        ParallelSelfAttention(AttentionConfig(8, 2), topology=topo, cp=topo.axis("cp"))
    with pytest.raises(ValueError, match=r"ParallelMoE: topology= and ep= are both given"):
        ParallelMoE(MoEConfig(8, 8, 2), topology=topo, ep=topo.axis("ep"))
    with pytest.raises(ValueError, match=r"ParallelMoE: topology= and device= are both given"):
        ParallelMoE(MoEConfig(8, 8, 2), topology=topo, device="cpu")
    # One rank's axis (or none) is one device: the layer is a plain one there.
    layer = RowParallelLinear(4, 4, tp=topo.axis("tp"), device="cpu")
    assert layer.weight.shape == (4, 4) and layer.weight.device == torch.device("cpu")
