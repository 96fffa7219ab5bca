"""Build the commands of a run as argument lists: torchrun, pdsh, docker, srun and sbatch.

Nothing here starts a process; :func:`build_launches` is pure given the config, the
payload variables and the launching environment, so ``--dry-run`` prints exactly what
:func:`runner_main` would run.
"""

from __future__ import annotations

import os
import random
import shlex
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from scaling.runner._config import RunnerConfig
from scaling.runner._env import mask_env, select_forwarded, split_secrets
from scaling.runner._hosts import HostSpec

DEFAULT_REMOTE_PORT = 29500


@dataclass(frozen=True)
class Launch:
    """One command the runner starts on this machine.

    Attributes:
        label: short name used to prefix output when several launches run together.
        argv: the argument list given to ``subprocess.Popen`` (never holds a secret value).
        env: variables added to this machine's environment for the command (may hold secrets).
        node_commands: ``(node, command)`` pairs: what each node runs, for the dry-run print.
        files: ``(path, content)`` pairs written before the command starts (an sbatch script).
        follow: a file the command's real output goes to (a SLURM job's), shown and read
            while the command runs as if it were the command's stderr.
    """

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    node_commands: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    follow: str | None = None

    def describe(self) -> str:
        """A printable description with every secret value masked."""
        lines = [f"# {self.label}"]
        if self.env:
            shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(mask_env(self.env).items()))
            lines.append(f"# environment added: {shown}")
        lines.append(shlex.join(self.argv))
        lines.extend(f"#   {node}: {cmd}" for node, cmd in self.node_commands)
        for path, content in self.files:
            lines.append(f"# file {path}:")
            lines.extend(f"#   {line}" for line in content.splitlines())
        return "\n".join(lines)


def torchrun_argv(python: str, config: RunnerConfig, nnodes: int, nproc: int, endpoint: str, run_id: str) -> list[str]:
    """torchrun (``python -m scaling.runner.torchrun``: torchrun's agent, reporting failed ranks as JSON lines)
    with c10d rendezvous at ``endpoint``."""
    script = config.require_script()
    return [
        python, "-m", "scaling.runner.torchrun",
        "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--max-restarts", str(config.max_restarts),
        script, *config.script_args,
    ]  # fmt: skip


def docker_argv(
    config: RunnerConfig, run_id: str, env: Mapping[str, str], secret_names: list[str], inner: list[str]
) -> list[str]:
    """``docker run --network host`` around ``inner``; secrets are passed by name only (``-e NAME``).

    The container carries the label ``scaling.run_id=<run_id>``:
    ``docker stop $(docker ps -q --filter label=scaling.run_id=<run_id>)`` stops a run's containers.
    """
    dc = config.docker_config
    assert dc is not None  # guaranteed by RunnerConfig validation for pdsh_docker
    argv = ["sudo"] if dc.sudo else []
    argv += [dc.command, "run", "--rm", "--network", "host", "--ipc", "host", "--label", f"scaling.run_id={run_id}"]
    if dc.gpus is not None:
        argv += ["--gpus", dc.gpus]
    for host_path, container_path in dc.mounts:
        argv += ["-v", f"{host_path}:{container_path}"]
    for name, value in env.items():
        argv += ["-e", f"{name}={value}"]
    for name in secret_names:
        argv += ["-e", name]
    if dc.workdir is not None:
        argv += ["-w", dc.workdir]
    return [*argv, *dc.extra_args, dc.image, *inner]


def build_launches(
    config: RunnerConfig, run_id: str, payload_env: Mapping[str, str], environ: Mapping[str, str], port: int
) -> list[Launch]:
    """The commands that run ``config`` (local, pdsh, docker; SLURM's are in ``_slurm``); ``port`` is chosen."""
    hosts = config.host_specs()
    forwarded = select_forwarded(environ, config.env_forward)
    plain_fwd, secret_fwd = split_secrets(forwarded)
    node_env = {**plain_fwd, **config.env, **payload_env}
    python = config.python_executable or sys.executable
    if not hosts:
        endpoint = f"{config.master_addr or '127.0.0.1'}:{port}"
        if config.runner_type == "pdsh_docker":
            assert config.docker_config is not None
            inner = torchrun_argv(
                config.docker_config.python_executable, config, 1, config.nproc_per_node, endpoint, run_id
            )
            argv = docker_argv(config, run_id, node_env, sorted(secret_fwd), inner)
            return [Launch("docker on this machine", tuple(argv), {})]
        argv = torchrun_argv(python, config, 1, config.nproc_per_node, endpoint, run_id)
        return [Launch(f"local: {config.nproc_per_node} processes", tuple(argv), {**config.env, **payload_env})]
    endpoint = f"{config.master_addr or hosts[0].name}:{port}"
    launches = []
    for slots, group in _group_by_slots(hosts):
        inner = torchrun_argv(python, config, len(hosts), slots, endpoint, run_id)
        if config.runner_type == "pdsh_docker":
            assert config.docker_config is not None
            inner = torchrun_argv(config.docker_config.python_executable, config, len(hosts), slots, endpoint, run_id)
            remote = "exec " + shlex.join(docker_argv(config, run_id, node_env, sorted(secret_fwd), inner))
        else:
            env_words = [f"{k}={v}" for k, v in node_env.items()]
            remote = f"cd {shlex.quote(config.workdir or os.getcwd())} && exec " + shlex.join(
                ["env", *env_words, *inner]
            )
        launches.append(_pdsh_launch(config, group, slots, remote, sorted(secret_fwd), environ))
    return launches


def _pdsh_launch(
    config: RunnerConfig,
    group: list[HostSpec],
    slots: int,
    remote: str,
    secret_names: list[str],
    environ: Mapping[str, str],
) -> Launch:
    names = [h.name for h in group]
    # -f: pdsh's fanout must cover every host, else late hosts wait for early ones that wait for the rendezvous.
    argv = ["pdsh", "-S", "-f", str(len(names)), "-R", config.pdsh_rcmd, "-w", ",".join(names)]
    env: dict[str, str] = {}
    if config.pdsh_rcmd == "exec":
        # exec runs argv without a shell and substitutes %h/%u/%n in it: give it a shell, keep '%' literal.
        argv += ["sh", "-c", remote.replace("%", "%%")]
    else:
        # ssh/rsh hand the joined arguments to the remote login shell: one pre-quoted string.
        argv.append(remote)
        if secret_names and config.pdsh_rcmd == "ssh":
            # Secret values go over the ssh channel (sshd must AcceptEnv them), never on the command line.
            send = " ".join(f"-o SendEnv={n}" for n in secret_names)
            env["PDSH_SSH_ARGS_APPEND"] = f"{environ.get('PDSH_SSH_ARGS_APPEND', '')} {send}".strip()
    label = f"pdsh {','.join(names)}: {len(names)} node(s) x {slots} processes"
    return Launch(label, tuple(argv), env, tuple((n, remote) for n in names))


def _group_by_slots(hosts: list[HostSpec]) -> list[tuple[int, list[HostSpec]]]:
    # One pdsh command runs the same torchrun everywhere, so hosts with different slots need separate commands.
    groups: dict[int, list[HostSpec]] = {}
    for host in hosts:
        groups.setdefault(host.slots, []).append(host)
    return list(groups.items())


def free_port() -> int:
    """A TCP port free on this machine right now, below the kernel's ephemeral range.

    The kernel's own pick (``bind(0)``) comes from the ephemeral range, where any outgoing
    connection may take the port again before the rendezvous binds it (seen in CI: a SLURM
    job's torchrun failed with EADDRINUSE while other runs' gloo connections came and went).
    Below that range only a listener binds, so a port free now stays free unless a listener
    picks the same one.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(_PORTS_FROM, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every try taken: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PORTS_FROM = 20_000  # above the well-known and most registered services' ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return low if low > _PORTS_FROM + 1000 else 32_768
