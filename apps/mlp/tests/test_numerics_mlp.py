"""The numerics bisector on the MLP app: its 3D layout agrees with one process module by module,
a gradient lost in one layer is named there, and ``scaling-check numerics`` runs both sides
under torchrun and reports the same."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml
from mlp_testlib import small_config

from scaling.testing import run_distributed
from scaling.topology import Topology
from scaling.trainer.numerics import Trace, compare

STEPS = 2


def record_worker(cfg: dict[str, Any], halve_layer: str | None = None) -> Trace | None:
    """``halve_layer``: a module whose weight gradient is halved in backward (an injected bug)."""
    from scaling.mlp.config import MLPConfig
    from scaling.mlp.train import build_trainer
    from scaling.trainer.numerics import NumericsRecorder

    config = MLPConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    try:
        trainer = build_trainer(config, topology)
        for name, param in trainer.parallel_module.named_parameters():
            if halve_layer is not None and name == halve_layer:
                param.register_hook(lambda g: g * 0.5)
        return NumericsRecorder(trainer).run(STEPS)
    finally:
        topology.destroy()


def _traces(halve_layer: str | None = None) -> tuple[Trace, Trace]:
    a = run_distributed(record_worker, 1, small_config(steps=STEPS), timeout_seconds=120)[0]
    b = run_distributed(record_worker, 8, small_config(2, 2, 2, steps=STEPS), halve_layer, timeout_seconds=180)[0]
    assert a is not None and b is not None
    return a, b


@pytest.mark.distributed
@pytest.mark.slow
def test_the_3d_layout_agrees_module_by_module_and_a_halved_gradient_is_named():
    report = compare(*_traces())
    assert report.first is None and report.compared > 30 and not report.only_in_one, report.describe()
    report = compare(*_traces("layers.2.linear.weight"))
    assert report.first is not None, report.describe()
    first = report.first
    assert (first.step, first.quantity, first.name) == (1, "gradient", "layers.2.linear.weight"), report.describe()


@pytest.mark.slow
def test_scaling_check_numerics_runs_both_sides_under_torchrun(tmp_path):
    """The command line: two sides of the MLP app (one process, and dp2 at ZeRO-1), a report on
    stdout, status 0 when they agree; then bf16 against fp32, status 0 with its precision's tolerance."""
    config = tmp_path / "mlp.yml"
    config.write_text(yaml.safe_dump(small_config(steps=STEPS)))
    cmd = [sys.executable, "-m", "scaling.trainer.numerics", "numerics", "mlp", str(config), "--out", str(tmp_path)]
    b = ["topology.data_parallel_size=2", "topology.micro_batch_size=15", "optimizer.zero_stage=1",
         "runner.nproc_per_node=2"]  # fmt: skip
    done = subprocess.run([*cmd, "--b", *b], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no divergence" in done.stdout and "a: the config as given (float32)" in done.stdout, done.stdout
    assert Trace.load(str(tmp_path / "b.pt")).steps[0].gradients  # --out keeps the traces
    assert isinstance(Trace.load(str(tmp_path / "a.pt")).steps[1].loss, float)
    bad = subprocess.run([*cmd, "--b", "topology.data_parallel_size=3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid app or config" in bad.stderr, bad.stdout + bad.stderr
