import os

import pytest
import torch

from scaling.testing import make_topology, run_distributed
from scaling.topology import RNGTracker, get_rng_state, seed_all, set_rng_state


def test_fork_leaves_default_stream_untouched():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    tracker = RNGTracker(torch.device("cpu"))
    tracker.add("s", 5)
    with tracker.fork("s"):
        a = torch.rand(2)
    assert torch.equal(torch.rand(3), expected)
    with tracker.fork("s"):
        b = torch.rand(2)
    # The stream continues across forks exactly like one generator seeded with 5.
    assert torch.equal(torch.cat([a, b]), torch.rand(4, generator=torch.Generator().manual_seed(5)))


def test_tracker_errors():
    tracker = RNGTracker(torch.device("cpu"))
    tracker.add("s", 1)
    with pytest.raises(ValueError, match="'s' already exists"):
        tracker.add("s", 2)
    with pytest.raises(KeyError, match="'nope' does not exist"):
        with tracker.fork("nope"):
            pass


def test_state_roundtrip_reproduces_draws():
    tracker = RNGTracker(torch.device("cpu"))
    tracker.add("s", 3)
    state = get_rng_state(tracker)

    def draw():
        plain = torch.rand(2)
        with tracker.fork("s"):
            forked = torch.rand(2)
        return plain, forked

    first = draw()
    set_rng_state(state, tracker)
    second = draw()
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])


def _draws():
    topo = make_topology(model_parallel_size=2)
    tracker = seed_all(1234, topo)
    replicated = torch.rand(4)
    with tracker.fork():
        sharded = torch.rand(4)
    return topo.coordinates(), replicated, sharded


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_group_shares_default_stream_not_model_parallel_stream():
    out = run_distributed(_draws, 4, timeout_seconds=60)
    by_tp = {}
    for coords, replicated, sharded in out:
        by_tp.setdefault(coords.tp, []).append(sharded)
        assert torch.equal(replicated, out[0][1])  # same on every TP and DP rank (pp=1)
    assert not torch.equal(by_tp[0][0], by_tp[1][0])  # TP ranks draw different masks
    assert torch.equal(by_tp[0][0], by_tp[0][1])  # same TP rank across DP: same stream


def test_use_deterministic_algorithms_sets_torch_cudnn_and_cublas_and_is_undone(monkeypatch):
    from scaling.topology import use_deterministic_algorithms

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.backends.cudnn.benchmark
    try:
        use_deterministic_algorithms()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without a kernel raises
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        use_deterministic_algorithms(False)
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other setting cuBLAS documents: kept
    try:
        use_deterministic_algorithms()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = before
