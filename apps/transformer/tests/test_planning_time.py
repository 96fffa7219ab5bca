"""The planner's step time (``scaling.transformer.steptime``): what each part adds, the pipeline's
makespan, a crowded CPU's bound, the operator counts it assumes against this app's real step, the
memory command's ``--machine``, and the on-paper Llama 3 8B figure docs/planning.md quotes. How
well it ranks measured steps is ``bench/plan_step_time.py``'s (timing never decides a test)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode
from transformer_testlib import tiny_config

from scaling.testing import run_distributed
from scaling.topology import Topology
from scaling.trainer.planning import Link, MachineProfile
from scaling.transformer.__main__ import DEFAULT_CONFIG, main
from scaling.transformer.config import TransformerConfig
from scaling.transformer.memory import peak_memory
from scaling.transformer.plan import _with_layout, rank_plans
from scaling.transformer.steptime import OPERATORS, step_time
from scaling.transformer.train import build_trainer

GPU = MachineProfile(
    name="gpu-like",
    device="cuda",
    source="the test's",
    devices_per_node=8,
    compute_slots=8,
    matmul={"bf16": ((1e6, 1e12), (1e12, 5e14)), "fp32": ((1e6, 1e11), (1e12, 5e13))},
    memory_bandwidth=2e12,
    operator_overhead=5e-6,
    intra_node=Link(bandwidth=2e11, latency=1e-5),
    inter_node=Link(bandwidth=2e10, latency=2e-5),
)
CPU = MachineProfile(
    name="cpu-like",
    device="cpu",
    source="the test's",
    devices_per_node=1 << 20,
    compute_slots=2,
    matmul={"fp32": ((1e5, 2e10), (1e9, 8e10))},
    memory_bandwidth=2e10,
    operator_overhead=4e-6,
    intra_node=Link(bandwidth=1e9, latency=1e-3),
    inter_node=Link(bandwidth=1e9, latency=1e-3),
    overlap=False,
)


def _config(corpus: Any = "unused", arch: dict[str, Any] | None = None, **sections: Any) -> TransformerConfig:
    cfg = tiny_config(corpus, **sections)
    cfg["transformer_architecture"].update(
        {"hidden_size": 64, "num_layers": 4, "max_sequence_length": 64, **(arch or {})}
    )
    cfg["data"]["sequence_length"] = 64
    dp = sections.get("dp", 1)
    cfg["topology"].update(micro_batch_size=2, global_batch_size=8 * dp)
    return TransformerConfig.from_dict(cfg)


def test_every_layer_recomputes_the_forward_and_selective_attention_s_core():
    none = step_time(_config(), GPU).chunk
    every = step_time(_config(arch={"activation_checkpointing": "every_layer"}), GPU).chunk
    selective = step_time(_config(arch={"activation_checkpointing": "selective"}), GPU).chunk
    assert every.forward_compute == none.forward_compute
    assert every.backward_compute == pytest.approx(none.backward_compute + none.forward_compute)
    assert none.backward_compute < selective.backward_compute < every.backward_compute


def test_tensor_parallelism_halves_the_products_and_adds_two_all_reduces_per_block_each_way():
    one = step_time(_config(), GPU).chunk
    tp2 = step_time(_config(tp=2), GPU).chunk
    stream = 4 * 2 * 64 * 64  # fp32, micro-batch 2 x 64 tokens x hidden 64
    per_block = 2 * GPU.collective_seconds("all_reduce", stream, 2)
    assert tp2.forward_communication == pytest.approx(4 * per_block)
    assert tp2.backward_communication == pytest.approx(4 * per_block)
    assert tp2.forward_compute < one.forward_compute
    sp = step_time(_config(tp=2, arch={"sequence_parallel": True}), GPU).chunk
    gathers = GPU.collective_seconds("all_gather", stream, 2) + GPU.collective_seconds("reduce_scatter", stream, 2)
    assert sp.forward_communication == pytest.approx(4 * 2 * gathers)


def test_the_pipeline_s_makespan_is_the_schedule_s_and_zero_bubble_shrinks_it():
    config = _config(pp=2)  # 4 micro-batches of 2 per step
    t = step_time(config, GPU)
    f, b = t.chunk.forward, t.chunk.backward
    assert t.pipeline == pytest.approx((4 + 2 - 1) * (f + b))
    zb = step_time(_config(pp=2, training={"schedule": "zb_h1"}), GPU)
    assert zb.chunk == t.chunk and zb.pipeline < t.pipeline


def test_ranks_crowding_a_cpu_s_cores_share_them_and_a_pipeline_s_idle_stages_lend_theirs():
    one = step_time(_config(), CPU)
    dp4 = step_time(_config(dp=4), CPU)  # 4 ranks on 2 slots, each its own 4 micro-batches
    work = 4 * (one.chunk.forward_compute + one.chunk.backward_compute)
    assert one.pipeline == pytest.approx(work)
    assert dp4.pipeline == pytest.approx(2 * work)
    pp2 = step_time(_config(pp=2), CPU)  # 2 ranks on 2 slots: the critical path
    assert pp2.pipeline == pytest.approx(5 * (pp2.chunk.forward + pp2.chunk.backward))
    assert dp4.reduction > 0 and dp4.tokens_per_second_per_device < one.tokens_per_second_per_device


def test_zero3_gathers_each_layer_twice_per_micro_batch_and_leaves_no_reduction_after_the_step():
    zero1 = step_time(_config(dp=2, optimizer={"zero_stage": 1}), GPU)
    zero3 = step_time(_config(dp=2, optimizer={"zero_stage": 3}), GPU)
    assert zero1.chunk.forward_communication == 0 and zero3.chunk.forward_communication > 0
    assert zero3.chunk.backward_communication > zero3.chunk.forward_communication  # + the reduce-scatters
    assert zero3.reduction == 0 < zero1.reduction


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch._C._current_autograd_node() is not None:
            self.backward += 1
        elif torch.is_grad_enabled():
            self.forward += 1
        return func(*args, **(kwargs or {}))


def census_worker(cfg: dict[str, Any]) -> tuple[int, int]:
    """The operators a training step runs forward (grad on, outside a backward) and backward."""
    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    try:
        trainer = build_trainer(config, topology)
        trainer.train_step()
        with _Count() as count:
            trainer.train_step()
        return count.forward, count.backward
    finally:
        topology.destroy()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["dense", "moe", "ring_step", "all_to_all"])
def test_the_operators_assumed_per_block_are_those_this_app_s_step_runs(tiny_corpus, kind):
    cp = 2 if kind in ("ring_step", "all_to_all") else 1
    counts = []
    for layers in (2, 4):
        cfg = tiny_config(tiny_corpus, steps=2, cp=cp)
        cfg["transformer_architecture"].update(hidden_size=64, num_layers=layers, max_sequence_length=64)
        if kind == "moe":
            cfg["transformer_architecture"]["moe"] = {"num_experts": 4, "top_k": 2}
        if kind == "all_to_all":
            cfg["transformer_architecture"]["context_parallel_method"] = "all_to_all"
        cfg["data"]["sequence_length"] = 32
        cfg["topology"].update(micro_batch_size=2, global_batch_size=2)
        counts.append(run_distributed(census_worker, cp, cfg, timeout_seconds=120)[0])
    (f2, b2), (f4, b4) = counts
    per_block = ((f4 - f2) / 2, (b4 - b2) / 2)
    if cp > 1:  # what context parallelism adds to a dense block (the ring: per step, 2 a block)
        steps = 2 if kind == "ring_step" else 1
        per_block = tuple((n - dense) / steps for n, dense in zip(per_block, OPERATORS["dense"]))
    for counted, assumed in zip(per_block, OPERATORS[kind]):
        assert abs(counted - assumed) <= max(0.1 * assumed, 3), (
            f"{kind}: counted {per_block}, assumed {OPERATORS[kind]}"
        )


def _llama3_8b_fsdp8() -> dict[str, Any]:
    """torchtitan's Llama 3.1 8B run (docs/performance.md): 8 H100, FSDP, local batch 2, sequence 8192,
    per-operator checkpointing, bf16."""
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["topology"].update(data_parallel_size=8, micro_batch_size=2, global_batch_size=16, device="cuda")
    cfg["transformer_architecture"] = dict(
        preset="llama3_8b", precision="bf16", activation_checkpointing="operators", max_sequence_length=8192
    )
    cfg["data"]["sequence_length"] = 8192
    cfg["optimizer"]["zero_stage"] = 3
    return cfg


def test_the_on_paper_llama3_8b_figures_docs_planning_md_quotes():
    config = TransformerConfig.from_dict(_llama3_8b_fsdp8())
    assert round(peak_memory(config, 0, "cuda").peak / 2**30, 1) == 88.6
    for machine, tokens in (("h100-sxm-node", 9059), ("h200-sxm-node", 9912)):
        assert round(step_time(config, MachineProfile.load(machine)).tokens_per_second_per_device) == tokens


def test_the_memory_command_predicts_the_step_time_on_a_named_machine(tmp_path, capsys):
    path = tmp_path / "llama.yml"
    path.write_text(yaml.safe_dump(_llama3_8b_fsdp8()))
    assert main(["memory", str(path), "--machine", "h100-sxm-node"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("step time on h100-sxm-node: 1.809 s (pipeline ") and line.endswith(
        "9,059 tokens/s per device"
    )
    assert main(["memory", str(path), "--machine", "a100"]) == 2
    assert "--machine: machine profile 'a100' is neither a file nor a shipped profile" in capsys.readouterr().err


def test_plans_are_ranked_by_predicted_tokens_per_second_and_refused_with_their_reasons():
    config = _config(arch={"num_layers": 6}, dp=4)  # 8 pipeline layers: two equal chunks per stage at pp2
    rows = rank_plans(config, GPU, 4)
    ranked = [r for r in rows if r.refused is None]
    speeds = [r.step.tokens_per_second_per_device for r in ranked]  # type: ignore[union-attr]
    assert speeds == sorted(speeds, reverse=True) and len(ranked) > 10
    best = ranked[0]
    again = _with_layout(config, best.candidate)
    assert best.step == step_time(again, GPU)
    assert best.peak == max(peak_memory(again, s, "cuda").peak for s in range(best.pp))
    # With pipeline stages every schedule of the search is tried and predicted as its own config would be.
    assert {r.schedule for r in rows if r.pp > 1} == {"1f1b", "zb_h1", "zb_v", "interleaved_1f1b"}
    v_shaped = next(r for r in ranked if r.schedule == "zb_v")
    assert v_shaped.step == step_time(_with_layout(config, v_shaped.candidate), GPU)
    refused = {r.refused for r in rows if r.refused is not None}
    assert any(reason.startswith("optimizer.zero_stage=3 with topology.pipe_parallel_size > 1") for reason in refused)
    assert any("num_kv_heads" in reason or "divisible" in reason for reason in refused)  # tp4 with 2 KV heads

    peaks = sorted(r.peak for r in ranked)  # type: ignore[type-var]
    budget = (peaks[0] + peaks[-1]) / 2
    fitted = rank_plans(config, GPU, 4, device_memory=budget)
    assert all(r.peak <= budget for r in fitted if r.refused is None)  # type: ignore[operator]
    over = [r for r in fitted if r.refused is not None and r.refused.startswith("does not fit")]
    assert over and all(r.peak > budget for r in over)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"devices=0: give the number of devices"):
        rank_plans(config, GPU, 0)


@pytest.mark.slow  # 240 candidates of an 8B model: ~6 s
def test_the_plan_command_prints_the_ranked_table_and_exits_1_when_nothing_fits(tmp_path, capsys):
    path = tmp_path / "llama.yml"
    path.write_text(yaml.safe_dump(_llama3_8b_fsdp8()))
    assert main(["plan", str(path), "--machine", "h100-sxm-node", "--devices", "8", "--device-memory", "80"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("69 of 300 layouts of 8 devices on h100-sxm-node, 80 GiB each, fastest first")
    assert lines[2].split()[:6] == ["1", "tp2", "pp1", "cp2", "dp2", "ZeRO-1"]
    refusals = [line for line in lines if line.startswith("refused (")]
    assert refusals[0].startswith("refused (60): optimizer.zero_stage=3 with topology.pipe_parallel_size > 1")
    assert "refused (31): does not fit the device's memory" in lines
    # 34 pipeline layers: no two equal chunks per stage at pp 2, 4 or 8, so ZB-V and interleaving are refused.
    assert any("do not split into topology.pipe_parallel_size=2 x 2 chunks" in r and "'zb_v'" in r for r in refusals)
    assert main(["plan", str(path), "--machine", "h100-sxm-node", "--devices", "8", "--device-memory", "1"]) == 1
    assert capsys.readouterr().out.startswith("0 of 300 layouts")
