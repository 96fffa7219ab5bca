import gc
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from scaling.testing import (
    DistributedTestError,
    DistributedTimeoutError,
    _harness,
    assert_parity,
    run_distributed,
    shard,
    shutdown_workers,
    worker_pids,
)


def _sum_ranks(scale):
    x = torch.tensor([float(dist.get_rank()) * scale])
    dist.all_reduce(x)
    return x.item(), int(os.environ["RANK"]), dist.get_world_size()


def _raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from {bad_rank}")
    dist.barrier()
    return True


def _hang_on(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(600)
    dist.barrier()
    return True


def _die_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(7)
    dist.barrier()


class _Node:
    pass


_CYCLES: list[weakref.ref] = []
_KEPT: list[list] = []


def _leave_a_cycle_and_a_survivor():
    """A cycle only the collector can free, and a list that outlives this task."""
    node = _Node()
    node.self = node
    _CYCLES.append(weakref.ref(node))
    _KEPT.append([])


def _after_the_first_task():
    survivor = _KEPT[-1]
    # Frozen objects are in no generation that gc.get_objects() lists.
    return _CYCLES[-1]() is None, not any(o is survivor for o in gc.get_objects()), gc.isenabled()


def test_finished_task_garbage_is_collected_and_the_rest_frozen():
    # One rank: the same worker runs both tasks.
    run_distributed(_leave_a_cycle_and_a_survivor, 1, timeout_seconds=60)
    ((freed, frozen, enabled),) = run_distributed(_after_the_first_task, 1, timeout_seconds=60)
    assert freed  # collected before the freeze, not kept for the life of the worker
    assert frozen  # later collections skip what the task left
    assert enabled  # the forkserver imports with collection off; the tasks run with it on


_GROUPS: list = []


def _keep_a_group():
    _GROUPS.append(dist.new_group([0]))  # holds the task's store past its end


def _release_the_groups():
    _GROUPS.clear()


def test_a_store_outliving_its_task_is_destroyed_with_its_rendezvous_file_in_place():
    run_distributed(_keep_a_group, 1, timeout_seconds=60)
    rendezvous_dir = _harness._POOL.rendezvous_dir
    # The newest file is this call's: its store is kept, so its destructor has not run (older
    # files are those of stores that earlier tests in this process left alive).
    kept = max(os.listdir(rendezvous_dir), key=lambda name: int(name.rsplit("-", 1)[1]))
    # The store's destructor runs in the next call; its file must still be there (a missing
    # directory made it throw, aborting the worker: the pool removed the directory too soon).
    run_distributed(_release_the_groups, 1, timeout_seconds=60)
    assert _harness._POOL.rendezvous_dir == rendezvous_dir
    assert kept not in os.listdir(rendezvous_dir)  # the last store of a rendezvous removes its file
    shutdown_workers()
    assert not os.path.exists(rendezvous_dir)  # the directory goes with the workers


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_per_rank(world_size):
    out = run_distributed(_sum_ranks, world_size, 2.0, timeout_seconds=60)
    expected = 2.0 * sum(range(world_size))
    assert out == [(expected, r, world_size) for r in range(world_size)]


@pytest.mark.slow
def test_raising_rank_is_named_and_pool_recovers():
    with pytest.raises(DistributedTestError, match=r"rank 1 failed ---\nValueError: boom from 1") as info:
        run_distributed(_raise_on, 3, 1, timeout_seconds=20)
    assert 1 in info.value.failed_ranks
    assert worker_pids() == []  # the pool was killed, nothing left behind
    assert run_distributed(_sum_ranks, 2, 1.0, timeout_seconds=60)[0][0] == 1.0


@pytest.mark.slow
@pytest.mark.waits
def test_hanging_rank_is_named_within_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match=r"rank\(s\) \[2\] did not return") as info:
        # Collectives time out at 60% of the call's timeout (12 s), which leaves the peers
        # 8 s to report on a loaded 2-core machine.
        run_distributed(_hang_on, 3, 2, timeout_seconds=20)
    assert info.value.hung_ranks == [2]
    # 20 s plus starting and killing the pool: 30.7 s once under a full suite's load on 2 cores.
    assert time.monotonic() - start < 40
    pids = worker_pids()
    assert pids == []


@pytest.mark.slow
def test_dead_rank_is_named():
    with pytest.raises(DistributedTestError, match=r"rank 0 died \(exit code 7\)"):
        run_distributed(_die_on, 2, 0, timeout_seconds=20)


@pytest.mark.slow
def test_no_process_left_after_failure():
    run_distributed(_sum_ranks, 2, 1.0, timeout_seconds=60)
    pids = worker_pids()
    assert len(pids) >= 2
    with pytest.raises(DistributedTestError):
        run_distributed(_raise_on, 2, 0, timeout_seconds=20)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# A test process that starts two pooled workers and dies without any clean-up (no atexit).
_ORPHANING_SCRIPT = """
import os
import torch.distributed as dist
from scaling.testing import run_distributed, worker_pids

def rank(_):
    return dist.get_rank()

if __name__ == "__main__":
    assert run_distributed(rank, 2, 0, timeout_seconds=60) == [0, 1]
    with open("pids", "w") as f:
        f.write(" ".join(map(str, worker_pids())))
    os._exit(0)
"""


@pytest.mark.slow
def test_workers_leave_when_the_test_process_dies_without_clean_up(tmp_path):
    # Forked workers are children of the forkserver, not of the test process: each must
    # notice on its own that the test process is gone.
    script = tmp_path / "orphan_main.py"
    script.write_text(_ORPHANING_SCRIPT)
    # Output to files: the workers inherit the script's descriptors, and a pipe would stay open.
    # The pool's rendezvous directory, never removed by a process that dies, goes to tmp_path.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with open(tmp_path / "err", "w") as err:
        code = subprocess.call(
            [sys.executable, str(script)], stdout=err, stderr=err, timeout=120, cwd=tmp_path, env=env
        )
    assert code == 0, (tmp_path / "err").read_text()[-3000:]
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 15  # workers poll for the test process every second
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)], "pooled workers outlived the test process"


_PRELOADING_SCRIPT = """
import sys
from scaling.testing import preload, run_distributed

def imported(_):
    return "wave" in sys.modules  # before this function imports anything

if __name__ == "__main__":
    preload("wave", "no_such_module_is_installed")  # the missing one is skipped
    assert "wave" not in sys.modules  # the forkserver imports it, not this process
    assert run_distributed(imported, 2, 0, timeout_seconds=60) == [True, True]
    try:
        preload("mailbox")
    except RuntimeError as exc:
        print(exc)
    else:
        raise AssertionError("preload after the forkserver started did not raise")
"""


@pytest.mark.slow  # a fresh interpreter starts its own workers: ~15 s of the quick tier
def test_preloaded_modules_are_imported_in_every_worker_and_late_preload_is_refused(tmp_path):
    script = tmp_path / "preload_main.py"
    script.write_text(_PRELOADING_SCRIPT)
    with open(tmp_path / "out", "w") as out:
        code = subprocess.call([sys.executable, str(script)], stdout=out, stderr=out, timeout=120, cwd=tmp_path)
    text = (tmp_path / "out").read_text()
    assert code == 0, text[-3000:]
    assert "preload('mailbox',): the workers' forkserver has already started" in text, text


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # An exited child of init is reaped at once; a zombie still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # gone between the two looks
        return False


def test_assert_parity_reports_worst_element():
    a = {"w": torch.tensor([1.0, 2.0, 3.0])}
    assert_parity(a, {"w": torch.tensor([1.0, 2.0, 3.0])}, bitwise=True)
    with pytest.raises(AssertionError, match=r"\['w'\]: not within rtol=1e-06.*index \(2,\)"):
        assert_parity(a, {"w": torch.tensor([1.0, 2.0, 3.1])})
    with pytest.raises(AssertionError, match="shape"):
        assert_parity(torch.zeros(2), torch.zeros(3))
    # A container where another was expected is named, not a TypeError from inside the check.
    with pytest.raises(AssertionError, match=r"value\['w'\]: a list, expected a mapping"):
        assert_parity({"w": [1.0]}, {"w": {"x": 1.0}})
    with pytest.raises(AssertionError, match="value: a Tensor, expected a sequence"):
        assert_parity(torch.zeros(2), [0.0, 0.0])


def test_shard():
    full = torch.arange(12.0).view(3, 4)
    assert torch.equal(shard(full, 1, 1, 2), full[:, 2:])
    with pytest.raises(ValueError, match="not divisible by 5"):
        shard(full, 1, 0, 5)
