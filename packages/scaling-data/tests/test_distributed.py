from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist

from scaling.data import (
    BaseDataset,
    BaseDatasetBatch,
    BaseDatasetItem,
    DataLoader,
    LMPackingDataset,
    MMapTokenBuilder,
    MMapTokenDataset,
)
from scaling.testing import make_topology, run_distributed

pytestmark = pytest.mark.distributed


@dataclass
class IdBatch(BaseDatasetBatch):
    sample_ids: torch.Tensor
    is_even: torch.Tensor

    def only_inputs(self):
        return self

    def only_targets(self):
        return self


class IdDataset(BaseDataset[BaseDatasetItem, IdBatch]):
    def ident(self):
        return "ids"

    def __len__(self):
        return 23

    def __getitem__(self, index):
        return index

    def collate(self, items):
        ids = torch.tensor(items, dtype=torch.int64)
        return IdBatch(ids, ids % 2 == 0)


def reference_global_batches(steps, gbs, seed):
    loader = DataLoader(
        IdDataset(), seed=seed, global_batch_size=gbs, micro_batch_size=gbs, data_parallel_rank=0, data_parallel_size=1
    )
    return [loader.next_step()[0].sample_ids.tolist() for _ in range(steps)]


def _global_batches_over_dp(steps, gbs, mbs, seed):
    topo = make_topology(global_batch_size=gbs, micro_batch_size=mbs)
    loader = DataLoader(IdDataset(), seed=seed, topology=topo)
    out = []
    for _ in range(steps):
        local = [i for b in loader.next_step() for i in b.sample_ids.tolist()]
        gathered = [None] * topo.axis("dp").size
        dist.all_gather_object(gathered, local, group=topo.axis("dp").group)
        out.append([i for part in gathered for i in part])
    return out, loader.state_dict()


@pytest.mark.parametrize("world_size,mbs", [(2, 2), (4, 1)])
def test_real_dp_ranks_assemble_the_reference_order(world_size, mbs):
    ref = reference_global_batches(steps=5, gbs=8, seed=5)
    results = run_distributed(_global_batches_over_dp, world_size, 5, 8, mbs, 5, timeout_seconds=120)
    for batches, state in results:
        assert batches == ref
        assert state["consumed_samples"] == 40


def _tp_sync(prefix, gbs, mbs):
    topo = make_topology(model_parallel_size=2, global_batch_size=gbs, micro_batch_size=mbs)
    ds = LMPackingDataset(MMapTokenDataset(prefix), sequence_length=6)
    loader = DataLoader(ds, seed=1, topology=topo)
    out = []
    for _ in range(2):
        for batch in loader.next_step():
            if topo.axis("tp").rank == 0:
                assert batch is not None
            else:
                assert batch is None  # only TP rank 0 reads
            synced = ds.sync_batch_to_model_parallel(topo, batch)
            out.append({k: (v.dtype, v.tolist()) for k, v in vars(synced).items()})
    return topo.axis("dp").rank, out


def test_tp_ranks_receive_the_batch_of_tp_rank_0(tmp_path):
    rng = np.random.default_rng(0)
    with MMapTokenBuilder(tmp_path / "c", dtype=np.uint16) as b:
        for n in [7, 3, 20, 11, 2, 30]:
            b.add_document(rng.integers(0, 5000, size=n))
    results = run_distributed(_tp_sync, 4, str(tmp_path / "c"), 4, 1, timeout_seconds=120)
    # ranks (dp, tp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1): TP peers hold identical batches
    assert results[0] == results[1] and results[2] == results[3]
    ds = LMPackingDataset(MMapTokenDataset(tmp_path / "c"), sequence_length=6)
    for dp in (0, 1):
        ref = DataLoader(
            ds, seed=1, global_batch_size=4, micro_batch_size=1, data_parallel_rank=dp, data_parallel_size=2
        )
        expected = [{k: (v.dtype, v.tolist()) for k, v in vars(b).items()} for _ in range(2) for b in ref.next_step()]
        assert results[2 * dp] == (dp, expected)
    assert results[0][1][0]["cumulative_seq_lengths"][0] == torch.int32
