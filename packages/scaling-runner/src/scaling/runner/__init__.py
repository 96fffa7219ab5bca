"""scaling.runner: launch a training script with torchrun locally, via pdsh (+docker) or SLURM."""

from scaling.runner._cli import main
from scaling.runner._commands import Launch
from scaling.runner._config import DockerConfig, RunnerConfig, SlurmConfig
from scaling.runner._env import SECRET_PATTERNS, is_secret
from scaling.runner._failures import RankFailure
from scaling.runner._hosts import HostSpec
from scaling.runner._main import plan, runner_main
from scaling.runner._payload import PAYLOAD_INLINE_ENV, PAYLOAD_PATH_ENV, load_payload

__all__ = [
    "PAYLOAD_INLINE_ENV",
    "PAYLOAD_PATH_ENV",
    "SECRET_PATTERNS",
    "DockerConfig",
    "HostSpec",
    "Launch",
    "RankFailure",
    "RunnerConfig",
    "SlurmConfig",
    "is_secret",
    "load_payload",
    "main",
    "plan",
    "runner_main",
]
