"""A script that never destroys its process groups still exits with their threads joined, and a
rank that fails exits with code 1, never blocked and never aborted.

Each case is a fresh Python process (real gloo groups through a file rendezvous). In the
clean case its last atexit handler, registered before the topology's, counts the threads the
groups started (``/proc/self/task``) after the topology's handler ran.
"""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys

    def threads():
        return set(os.listdir("/proc/self/task"))

    def count_gloo_threads():
        # The threads started with the groups (torch 2.6 leaves gloo's unnamed, so not by name).
        print("gloo threads at exit:", len(threads() - before), flush=True)

    atexit.register(count_gloo_threads)  # runs after the handlers registered later

    from scaling.topology import Topology, TopologyConfig

    def main():
        global before
        topology = Topology(TopologyConfig(world_size=1, device="cpu"), 0)
        before = threads()
        topology.initialize_distributed(init_method="file://" + sys.argv[1])
        cycle = {"topology": topology}
        cycle["self"] = cycle  # once main returns, held by a reference cycle only, as a trainer's objects are

    main()
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")
def test_groups_are_destroyed_and_their_threads_joined_at_a_clean_exit(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "gloo threads at exit: 0" in out.stdout, out.stdout


FAILING = textwrap.dedent(
    """
    import atexit, sys
    import torch, torch.distributed as dist

    atexit.register(lambda: print("interpreter teardown reached", flush=True))  # runs after the topology's
    from scaling.topology import Topology, TopologyConfig

    rank = int(sys.argv[2])
    topology = Topology(TopologyConfig(world_size=2, device="cpu", timeout_seconds=60), rank)
    topology.initialize_distributed(init_method="file://" + sys.argv[1])
    beat = torch.ones(1)
    for _ in range(20):
        dist.all_reduce(beat)
    if rank == 1:
        raise RuntimeError("rank 1 gave up")
    while True:  # the peer: in a collective when rank 1 fails, as a training rank would be
        dist.all_reduce(beat)
    """
)


@pytest.mark.slow
def test_a_rank_that_raises_while_its_peer_is_in_a_collective_exits_1(tmp_path):
    """A failing rank's peer may still wait in a collective: the groups are not torn down (that
    could block the exit), and the rank ends with Python's exit code for an uncaught exception
    before the interpreter's teardown, where the groups' live threads aborted it about one time
    in five (exit 134: the launcher then reported a SIGABRT instead of the error). Five runs."""
    for attempt in range(5):
        rendezvous = tmp_path / f"rendezvous{attempt}"
        command = [sys.executable, "-c", FAILING, str(rendezvous)]
        peer = subprocess.Popen([*command, "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            start = time.monotonic()
            failing = subprocess.run([*command, "1"], capture_output=True, text=True, timeout=120)
            took = time.monotonic() - start
        finally:
            peer.kill()
            peer.wait()
        assert failing.returncode == 1, (attempt, failing.returncode, failing.stderr[-2000:])
        assert "RuntimeError: rank 1 gave up" in failing.stderr
        assert "interpreter teardown reached" not in failing.stdout  # ended before it
        assert took < 45, f"the failing rank took {took:.0f} s to exit: blocked on its peer (timeout 60 s)?"
