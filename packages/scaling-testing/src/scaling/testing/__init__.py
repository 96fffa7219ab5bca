"""scaling.testing: multi-rank test harness and parity helpers (test-time only)."""

from scaling.testing._harness import (
    DEFAULT_TIMEOUT_SECONDS,
    DistributedTestError,
    DistributedTimeoutError,
    WorkerPool,
    preload,
    run_distributed,
    shutdown_workers,
    worker_pids,
)
from scaling.testing._memory import ActivationBytes, PeakBytes
from scaling.testing._parity import assert_parity, make_topology, shard

__all__ = [
    "ActivationBytes",
    "DEFAULT_TIMEOUT_SECONDS",
    "DistributedTestError",
    "DistributedTimeoutError",
    "PeakBytes",
    "WorkerPool",
    "assert_parity",
    "make_topology",
    "preload",
    "run_distributed",
    "shard",
    "shutdown_workers",
    "worker_pids",
]
