"""RunnerConfig, DockerConfig and SlurmConfig: how and where the training script is launched; LaunchedConfig."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from scaling.config import BaseConfig
from scaling.runner._env import check_args, check_env_name, check_env_pattern, is_secret
from scaling.runner._hosts import HostSpec, check_host_name, parse_hosts, read_hostsfile

RunnerType = Literal["local", "pdsh", "pdsh_docker", "slurm"]
_RUN_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
DEFAULT_ENV_FORWARD = ["PYTHONPATH", "OMP_NUM_THREADS", "NCCL_*", "GLOO_*", "TORCH_*", "WANDB_API_KEY", "HF_TOKEN"]


class DockerConfig(BaseConfig):
    """How ``pdsh_docker`` wraps torchrun in ``docker run --network host`` on every node."""

    image: str = Field(..., min_length=1, description="Container image with the training code, e.g. 'registry/x:1.0'.")
    mounts: list[tuple[str, str]] = Field(
        default_factory=list,
        description="Bind mounts as [host_path, container_path] pairs; both absolute, no ':' (docker -v syntax).",
    )
    command: str = Field(
        "docker",
        min_length=1,
        description="The docker-compatible CLI on the nodes: 'docker', or 'podman' (or a path to either).",
    )
    sudo: bool = Field(False, description="Prefix 'sudo' to the docker command (hosts where docker needs root).")
    gpus: str | None = Field(
        None, description="Value of 'docker run --gpus' ('all', '2', 'device=0,1'); None: no GPUs."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Further 'docker run' arguments, inserted before the image, each one argv item.",
    )
    workdir: str | None = Field(None, description="Working directory inside the container (-w); None: the image's.")
    python_executable: str = Field(
        "python", min_length=1, description="Python inside the container that runs torchrun."
    )

    @field_validator("command", "image")
    @classmethod
    def _one_word(cls, value: str, info: ValidationInfo) -> str:
        # Both land in docker's argv: a leading '-' would be read as an option.
        if value.startswith("-") or any(c.isspace() for c in value):
            example = "'docker' or 'podman'" if info.field_name == "command" else "'repo/name:tag'"
            raise ValueError(
                f"docker {info.field_name} {value!r} must not start with '-' or contain spaces; e.g. {example}"
            )
        return value

    @field_validator("mounts")
    @classmethod
    def _check_mounts(cls, mounts: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for i, (host, container) in enumerate(mounts):
            for side, path in (("host", host), ("container", container)):
                if not path.startswith("/") or ":" in path or "\n" in path or "\x00" in path:
                    raise ValueError(
                        f"mounts[{i}] {side} path {path!r} must be absolute and contain no ':' or newline "
                        f"(docker -v splits on ':'); e.g. ['/data/set', '/dataset']"
                    )
        return mounts

    @field_validator("extra_args")
    @classmethod
    def _no_secret_in_args(cls, value: list[str]) -> list[str]:
        return check_args(value, "docker_config.extra_args")


class SlurmConfig(BaseConfig):
    """The allocation ``runner_type='slurm'`` asks ``sbatch`` for (ignored inside an allocation's srun)."""

    num_nodes: int = Field(1, gt=0, description="Nodes to allocate (sbatch --nodes); one torchrun agent per node.")
    job_name: str = Field("scaling", description="sbatch --job-name.")
    partition: str | None = Field(None, description="sbatch --partition; None: the cluster default.")
    account: str | None = Field(None, description="sbatch --account; None: the user's default.")
    time_limit: str | None = Field(None, description="sbatch --time, e.g. '2-00:00:00'; None: partition default.")
    gpus_per_node: int | None = Field(None, ge=0, description="sbatch --gpus-per-node; None: do not request GPUs.")
    output: str | None = Field(None, description="sbatch --output file pattern, e.g. 'logs/%j.out'; None: default.")
    extra_args: list[str] = Field(
        default_factory=list, description="Further sbatch options, one per item ('--qos=hi')."
    )

    @field_validator("job_name", "partition", "account", "time_limit", "output")
    @classmethod
    def _single_line(cls, value: str | None) -> str | None:
        # These land on '#SBATCH' lines of a generated script: one line, no shell quoting there.
        if value is not None and (not value or any(c in value for c in "\n\r\x00 '\"$`\\;")):
            raise ValueError(f"{value!r} must be non-empty, one word, without quotes, '$', '`', ';' or '\\'")
        return value

    @field_validator("extra_args")
    @classmethod
    def _args_single_line(cls, value: list[str]) -> list[str]:
        for arg in value:
            if "\n" in arg or "\r" in arg or not arg.startswith("-"):
                raise ValueError(f"extra_args item {arg!r} must be one '--option=value' on one line")
        return check_args(value, "slurm_config.extra_args")


class RunnerConfig(BaseConfig):
    """Where and how :func:`runner_main` starts the training script.

    Every process runs ``script`` under torchrun (``python -m scaling.runner.torchrun``), reads
    its rank from the torchrun environment and the payload with :func:`load_payload`.

    Example::

        cfg = RunnerConfig(script="train.py", nproc_per_node=4)  # local, 4 processes
        cfg = RunnerConfig(runner_type="pdsh", script="/opt/app/train.py",
                           hosts=["node-01 slots=8", "node-02 slots=8"])
    """

    runner_type: RunnerType = Field(
        "local",
        description="'local': torchrun on this machine; 'pdsh': torchrun on every host through pdsh; "
        "'pdsh_docker': the same inside 'docker run' (on this machine if hosts is None); 'slurm': sbatch/srun.",
    )
    script: str | None = Field(
        None,
        description="Training script every process runs (a path on the nodes); None: none yet (launching needs one).",
    )
    script_args: list[str] = Field(default_factory=list, description="Arguments passed to the script after its path.")
    hosts: list[str] | None = Field(
        None, description="Hosts as 'name slots=N' (slots defaults to nproc_per_node); None: see hostsfile."
    )
    hostsfile: str | None = Field(
        None, description="MPI-style file with one 'name slots=N' per line ('#' comments); exclusive with hosts."
    )
    nproc_per_node: int = Field(
        1, gt=0, description="Processes per node for 'local' and 'slurm', and the slots of a host without 'slots='."
    )
    master_addr: str | None = Field(
        None, description="Rendezvous host (c10d store). None: 127.0.0.1 locally, else the first host / node."
    )
    master_port: int | None = Field(
        None, ge=1, le=65535, description="Rendezvous port. None: a free port locally, 29500 across nodes."
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description=(
            "torchrun --max-restarts: restarts of the worker group after a rank fails, >= 0; a restarted group "
            "resumes from the trainer's in-memory copies (trainer.memory_checkpoint_interval)."
        ),
    )
    run_id: str | None = Field(None, description="Rendezvous id shared by all nodes; None: a fresh random id per run.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra non-secret environment variables for every process."
    )
    env_forward: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ENV_FORWARD),
        description="Names or 'PREFIX_*' patterns of launching-environment variables forwarded to remote processes; "
        "secrets among them (WANDB_API_KEY, *_TOKEN, *_PASSWORD) travel only in the environment.",
    )
    python_executable: str | None = Field(
        None, description="Python that runs torchrun on the nodes. None: this interpreter (sys.executable)."
    )
    workdir: str | None = Field(None, description="Directory to cd into on every node. None: the current directory.")
    payload_dir: str | None = Field(
        None,
        description="Directory for the payload file (must be visible to all nodes). None: a temp dir for 'local', "
        "'./.scaling-run' for 'slurm', and inline in the environment for pdsh runs.",
    )
    pdsh_rcmd: Literal["ssh", "rsh", "exec"] = Field(
        "ssh", description="pdsh -R module: 'ssh' (default), 'rsh', or 'exec' (runs the node commands locally)."
    )
    teardown_timeout_s: float = Field(
        30.0, ge=0, description="Seconds the other node groups get to exit after one fails before they are stopped."
    )
    docker_config: DockerConfig | None = Field(None, description="Container settings; required for 'pdsh_docker'.")
    slurm_config: SlurmConfig = Field(default_factory=SlurmConfig, description="Allocation for 'slurm'.")

    @field_validator("master_addr")
    @classmethod
    def _check_master(cls, value: str | None) -> str | None:
        return None if value is None else check_host_name(value, "master_addr")

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str | None) -> str | None:
        if value is not None and not _RUN_ID_RE.fullmatch(value):
            raise ValueError(f"run_id={value!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")
        return value

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            check_env_name(name, "env")
            if is_secret(name, value):
                what = "by its name" if is_secret(name) else "by its value (a key or token)"
                raise ValueError(
                    f"env: {name!r} looks like a secret {what} and would be written into the config, the payload and command lines; "
                    f"export it in the launching environment instead and list it in env_forward"
                )
            if "\x00" in value:
                raise ValueError(f"env: value of {name!r} contains a NUL byte")
        return env

    @field_validator("script_args")
    @classmethod
    def _no_secret_in_script_args(cls, value: list[str]) -> list[str]:
        return check_args(value, "script_args", by_value=False)  # a script's own values may look random

    @field_validator("env_forward")
    @classmethod
    def _check_forward(cls, patterns: list[str]) -> list[str]:
        return [check_env_pattern(p, "env_forward") for p in patterns]

    @model_validator(mode="after")
    def _check_combination(self) -> RunnerConfig:
        # script=None is allowed here (RunnerConfig() as a default in a config class); launching
        # without one fails in require_script, before anything starts.
        if self.script is not None and not self.script.strip():
            raise ValueError(f"script={self.script!r} is empty; set runner.script to the training script to run")
        if self.script is not None and self.script.startswith("-"):
            raise ValueError(
                f"script={self.script!r} starts with '-' and would be read as a torchrun option; use ./{self.script}"
            )
        if self.hosts is not None and self.hostsfile is not None:
            raise ValueError(
                f"hosts={self.hosts!r} and hostsfile={self.hostsfile!r} are both set; give one of them, not both"
            )
        has_hosts = self.hosts is not None or self.hostsfile is not None
        if has_hosts and self.runner_type in ("local", "slurm"):
            raise ValueError(
                f"runner_type={self.runner_type!r} does not take hosts/hostsfile "
                f"({'this machine' if self.runner_type == 'local' else 'SLURM picks the nodes'}); "
                f"remove them or use runner_type='pdsh'"
            )
        if self.runner_type == "pdsh_docker" and self.docker_config is None:
            raise ValueError("runner_type='pdsh_docker' needs docker_config (at least docker_config.image)")
        if (
            self.runner_type == "local"
            and self.script is not None
            and not Path(self.workdir or ".", self.script).is_file()
        ):
            raise ValueError(
                f"script={self.script!r} does not exist on this machine; give the path of the training script"
            )
        self.host_specs()  # parse now so that a bad host or hostsfile fails before any launch
        return self

    def require_script(self) -> str:
        """The script to launch.

        Raises:
            ValueError: when none is set (the launch stops before starting anything).
        """
        if self.script is None:
            raise ValueError("script is missing (got None); set runner.script to the training script each process runs")
        return self.script

    def process_count(self) -> int:
        """How many processes the run starts: the world size it gives the training script."""
        hosts = self.host_specs()
        if hosts:
            return sum(h.slots for h in hosts)
        nodes = self.slurm_config.num_nodes if self.runner_type == "slurm" else 1
        return nodes * self.nproc_per_node

    def check_world_size(self, world_size: int, source: str = "topology.world_size") -> None:
        """Raise before anything launches when the run would start another number of processes.

        Raises:
            ValueError: naming the runner fields that give the count, their values and the fix.
        """
        count = self.process_count()
        if count == world_size:
            return
        if self.host_specs():
            given = f"the hosts' slots ({', '.join(f'{h.name}={h.slots}' for h in self.host_specs())})"
            fix = f"hosts whose slots add up to {world_size}"
        elif self.runner_type == "slurm":
            given = f"runner.slurm_config.num_nodes={self.slurm_config.num_nodes} × runner.nproc_per_node="
            given += str(self.nproc_per_node)
            fix = f"num_nodes × nproc_per_node = {world_size}"
        else:
            given, fix = f"runner.nproc_per_node={self.nproc_per_node}", f"runner.nproc_per_node={world_size}"
        raise ValueError(
            f"{given} start {count} processes, but {source}={world_size}; set {fix} or change the topology"
        )

    def host_specs(self) -> list[HostSpec]:
        """The parsed hosts (from ``hosts`` or ``hostsfile``); empty when the run stays on this machine.

        Raises:
            ValueError: for a bad host name, ``slots <= 0``, a duplicate host or a missing hostsfile.
        """
        if self.hosts is not None:
            if not self.hosts:
                raise ValueError("hosts=[] lists no host; give at least one 'name slots=N' or set hosts to None")
            return parse_hosts(self.hosts, self.nproc_per_node)
        if self.hostsfile is not None:
            return read_hostsfile(self.hostsfile, self.nproc_per_node)
        return []


class LaunchedConfig(BaseConfig):
    """Base of an app config the runner launches: a ``runner`` section whose script defaults to the app's.

    A subclass sets ``default_script`` (the training script every process runs); a config
    that leaves ``runner.script`` empty gets it, so users only name a script to replace it.
    Compose it with the app's other sections (``class AppConfig(TrainingAppConfig,
    LaunchedConfig)`` puts ``runner`` first: pydantic orders fields from the last base on).
    """

    default_script: ClassVar[Path | None] = None

    runner: RunnerConfig = Field(description="How processes are launched; script defaults to this app's train.py.")

    @model_validator(mode="before")
    @classmethod
    def _default_script(cls, data: object) -> object:
        """Every process runs the app's train.py unless runner.script says otherwise."""
        if isinstance(data, dict) and cls.default_script is not None:
            runner = dict(data.get("runner") or {})
            if not runner.get("script"):
                runner["script"] = str(cls.default_script)
                data = {**data, "runner": runner}
        return data
