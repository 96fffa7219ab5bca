"""Stragglers named (#51): a rank slow in a phase is named within 10 steps, and no one in a clean run.

The runs train ``trainer_model``'s classifier with a forward that spins 20 ms on every rank
(the model's compute, made large against the machine's noise); from step 20 a rank gets 30 %
of its median step more, as compute in its forward or as a slow data set.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

import numpy as np
import pytest
import torch
from trainer_model import Batch, Blobs, build_trainer, loss_function

from scaling.collectives import get_recorder
from scaling.testing import run_distributed
from scaling.trainer._stragglers import PHASES, WAIT_OPS, PhaseTimer, _median_of_others, find_slow

COMPUTE_SECONDS = 0.02
ONSET = 20  # the first slow step


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _SlowBlobs(Blobs):
    """Blobs whose items take ``delay[0]`` seconds each to read."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = [0.0]

    def __getitem__(self, i: int) -> Any:
        if self.delay[0]:
            time.sleep(self.delay[0])
        return super().__getitem__(i)


def straggler_worker(
    tp: int, steps: int, slow_compute: int | None, slow_data: int | None, diagnostics: str
) -> dict[str, Any]:
    built: list[Any] = []
    extra = [0.0]

    def loss(out: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        trainer = built[0]
        rank, step = trainer.context.topology.global_rank, trainer.context.iterations + 1
        _spin(COMPUTE_SECONDS + (extra[0] if rank == slow_compute and step >= ONSET else 0.0))
        return loss_function(out, batch)

    settings = {"train_iterations": steps, "diagnostics_dir": diagnostics, "log_interval": 1000}
    data = _SlowBlobs()
    trainer = build_trainer(tp, 1, settings, zero_stage=1, loss=loss, dataset=data)
    built.append(trainer)
    rank = trainer.context.topology.global_rank
    history = []
    while trainer.context.iterations < steps:
        step = trainer.context.iterations + 1
        if step == ONSET:  # 30 % of this rank's median step so far
            extra[0] = 0.3 * statistics.median(m["runtime/step_duration"] for m in history[4:])
            if rank == slow_data:
                data.delay[0] = extra[0] / 4  # four samples a step on each of the four DP ranks
        history.append(trainer.train_step())
    named = {m["step"]: sorted((int(v), k.split("/")[1]) for k, v in m.items() if k.endswith("/rank")) for m in history}
    return {"named": {s: n for s, n in named.items() if n}, "checks": trainer.stragglers.interval}


def _first_named(named: dict[int, list[tuple[int, str]]]) -> dict[tuple[int, str], int]:
    first: dict[tuple[int, str], int] = {}
    for step in sorted(named):
        for key in named[step]:
            first.setdefault(key, step)
    return first


@pytest.mark.distributed
def test_a_slow_rank_and_a_slow_loader_are_named_within_ten_steps(tmp_path):
    """dp4: rank 2 computes 30 % more from step 20 and rank 1 reads its data 30 % slower: both are
    named, with their phase, by step 30 (checks every 5 steps, named at the second slow check), the
    same on every rank, in the metrics and in stragglers.jsonl; nothing is named before."""
    results = run_distributed(straggler_worker, 4, 1, 35, 2, 1, str(tmp_path), timeout_seconds=240)
    assert all(r["named"] == results[0]["named"] for r in results)
    first = _first_named(results[0]["named"])
    assert set(first) == {(2, "forward"), (1, "data")}, results[0]["named"]
    assert all(ONSET < step <= ONSET + 10 for step in first.values()), first
    lines = [json.loads(line) for line in (tmp_path / "stragglers.jsonl").read_text().splitlines()]
    assert {(line["rank"], line["phase"]) for line in lines} == {(2, "forward"), (1, "data")}
    forward = next(line for line in lines if line["phase"] == "forward")
    assert forward["score"] > 1.2 and forward["first"] > ONSET - 5 and forward["stage"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_under_tensor_parallelism_the_slow_rank_is_named_and_not_the_peer_that_waits_for_it(tmp_path):
    """dp2·tp2: rank 2's TP partner (rank 3) and DP partner (rank 0) wait for it in collectives;
    waits are not work, so rank 2 alone is named, in forward."""
    results = run_distributed(straggler_worker, 4, 2, 35, 2, None, str(tmp_path), timeout_seconds=240)
    first = _first_named(results[0]["named"])
    assert set(first) == {(2, "forward")}, results[0]["named"]
    assert all(ONSET < step <= ONSET + 10 for step in first.values()), first


@pytest.mark.slow
@pytest.mark.distributed
def test_nobody_is_named_over_two_hundred_clean_steps(tmp_path):
    results = run_distributed(straggler_worker, 4, 1, 200, None, None, str(tmp_path), timeout_seconds=300)
    assert results[0]["named"] == {}
    assert not (tmp_path / "stragglers.jsonl").exists()


# ------------------------------------------------------------------ scoring, no timing


def _table(ranks: int, steps: int, seconds: dict[str, float]) -> np.ndarray:
    table = np.zeros((ranks, steps, len(PHASES) + len(WAIT_OPS)))
    for phase, value in seconds.items():
        table[:, :, PHASES.index(phase)] = value
    return table


def test_find_slow_names_the_rank_above_its_peers_median_by_the_threshold():
    table = _table(4, 5, {"data": 0.001, "forward": 0.02, "backward": 0.03, "optimizer": 0.005})
    table[2, :, PHASES.index("forward")] = 0.03  # 1.5x its peers', 17 % of the step more
    table[2, 1, PHASES.index("forward")] = 0.02  # one fast step: the median does not care
    table[0, 3, PHASES.index("backward")] = 1.0  # one stall on rank 0: not chronic
    table[1, :, PHASES.index("data")] = 0.0011  # 1.1x: under the threshold
    (finding,) = find_slow(table, [0, 0, 0, 0], threshold=1.2, first=11)
    assert (finding.rank, finding.phase, finding.first, finding.last) == (2, "forward", 11, 15)
    assert finding.score == pytest.approx(1.5) and finding.stage == 0
    assert "rank 2 (pipeline stage 0) is slow in forward over steps 11-15" in finding.describe()


def test_find_slow_needs_a_share_of_the_step_and_compares_within_a_pipeline_stage():
    table = _table(4, 5, {"forward": 0.02, "backward": 0.04})
    table[1, :, PHASES.index("transfer")] = 1e-4  # 100x its peers' 1e-6, but 0.2 % of the step
    table[:, :, PHASES.index("transfer")] += 1e-6
    table[2:, :, PHASES.index("forward")] = 0.06  # stage 1 runs heavier layers: not slow
    assert find_slow(table, [0, 0, 1, 1], threshold=1.2) == []
    table[3, :, PHASES.index("forward")] = 0.09
    assert [(f.rank, f.phase) for f in find_slow(table, [0, 0, 1, 1], threshold=1.2)] == [(3, "forward")]
    # Alone in its stage, a rank has no peer to be compared with.
    assert find_slow(table, [0, 0, 1, 2], threshold=1.2) == []


def test_find_slow_skips_steps_a_rank_has_not_timed():
    table = _table(2, 5, {"forward": 0.02})
    table[:, :2] = math.nan  # resumed at step 3: three steps timed on both ranks
    table[1, 2:, PHASES.index("forward")] = 0.04
    (finding,) = find_slow(table, [0, 0], threshold=1.2, first=3)
    assert (finding.rank, finding.first, finding.last, finding.seconds) == (1, 3, 5, 0.04)


def test_the_phase_timer_leaves_collective_waits_out_of_the_phase_they_fall_in():
    now = [100.0]
    timer = PhaseTimer(torch.device("cpu"), steps=2, clock=lambda: now[0])
    recorder = get_recorder()
    for _ in range(3):  # the ring keeps the last two steps
        timer.start_step()
        now[0] += 0.25  # data: 0.25 s
        timer.mark("forward")
        now[0] += 1.5  # 1.5 s in forward, of which 1 s blocked in an all-reduce, 0.125 s in a ring shift
        recorder.add_wait("all_reduce", 1.0)
        recorder.add_wait("ring_shift", 0.125)
        timer.mark("optimizer")
        now[0] += 0.5
        timer.end_step()
    table = timer.table()
    assert table.shape == (2, len(PHASES) + len(WAIT_OPS))
    expected = dict.fromkeys(PHASES + WAIT_OPS, 0.0)
    expected.update(data=0.25, forward=0.375, optimizer=0.5, all_reduce=1.0, send_recv=0.125)
    for row in table:
        assert dict(zip(PHASES + WAIT_OPS, row.tolist())) == expected


def test_the_median_of_the_other_ranks_is_the_statistics_median_without_the_rank():
    rng = np.random.default_rng(0)
    for n in range(2, 9):
        x = rng.random((n, 3))
        x[0, 0] = x[1, 0]  # ties too
        got = _median_of_others(x)
        for r in range(n):
            for c in range(3):
                assert got[r, c] == pytest.approx(statistics.median(x[q, c] for q in range(n) if q != r), abs=0)
