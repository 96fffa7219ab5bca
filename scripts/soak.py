"""Bounded chaos loop: train, kill at random, restart, and check nothing was lost.

    python scripts/soak.py --minutes 20 --seed 0

Each round launches tests/reliability/fault_train.py on 2 ranks (dp2, dropout, save every
step, keep_last_n_checkpoints=N) through ``runner_main``, resuming from the checkpoint
folder; at a random moment either one random rank is SIGKILLed or SIGTERM goes to every
rank. While rounds run, the number of step folders is sampled and must never exceed N + 1.
When the time is up (or the run reaches its last step) one round runs to the end. The
per-step losses of every completed step (last write wins) must equal an uninterrupted
reference run bitwise, and each round must exit 0 (it finished first), 143 after SIGTERM
or 137 after SIGKILL. Exit code 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))

from reliability_testlib import alive, config, launch, steps  # noqa: E402


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in steps(out, 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of the whole run")
    parser.add_argument("--keep-last", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="scaling-soak-"))
    ckpt = work / "ckpt"
    trainer = {"save_dir": str(ckpt), "save_interval": 1, "keep_last_n_checkpoints": args.keep_last}

    print(f"soak: reference run of {args.steps} steps in {work}", flush=True)
    assert launch(config(work, steps=args.steps, tp=1, dp=2), work / "reference") == 0
    reference = _losses(work / "reference")

    end = time.monotonic() + args.minutes * 60
    max_folders, rounds, problems = 0, [], []
    done = False
    while not done:
        final = time.monotonic() > end
        resume = {"load_dir": str(ckpt)} if (ckpt / "latest").exists() else {}
        cfg = config(work, steps=args.steps, tp=1, dp=2, trainer={**trainer, **resume})
        out = work / "chaos"
        action = "none" if final else rng.choice(["sigkill_rank", "sigterm_all"])
        delay = rng.uniform(0.5, 10.0)  # counted from the moment every rank is up
        stop = threading.Event()

        def chaos(action=action, delay=delay, out=out, stop=stop) -> None:
            nonlocal max_folders
            t0: float | None = None
            fired = False
            while not stop.is_set():
                if t0 is None and len(list(out.glob("rank*.json"))) == 2:
                    t0 = time.monotonic()
                n = len([p for p in ckpt.glob("step_*") if p.is_dir()]) if ckpt.exists() else 0
                max_folders = max(max_folders, n)
                if not fired and t0 is not None and action != "none" and time.monotonic() - t0 > delay:
                    pids = [json.loads(p.read_text())["pid"] for p in sorted(out.glob("rank*.json"))]
                    victims = [rng.choice(pids)] if action == "sigkill_rank" else pids
                    for pid in victims:
                        if alive(pid):
                            os.kill(pid, signal.SIGKILL if action == "sigkill_rank" else signal.SIGTERM)
                    fired = True
                time.sleep(0.05)

        for stale in out.glob("rank*.json"):
            stale.unlink()
        watcher = threading.Thread(target=chaos, daemon=True)
        watcher.start()
        code = launch(cfg, out)
        stop.set()
        watcher.join()
        rounds.append((action, round(delay, 1), code))
        print(f"soak: round {len(rounds)}: {action} after {delay:.1f}s -> exit {code}", flush=True)
        done = code == 0
        expected = {"sigterm_all": (0, 143), "sigkill_rank": (0, 137), "none": (0,)}[action]
        if code not in expected:
            problems.append(f"round {len(rounds)}: {action} gave exit {code}, expected one of {expected}")
        if final and code != 0:
            problems.append(f"the final uninterrupted round exited with {code}")
            break

    got = _losses(work / "chaos")
    wrong = [s for s in reference if got.get(s) != reference[s]]
    if wrong:
        problems.append(f"{len(wrong)} steps differ from the reference, first: step {wrong[0]}")
    if max_folders > args.keep_last + 1:
        problems.append(f"{max_folders} step folders seen at once > keep_last_n_checkpoints + 1 = {args.keep_last + 1}")
    summary = {
        "rounds": len(rounds),
        "actions": rounds,
        "max_step_folders": max_folders,
        "steps_checked": len(reference),
        "problems": problems,
    }
    print("soak: " + json.dumps(summary), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
