"""What straggler detection costs a training step, against the same step without it, in the same run.

Run: python bench/stragglers.py [--layout pp2|dp2|tp2] [--pairs 150] [--interval 5]

The MLP app's trainer (its bundled config at the layout given, 2 gloo ranks) trains
``2 * pairs`` steps after a warm-up, alternating one step with detection on
(``trainer.straggler_interval`` = ``--interval``) and one with it off, so both see the same
interference from other processes; a check (the all-gather and the scoring: every
``interval`` steps) runs where such a step falls on an "on" step, and counts there. The ratio is the median over pairs
of ``on_i / off_i`` (IQR printed); step times include data, schedule, reduction and update.

The second figure does not depend on the machine's noise: the timer's own work per step
(its ``mark`` calls times the marks a step makes, ``start_step``/``end_step``, and each check
divided by the interval), timed in isolation, over the median step without detection.
Issue #51's goal: <= 0.5 % of the step. The collectives' wait counting (two clock reads per
collective) is always on and is in both sides.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import yaml

from scaling.mlp import train
from scaling.mlp.__main__ import DEFAULT_CONFIG
from scaling.testing import run_distributed
from scaling.topology import Topology
from scaling.trainer._stragglers import StragglerDetector

LAYOUTS = {"pp2": (1, 2, 1), "dp2": (1, 1, 2), "tp2": (2, 1, 1)}


def _config(layout: str, steps: int, interval: int) -> dict[str, Any]:
    tp, pp, dp = LAYOUTS[layout]
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["topology"].update(model_parallel_size=tp, pipe_parallel_size=pp, data_parallel_size=dp, timeout_seconds=120)
    cfg["runner"]["nproc_per_node"] = tp * pp * dp
    cfg["trainer"].update(
        train_iterations=steps,
        eval_interval=None,
        save_dir=None,
        save_interval=None,
        log_interval=10**6,
        straggler_interval=interval,
    )
    cfg["logger"].update(log_dir=None)
    cfg["learning_rate_scheduler"].update(learning_rate_decay_iters=steps, learning_rate_warmup_steps=10)
    return cfg


def measure(layout: str, pairs: int, interval: int, warmup: int = 20) -> dict[str, float]:
    config = train.MLPConfig.from_dict(_config(layout, warmup + 2 * pairs + 1, interval))
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    on = trainer.stragglers
    off = StragglerDetector(topology, None, on.threshold, on.console, None)
    for _ in range(warmup):
        trainer.train_step()
    times: dict[bool, list[float]] = {True: [], False: []}
    marks: list[int] = []
    for i in range(2 * pairs):
        detecting = i % 2 == 0 if (i // 2) % 2 == 0 else i % 2 == 1  # ABBA: each side first half the time
        trainer.stragglers = on if detecting else off
        start = time.perf_counter()
        trainer.train_step()
        times[detecting].append(time.perf_counter() - start)
        if detecting:
            assert on.timer is not None
            marks.append(len(on.timer.steps[-1][0]))
    ratios = sorted(a / b for a, b in zip(times[True], times[False]))
    step_off = statistics.median(times[False])
    # The timer's own work, in isolation: a step's marks, and one check per interval steps.
    timer = on.timer
    assert timer is not None
    per_step_marks = statistics.median(marks)
    rounds = 2000
    start = time.perf_counter()
    for _ in range(rounds):
        timer.start_step()
        for _ in range(int(per_step_marks) - 2):
            timer.mark("forward")
        timer.end_step()
    timer_seconds = (time.perf_counter() - start) / rounds
    on.check(interval)  # once untimed: both ranks leave it together (the loop above ends apart)
    start = time.perf_counter()
    checks = 20
    for k in range(checks):
        on.check(interval * (k + 1))  # every rank calls it at the same points: the all-gather pairs up
    check_seconds = (time.perf_counter() - start) / checks
    trainer.stragglers = off
    topology.destroy()
    q = len(ratios) // 4
    return {
        "ratio": statistics.median(ratios),
        "ratio_p25": ratios[q],
        "ratio_p75": ratios[-q - 1],
        "step_ms": step_off * 1e3,
        "marks": per_step_marks,
        "timer_us": timer_seconds * 1e6,
        "check_us": check_seconds * 1e6,
        "share": (timer_seconds + check_seconds / interval) / step_off,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2")
    parser.add_argument("--pairs", type=int, default=150)
    parser.add_argument("--interval", type=int, default=5)
    args = parser.parse_args()
    results = run_distributed(measure, 2, args.layout, args.pairs, args.interval, timeout_seconds=1200)
    r = results[0]
    print(
        f"layout {args.layout}, 2 gloo ranks, MLP app step {r['step_ms']:.2f} ms without detection, "
        f"{r['marks']:.0f} marks a step, check every {args.interval} steps"
    )
    print(
        f"step with detection / without: {r['ratio']:.4f} (IQR {r['ratio_p25']:.4f}-{r['ratio_p75']:.4f}, "
        f"{args.pairs} pairs, same run)"
    )
    print(
        f"timer's own work: {r['timer_us']:.1f} us a step + a check {r['check_us']:.0f} us / {args.interval} = "
        f"{r['share']:.3%} of the step (goal <= 0.5 %)"
    )


if __name__ == "__main__":
    main()
