"""A script that never destroys its process groups still exits with their threads joined.

Each case is a fresh Python process (a real gloo group of one rank through a file
rendezvous) whose last atexit handler, registered before the topology's, counts the
process's gloo threads (``/proc/self/task/*/comm``) after the topology's handler ran.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, glob, os, sys

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
        if sys.argv[2] == "raise":
            raise RuntimeError("a rank fails")

    main()
    """
)


def _run(tmp_path: Path, how: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "rendezvous"), how],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")
def test_groups_are_destroyed_and_their_threads_joined_at_a_clean_exit(tmp_path):
    out = _run(tmp_path, "end")
    assert out.returncode == 0, out.stderr
    assert "gloo threads at exit: 0" in out.stdout, out.stdout


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")
def test_after_an_uncaught_exception_the_groups_are_left_alone(tmp_path):
    """A failing rank's peers may still wait in a collective: no teardown that could block its exit."""
    out = _run(tmp_path, "raise")
    assert out.returncode == 1 and "RuntimeError: a rank fails" in out.stderr, out.stderr
    count = int(out.stdout.split("gloo threads at exit:")[1].split()[0])
    assert count > 0, out.stdout
