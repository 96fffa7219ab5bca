"""Secrets never land in output, logs, configs, checkpoints or W&B files (docs/reliability.md 13).

``WANDB_API_KEY``, ``FOO_TOKEN`` and ``BAR_PASSWORD`` hold unique sentinels in the environment
of ``scaling-run``; a dry run, then 2 training steps at DEBUG log level with an offline W&B
run, metrics.jsonl and a checkpoint per step. Afterwards no captured output and no file under
the test's folder (payload config, run output, logs, W&B dirs, checkpoints) holds a sentinel,
in plain text or base64, while every worker proves it could read each one (its sha256).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import uuid

import pytest
from reliability_testlib import cli_config, config, reap, start_cli, worker_pids

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NAMES = ("WANDB_API_KEY", "FOO_TOKEN", "BAR_PASSWORD")


def test_secrets_appear_nowhere_yet_reach_the_worker(tmp_path):
    secrets = {name: uuid.uuid4().hex + uuid.uuid4().hex[:8] for name in NAMES}  # 40 characters, like a W&B key
    wandb_dirs = {f"WANDB_{k}_DIR": str(tmp_path / "wandb-env" / k.lower()) for k in ("", "CACHE", "CONFIG", "DATA")}
    wandb_dirs["WANDB_DIR"] = wandb_dirs.pop("WANDB__DIR")
    env = {**os.environ, **secrets, **wandb_dirs}
    out, ckpt, logs = tmp_path / "out", tmp_path / "ckpt", tmp_path / "logs"
    cfg = config(
        tmp_path,
        steps=2,
        tp=1,
        dp=2,
        trainer={"save_dir": str(ckpt), "save_interval": 1},
        logger={"log_dir": str(logs), "use_wandb": True, "wandb_mode": "offline", "log_level": "DEBUG"},
    )
    path = cli_config(tmp_path / "run.json", cfg, out, echo_env_hash=list(NAMES))
    data = json.loads(path.read_text())
    data["runner"]["env_forward"] = ["WANDB_*", "*_TOKEN", "*_PASSWORD"]
    path.write_text(json.dumps(data))

    dry = start_cli(path, tmp_path / "dry", "--dry-run", env=env)
    assert dry.wait(timeout=120) == 0, (tmp_path / "dry" / "runner.err").read_text()
    assert "scaling.runner.torchrun" in (tmp_path / "dry" / "runner.out").read_text()
    run = start_cli(path, tmp_path / "run", env=env)
    try:
        assert run.wait(timeout=600) == 0, (tmp_path / "run" / "runner.err").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
        if (out / "rank1.json").exists():
            reap(worker_pids(out, 2))

    # The run really produced what is swept: W&B offline files, metrics, committed checkpoints.
    assert list(logs.rglob("*.wandb")), sorted(str(p) for p in logs.rglob("*"))
    assert (logs / "metrics.jsonl").is_file()
    assert (ckpt / "step_00000002" / "commit.json").is_file()
    # Each worker read every secret from its environment.
    for rank in range(2):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["env_sha256"] == {k: hashlib.sha256(v.encode()).hexdigest() for k, v in secrets.items()}
    # No file anywhere under the test's folder (runner output included) holds a secret.
    needles = [form for v in secrets.values() for form in (v.encode(), base64.b64encode(v.encode()))]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 20, files
    leaks = [(str(p), n) for p in files for n in needles if n in p.read_bytes()]
    assert not leaks, leaks
