"""The app's `profiler` section (from TrainingAppConfig): a torch.profiler window and, on CUDA,
memory snapshots, set from the command line like any other setting. The CUDA snapshots are
the `gpu` tier's (`tests/gpu/test_cuda.py::test_memory_snapshots_on_cuda_at_the_window_and_on_out_of_memory`)."""

import json

import pytest
from transformer_testlib import tiny_config, train_worker

from scaling.testing import run_distributed


@pytest.mark.distributed
def test_the_app_profiles_the_window_its_config_names(tiny_corpus, tmp_path):
    trace_dir = tmp_path / "traces"
    profiler = {
        "enabled": True,
        "profile_start_step": 2,
        "profile_steps": 1,
        "trace_dir": str(trace_dir),
        "memory_snapshot": True,  # no CUDA here: nothing recorded, the log says so
    }
    cfg = tiny_config(tiny_corpus, steps=3, profiler=profiler)
    run_distributed(train_worker, 1, cfg)
    trace = json.loads((trace_dir / "torch_trace_rank0_steps2-2.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("Forward(mb=") for n in names)
    assert sorted(p.name for p in trace_dir.iterdir()) == [
        "instructions_rank0_steps2-2.json",
        "tensorboard",
        "torch_trace_rank0_steps2-2.json",
    ]
