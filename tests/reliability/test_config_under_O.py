"""Every user config refuses bad input identically under ``python -O`` (no validation rests on assert)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("config_checks.py")


@pytest.mark.slow
def test_every_config_is_validated_the_same_under_python_O():
    runs = {}
    for flags in ([], ["-O"]):
        out = subprocess.run(
            [sys.executable, *flags, str(SCRIPT)], capture_output=True, text=True, timeout=180, check=True
        )
        runs[tuple(flags)] = json.loads(out.stdout)
    plain, optimised = runs[()], runs[("-O",)]
    assert optimised == plain
    assert not [e for e in plain if "ACCEPTED" in e], plain
    names = {e.split(":", 1)[0] for e in plain}
    assert names == {
        "TopologyConfig", "OptimizerConfig", "LearningRateSchedulerConfig", "TrainerConfig", "RunnerConfig",
        "MLPConfig", "TransformerConfig",
    }  # fmt: skip
    assert "abcd1234" not in json.dumps(plain)  # the runner.env secret is masked there too
