"""The planner's peak memory on CUDA (#52): ``scaling.transformer.memory.peak_memory(config, 0, "cuda")``
against ``torch.cuda.max_memory_allocated`` over the second training step of one GPU, within 10 %.

The activation terms on CUDA differ from the CPU's by kernel (flash attention's variable-length
kernel with documents, bool dropout masks, the efficient kernel of latent attention): the CPU tests
hold the CPU's terms to measurement, this holds CUDA's. A model large enough that the caching
allocator's rounding is small against it (hidden 512, 4 blocks, sequence 512).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformer_testlib import tiny_config

from scaling.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present on this machine"),
]

MOE = {"num_experts": 8, "top_k": 2, "num_shared_experts": 1}
LATENT = {"kv_lora_rank": 128, "q_lora_rank": 192, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
#: name: (architecture, other sections); each bf16 with fp32 master weights unless it says.
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "none": ({}, {}),
    "selective": ({"activation_checkpointing": "selective"}, {}),
    "every-layer": ({"activation_checkpointing": "every_layer"}, {}),
    "no-documents": ({"document_masking": False}, {}),
    "fp32": ({"precision": "fp32"}, {}),
    "gelu-layernorm-dropout": ({"mlp_type": "gelu", "norm": "layernorm", "hidden_dropout": 0.1}, {}),
    "zero3": ({}, {"optimizer": {"zero_stage": 3}}),
    "offload": ({}, {"optimizer": {"zero_stage": 1, "cpu_offload": True}}),
    "lora": ({}, {"finetuning": {"method": "lora", "rank": 16}}),
    "moe": ({"moe": MOE}, {}),
    "latent-attention": ({"latent_attention": LATENT, "num_kv_heads": None, "document_masking": False}, {}),
}


def peak_worker(cfg: dict[str, Any]) -> int:
    """The most the caching allocator held over the second training step (the first makes the
    optimizer state)."""
    from scaling.topology import Topology
    from scaling.transformer import train
    from scaling.transformer.config import TransformerConfig

    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    try:
        trainer = train.build_trainer(config, topology)
        trainer.train_step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    finally:
        topology.destroy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_peak_memory_on_cuda_is_predicted_within_10_percent(gpu_corpus, name):
    from scaling.transformer.config import TransformerConfig
    from scaling.transformer.memory import peak_memory

    arch, sections = CONFIGS[name]
    cfg = tiny_config(gpu_corpus, steps=2, **sections)
    cfg["topology"].update(device="cuda", backend="nccl", micro_batch_size=4, global_batch_size=4)
    cfg["optimizer"] = {"master_weights": True, **cfg.get("optimizer", {})}
    cfg["transformer_architecture"].update(
        hidden_size=512, num_layers=4, num_attention_heads=8, num_kv_heads=4, max_sequence_length=512, precision="bf16"
    )
    cfg["transformer_architecture"].update(arch)
    cfg["data"]["sequence_length"] = 512
    (held,) = run_distributed(peak_worker, 1, cfg, backend="nccl", timeout_seconds=300)
    predicted = peak_memory(TransformerConfig.from_dict(cfg), 0, "cuda")
    assert abs(predicted.peak / held - 1) <= 0.10, f"{name}: {predicted} max_memory_allocated={held}"
