"""Profiler window, pipeline-instruction timers, peak memory, MFU/HFU, tokens/s, progress bar."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from trainer_model import Batch, Blobs, Head, Hidden, Item, loss_function

from scaling.config import BaseConfig
from scaling.nn import LayerSpec
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.pipeline import ParallelModule
from scaling.testing import make_topology, run_distributed
from scaling.trainer import BaseContext, BaseTrainer, ProfilerConfig, TrainerConfig, device_peak_flops
from scaling.trainer._profiler import peak_flops_of

FLOPS_PER_SAMPLE = 3.0e6
HARDWARE_FLOPS_PER_SAMPLE = 4.0e6
PEAK = 2.0e9


@dataclass
class TokenBatch(Batch):
    def num_tokens(self) -> int:
        return 0 if self.x is None else self.x.numel()  # every feature counts as a "token"

    def only_inputs(self) -> TokenBatch:
        return TokenBatch(self.x, None)

    def only_targets(self) -> TokenBatch:
        return TokenBatch(None, self.y)


class TokenBlobs(Blobs):
    def collate(self, items: list[Item]) -> TokenBatch:
        return TokenBatch(torch.stack([i.x for i in items]), torch.stack([i.y for i in items]))


class AppConfig(BaseConfig):
    _require_descriptions = False
    trainer: TrainerConfig
    profiler: ProfilerConfig


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def profiled_worker(pp: int, trainer: dict[str, Any], profiler: dict[str, Any], loss: Any = None) -> dict[str, Any]:
    topology = make_topology(pipe_parallel_size=pp, global_batch_size=16, micro_batch_size=4)
    config = AppConfig(trainer=TrainerConfig(**trainer), profiler=ProfilerConfig(**profiler))
    context = BaseContext(config=config, topology=topology)
    context.initialize(seed=config.trainer.seed)
    module = ParallelModule(
        [LayerSpec(Hidden, topology=topology), LayerSpec(Head, topology=topology)], topology, seed=1
    )
    group = OptimizerParamGroup(
        named_parameters_with_meta=list(module.named_parameters_with_meta()),
        config=OptimizerParamGroupConfig(name="all"),
    )
    dataset = TokenBlobs()
    trainer_obj = BaseTrainer(
        config=config.trainer,
        context=context,
        parallel_module=module,
        optimizer=Optimizer(OptimizerConfig(), [group], topology),
        dataset=dataset,
        dataset_evaluation=None,
        sync_batch_to_model_parallel=dataset.sync_batch_to_model_parallel,
        metrics_aggregation_fn=None,
        loss_function=loss or loss_function,
        flops_per_sample=FLOPS_PER_SAMPLE,
        hardware_flops_per_sample=lambda: HARDWARE_FLOPS_PER_SAMPLE,
    )
    collect = _Collect()
    trainer_obj.metrics_logger.logger.addHandler(collect)
    try:
        history = trainer_obj.run_training(return_metrics=True) or []
    finally:
        trainer_obj.metrics_logger.logger.removeHandler(collect)
    return {
        "history": history,
        "formula_lines": [m for m in collect.messages if "flops_per_sample" in m],
        "timings_left": getattr(module, "instruction_timings", None),
    }


@pytest.mark.distributed
def test_profiled_window_writes_traces_with_instruction_events(tmp_path):
    trace_dir = tmp_path / "traces"
    out = run_distributed(
        profiled_worker,
        2,
        2,
        {"train_iterations": 3, "peak_flops_per_second": PEAK, "progress_bar": True},
        {"enabled": True, "profile_start_step": 2, "profile_steps": 2, "trace_dir": str(trace_dir), "all_ranks": True},
        timeout_seconds=180,
    )
    for rank in range(2):
        torch_trace = trace_dir / f"torch_trace_rank{rank}_steps2-3.json"
        names = {e.get("name", "") for e in json.loads(torch_trace.read_text())["traceEvents"]}
        assert any(n.startswith("Forward(mb=") for n in names), f"rank {rank}: no Forward event"
        assert any(n.startswith("Backward(mb=") for n in names), f"rank {rank}: no Backward event"
        assert list((trace_dir / "tensorboard").glob(f"rank{rank}.*.pt.trace.json")), f"rank {rank}"
        timers = json.loads((trace_dir / f"instructions_rank{rank}_steps2-3.json").read_text())["traceEvents"]
        # 4 micro-batches: per step 4 Forward + 4 Backward on each stage, in steps 2 and 3 only.
        forwards = [e for e in timers if e["name"].startswith("Forward(")]
        assert len(forwards) == 8 and {e["args"]["step"] for e in forwards} == {2, 3}
        assert all(e["ph"] == "X" and e["dur"] >= 0 and e["pid"] == rank for e in timers)
        assert any(e["name"].startswith(("SendActivation", "RecvActivation", "Exchange")) for e in timers)
        # The hook is switched off again after the window.
        assert out[rank]["timings_left"] is None
    assert not list(trace_dir.glob("*steps1-*"))


def _check_metrics(history: list[dict[str, Any]], world_size: int) -> None:
    assert len(history) == 3
    for m in history:
        assert m["runtime/peak_memory_mib"] > 1.0  # a Python process with torch holds well over 1 MiB
        sps = m["runtime/samples_per_second"]
        assert sps == pytest.approx(16 / m["runtime/step_duration"], rel=1e-12)
        assert m["runtime/mfu"] == pytest.approx(FLOPS_PER_SAMPLE * sps / (PEAK * world_size), rel=1e-12)
        assert m["runtime/tflops_per_device"] == pytest.approx(FLOPS_PER_SAMPLE * sps / world_size / 1e12, rel=1e-12)
        assert m["runtime/hfu"] == pytest.approx(HARDWARE_FLOPS_PER_SAMPLE * sps / (PEAK * world_size), rel=1e-12)
        # 16 samples of 8 features per step, counted once per data-parallel replica.
        assert m["runtime/tokens_per_second"] == pytest.approx(16 * 8 / m["runtime/step_duration"], rel=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_mfu_peak_memory_tokens_and_formula_once(world_size):
    # world_size 2 is data parallel (pp=1): tokens are summed over the two DP ranks.
    out = run_distributed(
        profiled_worker, world_size, 1, {"train_iterations": 3, "peak_flops_per_second": PEAK}, {}, timeout_seconds=180
    )
    for rank in range(world_size):
        _check_metrics(out[rank]["history"], world_size)
        # Every rank logs the same peak (max over ranks).
        assert [m["runtime/peak_memory_mib"] for m in out[rank]["history"]] == [
            m["runtime/peak_memory_mib"] for m in out[0]["history"]
        ]
    lines = out[0]["formula_lines"]
    assert len(lines) == 2 and lines[0].startswith("MFU = flops_per_sample (3e+06)") and "HFU" in lines[1]
    assert f"peak_flops_per_second (2e+09) * world_size ({world_size})" in lines[0]
    assert all(not r["formula_lines"] for r in out[1:])


@pytest.mark.distributed
def test_peak_memory_and_tokens_are_measured_on_logged_steps_only():
    """Their collectives (max over every rank, sum over DP) run when the trainer logs (#48):
    log_interval=2 over 5 steps measures steps 2, 4 and the last."""
    cfg = {"train_iterations": 5, "log_interval": 2, "peak_flops_per_second": PEAK}
    out = run_distributed(profiled_worker, 2, 1, cfg, {}, timeout_seconds=180)
    for rank in range(2):
        history = out[rank]["history"]
        for key in ("runtime/peak_memory_mib", "runtime/tokens_per_second"):
            assert [m["step"] for m in history if key in m] == [2, 4, 5], (rank, key)
        assert all("runtime/mfu" in m for m in history)  # local arithmetic: every step


@pytest.mark.distributed
def test_no_peak_no_mfu():
    out = run_distributed(profiled_worker, 1, 1, {"train_iterations": 3}, {}, timeout_seconds=180)
    assert all("runtime/mfu" not in m and "runtime/hfu" not in m for m in out[0]["history"])
    # The model's FLOP rate needs no peak.
    assert all(m["runtime/tflops_per_device"] > 0 for m in out[0]["history"])
    assert out[0]["formula_lines"] == []
    assert all(m["runtime/peak_memory_mib"] > 1.0 for m in out[0]["history"])


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),  # not the SXM part's figure
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GeForce RTX 4090", None),  # unknown: no MFU unless configured
    ],
)
def test_a_known_gpu_gives_mfu_its_bf16_peak(name, peak):
    assert peak_flops_of(name) == peak


def test_no_peak_on_cpu():
    assert device_peak_flops(torch.device("cpu")) is None  # CPUs have no standard figure


def test_profiler_and_metric_config_errors():
    with pytest.raises(ValidationError, match=r"profiler.enabled=true needs profiler.trace_dir"):
        ProfilerConfig(enabled=True)
    with pytest.raises(ValidationError, match=r"profiler.memory_snapshot=true needs profiler.trace_dir; set trace_dir"):
        ProfilerConfig(memory_snapshot=True)
    with pytest.raises(ValidationError, match=r"profile_steps\n  Input should be greater than or equal to 1"):
        ProfilerConfig(profile_steps=0)
    with pytest.raises(ValidationError, match=r"peak_flops_per_second\n  Input should be greater than 0"):
        TrainerConfig(peak_flops_per_second=0)


def test_profiler_config_describes_every_field():
    for name, field in ProfilerConfig.model_fields.items():
        assert field.description, name
    assert ProfilerConfig().enabled is False
    assert Path(ProfilerConfig(enabled=True, trace_dir="t").trace_dir or "") == Path("t")


def _out_of_memory_worker(trace_dir: str) -> tuple[str, int, list[str], list[str]]:
    """A step that runs out of device memory (raised by the loss at step 2, as an allocation
    would) with memory snapshots asked for: the error leaves run_training as it was. On CPU
    there is no allocator history to dump, and the log says so once; the `gpu` tier checks
    the `_oom` snapshot on CUDA."""
    calls = []

    def exhausting(out: Any, batch: Any) -> Any:
        calls.append(len(calls) + 1)
        if len(calls) > 4:  # step 2's first micro-batch (4 per step)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 PiB")
        return loss_function(out, batch)

    collect = _Collect()
    logging.getLogger("scaling.trainer").addHandler(collect)
    profiler = {"memory_snapshot": True, "trace_dir": trace_dir}
    try:
        profiled_worker(1, {"train_iterations": 3}, profiler, loss=exhausting)
        caught = "nothing raised"
    except torch.OutOfMemoryError as err:
        caught = f"{type(err).__name__}: {err}"
    finally:
        logging.getLogger("scaling.trainer").removeHandler(collect)
    files = sorted(p.name for p in Path(trace_dir).glob("*")) if Path(trace_dir).exists() else []
    return caught, len(calls), [m for m in collect.messages if "memory_snapshot" in m], files


@pytest.mark.distributed
def test_a_step_out_of_memory_raises_on_and_cpu_takes_no_snapshot(tmp_path):
    ((caught, calls, messages, files),) = run_distributed(_out_of_memory_worker, 1, str(tmp_path / "traces"))
    assert caught == "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 PiB"
    assert calls == 5
    assert messages == ["profiler.memory_snapshot: cpu has no CUDA caching allocator; no snapshot"]
    assert files == []
