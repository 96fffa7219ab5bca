"""A script written from the walkthrough's code blocks runs with only its imports changed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlp_testlib import small_config, write_mnist

HERE = Path(__file__).parent / "walkthrough"


@pytest.mark.slow
def test_walkthrough_script_trains(tmp_path):
    write_mnist(tmp_path, n_train=40, n_test=20)
    cfg = small_config(pp=2, steps=4, data={"mnist_path": str(tmp_path)})
    cfg["topology"].update(global_batch_size=8, micro_batch_size=4)
    cfg["runner"]["script"] = str(HERE / "train.py")
    cfg["logger"]["log_dir"] = str(tmp_path / "log")
    cfg["trainer"]["log_interval"] = 1
    (tmp_path / "config.yml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, str(HERE / "run.py"), str(tmp_path / "config.yml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["training/loss"] for r in rows if "training/loss" in r]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
