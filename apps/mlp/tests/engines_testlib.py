"""Real engines for the launcher's tests: a two-node SLURM cluster and a container image, on this machine.

- :func:`slurm_cluster` starts munged, slurmctld and two slurmd (nodes ``n1`` and ``n2``,
  both this machine: Debian's slurm-wlm runs several slurmd per host) from a private
  directory, with their own munge socket and free ports, so nothing outside it is touched.
  Needs root and the Debian packages slurm-wlm and munge (``.ci/run`` installs them).
- :func:`skeleton_image` makes an image offline with ``podman import`` from a tar holding
  only the directory skeleton; the tests bind-mount the host's ``/usr``, Python, the
  project's environment and checkout at their own paths (nothing can be pulled here).
  Needs podman with the runc runtime (``.ci/run`` installs and configures it).

Where an engine cannot run here, each raises :class:`EngineMissing` saying what to install;
the tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaling.runner import free_port

SLURM_PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo")
IMAGE = "localhost/scaling-test:skeleton"


class EngineMissing(RuntimeError):
    """The engine cannot run on this machine (the message says what to install)."""


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:  # below the ephemeral range, where outgoing connections never take them
        ports.add(free_port())
    return sorted(ports)


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster: ``env`` points SLURM's commands (and the runner's sbatch) at it."""

    directory: Path
    env: dict[str, str]

    def run(self, *argv: str) -> str:
        return subprocess.run(argv, env={**os.environ, **self.env}, check=True, capture_output=True, text=True).stdout


def _slurm_conf(d: Path, nodes: int) -> str:
    ctld, slurmd, *node_ports = _free_ports(2 + nodes)
    host, cpus = socket.gethostname().split(".")[0], os.cpu_count() or 1
    lines = [
        "ClusterName=scalingtest", f"SlurmctldHost={host}", f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={d / 'munge.socket'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none", "ReturnToService=2", "KillWait=30",
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool-%n'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd-%n.log'}",
    ]  # fmt: skip
    names = [f"n{i + 1}" for i in range(nodes)]
    lines += [
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"
        for name, port in zip(names, node_ports)
    ]
    lines.append(f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def slurm_cluster(directory: Path, nodes: int = 2) -> Iterator[SlurmCluster]:
    """A SLURM cluster of ``nodes`` nodes on this machine, stopped (every daemon killed) on exit."""
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing:
        raise EngineMissing(f"{', '.join(missing)} not installed; apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        raise EngineMissing("the test cluster's slurmd runs jobs as any user and needs root")
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)  # munged refuses a socket directory others can write to
    (d / "state").mkdir(exist_ok=True)
    subprocess.run(["mungekey", "--create", "--force", "--keyfile", str(d / "munge.key")], check=True)
    munge = [f"--socket={d / 'munge.socket'}", f"--key-file={d / 'munge.key'}", f"--pid-file={d / 'munged.pid'}"]
    munge += [f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}", "--force"]
    (d / "slurm.conf").write_text(_slurm_conf(d, nodes))
    env = {"SLURM_CONF": str(d / "slurm.conf")}
    cluster = SlurmCluster(d, env)
    daemons = [["munged", *munge], ["slurmctld", "-f", str(d / "slurm.conf")]]
    daemons += [["slurmd", "-f", str(d / "slurm.conf"), "-N", f"n{i + 1}"] for i in range(nodes)]
    try:
        for argv in daemons:
            subprocess.run(argv, env={**os.environ, **env}, check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while cluster.run("sinfo", "-h", "-o", "%T %D").split() != ["idle", str(nodes)]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the SLURM nodes did not come up: {cluster.run('sinfo')}")
            time.sleep(0.5)
        yield cluster
    finally:
        for pid_file in d.glob("*.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError, FileNotFoundError):
                os.kill(int(pid_file.read_text().split()[0]), 9)


def skeleton_image() -> str:
    """Import :data:`IMAGE` (an empty root filesystem) with podman; return its name."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        raise EngineMissing("podman or runc not installed; apt-get install -y podman runc (see .ci/run)")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("usr", "etc", "tmp", "root", "proc", "sys", "dev", "run", "var/tmp"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if "tmp" in name else 0o755
            tar.addfile(info)
        for name in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, f"usr/{name}"
            tar.addfile(info)
    subprocess.run(["podman", "import", "-", IMAGE], input=buffer.getvalue(), check=True, capture_output=True)
    return IMAGE


def host_mounts(*extra: Path) -> list[list[str]]:
    """Bind mounts that make this process's Python environment and checkout work inside the image."""
    paths = {Path("/usr"), Path(sys.base_prefix), Path(sys.prefix), Path(__file__).resolve().parents[3], *extra}
    return [[str(p), str(p)] for p in sorted(paths)]
