from dataclasses import dataclass

import numpy as np
import pytest
import torch

from scaling.data import BaseDataset, BaseDatasetBatch, BaseDatasetItem, DataLoader, GlobalBatchSampler
from scaling.topology import Topology, TopologyConfig


@dataclass
class IdItem(BaseDatasetItem):
    sample_id: int


@dataclass
class IdBatch(BaseDatasetBatch):
    sample_ids: torch.Tensor | None
    doubled: torch.Tensor | None

    def only_inputs(self):
        return IdBatch(self.sample_ids, None)

    def only_targets(self):
        return IdBatch(None, self.doubled)


class IdDataset(BaseDataset[IdItem, IdBatch]):
    def __init__(self, n):
        self.n = n

    def ident(self):
        return f"ids-{self.n}"

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return IdItem(int(index))

    def collate(self, items):
        ids = torch.tensor([i.sample_id for i in items], dtype=torch.int64)
        return IdBatch(ids, ids * 2)


def global_batches(n, gbs, mbs, dp, steps, seed=7, consumed=0, shuffle=True):
    """Global-batch sample ids of `steps` steps, assembled from one loader per DP rank (rank order)."""
    loaders = [
        DataLoader(
            IdDataset(n),
            seed=seed,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            data_parallel_rank=d,
            data_parallel_size=dp,
            consumed_samples=consumed,
            shuffle=shuffle,
        )
        for d in range(dp)
    ]
    out = []
    for _ in range(steps):
        out.append([int(i) for loader in loaders for b in loader.next_step() for i in b.sample_ids])
    return out, loaders


def test_order_identical_for_dp_1_2_4():
    ref, _ = global_batches(n=37, gbs=8, mbs=1, dp=1, steps=12)
    for dp, mbs in [(2, 1), (2, 2), (4, 1), (4, 2)]:
        got, _ = global_batches(n=37, gbs=8, mbs=mbs, dp=dp, steps=12)
        assert got == ref, f"dp={dp} mbs={mbs}"


def test_epochs_are_permutations_with_distinct_orders():
    steps, _ = global_batches(n=24, gbs=8, mbs=2, dp=2, steps=6)
    flat = [i for s in steps for i in s]
    first, second = flat[:24], flat[24:]
    assert sorted(first) == list(range(24)) and sorted(second) == list(range(24))
    assert first != second  # epoch e draws from seed + e
    expected = np.random.default_rng(7).permutation(24).tolist()
    assert first == expected


def test_no_shuffle_is_in_order():
    steps, _ = global_batches(n=10, gbs=4, mbs=2, dp=2, steps=3, shuffle=False)
    assert steps == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_different_seed_different_order():
    a, _ = global_batches(n=50, gbs=10, mbs=5, dp=2, steps=2, seed=1)
    b, _ = global_batches(n=50, gbs=10, mbs=5, dp=2, steps=2, seed=2)
    assert a != b


@pytest.mark.parametrize(
    "dp_before,mbs_before,dp_after,mbs_after", [(2, 2, 2, 2), (2, 2, 4, 1), (4, 1, 1, 8), (1, 4, 2, 2)]
)
def test_resume_continues_the_stream(dp_before, mbs_before, dp_after, mbs_after):
    ref, _ = global_batches(n=29, gbs=8, mbs=1, dp=1, steps=10)
    head, loaders = global_batches(n=29, gbs=8, mbs=mbs_before, dp=dp_before, steps=4)
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)
    assert states[0]["consumed_samples"] == 32
    resumed = [
        DataLoader(
            IdDataset(29),
            seed=999,  # overwritten by the state
            global_batch_size=8,
            micro_batch_size=mbs_after,
            data_parallel_rank=d,
            data_parallel_size=dp_after,
        )
        for d in range(dp_after)
    ]
    for loader in resumed:
        loader.next_step()  # iterate (and prefetch) before the load: the load must reset it
        loader.load_state_dict(states[0])
    tail = [[int(i) for loader in resumed for b in loader.next_step() for i in b.sample_ids] for _ in range(6)]
    assert head + tail == ref


def test_topology_gives_sizes_and_workers_match_in_process():
    cfg = TopologyConfig(
        world_size=4, data_parallel_size=2, model_parallel_size=2, global_batch_size=8, micro_batch_size=2
    )
    topo = Topology(cfg, global_rank=2)  # dp=1, tp=0; no process group needed for the order
    plain = DataLoader(IdDataset(40), seed=3, topology=topo)
    workers = DataLoader(IdDataset(40), seed=3, topology=topo, num_workers=2, prefetch_factor=2)
    assert plain.gradient_accumulation_steps == 2
    for _ in range(3):
        a, b = plain.next_step(), workers.next_step()
        assert [x.sample_ids.tolist() for x in a] == [x.sample_ids.tolist() for x in b]
    assert workers.state_dict()["consumed_samples"] == 24
    # TP rank 1 does not read: it gets None and receives the batch through sync_batch_to_model_parallel.
    other = DataLoader(IdDataset(40), seed=3, topology=Topology(cfg, global_rank=3))
    assert other.next_step() == [None, None] and other.consumed_samples == 8


class CountingDataset(IdDataset):
    """Counts the items read (``__getitem__``), to show which ranks read nothing."""

    def __init__(self, n):
        super().__init__(n)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_middle_pipeline_stages_read_nothing():
    """pp=3: the first and last stages read the micro-batches, the middle one reads none (#48), and
    every stage's stream position advances alike (a checkpoint of any rank resumes the same stream)."""
    cfg = TopologyConfig(world_size=3, pipe_parallel_size=3, global_batch_size=4, micro_batch_size=2)
    loaders = {}
    for rank in range(3):
        loaders[rank] = DataLoader(CountingDataset(40), seed=3, topology=Topology(cfg, global_rank=rank))
        for _ in range(2):
            batches = loaders[rank].next_step()
        assert (batches == [None, None]) == (rank == 1)
    assert [loaders[r].dataset.reads for r in range(3)] == [8, 0, 8]
    assert {loaders[r].state_dict()["consumed_samples"] for r in range(3)} == {8}
    # Under ZB-V the loss is on stage 0 too: the last stage reads nothing either.
    v_shape = [DataLoader(CountingDataset(40), seed=3, topology=Topology(cfg, global_rank=r), reading_stages=(0,))
               for r in range(3)]  # fmt: skip
    assert [loader.next_step() == [None, None] for loader in v_shape] == [False, True, True]
    assert [loader.dataset.reads for loader in v_shape] == [4, 0, 0]


def test_sampler_matches_global_order():
    sampler = GlobalBatchSampler(100, 12, 3, data_parallel_rank=1, data_parallel_size=2, seed=5)
    it = iter(sampler)
    assert [next(it) for _ in range(2)] == [
        sampler.order.global_batch(0, 12)[6:9].tolist(),
        sampler.order.global_batch(0, 12)[9:12].tolist(),
    ]


def test_errors():
    ds = IdDataset(10)
    with pytest.raises(
        ValueError, match=r"global_batch_size=10 is not a multiple of micro_batch_size=2 × data_parallel_size=4"
    ):
        DataLoader(ds, seed=0, global_batch_size=10, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=4)
    with pytest.raises(ValueError, match=r"\['data_parallel_rank', 'data_parallel_size'\] not set"):
        DataLoader(ds, seed=0, global_batch_size=4, micro_batch_size=2)
    topo = Topology(TopologyConfig(world_size=2, global_batch_size=8, micro_batch_size=2), global_rank=0)
    with pytest.raises(ValueError, match=r"\['micro_batch_size'\] given together with topology"):
        DataLoader(ds, seed=0, topology=topo, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 is outside \[0, data_parallel_size=2\)"):
        DataLoader(ds, seed=0, global_batch_size=4, micro_batch_size=2, data_parallel_rank=2, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"prefetch_factor=2 needs num_workers > 0"):
        DataLoader(ds, seed=0, topology=topo, prefetch_factor=2)
    with pytest.raises(ValueError, match=r"num_samples \(len\(dataset\)\)=0 must be >= 1"):
        DataLoader(IdDataset(0), seed=0, topology=topo)
    with pytest.raises(TypeError, match=r"seed must be an int, got float"):
        DataLoader(ds, seed=1.5, topology=topo)
    loader = DataLoader(ds, seed=0, topology=topo)
    next(loader)
    with pytest.raises(RuntimeError, match=r"state_dict\(\) at micro-batch 1 of 2 of a step"):
        loader.state_dict()
    next(loader)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"dataset_ident='ids-10' in the checkpoint but 'ids-11' now"):
        DataLoader(IdDataset(11), seed=0, topology=topo).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state lacks \['consumed_samples'\]"):
        loader.load_state_dict({"seed": 1})


def test_sync_batch_errors_and_identity_without_tp():
    ds = IdDataset(4)
    batch = ds.collate([ds[0], ds[1]])
    single = Topology(TopologyConfig(world_size=2, data_parallel_size=2), global_rank=1)
    assert ds.sync_batch_to_model_parallel(single, batch) is batch
    with pytest.raises(ValueError, match=r"batch is None but this rank is the only model-parallel rank"):
        ds.sync_batch_to_model_parallel(single, None)
    tp_rank_0 = Topology(TopologyConfig(world_size=2, model_parallel_size=2), global_rank=0)
    with pytest.raises(ValueError, match=r"batch is None on model-parallel rank 0"):
        ds.sync_batch_to_model_parallel(tp_rank_0, None)
