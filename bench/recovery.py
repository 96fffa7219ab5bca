"""Goodput after a lost rank: restart from memory against restart from disk, and what the copies cost.

Run: python bench/recovery.py [--ranks 4 8] [--step-delay 0.1] [--save-interval 20] [--kill-step 45]
     python bench/recovery.py --cost [--blocks 10] [--hidden 1024]

Restart (the default): ``tests/reliability/fault_train.py`` (the dropout classifier, at dp =
ranks) through the runner (local torchrun, ``runner.max_restarts=1``), each step padded to
``--step-delay`` seconds (a model's compute, without its memory), a disk save every
``--save-interval`` steps. Rank 1 SIGKILLs itself in step ``--kill-step``. Measured: from the
kill (rank 1's clock just before it) to the end of that step in the restarted attempt (rank 0's
record), once with a copy in memory every step (``memory_checkpoint_interval=1``: the restart
resumes from the step before) and once without (the restart loads the last disk checkpoint and
trains the steps since it again). Both include what any restart costs here: torchrun stopping
the survivors, new processes importing torch, the rendezvous. Issue #51's goal: memory >= 5x
faster.

Cost (``--cost``): the MLP app's trainer (2 gloo ranks, dp2, hidden ``--hidden``), alternating
blocks of 10 steps with a copy to memory after every step and without, in the same run (ABBA
over the blocks). Printed: the median step with and without the copy, their ratio, the copy's
own time and the bytes a rank copies. The trainer copies every ``memory_checkpoint_interval``
steps (default 10): its share of the step is the copy over that interval. Issue #51's goal:
<= 2 % of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def restart_seconds(ranks: int, memory: bool, step_delay: float, save_interval: int, kill_step: int) -> float:
    sys.path.insert(0, str(ROOT / "tests" / "reliability"))
    from reliability_testlib import config, launch

    with tempfile.TemporaryDirectory(prefix="scaling-recovery-") as tmp_name:
        tmp = Path(tmp_name)
        trainer = {
            "save_dir": str(tmp / "ckpt"),
            "save_interval": save_interval,
            "log_interval": 1000,
            "memory_checkpoint_interval": 1 if memory else None,
            "memory_checkpoint_dir": f"/dev/shm/scaling-bench-{tmp.name}",
            "straggler_interval": None,
        }
        cfg = config(tmp, steps=kill_step + 2, tp=1, dp=ranks, timeout_s=30.0, trainer=trainer)
        cfg["topology"]["micro_batch_size"] = 16 // ranks
        faults = [{"kind": "sigkill", "rank": 1, "step": kill_step}]
        out = tmp / "out"
        code = launch(cfg, out, faults, max_restarts=1, step_delay_s=step_delay)
        if code != 0:
            raise RuntimeError(f"the run with {ranks} ranks (memory={memory}) failed with exit code {code}")
        killed = float((out / "fault_rank1.time").read_text())
        records = [json.loads(line) for line in (out / "steps_rank0.jsonl").read_text().splitlines()]
        done = next(r["time"] for r in records if r["attempt"] == 1 and r["step"] == kill_step)
        return float(done - killed)


def cost_worker(blocks: int, hidden: int) -> dict[str, float]:
    import yaml

    from scaling.mlp import train
    from scaling.mlp.__main__ import DEFAULT_CONFIG
    from scaling.topology import Topology
    from scaling.trainer.checkpoint import MemoryCheckpoints

    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["topology"].update(model_parallel_size=1, pipe_parallel_size=1, data_parallel_size=2, micro_batch_size=30)
    cfg["runner"]["nproc_per_node"] = 2
    steps = 10 + 2 * blocks * 10
    cfg["trainer"].update(train_iterations=steps, eval_interval=None, save_dir=None, save_interval=None)
    cfg["trainer"].update(log_interval=10**6, straggler_interval=None)
    cfg["logger"].update(log_dir=None)
    cfg["architecture"].update(hidden_size=hidden)
    cfg["learning_rate_scheduler"].update(learning_rate_decay_iters=steps, learning_rate_warmup_steps=5)
    config = train.MLPConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    with tempfile.TemporaryDirectory(prefix="scaling-bench-", dir="/dev/shm") as folder:
        memory = MemoryCheckpoints(Path(folder), topology.global_rank)
        checkpointer = trainer.checkpointer
        for _ in range(10):  # warm-up
            trainer.train_step()
        times: dict[bool, list[float]] = {True: [], False: []}
        blocking: list[float] = []
        for block in range(2 * blocks):
            copying = (block % 4) in (0, 3)  # ABBA over blocks
            checkpointer.memory = memory if copying else None
            checkpointer.last_memory_step = None
            for _ in range(10):
                start = time.perf_counter()
                trainer.train_step()
                middle = time.perf_counter()
                checkpointer.save_to_memory()
                times[copying].append(time.perf_counter() - start)
                if copying:
                    blocking.append(time.perf_counter() - middle)
        checkpointer.memory = None
        state_bytes = (Path(folder) / f"rank_{topology.global_rank}" / "slot_0.bin").stat().st_size
    topology.destroy()
    return {
        "with": statistics.median(times[True]),
        "without": statistics.median(times[False]),
        "blocking": statistics.median(blocking),
        "bytes": state_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--save-interval", type=int, default=20)
    parser.add_argument("--kill-step", type=int, default=45)
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    if args.cost:
        from scaling.testing import run_distributed

        r = run_distributed(cost_worker, 2, args.blocks, args.hidden, timeout_seconds=1800)[0]
        print(
            f"MLP app, dp2, hidden {args.hidden}: {r['bytes'] / 2**20:.1f} MiB copied a rank; step "
            f"{r['without'] * 1e3:.2f} ms without a copy, {r['with'] * 1e3:.2f} ms with one every step (the copy "
            f"{r['blocking'] * 1e3:.2f} ms): ratio {r['with'] / r['without']:.4f}; at the default interval (10) "
            f"{r['blocking'] / 10 / r['without']:.2%} of the step (goal <= 2 %)"
        )
        return
    lost = args.kill_step - 1 - (args.kill_step - 1) // args.save_interval * args.save_interval
    for ranks in args.ranks:
        memory = restart_seconds(ranks, True, args.step_delay, args.save_interval, args.kill_step)
        disk = restart_seconds(ranks, False, args.step_delay, args.save_interval, args.kill_step)
        print(
            f"{ranks} ranks, steps of {args.step_delay:.2f} s, disk save every {args.save_interval}: kill in step "
            f"{args.kill_step} to that step done: from memory {memory:.1f} s, from disk {disk:.1f} s "
            f"({lost} steps trained again); disk / memory {disk / memory:.2f}x (goal >= 5x)"
        )


if __name__ == "__main__":
    main()
