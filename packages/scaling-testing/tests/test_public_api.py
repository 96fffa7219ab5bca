import scaling.testing


def test_public_api():
    assert sorted(scaling.testing.__all__) == [
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
