"""Materialising through parallelize: each rank's peak memory is its shard plus one module, never the model."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scaling.testing import run_distributed
from scaling.trainer.auto import deferred_init, generate_plan, parallelize

SLACK_BYTES = 64 << 20  # allocator slack and process-group buffers (the bench's stated overhead)
CONFIG = {  # ~190 MB in fp32
    "vocab_size": 8000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "max_position_embeddings": 64,
}


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_worker() -> tuple[int, int, int, int]:
    model = deferred_init(LlamaForCausalLM, LlamaConfig(**CONFIG))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    plan = generate_plan(model, {"tensor_parallel.size": 4})
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    model, _, _, _ = parallelize(plan, model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), None, None)
    peak = (_kib("VmHWM") - before) * 1024
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return peak, shard, largest, whole


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_tp4_materialisation_peak_is_shard_plus_one_module() -> None:
    for peak, shard, largest, whole in run_distributed(memory_worker, 4, timeout_seconds=420):
        assert whole > 180e6 and shard < whole / 3
        assert peak < shard + largest + SLACK_BYTES, (peak, shard, largest)
        assert peak < whole / 2, (peak, whole)
