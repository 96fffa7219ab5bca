"""The benches that scripts/gpu_check runs on a lent GPU run here too, tiny, on CPU.

A lent GPU comes rarely and for minutes: a bench that crashes there costs the figures of a
whole session. These runs check only that each bench finishes and prints its figures (no
timing is asserted: it is measured, not tested).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaling.nn import float8_supported

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _bench(*argv: str, cwd: Path = ROOT) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_transformer_step_bench_runs_with_master_weights_and_a_trace(tmp_path):
    out = _bench(
        "bench/transformer_step.py", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
        "--seq", "32", "--batch", "2", "--dtype", "bf16", "--warmup", "1", "--iters", "2", "--trace", str(tmp_path),
    )  # fmt: skip
    assert "wall ratio ours/reference = " in out
    assert (tmp_path / "transformer_step_top_ops.txt").exists()
    assert not list(tmp_path.glob(".*_trace.json"))  # read for the device's idle time, then removed


def test_device_idle_charges_each_hole_to_the_host_range_around_it():
    """The GPU profile's idle analysis, on a hand-made trace (a CPU profile has no device work)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from transformer_step import device_idle

    events = [
        ("kernel", "gemm", 0.0, 10_000.0),
        ("kernel", "gemm", 5_000.0, 20_000.0),  # overlaps the first: one busy stretch
        ("gpu_memcpy", "DtoH", 22_000.0, 30_000.0),
        ("kernel", "adamw", 90_000.0, 100_000.0),
        ("user_annotation", "train_step: schedule", 0.0, 21_500.0),
        ("user_annotation", "train_step: optimizer", 21_500.0, 100_000.0),
        ("cpu_op", "aten::item", 35_000.0, 36_000.0),
        ("cpu_op", "aten::_foreach_norm", 40_000.0, 41_000.0),
        ("cpu_op", "aten::mm", 10_000.0, 11_000.0),  # started while the device was busy
    ]
    lines = device_idle(events)
    assert lines[0] == "device busy 38.00 ms of 100.00 ms (38.0%); idle 62.00 ms in 2 holes"
    assert lines[1] == "idle by range: train_step: optimizer 60.00 ms, train_step: schedule 2.00 ms"
    assert lines[2] == (
        "  hole 60.000 ms in train_step: optimizer; host operators started: aten::item, aten::_foreach_norm"
    )
    assert lines[3] == "  hole 2.000 ms in train_step: schedule; host operators started: none"
    assert device_idle([e for e in events if e[0] not in ("kernel", "gpu_memcpy")]) is None


def test_transformer_step_bench_runs_with_packed_documents():
    out = _bench(
        "bench/transformer_step.py", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
        "--seq", "32", "--batch", "2", "--warmup", "1", "--iters", "2", "--documents", "3",
    )  # fmt: skip
    assert "wall ratio ours/reference = " in out


@pytest.mark.skipif(
    not hasattr(torch.cpu.Stream(), "record_event"),
    reason=f"torch {torch.__version__}'s FSDP2 cannot run on CPU (its CPU stream has no record_event)",
)
def test_transformer_step_bench_runs_against_torchtitans_recipe():
    out = _bench(
        "bench/transformer_step.py", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
        "--seq", "32", "--batch", "2", "--dtype", "bf16", "--warmup", "1", "--iters", "2", "--reference", "fsdp2",
    )  # fmt: skip
    assert "reference: torchtitan's recipe" in out
    assert "wall ratio ours/reference = " in out


@pytest.mark.skipif(float8_supported(torch.device("cpu")) is not None, reason="no float8 products on CPU here")
def test_compile_step_bench_runs_with_float8_linears_and_profiles_both_compiled_sides(tmp_path):
    # aot_eager: the bench's logic without inductor's compile time (the GPU run uses inductor)
    out = _bench("bench/compile_step.py", "--backend", "aot_eager", "--fp8", "--hidden", "64", "--layers", "2",
                 "--heads", "4", "--vocab", "256", "--seq", "32", "--batch", "2", "--warmup", "1", "--iters", "2",
                 "--profile", str(tmp_path))  # fmt: skip
    assert "ours compiled / reference compiled = " in out
    ours = (tmp_path / "compiled_ours_top_ops.txt").read_text()
    assert "train_step: schedule" in ours and "train_step: optimizer" in ours  # our step's phases, named
    assert "Optimizer.step#AdamW.step" in (tmp_path / "compiled_reference_top_ops.txt").read_text()


@pytest.mark.skipif(
    not hasattr(torch.cpu.Stream(), "record_event"),
    reason=f"torch {torch.__version__}'s FSDP2 cannot run on CPU (its CPU stream has no record_event)",
)
def test_compile_step_bench_runs_against_torchtitans_recipe_compiled():
    # gpu_check's compile_fsdp2 step: the reference's blocks are fully_shard-ed, then compiled
    out = _bench("bench/compile_step.py", "--backend", "aot_eager", "--reference", "fsdp2", "--dtype", "bf16",
                 "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256", "--seq", "32", "--batch", "2",
                 "--warmup", "1", "--iters", "2")  # fmt: skip
    assert "reference recipe fsdp2" in out
    assert "ours compiled / reference compiled = " in out


@pytest.mark.skipif(
    not hasattr(torch.cpu.Stream(), "record_event"),
    reason=f"torch {torch.__version__}'s FSDP2 cannot run on CPU (its CPU stream has no record_event)",
)
def test_offload_step_bench_runs_all_three_sides():
    out = _bench("bench/offload_step.py", "--hidden", "64", "--blocks", "2", "--batch", "32", "--steps", "2",
                 "--rounds", "1")  # fmt: skip
    assert "ours offloaded / FSDP2 offloaded: " in out
    assert "largest relative loss difference, ours offloaded vs FSDP2: 0.0e+00" in out  # same weights, batches


def test_model_state_bytes_bench_meets_its_theory():
    out = _bench("bench/model_state_bytes.py", "--hidden", "64", "--layers", "2")
    assert "worst deviation from theory 0.0000%" in out


def test_ring_block_kernels_bench_compares_the_three_sides():
    out = _bench("bench/ring_block_kernels.py", "--seqs", "64", "--heads", "2", "--head-dim", "16", "--iters", "1")
    rows = [line for line in out.splitlines() if line.startswith("| 64 |")]
    assert [row.split(" | ")[1:3] for row in rows] == [["causal", "cpu_flash"], ["full", "cpu_flash"]]
    assert all(float(row.rstrip(" |").split(" | ")[-1]) < 1e-5 for row in rows)  # fused = written-out (fp32)


def test_moe_step_bench_compares_grouped_experts_with_the_loop():
    out = _bench("bench/moe_step.py", "--hidden", "32", "--ffn", "64", "--tokens", "64", "--eps", "1", "--steps", "1")
    assert "grouped / loop (ep 1): " in out


def test_pipeline_benches_run_with_their_own_transports_and_the_zero_bubble_schedules():
    # The floor transports replace PipeTransport.transfer, which the executor calls for every message.
    out = _bench("bench/pipeline_bubble.py", "--forward-ms", "1", "--backward-ms", "2", "--micro-batches", "2",
                 "--repeats", "1", "--transport", "bare")  # fmt: skip
    assert "our hand-offs: bare" in out
    out = _bench("bench/zero_bubble.py", "--stages", "2", "--micro-batches", "4", "--layer-ms", "1", "--repeats", "1")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1f1b"], ["zb_h1"], ["zb_v"])]
    assert [row[0] for row in rows] == ["1f1b", "zb_h1", "zb_v"]
