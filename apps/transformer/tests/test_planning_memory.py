"""The planner's model-state bytes (``scaling.trainer.planning``) against what a training step of the
transformer app holds, rank by rank: predicted from the config alone, equal to the byte."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from transformer_testlib import tiny_config

from scaling.testing import run_distributed
from scaling.topology import Topology
from scaling.transformer.__main__ import main
from scaling.transformer.config import TransformerConfig
from scaling.transformer.memory import activation_memory, model_state_memory, peak_memory
from scaling.transformer.train import build_trainer

MOE = {"moe": {"every": 2, "num_experts": 4, "top_k": 2, "num_shared_experts": 1}}


def _storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a freed ZeRO-3 parameter holds 0)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(n for p, n in seen.items() if n)


def measure_worker(cfg: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """This rank's coordinates and the model-state bytes it holds after the backward and the DP
    reduction, before the update (the planner's moment), of one training step."""
    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    try:
        trainer = build_trainer(config, topology)
        dp = trainer.optimizer.data_parallel
        held: dict[str, int] = {}

        def observe(slots: Any, grads: Any) -> None:
            params = list(trainer.parallel_module.parameters())
            frozen = [s for space in dp.spaces if space.gatherer is not None for s in space.gatherer.frozen]
            held["parameters"] = _storage_bytes([*params, *(s.param_shard for s in [*slots, *frozen])])
            held["gradients"] = _storage_bytes([*(p.grad for p in params), *(s.grad_shard for s in slots)])
            held["optimizer"] = _storage_bytes(
                [*(s.master for s in slots), *(t for s in slots for t in s.state.values())]
            )

        dp.grad_observers.append(observe)
        trainer.train_step()
        where = {
            "stage": topology.axis("pp").rank,
            "shard_rank": topology.axis("dp_shard").rank,
            "expert_shard_rank": topology.axis("edp").rank,
            "ep_rank": topology.axis("ep").rank,
        }
        return where, held
    finally:
        topology.destroy()


LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "one-process": ({}, 1),
    "dp2-zero0": ({"dp": 2}, 2),
    "dp2-zero1-bf16": ({"dp": 2, "optimizer": {"zero_stage": 1}, "transformer_architecture": {"precision": "bf16"}}, 2),
    "dp2-zero2": ({"dp": 2, "optimizer": {"zero_stage": 2}}, 2),
    "dp2-zero3": ({"dp": 2, "optimizer": {"zero_stage": 3}}, 2),
    "tp2-vocab301": ({"tp": 2, "transformer_architecture": {"vocab_size": 301}}, 2),
    "pp2-tied": ({"pp": 2}, 2),
    "pp2-interleaved-zero2": (
        {
            "pp": 2,
            "optimizer": {"zero_stage": 2},
            "training": {"schedule": "interleaved_1f1b", "num_virtual_stages": 2},
        },
        2,
    ),  # fmt: skip
    "cp2-dp2-zero1": ({"cp": 2, "dp": 2, "optimizer": {"zero_stage": 1}}, 4),
    "dp2-ep2-moe-zero1": ({"dp": 2, "optimizer": {"zero_stage": 1}, "topology": {"expert_parallel_size": 2}}, 2),
    "dp4-ep2-moe-zero3": ({"dp": 4, "optimizer": {"zero_stage": 3}, "topology": {"expert_parallel_size": 2}}, 4),
    "hsdp-zero3-bf16": (
        {
            "dp": 4,
            "optimizer": {"zero_stage": 3},
            "topology": {"data_parallel_shard_size": 2},
            "transformer_architecture": {"precision": "bf16"},
        },
        4,
    ),  # fmt: skip
    "dp2-offload": ({"dp": 2, "optimizer": {"zero_stage": 1, "cpu_offload": True}}, 2),
    "dp2-muon-zero1": ({"dp": 2, "optimizer": {"zero_stage": 1, "method": "muon"}}, 2),
    "dp2-tp2-pp2-zero1": ({"dp": 2, "tp": 2, "pp": 2, "optimizer": {"zero_stage": 1}}, 8),
    "dp2-lora-zero1-bf16": (
        {
            "dp": 2,
            "optimizer": {"zero_stage": 1},
            "finetuning": {"method": "lora", "rank": 4},
            "transformer_architecture": {"precision": "bf16"},
        },
        2,
    ),  # fmt: skip
    "tp2-lora-attention": ({"tp": 2, "finetuning": {"method": "lora", "target_modules": "attention\\..*"}}, 2),
    "dp2-zero2-adapter": ({"dp": 2, "optimizer": {"zero_stage": 2}, "finetuning": {"method": "adapter"}}, 2),
}
QUICK = {"dp2-zero3", "dp2-ep2-moe-zero1"}


def _config(corpus: Any, name: str) -> dict[str, Any]:
    sections, _ = LAYOUTS[name]
    arch = sections.get("transformer_architecture", {})
    cfg = tiny_config(corpus, steps=1, **{k: v for k, v in sections.items() if k != "transformer_architecture"})
    cfg["transformer_architecture"].update(arch)
    if "expert_parallel_size" in sections.get("topology", {}):
        cfg["transformer_architecture"].update(MOE)
    return cfg


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_model_state_bytes_are_predicted_exactly_on_every_rank(tiny_corpus, name):
    """Parameters (the owned shards under ZeRO-3, frozen ones too), gradients (``.grad`` and the
    reduced shards) and optimizer storage (master copies and state, on the host under offload), as
    predicted from the config by ``scaling.transformer.memory`` for each rank's coordinates."""
    cfg = _config(tiny_corpus, name)
    config = TransformerConfig.from_dict(cfg)
    world = LAYOUTS[name][1]
    for rank, (where, held) in enumerate(run_distributed(measure_worker, world, cfg, timeout_seconds=180)):
        predicted = model_state_memory(config, **where)
        got = {
            "parameters": predicted.parameters,
            "gradients": predicted.gradients,
            "optimizer": predicted.master + predicted.state + predicted.host,
        }
        assert got == held, f"{name} rank {rank} at {where}: predicted {got}, held {held}"
        assert (predicted.host > 0) == bool(config.optimizer.cpu_offload)


def test_the_memory_command_prints_each_stage_s_first_rank(tiny_corpus, capsys):
    cfg = _config(tiny_corpus, "dp2-tp2-pp2-zero1")
    path = tiny_corpus.parent / "memory.yml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["memory", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model state per rank at tp2 pp2 dp2, ZeRO-1, fp32, adamw: ")
    config = TransformerConfig.from_dict(cfg)
    for stage, line in enumerate(lines[2:]):
        m, a = model_state_memory(config, stage), activation_memory(config, stage, "cpu").peak
        peak = peak_memory(config, stage, "cpu").peak
        assert line.split() == [str(stage), *(f"{b / 2**30:.3f}" for b in (m.parameters, m.gradients, m.master,
                                                                            m.state, m.device, m.host, a, peak))]  # fmt: skip
    assert len(lines) == 4
    assert main(["memory", str(path), "training.groups=[{name: all, include: ['.*'], method: sgd}]"]) == 2
    assert "knows the default groups only" in capsys.readouterr().err
    assert main(["memory", str(path), "transformer_architecture.attention_dropout=0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[-2:] == ["-", "-"]
    assert lines[-1].startswith("not predicted: transformer_architecture.attention_dropout=0.1")
    assert main(["memory", str(path), "optimizer.zero_stage=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[-2] != "-" and lines[2].split()[-1] == "-"
    assert lines[-1].startswith("not predicted: optimizer.zero_stage=3")


def test_device_memory_says_whether_the_predicted_peak_fits_and_names_the_overflow(tiny_corpus, capsys):
    cfg = _config(tiny_corpus, "dp2-tp2-pp2-zero1")
    path = tiny_corpus.parent / "fits.yml"
    path.write_text(yaml.safe_dump(cfg))
    config = TransformerConfig.from_dict(cfg)
    worst = max((peak_memory(config, stage, "cpu") for stage in range(2)), key=lambda p: p.peak)
    gib = worst.peak / 2**30
    assert main(["memory", str(path), "--device-memory", f"{gib * 1.01}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"fits: the largest peak, stage {worst.stage}'s")
    assert main(["memory", str(path), "--device-memory", f"{gib / 2}"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"does not fit: stage {worst.stage} peaks at {gib:.3f} GiB ({worst.moment}: model state")
    assert f"{gib / 2:.3f} GiB over" in last and "optimizer.zero_stage" in last
    assert main(["memory", str(path), "optimizer.zero_stage=3", "--device-memory", "80"]) == 2
    assert "cannot tell whether it fits" in capsys.readouterr().out
