"""ZeRO-3 mechanics: storage freed between uses, prefetch of the next layer, refusals.

Numerical parity of ZeRO-3 with one process (DP=2, also with TP=2) is in test_parity.py.
"""

import os
import sys

import pytest
import torch

from scaling.nn import ParameterMeta, float8_supported
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from optim_models import model  # noqa: E402


def _lifecycle():
    topo = make_topology()
    layers, groups = model()
    full_bytes = sum(p.numel() * 4 for p in layers.parameters())
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=3),
        parameter_groups=groups,
        topology=topo,
        zero3_modules=[layers[0], layers[2]],
    )
    seen = {}

    def inside_first(module, args, output):
        # runs after the gatherer's own post-hook: layer 0 freed, layer 2 already prefetching
        seen["prefetching"] = sorted(opt.data_parallel.gatherer._pending)
        seen["first_freed"] = all(p.untyped_storage().nbytes() == 0 for p in layers[0].parameters())

    def inside_last(module, args):
        seen["last_whole"] = all(p.untyped_storage().nbytes() == p.numel() * 4 for p in layers[2].parameters())

    layers[0].register_forward_hook(inside_first)
    layers[2].register_forward_pre_hook(inside_last)
    stored = lambda: sum(p.untyped_storage().nbytes() for p in layers.parameters())  # noqa: E731
    after_init = stored()
    for _ in range(2):
        opt.zero_grad()
        opt.backward(layers(torch.randn(4, 6)).pow(2).mean())
        after_backward = stored()
        out = opt.step()
    shard_bytes = sum(s.param_shard.numel() * 4 for s in opt.slots)
    with opt.full_parameters():
        whole = stored()
    return after_init, after_backward, stored(), whole, full_bytes, shard_bytes, seen, out.step


@pytest.mark.distributed
def test_parameters_freed_between_uses_and_next_layer_prefetched():
    for init, backward, after_step, whole, full, shard, seen, steps in run_distributed(
        _lifecycle, 2, timeout_seconds=60
    ):
        assert init == backward == after_step == 0, "a ZeRO-3 parameter stayed whole outside its layer"
        assert whole == full and steps == 2
        assert shard == pytest.approx(full / 2, abs=4 * 4)  # each of 4 tensors pads at most one element
        assert seen == {"prefetching": [1], "first_freed": True, "last_whole": True}


def _reads_between_steps():
    topo = make_topology()
    layers, groups = model()
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=3),
        parameter_groups=groups,
        topology=topo,
        zero3_modules=[layers[0], layers[2]],
    )
    opt.zero_grad()
    opt.backward(layers(torch.randn(4, 6)).pow(2).mean())
    opt.step()
    weight = layers[0].weight
    # Metadata reads as a parameter's; the values are refused with the parameter named (it segfaulted).
    assert (weight.shape, weight.dtype, weight.requires_grad, weight.numel()) == (
        torch.Size([5, 6]),
        torch.float32,
        True,
        30,
    )
    with pytest.raises(RuntimeError, match=r"parameter 'layers.0.weight' is sharded by ZeRO-3 .* so norm cannot read it; "
                                           r"read it inside `with optimizer.full_parameters\(\):`"):  # fmt: skip
        weight.norm()
    with pytest.raises(RuntimeError, match="so __repr__ cannot read it"):
        repr(weight)
    with opt.full_parameters():
        inside = weight.norm().item()
        assert type(weight) is torch.nn.Parameter
    with pytest.raises(RuntimeError, match="sharded by ZeRO-3"):
        weight.sum()  # freed again after the context
    return inside


@pytest.mark.distributed
def test_a_parameter_read_between_steps_is_refused_by_name_and_whole_inside_full_parameters():
    norms = run_distributed(_reads_between_steps, 2, timeout_seconds=60)
    assert norms[0] == norms[1] > 0


def _refusals():
    topo = make_topology()
    layers, groups = model()
    opt = Optimizer(config=OptimizerConfig(zero_stage=3), parameter_groups=groups, topology=topo)
    with pytest.raises(RuntimeError, match=r"zero_stage=3 hooks into the model, and no model was attached"):
        opt.step()
    with pytest.raises(ValueError, match=r"Sequential does not name them \(it has no layer_modules\(\)\); pass zero3_"):
        opt.attach_model(layers)
    with pytest.raises(ValueError, match=r"parameters \['layers.2.weight', 'layers.2.bias'\] belong to none"):
        Optimizer(
            config=OptimizerConfig(zero_stage=3), parameter_groups=groups, topology=topo, zero3_modules=[layers[0]]
        )
    with pytest.raises(ValueError, match=r"zero3_modules is only used with zero_stage=3, got zero_stage=1"):
        Optimizer(
            config=OptimizerConfig(zero_stage=1), parameter_groups=groups, topology=topo, zero3_modules=list(layers)
        )
    with pytest.raises(ValueError, match=r"zero3_reshard_after_forward=False applies to zero_stage=3"):
        OptimizerConfig(zero_stage=2, zero3_reshard_after_forward=False)
    return True


@pytest.mark.distributed
def test_refusals():
    assert run_distributed(_refusals, 2, timeout_seconds=60) == [True, True]


def _hsdp_shards():
    topo = make_topology(data_parallel_shard_size=2)
    layers, groups = model()
    opt = Optimizer(config=OptimizerConfig(zero_stage=3), parameter_groups=groups, topology=topo, model=None)
    opt.attach_model([layers[0], layers[2]])
    opt.zero_grad()
    opt.backward(layers(torch.randn(4, 6, generator=torch.Generator().manual_seed(topo.axis("dp").rank))).sum())
    opt.step()
    owned = [(s.start, s.end) for s in opt.slots]
    shards = [s.param_shard.clone() for s in opt.slots]
    return topo.axis("dp_shard").rank, topo.axis("dp_replicate").rank, owned, shards


@pytest.mark.distributed
def test_hsdp_shards_over_the_shard_group_and_replicas_agree():
    results = run_distributed(_hsdp_shards, 4, timeout_seconds=60)
    assert [(r[0], r[1]) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    numels = [30, 5, 15, 3]  # Linear(6, 5) and Linear(5, 3): each rank owns half of each tensor
    for shard_rank, _, owned, _ in results:
        assert owned == [(min(shard_rank * -(-n // 2), n), min((shard_rank + 1) * -(-n // 2), n)) for n in numels]
    for a, b in ((0, 2), (1, 3)):  # the replicas of one shard hold the same values after the update
        for x, y in zip(results[a][3], results[b][3]):
            assert torch.equal(x, y)


def test_hsdp_refusals():
    from scaling.optim import check_sharding
    from scaling.topology import TopologyConfig

    four = dict(world_size=4, data_parallel_size=4)
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=3 does not divide data_parallel_size=4; choose"):
        TopologyConfig(**four, data_parallel_shard_size=3)
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=2 \(HSDP: .*\) needs optimizer.zero_stage=3, got"):
        check_sharding(OptimizerConfig(zero_stage=1), TopologyConfig(**four, data_parallel_shard_size=2))
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=1 shards nothing"):
        check_sharding(OptimizerConfig(zero_stage=3), TopologyConfig(**four, data_parallel_shard_size=1))
    check_sharding(OptimizerConfig(zero_stage=3), TopologyConfig(**four, data_parallel_shard_size=2))
    check_sharding(OptimizerConfig(zero_stage=1), TopologyConfig(**four, data_parallel_shard_size=4))


def _frozen():
    topo = make_topology()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    plain = [p.detach().clone() for p in layers.parameters()]
    layers[2].requires_grad_(False)  # a frozen base layer, as LoRA's
    for index, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            ParameterMeta(name, tuple(p.shape), layer_index=index).attach(p)
    trained = [(p.parameter_meta.key, p, p.parameter_meta) for p in layers[0].parameters()]
    groups = [OptimizerParamGroup(trained, OptimizerParamGroupConfig(name="all"))]
    opt = Optimizer(config=OptimizerConfig(zero_stage=3), parameter_groups=groups, topology=topo)
    opt.attach_model([layers[0], layers[2]])
    frozen_bytes = lambda: sum(p.untyped_storage().nbytes() for p in layers[2].parameters())  # noqa: E731
    seen = {"init": frozen_bytes()}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(topo.axis("dp").rank))
    opt.zero_grad()
    out = layers(x).pow(2).mean()
    seen["after_forward"] = frozen_bytes()
    opt.backward(out)
    seen["after_backward"] = frozen_bytes()  # freed by the hook on the layer's inputs
    opt.step()
    with opt.full_parameters():
        frozen_kept = all(torch.equal(p, q) for p, q in zip(layers[2].parameters(), plain[2:]))
    return seen, frozen_kept, [s.name for s in opt.data_parallel.gatherer.frozen]


@pytest.mark.distributed
def test_frozen_parameters_are_sharded_and_freed_after_their_backward():
    for seen, frozen_kept, names in run_distributed(_frozen, 2, timeout_seconds=60):
        assert seen == {"init": 0, "after_forward": 0, "after_backward": 0}
        assert frozen_kept and names == ["layers.2.weight", "layers.2.bias"]


def _offload_overlap():
    import scaling.optim._optimizer as optimizer_module

    topo = make_topology()
    runs = {}
    for offload in (False, True):
        layers, groups = model()
        opt = Optimizer(
            config=OptimizerConfig(zero_stage=3, cpu_offload=offload),
            parameter_groups=groups,
            topology=topo,
            zero3_modules=[layers[0], layers[2]],
        )
        in_flight = []
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + topo.axis("dp").rank))
            opt.backward(layers(x).pow(2).mean())
            opt.step()
            in_flight.append(opt.data_parallel._host_update.in_flight)  # handed to a thread, not waited for
        with opt.full_parameters():
            runs[offload] = ([p.detach().clone() for p in layers.parameters()], in_flight)

    def boom(*args, **kwargs):
        raise RuntimeError("host update failed")

    real, optimizer_module.apply_updates = optimizer_module.apply_updates, boom
    try:
        opt.zero_grad()
        opt.backward(layers(torch.randn(4, 6)).sum())
        opt.step()
        with pytest.raises(RuntimeError, match="host update failed"):
            opt.finish_parameter_gather()  # the thread's error, on the caller's thread
    finally:
        optimizer_module.apply_updates = real
    return runs


@pytest.mark.distributed
def test_offloaded_zero3_update_overlaps_the_next_step_and_matches():
    for runs in run_distributed(_offload_overlap, 2, timeout_seconds=60):
        (plain, plain_flight), (offloaded, flight) = runs[False], runs[True]
        assert plain_flight == [False] * 3 and flight == [True] * 3
        for a, b in zip(plain, offloaded):
            assert torch.equal(a, b)


def _offload_per_layer():
    """Three ZeRO-3 layers with offload; the host update of the last one waits until the next
    step's forward has run the first layer: that forward must not wait for the whole update."""
    import time

    import scaling.optim._optimizer as optimizer_module

    topo = make_topology()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(3)])
    for index, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            ParameterMeta(name, tuple(p.shape), layer_index=index).attach(p)
    triples = [(p.parameter_meta.key, p, p.parameter_meta) for p in layers.parameters()]
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=3, cpu_offload=True),
        parameter_groups=[OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="all"))],
        topology=topo,
        zero3_modules=list(layers),
    )
    first_layer_forwards = []
    layers[0].register_forward_hook(lambda *args: first_layer_forwards.append(1))
    last_weight = opt.slots[-2].work_param()  # layers[2].weight's host master
    released = []
    real = optimizer_module.apply_updates

    def update_last_layer_after_the_next_first_forward(config, items, step, *rest):
        if any(item.param is last_weight for item in items):
            deadline = time.monotonic() + 5
            while len(first_layer_forwards) <= step and time.monotonic() < deadline:
                time.sleep(0.01)
            released.append(len(first_layer_forwards) > step)
        real(config, items, step, *rest)

    optimizer_module.apply_updates = update_last_layer_after_the_next_first_forward
    try:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(topo.axis("dp").rank))
        for _ in range(2):
            opt.zero_grad()
            opt.backward(layers(x).pow(2).mean())
            opt.step()
        layers(x)  # the third forward releases the second update
        opt.finish_parameter_gather()
    finally:
        optimizer_module.apply_updates = real
    return released, opt.data_parallel._host_update.layers


@pytest.mark.distributed
def test_offloaded_update_of_a_layer_overlaps_the_next_forward_of_earlier_layers():
    for released, by_layer in run_distributed(_offload_per_layer, 2, timeout_seconds=60):
        assert by_layer == [[0, 1], [2, 3], [4, 5]]  # slots (weight, bias) by layer, in forward order
        # Each step's update of the last layer ran while the next forward ran the first layer
        # (a forward waiting for the whole update would have held it until the 5 s deadline).
        assert released == [True, True]


def _float8_all_gather(all_gather, offload=False):
    """ZeRO-3 at DP 2 over two float8 linears (32 x 32): with ``all_gather`` their weights travel in float8."""
    from scaling.nn import ColumnParallelLinear, Float8Config, RowParallelLinear, enable_float8, set_layer_index

    topo = make_topology()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(ColumnParallelLinear(32, 32), torch.nn.Tanh(), RowParallelLinear(32, 32))
    for index in (0, 2):
        set_layer_index(layers[index], index)
    enable_float8(layers, Float8Config(enabled=True, min_features=16, all_gather=all_gather))
    full = layers[0].weight.detach().clone()
    triples = [(p.parameter_meta.key, p, p.parameter_meta) for p in layers.parameters()]
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=3, cpu_offload=offload),
        parameter_groups=[OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="all"))],
        topology=topo,
        zero3_modules=[layers[0], layers[2]],
    )
    seen = {}

    def first_gather(module, args):
        seen.setdefault("gathered", module.weight.detach().clone())
        held = module.float8_weight  # what the products use under float8 all-gathers
        seen.setdefault("held", None if held is None else held.tensor.float() * held.inverse)

    layers[0].register_forward_pre_hook(first_gather)
    losses = []
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1 + topo.axis("dp").rank))
    for _ in range(3):
        opt.zero_grad()
        loss = layers(x).pow(2).mean()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    nbytes, calls, amax_reductions = (
        opt.data_parallel.gatherer.sent_bytes,
        opt.data_parallel.gatherer.gathers,
        opt.data_parallel.gatherer.amax_reductions,
    )
    held = layers[0].float8_weight
    with torch.no_grad():
        gathered_out = layers(x)
        with opt.full_parameters():  # exact gathers; a forward here quantises the exact weights alike
            exact = layers[0].weight.detach().clone()
            shards = [torch.zeros_like(opt.slots[0].param_shard) for _ in range(2)]
            torch.distributed.all_gather(shards, opt.slots[0].param_shard, group=topo.axis("dp").group)
            whole_out = layers(x)
    scale = torch.finfo(torch.float8_e4m3fn).max / full.abs().max()
    float8_grid = (full * scale).to(torch.float8_e4m3fn).float() * scale.reciprocal()
    return {
        "losses": losses,
        "bytes": nbytes,
        "calls": calls,
        "amax_reductions": amax_reductions,
        "first_gather_is_float8": torch.equal(seen["gathered"], float8_grid),
        "first_gather_is_exact": torch.equal(seen["gathered"], full),
        "products_use_the_gathered_float8": seen["held"] is not None and torch.equal(seen["held"], float8_grid),
        "float8_freed_after_step": held is None or held.tensor.untyped_storage().nbytes() == 0,
        "forward_on_exact_weights_equal": torch.equal(gathered_out, whole_out),
        "full_parameters_exact": torch.equal(exact.view(-1), torch.cat(shards)[: exact.numel()]),
    }


@pytest.mark.distributed
@pytest.mark.slow  # two 2-rank runs: the quick tier stays under 2 minutes
@pytest.mark.skipif(float8_supported(torch.device("cpu")) is not None, reason="no float8 products on CPU here")
def test_float8_all_gather_sends_one_byte_per_weight_element_and_trains_alike():
    plain, float8, offloaded = (
        run_distributed(_float8_all_gather, 2, *flags, timeout_seconds=120)[0]
        for flags in ((False,), (True,), (True, True))
    )
    # What travels: the first gather is the float8 weight (one global scale), not the weight itself.
    assert float8["first_gather_is_float8"] and not float8["first_gather_is_exact"]
    assert plain["first_gather_is_exact"]
    # Per gather of a layer, a rank sends its 512 weight elements and 16 bias elements: 4 bytes
    # each (2112) or, in float8, 1 byte per weight element (576); the same gathers in both runs.
    assert plain["calls"] == float8["calls"] and plain["bytes"] % 2112 == 0
    assert float8["bytes"] == plain["bytes"] // 2112 * 576
    # The weights' scales: one all-reduce per step for both layers, not one per gather (12 here).
    assert float8["calls"] == 12 and float8["amax_reductions"] == 3 and plain["amax_reductions"] == 0
    # The products take the gathered float8 weight as it is (no second quantisation); it holds
    # the bytes the bf16 gather's products quantise the whole weight to: the same training, bit
    # for bit. Its memory is freed with the layer.
    assert float8["products_use_the_gathered_float8"] and not plain["products_use_the_gathered_float8"]
    assert float8["losses"] == plain["losses"] and float8["float8_freed_after_step"]
    # A forward on layers made whole exactly (inside full_parameters()) quantises them to the same bytes.
    assert float8["forward_on_exact_weights_equal"] and plain["forward_on_exact_weights_equal"]
    # full_parameters() (checkpoints) gathers the exact weights, never the float8 ones.
    assert float8["full_parameters_exact"] and plain["full_parameters_exact"]
    # With cpu_offload the scales wait for the whole host update (they read every weight's
    # shard), then the same bytes travel: the same losses, bit for bit.
    assert offloaded["losses"] == float8["losses"] and offloaded["amax_reductions"] == 3
