"""A real two-"node" run on one machine: pdsh's exec module starts torchrun once per node.

pdsh -R exec runs each node's command here instead of over ssh, so the whole launch path
(pdsh fan-out, the shell command, c10d rendezvous across two torchrun agents) is real.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from scaling.runner import RunnerConfig, free_port, runner_main

pytestmark = pytest.mark.skipif(
    shutil.which("pdsh") is None, reason="pdsh is not installed; apt-get install -y pdsh (see README)"
)


def _free_port() -> int:
    return free_port()  # below the ephemeral range: no outgoing connection takes it before torchrun binds


# Secrets under names of every kind: the runner's by-name rule, names it did not list before
# (AWS, Django, a GitHub PAT), and a random-looking value under a plain name.
SECRETS = {
    "HF_TOKEN": "pdsh-secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
    "DJANGO_SECRET_KEY": "django-secret-value",
    "GITHUB_PAT": "github-pat-value",
    "MY_SETTING": "Zx8Kq2Lm9Np4Rt7Vw1Yb3Cd6Fg",
}


@pytest.mark.slow
def test_two_nodes_two_processes_each(worker_script, tmp_path, monkeypatch, capfd):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PLAIN_SETTING", "plain-value")
    forwarded = [*SECRETS, "PLAIN_SETTING"]
    payload = {"out_dir": str(tmp_path), "steps": 5, "lr": 0.3, "echo_env": forwarded}
    cfg = RunnerConfig(
        runner_type="pdsh", pdsh_rcmd="exec", script=worker_script, hosts=["node1 slots=2", "node2 slots=2"],
        master_addr="127.0.0.1", master_port=_free_port(), env_forward=forwarded,
    )  # fmt: skip
    assert runner_main(cfg, payload) == 0
    out = capfd.readouterr().out
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["world_size"] for r in records} == {4}
    assert all(r["allreduce"] == 6.0 for r in records)
    assert len({(r["w"], r["b"]) for r in records}) == 1  # every rank holds the same trained model
    for r in records:
        assert r["env"] == {**SECRETS, "PLAIN_SETTING": "plain-value"}  # every variable arrived
        # What `ps` shows of the rank, torchrun's agent, the node's shell and pdsh: no secret value.
        assert any(c.startswith("pdsh ") for c in r["cmdlines"]), r["cmdlines"]
        assert any("PLAIN_SETTING=plain-value" in c for c in r["cmdlines"])  # plain ones may travel in argv
        for cmdline in r["cmdlines"]:
            assert not [name for name, value in SECRETS.items() if value in cmdline], cmdline
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
