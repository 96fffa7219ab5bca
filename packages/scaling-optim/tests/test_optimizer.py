"""Optimizer behaviour on real gloo ranks: SGD parity, frozen parameters, non-finite policy,
loss scaling, grad norm over TP/PP with replicas and tied copies, state round trip, errors."""

import gc
import math
import weakref

import pytest
import torch
import torch.distributed as dist

from scaling.nn import ParameterMeta
from scaling.optim import (
    LossScalerConfig,
    Optimizer,
    OptimizerConfig,
    OptimizerParamGroup,
    OptimizerParamGroupConfig,
)
from scaling.testing import assert_parity, make_topology, run_distributed


def make_params(dtype=torch.float32, frozen=False):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter((torch.randn(4, 3, generator=g) * 0.5).to(dtype))
    b = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    ParameterMeta("w", (4, 3), layer_index=0).attach(w)
    ParameterMeta("b", (3,), layer_index=0).attach(b)
    b.requires_grad_(not frozen)
    return w, b


def group(*params, wd=0.0):
    return OptimizerParamGroup(
        [(p.parameter_meta.key, p, p.parameter_meta) for p in params],
        OptimizerParamGroupConfig(name="g", weight_decay=wd),
    )


def data(step, rows=4):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)


def loss_fn(w, b, x, y):
    return ((x.to(w.dtype) @ w + b).float() - y).pow(2).mean()


def _sgd(zero, steps):
    topo = make_topology()
    w, b = make_params()
    opt = Optimizer(
        config=OptimizerConfig(method="sgd", momentum=0.9, zero_stage=zero),
        parameter_groups=[group(w, b, wd=0.01)],
        topology=topo,
    )
    dp, r = topo.axis("dp").size, topo.axis("dp").rank
    for step in range(steps):
        x, y = data(step)
        rows = x.shape[0] // dp
        opt.zero_grad()
        opt.backward(loss_fn(w, b, x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]))
        opt.step()
    return w.detach(), b.detach()


@pytest.mark.distributed
def test_sgd_momentum_matches_torch_on_dp2_zero1():
    w, b = make_params()
    ref = torch.optim.SGD([w, b], lr=1e-4, momentum=0.9, weight_decay=0.01, foreach=False)
    for step in range(4):
        ref.zero_grad()
        loss_fn(w, b, *data(step)).backward()
        ref.step()
    for got in run_distributed(_sgd, 2, 1, 4, timeout_seconds=180):
        assert_parity(list(got), [w.detach(), b.detach()], rtol=1e-6, atol=1e-9)


def _frozen_and_state_round_trip(zero):
    topo = make_topology()
    w, b = make_params(frozen=True)
    b0 = b.detach().clone()
    config = OptimizerConfig(zero_stage=zero)
    opt = Optimizer(config=config, parameter_groups=[group(w, b)], topology=topo)
    for step in range(5):
        if step == 3:  # restart from a checkpoint of step 3 into fresh objects
            state = opt.state_dict()
            saved_w = w.detach().clone()
            w, b = make_params(frozen=True)
            with torch.no_grad():
                w.copy_(saved_w)
            opt = Optimizer(config=config, parameter_groups=[group(w, b)], topology=topo)
            opt.load_state_dict(state)
        opt.zero_grad()
        opt.backward(loss_fn(w, b, *data(step)))
        opt.step()
    assert torch.equal(b.detach(), b0), "a frozen parameter changed"
    assert sorted(state["params"]) == ["layers.0.w"], "a frozen parameter has optimizer state"
    return w.detach()


def _straight(zero):
    topo = make_topology()
    w, b = make_params(frozen=True)
    opt = Optimizer(config=OptimizerConfig(zero_stage=zero), parameter_groups=[group(w, b)], topology=topo)
    for step in range(5):
        opt.zero_grad()
        opt.backward(loss_fn(w, b, *data(step)))
        opt.step()
    return w.detach()


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 2])
def test_frozen_parameters_and_state_round_trip_are_bitwise(zero):
    resumed = run_distributed(_frozen_and_state_round_trip, 2, zero, timeout_seconds=60)
    straight = run_distributed(_straight, 2, zero, timeout_seconds=60)
    assert_parity(resumed, straight, bitwise=True)


def _non_finite(policy, where):
    topo = make_topology()
    w, b = make_params()
    opt = Optimizer(
        config=OptimizerConfig(non_finite_policy=policy, zero_stage=1), parameter_groups=[group(w, b)], topology=topo
    )
    before = (w.detach().clone(), b.detach().clone())
    loss = loss_fn(w, b, *data(0))
    if dist.get_rank() == 1 and where == "loss":
        loss = loss * float("nan")
    if dist.get_rank() == 1 and where == "grad":
        # an inf in one element of one rank's gradient, produced inside backward
        w.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    opt.backward(loss)
    try:
        out = opt.step()
    except FloatingPointError as err:
        return "raised", str(err)
    unchanged = torch.equal(w, before[0]) and torch.equal(b, before[1])
    return out.skipped, unchanged, out.step, out.global_grad_norm


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["loss", "grad"])
def test_non_finite_policy_same_action_on_every_rank(where):
    for result in run_distributed(_non_finite, 2, "skip", where, timeout_seconds=60):
        assert result == (True, True, 0, None)
    for verdict, message in run_distributed(_non_finite, 2, "fail", where, timeout_seconds=60):
        assert verdict == "raised" and "non-finite loss or gradient at step 1" in message


def _fp16_loss_scaler():
    topo = make_topology()
    w, b = make_params(torch.float16)
    config = OptimizerConfig(
        zero_stage=1, loss_scaler=LossScalerConfig(enable=True, initial_scale=2.0**10, window=2, hysteresis=1)
    )
    opt = Optimizer(config=config, parameter_groups=[group(w, b)], topology=topo)
    trace = []
    for step in range(5):
        opt.zero_grad()
        loss = loss_fn(w, b, *data(step))
        if step == 2 and dist.get_rank() == 0:
            loss = loss * 1e4  # scaled by 2^10 its fp16 gradients overflow, on rank 0 only
        before = (w.detach().clone(), b.detach().clone(), opt.state_dict())
        opt.backward(loss)
        out = opt.step()
        after = (w.detach().clone(), b.detach().clone(), opt.state_dict())
        same = all(torch.equal(x, y) for x, y in zip(before[:2], after[:2]))
        state_same = all(
            torch.equal(before[2]["params"][k][n].to_local(), after[2]["params"][k][n].to_local())
            for k in after[2]["params"]
            for n in ("master", "exp_avg", "exp_avg_sq")
        )
        trace.append((out.overflow, out.current_loss_scale, same, state_same, w.dtype, opt.slots[0].master.dtype))
    return trace


@pytest.mark.distributed
def test_fp16_overflow_skips_bitwise_shrinks_and_grows():
    for trace in run_distributed(_fp16_loss_scaler, 2, timeout_seconds=60):
        overflow = [t[0] for t in trace]
        scales = [t[1] for t in trace]
        assert overflow == [False, False, True, False, False]
        assert scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]  # grow after 2 clean steps, shrink on overflow
        assert trace[2][2] and trace[2][3], "the overflow step changed parameters or optimizer state"
        assert not trace[3][2], "a clean step did not update"
        assert trace[0][4] == torch.float16 and trace[0][5] == torch.float32


def _norm_with_replicas_and_ties():
    """pp=2 × tp=2: a TP-split weight, a TP-replicated bias and a weight tied across stages."""
    topo = make_topology(model_parallel_size=2, pipe_parallel_size=2)
    tp, pp = topo.axis("tp").rank, topo.axis("pp").rank
    split = torch.nn.Parameter(torch.zeros(2, 3))
    ParameterMeta("split", (4, 3), 0, 2, layer_index=pp).attach(split)
    replica = torch.nn.Parameter(torch.zeros(3))
    ParameterMeta("replica", (3,), None, 2, layer_index=pp).attach(replica)
    tied = torch.nn.Parameter(torch.zeros(5))
    ParameterMeta("tied", (5,), None, 2, layer_index=0 if pp == 0 else 9, tied_key="emb").attach(tied)
    opt = Optimizer(config=OptimizerConfig(), parameter_groups=[group(split, replica, tied)], topology=topo)
    split.grad = torch.full((2, 3), float(1 + tp + 2 * pp))  # distinct per shard
    replica.grad = torch.full((3,), float(10 + pp))  # same on both TP ranks
    tied.grad = torch.full((5,), 7.0)  # same on both stages (tied grads already synced)
    return opt.step().global_grad_norm


@pytest.mark.distributed
def test_grad_norm_counts_replicas_and_tied_copies_once():
    shards = sum(6 * float(1 + t + 2 * p) ** 2 for t in range(2) for p in range(2))
    expected = math.sqrt(shards + 3 * 10.0**2 + 3 * 11.0**2 + 5 * 7.0**2)
    for norm in run_distributed(_norm_with_replicas_and_ties, 4, timeout_seconds=180):
        # per-tensor norms are fp32 (as clip_grad_norm_), summed in fp64
        assert norm == pytest.approx(expected, rel=1e-6)


def _errors():
    topo = make_topology()
    w, b = make_params()
    with pytest.raises(ValueError, match=r"parameter group names must be unique, got \['g', 'g'\]"):
        Optimizer(config=OptimizerConfig(), parameter_groups=[group(w), group(b)], topology=topo)
    other = OptimizerParamGroup([("w2", w, w.parameter_meta)], OptimizerParamGroupConfig(name="h"))
    with pytest.raises(ValueError, match=r"parameter 'w2' is in groups 'g' and 'h'; put it in one"):
        Optimizer(config=OptimizerConfig(), parameter_groups=[group(w), other], topology=topo)
    opt = Optimizer(config=OptimizerConfig(zero_stage=1), parameter_groups=[group(w, b)], topology=topo)
    state = Optimizer(config=OptimizerConfig(), parameter_groups=[group(w)], topology=topo).state_dict()
    with pytest.raises(ValueError, match=r"parameter keys differ: missing \['layers.0.b'\], unexpected \[\]"):
        opt.load_state_dict(state)
    state = Optimizer(
        config=OptimizerConfig(method="sgd", momentum=0.5), parameter_groups=[group(w, b)], topology=topo
    ).state_dict()
    with pytest.raises(
        ValueError, match=r"optimizer state 'layers.0.w' has no 'exp_avg' \(has \['master', 'momentum_buffer'\]\)"
    ):
        opt.load_state_dict(state)
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=1, overlap_param_gather=True), parameter_groups=[group(w, b)], topology=topo
    )
    with pytest.raises(
        RuntimeError, match=r"overlap_param_gather=True hooks into the model, and no model was attached"
    ):
        opt.step()  # before any gather is launched
    return True


def _overlapped_gather():
    """ZeRO-1 with overlap_param_gather: step() leaves the gathers to each layer's forward pre-hook."""
    topo = make_topology()
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        triples = []
        for name, p in model.named_parameters():
            index, local = name.split(".")
            meta = ParameterMeta(local, tuple(p.shape), layer_index=int(index)).attach(p).parameter_meta
            triples.append((meta.key, p, meta))
        config = OptimizerConfig(zero_stage=1, overlap_param_gather=overlap, allreduce_bucket_size=64)
        opt = Optimizer(
            config=config,
            parameter_groups=[OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="g"))],
            topology=topo,
            model=model,
        )
        gather = opt.data_parallel.spaces[0].shard_gather
        entries = [sorted({gather.entry_of[i] for i in (2 * k, 2 * k + 1)}) for k in range(2)]
        seen, losses = [], []
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + topo.axis("dp").rank))
            opt.zero_grad()
            h = model[0](x)
            # after the first layer's forward its gathers are done and the second layer's are not
            seen.append((sorted(gather._pending), entries))
            loss = model[2](model[1](h)).pow(2).mean()
            opt.backward(loss)
            losses.append(loss.item())
            opt.step()
        opt.finish_parameter_gather()
        runs[overlap] = ([p.detach().clone() for p in model.parameters()], losses, seen)
    return runs


@pytest.mark.distributed
def test_overlap_param_gather_waits_per_layer():
    for runs in run_distributed(_overlapped_gather, 2, timeout_seconds=60):
        (params, losses, _), (params_o, losses_o, seen) = runs[False], runs[True]
        assert losses == losses_o  # bitwise: the same values reach each forward
        for a, b in zip(params, params_o):
            assert torch.equal(a, b)
        for pending, (first, second) in seen[1:]:  # steps after the first: gathers were in flight
            assert not set(first) & set(pending) and set(second) <= set(pending), (pending, first, second)


@pytest.mark.distributed
def test_errors():
    assert run_distributed(_errors, 2, timeout_seconds=60) == [True, True]


def _released_when_dropped(zero, overlap):
    topo = make_topology()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    for index, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            ParameterMeta(name, tuple(p.shape), layer_index=index).attach(p)
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=zero, overlap_param_gather=overlap),
        parameter_groups=[group(*layers.parameters())],
        topology=topo,
        zero3_modules=[layers[0], layers[2]] if zero == 3 else None,
        model=layers if overlap else None,
    )
    for _ in range(2):
        opt.zero_grad()
        opt.backward(layers(torch.randn(4, 6)).pow(2).mean())
        opt.step()
    refs = [weakref.ref(opt), weakref.ref(layers), weakref.ref(layers[0].weight)]
    del opt, layers, p
    gc.collect()
    return [ref() is not None for ref in refs]


@pytest.mark.distributed
@pytest.mark.parametrize(("zero", "overlap"), [(0, False), (1, False), (1, True), (2, False), (3, False)])
def test_optimizer_and_parameters_are_freed_once_dropped(zero, overlap):
    # The hooks on the parameters must not keep the optimizer (its buffers, its process
    # groups) alive, nor the parameters themselves: a tensor hook's references are invisible
    # to the garbage collector, so a cycle through one is never freed.
    for alive in run_distributed(_released_when_dropped, 2, zero, overlap, timeout_seconds=60):
        assert alive == [False, False, False], "optimizer, model, parameter still alive"


def _sync_from_parameters():
    topo = make_topology()
    w, b = make_params(torch.bfloat16)
    opt = Optimizer(config=OptimizerConfig(zero_stage=1), parameter_groups=[group(w, b)], topology=topo)
    with torch.no_grad():
        w.fill_(0.75)  # as a checkpoint load writes the parameters
    opt.sync_from_parameters()
    slot = opt.slots[0]
    master_ok = torch.equal(slot.master, torch.full((slot.length,), 0.75))
    layer = torch.nn.Linear(3, 2)
    ParameterMeta("weight", (2, 3), layer_index=0).attach(layer.weight)
    ParameterMeta("bias", (2,), layer_index=0).attach(layer.bias)
    z3 = Optimizer(
        config=OptimizerConfig(zero_stage=3), parameter_groups=[group(layer.weight, layer.bias)], topology=topo
    )
    z3.attach_model([layer])
    with pytest.raises(RuntimeError, match=r"parameter 'layers.0.weight' is freed \(zero_stage=3\); call it inside"):
        z3.sync_from_parameters()
    with z3.full_parameters():
        with torch.no_grad():
            layer.weight.fill_(2.0)
        z3.sync_from_parameters()
    with z3.full_parameters():
        whole_ok = torch.equal(layer.weight, torch.full((2, 3), 2.0))
    return master_ok, whole_ok


@pytest.mark.distributed
def test_sync_from_parameters_refreshes_masters_and_zero3_shards():
    assert run_distributed(_sync_from_parameters, 2, timeout_seconds=60) == [(True, True)] * 2


def _tp_summed_norm(zero):
    topo = make_topology(model_parallel_size=2)
    w = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16))
    meta = ParameterMeta("norm.weight", (16, 8), reduce_over_tp=True).attach(w).parameter_meta
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=zero),
        parameter_groups=[OptimizerParamGroup([(meta.key, w, meta)], OptimizerParamGroupConfig(name="w"))],
        topology=topo,
    )
    opt.zero_grad()
    w.grad = _bf16_partial(topo.axis("tp").rank)
    return opt.step().global_grad_norm


def _bf16_partial(rank):
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(16, 8, generator=g) * 2.0 ** torch.randint(-4, 5, (16, 8), generator=g)).to(torch.bfloat16)


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 1])
def test_a_sequence_parallel_weights_bf16_gradient_is_summed_over_tp_in_fp32(zero):
    """A TP-replicated weight in a sequence-parallel region has a partial gradient on each TP
    rank; with master weights their sum is taken in fp32, not rounded to bf16 (the norm shows it)."""
    exact = _bf16_partial(0).double() + _bf16_partial(1).double()
    rounded = torch.linalg.vector_norm(exact.to(torch.bfloat16).double()).item()
    exact_norm = torch.linalg.vector_norm(exact).item()
    assert abs(rounded / exact_norm - 1) > 1e-5  # a bf16 sum would show
    for norm in run_distributed(_tp_summed_norm, 2, zero, timeout_seconds=60):
        assert norm == pytest.approx(exact_norm, rel=1e-6)
