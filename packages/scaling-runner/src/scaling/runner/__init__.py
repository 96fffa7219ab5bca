"""scaling.runner: launch a training script with torchrun locally, via pdsh (+docker) or SLURM.

Names load on first use (PEP 562): a worker's ``load_payload`` and each node's
``python -m scaling.runner.torchrun`` agent import neither pydantic nor the config layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers and editors (__all__ exports them)
    from scaling.runner._cli import main
    from scaling.runner._commands import Launch, free_port
    from scaling.runner._config import DockerConfig, LaunchedConfig, RunnerConfig, SlurmConfig
    from scaling.runner._env import SECRET_PATTERNS, is_secret
    from scaling.runner._failures import RankFailure
    from scaling.runner._hosts import HostSpec
    from scaling.runner._main import plan, runner_main
    from scaling.runner._payload import PAYLOAD_INLINE_ENV, PAYLOAD_PATH_ENV, load_payload

_HOMES = {
    "main": "_cli",
    "Launch": "_commands",
    "free_port": "_commands",
    "DockerConfig": "_config",
    "LaunchedConfig": "_config",
    "RunnerConfig": "_config",
    "SlurmConfig": "_config",
    "SECRET_PATTERNS": "_env",
    "is_secret": "_env",
    "RankFailure": "_failures",
    "HostSpec": "_hosts",
    "plan": "_main",
    "runner_main": "_main",
    "PAYLOAD_INLINE_ENV": "_payload",
    "PAYLOAD_PATH_ENV": "_payload",
    "load_payload": "_payload",
}

__all__ = [
    "PAYLOAD_INLINE_ENV",
    "PAYLOAD_PATH_ENV",
    "SECRET_PATTERNS",
    "DockerConfig",
    "HostSpec",
    "Launch",
    "LaunchedConfig",
    "RankFailure",
    "RunnerConfig",
    "SlurmConfig",
    "free_port",
    "is_secret",
    "load_payload",
    "main",
    "plan",
    "runner_main",
]


# Any: a module __getattr__ returns whichever name was asked for (mypy types each name
# from its definition; this is only the fallback for imports at run time).
def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'scaling.runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"scaling.runner.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
