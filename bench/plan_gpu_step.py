"""The planner's step time for scripts/gpu_check's bench shape (step 3) on this GPU: its measured
profile against the shipped one, beside bench/transformer_step.py's measured step.

Run: python bench/plan_gpu_step.py [--out PROFILE.json] [--shipped h200-sxm-node]

Measures this card's profile (``scaling.trainer.planning.measure_profile``: products of 1,024-8,192 per
dtype, a copy, the cost per operator; no collectives on one GPU), writes it, prints its figures beside
the shipped profile's, and the predicted step time and tokens/s of the 0.87B bench model (hidden 2048,
16 layers, 16 heads, vocab 32000, sequence 2048, batch 4, bf16, fp32 master weights, no documents) on
both. The measured step is bench.txt's (step 3 of scripts/gpu_check); docs/planning.md compares them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from scaling.trainer.planning import MachineProfile, measure_profile
from scaling.transformer.__main__ import DEFAULT_CONFIG
from scaling.transformer.config import TransformerConfig
from scaling.transformer.steptime import step_time


def bench_config() -> TransformerConfig:
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["topology"].update(micro_batch_size=4, global_batch_size=4, device="cuda")
    cfg["transformer_architecture"] = dict(
        vocab_size=32000, hidden_size=2048, num_layers=16, num_attention_heads=16, precision="bf16",
        document_masking=False, max_sequence_length=2048,
    )  # fmt: skip
    cfg["data"]["sequence_length"] = 2048
    return TransformerConfig.from_dict(cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", default="machine_profile.json")
    p.add_argument("--shipped", default="h200-sxm-node")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    measured = measure_profile(name, device, group_sizes=())
    Path(a.out).write_text(measured.to_json())
    shipped = MachineProfile.load(a.shipped)
    for label, profile in (("measured", measured), (f"shipped {a.shipped}", shipped)):
        rates = ", ".join(
            f"{dtype} " + "/".join(f"{rate / 1e12:.0f}" for _, rate in points)
            for dtype, points in profile.matmul.items()
        )
        t = step_time(bench_config(), profile)
        print(
            f"{label}: products TFLOP/s {rates}; memory {profile.memory_bandwidth / 1e12:.2f} TB/s; "
            f"{profile.operator_overhead * 1e6:.1f} us/operator; predicted step {t.total * 1e3:.1f} ms, "
            f"{t.tokens_per_second_per_device:,.0f} tokens/s"
        )


if __name__ == "__main__":
    main()
