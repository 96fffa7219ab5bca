"""Stragglers named: per-rank phase timers, a small all-gather every few steps, robust scores.

A synchronous job runs at the pace of its slowest rank. This module names that rank and
the part of the step it is slow in, on by default (``trainer.straggler_interval``).

**Timing.** Each step the trainer tells a :class:`PhaseTimer` which phase it is in:
``data`` (the next global batch: loading, placement, the TP broadcast), ``forward``,
``backward`` and ``transfer`` (pipeline messages; the executor marks its instructions),
``gradient_reduction`` (finishing the DP reduction, tied weights), ``optimizer`` and
``results`` (the step's loss and metrics). A phase's time is the host time spent in it
less the time this rank was blocked in collectives meanwhile (``scaling.collectives``
counts each wait, per op): a rank that waits for a slow peer accrues wait, not work, so
under tensor or data parallelism the slow rank stands out and not the peers that wait for
it. The waits are kept per op beside the phases, as the evidence (the others wait).
On CUDA the phases are timed by events on the current stream instead (the host only
queues kernels); a phase's device time then includes the stream's waits for NCCL.

**Scoring.** Every ``interval`` steps each rank all-gathers its last ``interval`` steps
(a float per phase and wait op per step, and its pipeline stage). For each phase, a rank's
median over those steps is compared with the median of the other ranks of its pipeline
stage (stages run different layers, so they are not compared). A rank is *slow* in a phase
when it exceeds that by ``threshold`` times and by at least :data:`MIN_SHARE` of the median
step and :data:`MIN_SECONDS`; it is *named* when it was slow in that phase at two checks in a row: chronically,
not once (a rank descheduled for a moment is not a straggler). A named rank is logged
once, when it is first named, and again when it is no longer slow; while named, each check
adds ``stragglers/<phase>/rank`` and ``/score`` to the step's metrics and a line to
``stragglers.jsonl`` in the diagnostics folder.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from scaling.collectives import all_gather, get_recorder
from scaling.topology import Topology

#: The phases of a step, in the order they are reported.
PHASES = ("data", "forward", "backward", "transfer", "gradient_reduction", "optimizer", "results")
#: The collective waits kept per step (any other op counts as ``other``).
WAIT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv", "other")
#: A phase must cost a rank at least this share of the median step, and this many seconds, more
#: than its peers before the rank is slow in it (a time slice of a shared CPU is a few ms).
MIN_SHARE = 0.1
MIN_SECONDS = 0.005
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}
_WAIT_INDEX = {op: len(PHASES) + i for i, op in enumerate(WAIT_OPS)}
_WAIT_OF = {"ring_shift": "send_recv"}


class PhaseTimer:
    """This rank's time per phase of its last ``steps`` steps (a ring).

    ``start_step()``, then ``mark(phase)`` at each change of phase, then ``end_step()``;
    :meth:`table` resolves the ring into one row per step. ``clock``: the host clock (seconds).
    """

    def __init__(self, device: torch.device, steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self._events = device.type == "cuda"
        self._clock = clock
        self._recorder = get_recorder()
        # Per step: the marks (phase, host seconds or CUDA event, seconds waited so far) and the waits per op.
        self.steps: deque[tuple[list[tuple[str, object, float]], dict[str, float]]] = deque(maxlen=steps)
        self._marks: list[tuple[str, object, float]] = []
        self._waits_before: dict[str, float] = {}

    def start_step(self) -> None:
        self._marks = []
        self._waits_before = dict(self._recorder.wait_seconds)
        self.mark("data")

    def mark(self, phase: str) -> None:
        """From now on the step is in ``phase``."""
        if self._events:
            stamp: object = torch.cuda.Event(enable_timing=True)
            stamp.record()  # type: ignore[attr-defined]
        else:
            stamp = self._clock()
        self._marks.append((phase, stamp, self._recorder.waited))

    def end_step(self) -> None:
        self.mark("")
        before = self._waits_before
        waits = {op: s - before.get(op, 0.0) for op, s in self._recorder.wait_seconds.items()}
        self.steps.append((self._marks, waits))

    def table(self) -> np.ndarray:
        """``[steps, len(PHASES) + len(WAIT_OPS)]`` float64 seconds, one row per step in the ring."""
        rows = []
        for marks, waits in self.steps:
            row = [0.0] * (len(PHASES) + len(WAIT_OPS))
            rows.append(row)
            if self._events:
                marks[-1][1].synchronize()  # type: ignore[attr-defined]
            for (phase, start, waited_before), (_, end, waited_after) in zip(marks, marks[1:]):
                if self._events:
                    seconds = start.elapsed_time(end) / 1000  # type: ignore[attr-defined]
                else:
                    seconds = (end - start) - (waited_after - waited_before)  # type: ignore[operator]
                row[_PHASE_INDEX[phase]] += max(seconds, 0.0)
            for op, seconds in waits.items():
                row[_WAIT_INDEX.get(_WAIT_OF.get(op, op), _WAIT_INDEX["other"])] += seconds
        return np.array(rows, dtype=np.float64).reshape(len(rows), len(PHASES) + len(WAIT_OPS))


@dataclass(frozen=True)
class Finding:
    """A rank slow in a phase over the steps ``first``..``last`` (medians in seconds per step)."""

    rank: int
    stage: int
    phase: str
    seconds: float  # the rank's median
    peer_seconds: float  # the median of its stage's other ranks
    step_seconds: float  # the median step of all ranks
    waits: float  # the rank's median time blocked in collectives
    peer_waits: float  # its peers'
    first: int
    last: int

    @property
    def score(self) -> float:
        return self.seconds / max(self.peer_seconds, 1e-9)

    def describe(self) -> str:
        excess = self.seconds - self.peer_seconds
        return (
            f"rank {self.rank} (pipeline stage {self.stage}) is slow in {self.phase} over steps {self.first}-"
            f"{self.last}: {_ms(self.seconds)} a step against {_ms(self.peer_seconds)} on the other ranks of its "
            f"stage ({self.score:.2f}x; {_ms(excess)}, {excess / self.step_seconds:.0%} of the "
            f"{_ms(self.step_seconds)} step); they wait {_ms(self.peer_waits)} a step in collectives, it "
            f"waits {_ms(self.waits)}"
        )


def find_slow(table: np.ndarray, stages: list[int], threshold: float, first: int = 0) -> list[Finding]:
    """The (rank, phase) pairs slow in ``table`` ``[ranks, steps, phases + waits]`` (NaN rows: steps
    a rank has not timed), each rank against the other ranks of its stage (``stages[rank]``).

    Vectorised over ranks and phases (numpy: tiny arrays, where torch's per-op cost dominates)."""
    table = table[:, ~np.isnan(table[0, :, 0])]  # every rank timed the same steps
    medians = np.median(table, axis=1)  # [ranks, columns]
    step_seconds = float(np.median(np.median(table.sum(axis=2), axis=1)))
    work = medians[:, : len(PHASES)]
    waits = medians[:, len(PHASES) :].sum(axis=1, keepdims=True)
    last = first + table.shape[1] - 1
    stage_of = np.asarray(stages)
    found = []
    for stage in sorted(set(stages)):
        ranks = np.flatnonzero(stage_of == stage)
        if len(ranks) < 2:
            continue  # alone in its stage: no peer to be compared with
        mine, theirs = work[ranks], _median_of_others(work[ranks])
        slow = (mine >= threshold * theirs) & (mine - theirs >= max(MIN_SHARE * step_seconds, MIN_SECONDS))
        peer_waits = _median_of_others(waits[ranks])
        for row, phase in zip(*np.nonzero(slow)):
            rank = int(ranks[row])
            found.append(
                Finding(
                    rank,
                    stage,
                    PHASES[phase],
                    float(mine[row, phase]),
                    float(theirs[row, phase]),
                    step_seconds,
                    float(waits[rank, 0]),
                    float(peer_waits[row, 0]),
                    first,
                    last,
                )
            )
    return sorted(found, key=lambda f: (f.rank, PHASES.index(f.phase)))


def _median_of_others(x: np.ndarray) -> np.ndarray:
    """``[n, k]`` -> ``[n, k]``: for each row, the median of the other ``n - 1`` rows (per column;
    the mean of the middle two for an even count), from one sort."""
    n = x.shape[0]
    order = np.argsort(x, axis=0, kind="stable")
    ordered = np.take_along_axis(x, order, axis=0)
    position = np.argsort(order, axis=0)  # each row's place in its column's order

    def other(i: int) -> np.ndarray:  # the i-th smallest of the other rows
        return np.take_along_axis(ordered, np.where(position > i, i, i + 1), axis=0)

    if n % 2 == 0:  # an odd number of others
        return other((n - 2) // 2)
    return (other((n - 1) // 2 - 1) + other((n - 1) // 2)) / 2


class StragglerDetector:
    """Times each training step's phases on this rank and names chronic stragglers (module docstring).

    Args:
        topology: the run's topology (world size, pipeline stage, device).
        interval: steps between checks (each rank's last ``interval`` steps are compared);
            ``None`` turns detection off, as does a world of one rank.
        threshold: how many times its peers' median a rank's phase must take to be slow.
        console: prints a line on the logging rank.
        diagnostics_dir: where ``stragglers.jsonl`` gets a line per named rank per check
            (written by global rank 0), or ``None``.
    """

    def __init__(
        self,
        topology: Topology,
        interval: int | None,
        threshold: float,
        console: Callable[[str], None],
        diagnostics_dir: Path | None,
    ) -> None:
        on = interval is not None and topology.world_size > 1
        self.timer = PhaseTimer(topology.device, interval) if on and interval is not None else None
        self.interval, self.threshold = interval or 0, threshold
        self.topology, self.console, self.diagnostics_dir = topology, console, diagnostics_dir
        self._slow: set[tuple[int, str]] = set()  # slow at the previous check
        self.named: dict[tuple[int, str], Finding] = {}  # slow at two checks in a row, and still

    def check(self, step: int) -> dict[str, float]:
        """After step ``step`` (every rank): on a check step, gather, score, log; the metrics to add."""
        timer = self.timer
        if timer is None or step % self.interval:
            return {}
        table = torch.full((self.interval, len(PHASES) + len(WAIT_OPS) + 1), float("nan"), dtype=torch.float64)
        timed = timer.table()
        table[: len(timed), :-1] = torch.from_numpy(timed)
        table[:, -1] = self.topology.axis("pp").rank
        device = self.topology.device
        gathered = all_gather(table.to(device).unsqueeze(0), dist.group.WORLD).cpu()
        stages = [int(s) for s in gathered[:, 0, -1]]
        found = find_slow(gathered[:, :, :-1].numpy(), stages, self.threshold, first=step - len(timed) + 1)
        slow = {(f.rank, f.phase): f for f in found}
        named = {key: f for key, f in slow.items() if key in self._slow}
        for key, finding in named.items():
            if key not in self.named:
                self.console(f"straggler: {finding.describe()}")
        for key in self.named.keys() - named.keys():
            self.console(
                f"straggler: rank {key[0]} is no longer slow in {key[1]} (steps {step - len(timed) + 1}-{step})"
            )
        self._slow, self.named = set(slow), named
        self._write(step, named.values())
        metrics: dict[str, float] = {}
        for finding in named.values():
            metrics[f"stragglers/{finding.phase}/rank"] = finding.rank
            metrics[f"stragglers/{finding.phase}/score"] = finding.score
        return metrics

    def _write(self, step: int, findings: Iterable[Finding]) -> None:
        if self.diagnostics_dir is None or self.topology.global_rank != 0:
            return
        lines = [json.dumps({"step": step, **asdict(f), "score": f.score}) for f in findings]
        if lines:
            self.diagnostics_dir.mkdir(parents=True, exist_ok=True)
            with open(self.diagnostics_dir / "stragglers.jsonl", "a") as out:
                out.write("\n".join(lines) + "\n")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
