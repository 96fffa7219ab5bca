"""A real two-"node" run on one machine: pdsh's exec module starts torchrun once per node.

pdsh -R exec runs each node's command here instead of over ssh, so the whole launch path
(pdsh fan-out, the shell command, c10d rendezvous across two torchrun agents) is real.
"""

from __future__ import annotations

import json
import re
import shutil
import socket

import pytest

from scaling.runner import RunnerConfig, runner_main

pytestmark = pytest.mark.skipif(
    shutil.which("pdsh") is None, reason="pdsh is not installed; apt-get install -y pdsh (see README)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_two_processes_each(worker_script, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HF_TOKEN", "pdsh-secret")
    payload = {"out_dir": str(tmp_path), "steps": 5, "lr": 0.3, "echo_env": ["HF_TOKEN"]}
    cfg = RunnerConfig(
        runner_type="pdsh", pdsh_rcmd="exec", script=worker_script, hosts=["node1 slots=2", "node2 slots=2"],
        master_addr="127.0.0.1", master_port=_free_port(), env_forward=["HF_TOKEN"],
    )  # fmt: skip
    assert runner_main(cfg, payload) == 0
    out = capfd.readouterr().out
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["world_size"] for r in records} == {4}
    assert all(r["allreduce"] == 6.0 for r in records)
    assert len({(r["w"], r["b"]) for r in records}) == 1  # every rank holds the same trained model
    assert all(r["env"]["HF_TOKEN"] == "pdsh-secret" for r in records)
    # Two torchrun agents, one per node, each the parent of that node's ranks: c10d assigns
    # node ranks, and each node holds a contiguous block of ranks with local ranks 0, 1.
    by_agent: dict[int, set[tuple[int, int, int]]] = {}
    for rank, r in enumerate(records):
        by_agent.setdefault(r["ppid"], set()).add((rank, r["group_rank"], r["local_rank"]))
    assert sorted(sorted(t) for t in by_agent.values()) == [[(0, 0, 0), (1, 0, 1)], [(2, 1, 0), (3, 1, 1)]]
    # pdsh prefixes each line with the node it came from. Two nodes print at once, so a line
    # may arrive split; every whole line must name one node's own block of ranks.
    by_node: dict[str, set[tuple[int, int, int]]] = {}
    for node, rank, group, local in re.findall(
        r"(node\d): scaling-test-rank rank=(\d) group_rank=(\d) local_rank=(\d)", out
    ):
        by_node.setdefault(node, set()).add((int(rank), int(group), int(local)))
    assert by_node, out[-2000:]
    for triples in by_node.values():
        (group,) = {g for _, g, _ in triples}
        assert triples <= {(2 * group, group, 0), (2 * group + 1, group, 1)}
