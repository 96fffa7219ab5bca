"""The GPU tier and the prepared GPU check behave on a machine without CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


@pytest.mark.slow
def test_gpu_check_says_there_is_no_gpu_in_one_line_and_exits_0(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check"), str(tmp_path / "report")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"gpu_check: no CUDA device here (torch.cuda.is_available() is not True for {sys.executable}); nothing to check"
    ]
    assert not (tmp_path / "report").exists()


@pytest.mark.slow
def test_gpu_tier_collects_at_least_13_tests_that_skip_with_the_reason():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED [")]
    assert sum(int(line.split("[")[1].split("]")[0]) for line in skipped) >= 13, out.stdout
    assert all("needs a CUDA device; none is present on this machine" in line for line in skipped), skipped
    assert " passed" not in out.stdout and " failed" not in out.stdout
