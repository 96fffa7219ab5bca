"""The planner's step times (``scaling.transformer.steptime.step_time``) against measured steps, in one run.

Run: python bench/plan_step_time.py [--steps 4] [--hidden 256] [--layers 6] [--seq 256] [--only NAME,...]
     [--save-measured F | --measured F] [--profile P | --save-profile P]

First this machine's profile is measured (``scaling.trainer.planning.measure_profile``: products,
memory bandwidth, operator cost, gloo all-reduces among 2 and 4 processes, one thread per rank as
the test harness runs them). Then each layout of 4 ranks (dp, tp, pp under every schedule, cp ring
and all-to-all, ZeRO 0-3, HSDP, activation checkpointing, sequence parallelism) trains the transformer
app on the tiny corpus: 2 untimed steps, then ``--steps`` timed ones after a barrier, a step's time the
slowest rank's mean. Prints each layout's measured and predicted seconds and their ratio, Spearman's
rank correlation of predicted against measured, and the measured time of the layout the prediction
ranks first over the fastest measured one. Goals (#52): Spearman >= 0.9, top-ranked within 5 % of the
best.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps" / "transformer" / "tests"))

from transformer_testlib import build_tiny_corpus, tiny_config  # noqa: E402

from scaling.testing import run_distributed  # noqa: E402
from scaling.topology import Topology  # noqa: E402
from scaling.trainer.planning import measure_profile  # noqa: E402
from scaling.transformer.config import TransformerConfig  # noqa: E402
from scaling.transformer.steptime import step_time  # noqa: E402
from scaling.transformer.train import build_trainer  # noqa: E402

#: name: (architecture, other sections); 4 ranks each.
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dp4": ({}, {"dp": 4}),
    "dp4-zero1": ({}, {"dp": 4, "optimizer": {"zero_stage": 1}}),
    "dp4-zero3": ({}, {"dp": 4, "optimizer": {"zero_stage": 3}}),
    "hsdp2x2-zero3": ({}, {"dp": 4, "optimizer": {"zero_stage": 3}, "topology": {"data_parallel_shard_size": 2}}),
    "dp4-every-layer": ({"activation_checkpointing": "every_layer"}, {"dp": 4}),
    "dp4-selective": ({"activation_checkpointing": "selective"}, {"dp": 4}),
    "tp2-dp2": ({}, {"tp": 2, "dp": 2}),
    "tp2-dp2-sp": ({"sequence_parallel": True}, {"tp": 2, "dp": 2}),
    "tp4": ({}, {"tp": 4}),
    "pp2-dp2-1f1b": ({}, {"pp": 2, "dp": 2}),
    "pp2-dp2-gpipe": ({}, {"pp": 2, "dp": 2, "training": {"schedule": "gpipe"}}),
    "pp2-dp2-zb-h1": ({}, {"pp": 2, "dp": 2, "training": {"schedule": "zb_h1"}}),
    "pp4-1f1b": ({}, {"pp": 4}),
    "pp2-dp2-interleaved": (
        {},
        {"pp": 2, "dp": 2, "training": {"schedule": "interleaved_1f1b", "num_virtual_stages": 2}},
    ),  # fmt: skip
    "cp2-dp2-ring": ({}, {"cp": 2, "dp": 2}),
    "cp2-dp2-all-to-all": ({"context_parallel_method": "all_to_all"}, {"cp": 2, "dp": 2}),
    "tp2-pp2": ({}, {"tp": 2, "pp": 2}),
}


def config_of(corpus: Path, name: str, a: argparse.Namespace) -> dict[str, Any]:
    arch, sections = LAYOUTS[name]
    cfg = tiny_config(corpus, steps=a.steps + 2, **sections)
    cfg["transformer_architecture"].update(
        hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=8, num_kv_heads=4, max_sequence_length=a.seq
    )
    cfg["transformer_architecture"].update(arch)
    cfg["data"]["sequence_length"] = a.seq
    cfg["topology"].update(micro_batch_size=a.micro_batch, global_batch_size=a.batch, timeout_seconds=300)
    return cfg


def time_worker(cfg: dict[str, Any], steps: int) -> float:
    """Seconds per step: the slowest rank's mean over ``steps`` after two untimed ones."""
    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    try:
        trainer = build_trainer(config, topology)
        for _ in range(2):
            trainer.train_step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        seconds = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds)
    finally:
        topology.destroy()


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6, help="6: 8 pipeline layers split evenly by 2, 4 and 2 x 2")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--profile", default=None, help="a profile file to use instead of measuring one")
    p.add_argument("--save-profile", default=None, help="write the profile used (JSON)")
    p.add_argument("--save-measured", default=None, help="write the measured seconds per layout (JSON)")
    p.add_argument("--measured", default=None, help="predict against these measured seconds instead of training")
    a = p.parse_args()
    names = [n for n in a.only.split(",") if n] or list(LAYOUTS)
    from scaling.trainer.planning import MachineProfile

    profile = MachineProfile.load(a.profile) if a.profile else measure_profile("this-cpu", torch.device("cpu"))
    print(f"profile: {profile.source}")
    if a.save_profile:
        Path(a.save_profile).write_text(profile.to_json())
    rows = []
    measured_before = json.loads(Path(a.measured).read_text()) if a.measured else {}
    with tempfile.TemporaryDirectory() as folder:
        corpus = build_tiny_corpus(Path(folder)) if not a.measured else Path(folder)
        for name in names:
            cfg = config_of(corpus, name, a)
            predicted = step_time(TransformerConfig.from_dict(cfg), profile).total
            if a.measured:
                measured = measured_before[name]
            else:
                measured = run_distributed(time_worker, 4, cfg, a.steps, timeout_seconds=900)[0]
            rows.append((name, measured, predicted))
            print(
                f"{name:22s} measured {measured:7.3f} s  predicted {predicted:7.3f} s  ratio {predicted / measured:5.2f}"
            )
    if a.save_measured:
        Path(a.save_measured).write_text(json.dumps({name: m for name, m, _ in rows}, indent=1))
    measured_times, predicted_times = [r[1] for r in rows], [r[2] for r in rows]
    best = min(measured_times)
    top = min(rows, key=lambda r: r[2])
    print(f"Spearman (predicted vs measured): {spearman(predicted_times, measured_times):.3f} over {len(rows)} layouts")
    print(f"top-ranked {top[0]}: measured {top[1]:.3f} s = {top[1] / best:.3f} x the best measured ({best:.3f} s)")


if __name__ == "__main__":
    main()
