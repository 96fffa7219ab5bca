"""torch's flight recorder, turned on for NCCL groups and pointed at the trainer's diagnostics folder.

The NCCL side (a collective stuck on the GPU, dumped by NCCL's watchdog into the folder) is
in ``tests/gpu/test_nccl.py``; here the rules, and that torch reads the variable that sizes
the recorder under the name set (a gloo group records into the same kind of ring).
"""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from scaling.topology import TopologyConfig, _flight_recorder, set_flight_recorder_folder
from scaling.topology._flight_recorder import DUMP_FILE, DUMP_ON_TIMEOUT, enable_flight_recorder

# The names torch reads: TORCH_FR_* from 2.8 (the older ones then warn as deprecated), TORCH_NCCL_* before.
SPELLINGS = {
    True: ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"),
    False: ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
}


@pytest.fixture(params=[True, False], ids=["torch>=2.8", "torch<2.8"])
def spelling(request, monkeypatch):
    """(buffer size, dump file): the names a torch of either age reads, that version pretended."""
    monkeypatch.setattr(_flight_recorder, "_NEW_NAMES", request.param)
    return SPELLINGS[request.param]


def test_the_running_torch_gets_the_names_it_reads():
    assert _flight_recorder._NEW_NAMES == (torch.torch_version.TorchVersion(torch.__version__) >= "2.8")


def test_nccl_gets_the_recorder_and_dump_on_timeout(spelling):
    env = {}
    expected = {spelling[0]: "2000", DUMP_ON_TIMEOUT: "1"}
    assert enable_flight_recorder("nccl", 2000, env) == expected  # one name: the other would warn or be ignored
    assert env == expected
    both = {}
    enable_flight_recorder("cpu:gloo,cuda:nccl", 16, both)
    assert both[spelling[0]] == "16"


@pytest.mark.parametrize("backend, entries", [("gloo", 2000), ("nccl", 0)])
def test_gloo_or_zero_entries_leave_the_environment_alone(backend, entries):
    env = {}
    assert enable_flight_recorder(backend, entries, env) == {}
    assert env == {}


@pytest.mark.parametrize("name", ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"])
def test_a_size_the_user_set_wins_under_either_name(name, spelling):
    env = {name: "0", DUMP_ON_TIMEOUT: "0"}
    assert enable_flight_recorder("nccl", 2000, env) == {}
    assert env == {name: "0", DUMP_ON_TIMEOUT: "0"}


def test_the_dumps_go_to_the_folder_which_is_created(tmp_path, spelling):
    env = {}
    enable_flight_recorder("nccl", 2000, env)
    folder = tmp_path / "run" / "diagnostics"
    prefix = set_flight_recorder_folder("nccl", folder, env)
    assert prefix == folder / "flight_recorder_rank_"
    assert env == {spelling[0]: "2000", DUMP_ON_TIMEOUT: "1", spelling[1]: str(prefix)}
    assert folder.is_dir()
    # A second run in the same process moves the dumps to its own folder (the first's was not the user's).
    assert set_flight_recorder_folder("nccl", tmp_path / "second", env) == tmp_path / "second" / "flight_recorder_rank_"
    assert env[spelling[1]] == str(tmp_path / "second" / "flight_recorder_rank_")


@pytest.mark.parametrize(
    "backend, env",
    [
        ("gloo", {"TORCH_FR_BUFFER_SIZE": "2000"}),  # gloo: Scaling's own diagnosis
        ("nccl", {}),  # recorder off
        ("nccl", {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/r_"}),
        ("nccl", {"TORCH_FR_BUFFER_SIZE": "2000", DUMP_FILE: "/elsewhere/r_"}),
    ],
)
def test_no_dump_folder_where_nothing_is_dumped_or_the_user_chose_one(tmp_path, backend, env, spelling):
    before = dict(env)
    assert set_flight_recorder_folder(backend, tmp_path / "diagnostics", env) is None
    assert env == before
    assert not (tmp_path / "diagnostics").exists()


def test_entries_are_a_config_field_refused_below_zero():
    assert TopologyConfig().flight_recorder_entries == 2000
    with pytest.raises(ValueError, match="flight_recorder_entries"):
        TopologyConfig(flight_recorder_entries=-1)


SCRIPT = textwrap.dedent(
    """
    import os, pickle, sys
    from scaling.topology._flight_recorder import enable_flight_recorder

    enable_flight_recorder("nccl", 8)  # the variables a topology on NCCL sets, before any group
    import torch, torch.distributed as dist
    import torch._C._distributed_c10d as c10d

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    for _ in range(11):
        dist.all_reduce(torch.ones(3))
    sys.stdout.buffer.write(c10d._dump_fr_trace())
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(
    not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"),
    reason=f"torch {torch.__version__}'s gloo groups keep no flight record (NCCL's only)",
)
def test_torch_reads_the_size_under_the_name_set(tmp_path):
    """The ring torch keeps has the size set: 8 of the 11 all-reduces (a misspelt name would keep none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous")], capture_output=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    dump = pickle.loads(run.stdout)  # torch's own dump of this test's process
    entries = dump["entries"]
    assert len(entries) == 8
    assert {e["profiling_name"] for e in entries} == {"gloo:all_reduce"}
    assert [e["collective_seq_id"] for e in entries] == list(range(4, 12))
