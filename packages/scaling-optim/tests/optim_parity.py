"""The optimizer parity tests' model, data and training run (``test_parity.py``, ``test_muon.py``).

The tiny model has every kind of parameter the optimizer must treat differently: a
column-parallel weight and bias (split dim 0), a row-parallel weight (split dim 1), a
TP-replicated bias, and a TP-replicated scale whose gradient is partial on each TP rank
(``reduce_over_tp``, as a sequence-parallel norm weight). Numels are odd so ZeRO chunks
are uneven and padded.
"""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from scaling.collectives import reduce_from_model_parallel_region
from scaling.nn import ParameterMeta
from scaling.optim import (
    LearningRateSchedulerConfig,
    Optimizer,
    OptimizerConfig,
    OptimizerParamGroup,
    OptimizerParamGroupConfig,
)
from scaling.testing import assert_parity, make_topology, shard

D, H, OUT, BATCH, STEPS = 5, 8, 3, 8, 5
# name -> (logical shape, parallel dim, reduce_over_tp, weight decay group)
SPECS = {
    "layers.0.scale": ((D,), None, True, "no_decay"),
    "layers.0.fc1.weight": ((H, D), 0, False, "decay"),
    "layers.0.fc1.bias": ((H,), 0, False, "no_decay"),
    "layers.1.fc2.weight": ((OUT, H), 1, False, "decay"),
    "layers.1.fc2.bias": ((OUT,), None, False, "no_decay"),
}
SCHED = {
    "decay": LearningRateSchedulerConfig(
        learning_rate=0.02,
        learning_rate_warmup_steps=2,
        learning_rate_decay_style="cosine",
        learning_rate_decay_iters=10,
        learning_rate_minimum=0.002,
    ),
    "no_decay": LearningRateSchedulerConfig(learning_rate=0.01, learning_rate_decay_style="constant"),
}
WEIGHT_DECAY = {"decay": 0.1, "no_decay": 0.0}


def full_weights():
    g = torch.Generator().manual_seed(0)
    return {
        n: torch.randn(shape, generator=g) * 0.5 + (1.0 if n.endswith("scale") else 0.0)
        for n, (shape, *_) in SPECS.items()
    }


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, OUT, generator=g)) for _ in range(STEPS)]


def layer0(p, x):
    return torch.relu((x * p["layers.0.scale"]) @ p["layers.0.fc1.weight"].t() + p["layers.0.fc1.bias"])


def layer1(p, h, tp_group=None):
    y = h @ p["layers.1.fc2.weight"].t()
    if tp_group is not None:
        y = reduce_from_model_parallel_region(y, tp_group)
    return y + p["layers.1.fc2.bias"]


def forward(p, x, tp_group=None):
    return layer1(p, layer0(p, x), tp_group)


class Layer(torch.nn.Module):
    """One layer as a module, so ZeRO-3 can hook it; parameters stay the shared objects."""

    def __init__(self, params, index, fn, tp_group):
        super().__init__()
        self.p = params
        self.fn, self.tp_group = fn, tp_group
        for name, param in params.items():
            if name.startswith(f"layers.{index}."):
                self.register_parameter(name.replace(".", "_"), param)

    def forward(self, x):
        return self.fn(self.p, x) if self.fn is layer0 else self.fn(self.p, x, self.tp_group)


def reference(method, clip):
    """torch.optim on one process, the full model and the global batch."""
    params = {n: torch.nn.Parameter(t.clone()) for n, t in full_weights().items()}
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[method]
    groups = [
        {"params": [params[n] for n in SPECS if SPECS[n][3] == k], "weight_decay": WEIGHT_DECAY[k], "name": k}
        for k in ("decay", "no_decay")
    ]
    opt = cls(groups, lr=0.0, foreach=False)
    from scaling.optim import LearningRateScheduler

    scheds = {k: LearningRateScheduler(SCHED[k]) for k in SCHED}
    for step, (x, y) in enumerate(batches(), start=1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(forward(params, x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        for group in opt.param_groups:
            group["lr"] = scheds[group["name"]].get_lr(step)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _dtensor_views(params, topo):
    """The parameters as DTensors of their logical shapes (sharing storage: DCP loads in place)."""
    mesh = topo.device_mesh["dp", "tp"]
    views = {}
    for name, p in params.items():
        meta = p.parameter_meta
        tp_place = Shard(meta.parallel_dim) if meta.is_model_parallel else Replicate()
        shape = torch.Size(meta.logical_shape)
        views[name] = DTensor.from_local(
            p.data,
            mesh,
            [Replicate(), tp_place],
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )
    return views


def _train(
    tp,
    zero,
    method,
    clip,
    dtype=torch.float32,
    steps=STEPS,
    start=0,
    save_to=None,
    load_from=None,
    micro=1,
    overlap=False,
    offload=False,
    **config_extra,
):
    topo = make_topology(model_parallel_size=tp)
    tp_rank, dp_rank, dp = topo.axis("tp").rank, topo.axis("dp").rank, topo.axis("dp").size
    params, members = {}, {"decay": [], "no_decay": []}
    for name, full in full_weights().items():
        shape, pdim, reduce_tp, group = SPECS[name]
        local = full if pdim is None or tp == 1 else shard(full, pdim, tp_rank, tp)
        p = torch.nn.Parameter(local.clone().to(dtype))
        layer, local_name = name.split(".", 2)[1:]
        meta = ParameterMeta(local_name, shape, pdim, tp, int(layer), None, reduce_tp)
        meta.attach(p)
        params[name] = p
        members[group].append((name, p, meta))
    groups = [
        OptimizerParamGroup(
            members[k],
            OptimizerParamGroupConfig(name=k, weight_decay=WEIGHT_DECAY[k], learning_rate_scheduler=SCHED[k]),
        )
        for k in ("decay", "no_decay")
    ]
    config = OptimizerConfig(
        method=method,
        zero_stage=zero,
        gradient_clipping=clip,
        allreduce_bucket_size=64,
        overlap_param_gather=overlap,
        cpu_offload=offload,
        **config_extra,
    )
    tp_group = topo.axis("tp").group if tp > 1 else None
    layers = [Layer(params, 0, layer0, tp_group), Layer(params, 1, layer1, tp_group)]
    opt = Optimizer(
        config=config,
        parameter_groups=groups,
        topology=topo,
        zero3_modules=layers if zero == 3 else None,
        model=layers if overlap else None,
    )
    rows = BATCH // dp
    norms = []
    if load_from is not None:
        with opt.full_parameters():
            state = {"model": _dtensor_views(params, topo), "optim": opt.state_dict()}
            dcp.load(state, checkpoint_id=load_from)
        opt.load_state_dict(state["optim"])
    for x, y in batches()[start:steps]:
        xs, ys = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        opt.zero_grad()
        for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):  # gradient accumulation
            out = layers[1](layers[0](xm.to(dtype)))
            opt.backward(torch.nn.functional.mse_loss(out.float(), ym) / micro)
        norms.append(opt.step().global_grad_norm)
    with opt.full_parameters():
        final = {n: p.detach().float().clone() for n, p in params.items()}
        if save_to is not None:
            dcp.save({"model": _dtensor_views(params, topo), "optim": opt.state_dict()}, checkpoint_id=save_to)
    return final, norms, tp_rank


def _check(results, expected, tp, rtol):
    for local, _, tp_rank in results:
        for name, value in local.items():
            pdim = SPECS[name][1]
            want = expected[name] if pdim is None or tp == 1 else shard(expected[name], pdim, tp_rank, tp)
            assert_parity(value, want, rtol=rtol, atol=rtol * 1e-2, name=name)
    norms = [r[1] for r in results]
    assert all(n == norms[0] for n in norms), f"grad norms differ across ranks: {norms}"
