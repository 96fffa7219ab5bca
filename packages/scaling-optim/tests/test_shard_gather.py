"""ShardGather (ZeRO 1/2 write-back): every parameter whole again on every rank, both paths.

Parameters of at least ``direct_min_bytes`` that split evenly are gathered in place into
their own storage; the others (padded, small) are bucketed. fp32 parameters send their
own owned slice, bf16 ones their fp32 master weights cast to bf16.
"""

import pytest
import torch

from scaling.nn import ParameterMeta
from scaling.optim._shard_gather import ShardGather
from scaling.optim._slots import ParamSlot
from scaling.testing import make_topology, run_distributed

# name: (shape, dtype); on 2 ranks "w" and "h" split evenly (direct), "odd" and "s" pad (bucketed)
SPECS = {
    "w": ((8, 4), torch.float32),
    "odd": ((7,), torch.float32),
    "h": ((4, 4), torch.bfloat16),
    "s": ((3,), torch.bfloat16),
    "w2": ((6, 2), torch.float32),
}


def _expected(name):
    shape, dtype = SPECS[name]
    # small integers: exact in bf16, so the check can be bitwise
    return (torch.arange(torch.Size(shape).numel()).reshape(shape) % 50 - 20).to(dtype)


def _gather():
    topo = make_topology()
    world, rank = topo.axis("dp").size, topo.axis("dp").rank
    slots = []
    for name, (shape, dtype) in SPECS.items():
        param = torch.nn.Parameter(torch.full(shape, -99.0, dtype=dtype))
        meta = ParameterMeta(name, shape, layer_index=0).attach(param).parameter_meta
        slot = ParamSlot(name, param, meta, 0, world, rank, True, ())
        # what the update leaves: the new values of the owned elements only
        slot.work_param().copy_(_expected(name).reshape(-1)[slot.start : slot.end])
        slots.append(slot)
    gather = ShardGather(slots, topo.axis("dp").group, bucket_size_bytes=1024, direct_min_bytes=32)
    for entry in range(len(gather.entries)):
        gather.launch(entry)
    gather.finish()
    names = list(SPECS)
    return {s.name: s.param.detach().clone() for s in slots}, [[names[i] for i in e] for e in gather.entries]


@pytest.mark.distributed
def test_shard_gather_makes_every_parameter_whole_on_every_rank():
    for params, entries in run_distributed(_gather, 2, timeout_seconds=60):
        # ordered by first parameter in model order; a bucket of padded ones closes where the dtype changes
        assert entries == [["w"], ["odd"], ["h"], ["s"], ["w2"]], entries
        for name in SPECS:
            assert torch.equal(params[name], _expected(name)), name
