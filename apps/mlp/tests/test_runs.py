"""The same command run again in one folder, as a user would: resume, then "already finished"."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest
import yaml
from mlp_testlib import small_config


def _run(tmp_path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaling.mlp", "c.yml", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_the_mlp_app_run_three_times_in_one_folder_resumes_then_says_it_is_finished(tmp_path):
    cfg = small_config(dp=2, steps=8, trainer={"save_dir": "runs/ckpt", "save_interval": 4, "log_interval": 1})
    cfg["logger"]["log_dir"] = "runs/logs"
    # The suite's slowest test runs beside the others: under that load one rank once reached the
    # third run's checkpoint verification over 60 s after its peer (a gloo timeout, not a resume bug).
    cfg["topology"]["timeout_seconds"] = 180
    (tmp_path / "c.yml").write_text(yaml.safe_dump(cfg))

    first = _run(tmp_path, "trainer.train_iterations=4")  # a run that ended early (stopped at step 4)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[0] == "scaling.mlp: checking c.yml with trainer.train_iterations=4"
    assert (
        lines[1] == "scaling.mlp: launching 2 rank(s) (dp 2), 4 steps; metrics in runs/logs, checkpoints in runs/ckpt"
    )
    progress = [line for line in first.stderr.splitlines() if re.match(r"\d\d:\d\d:\d\d step \d+/4 \| loss ", line)]
    assert len(progress) == 4 and all(len(line) <= 120 for line in progress), progress
    assert re.search(r"\| eta \d+s$", progress[0]) and "eta" not in progress[-1]  # none left to estimate
    assert re.search(r" done: step 4/4 \(4 trained in \d+s\) \| loss [\d.]+ \| checkpoint runs/ckpt/step_00000004 "
                     r"\| metrics runs/logs/metrics.jsonl$", first.stderr, re.M), first.stderr[-2000:]  # fmt: skip

    second = _run(tmp_path)  # the full command: continues from step 4
    assert second.returncode == 0, second.stderr[-3000:]
    assert "loaded checkpoint step 4 from runs/ckpt" in second.stderr
    assert re.search(r"step 5/8 \| loss ", second.stderr) and not re.search(r"step [1-4]/8 ", second.stderr)
    assert " done: step 8/8 (4 trained in " in second.stderr

    third = _run(tmp_path)  # the same command once more: nothing left
    assert third.returncode == 0, third.stderr[-3000:]
    assert "nothing to train: the run already reached step 8 of trainer.train_iterations=8" in third.stderr
    assert not re.search(r"step \d+/8 \|", third.stderr)  # no step trained

    rows = [json.loads(line) for line in (tmp_path / "runs/logs/metrics.jsonl").read_text().splitlines()]
    training = [r["step"] for r in rows if "training/loss" in r]
    assert training == list(range(1, 9)) and max(Counter(training).values()) == 1  # one row a step
    assert len({r["run"] for r in rows}) == 2  # the rows name the two attempts that trained
