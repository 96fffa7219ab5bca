"""Rank the layouts of a config on a cluster: each candidate's predicted peak memory per rank and step
time (``scaling-transformer plan``, #52).

The candidates keep the config's model and batch (global and micro), and vary how ``devices`` ranks
are laid out: TP within a node (a power of two dividing the node), pipeline stages, context
parallelism, data parallelism for the rest; ZeRO-1 or ZeRO-3; activation checkpointing ``none``,
``operators`` or ``every_layer``; with pipeline stages, the schedule (``SCHEDULES``: 1F1B, ZB-H1, ZB-V
and interleaved 1F1B with two chunks per stage; GPipe holds more than 1F1B for the same bubble). A candidate is refused, with the reason, when the config
rejects it (heads, layers or the batch not dividing), when its memory or time is not predicted, or
when its predicted peak exceeds the device's memory (by how much); the rest are ranked by predicted
tokens per second per device.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from pydantic import ValidationError

from scaling.trainer.planning import MachineProfile
from scaling.transformer.config import TransformerConfig
from scaling.transformer.memory import peak_memory
from scaling.transformer.steptime import StepTime, step_time

ZERO_STAGES = (1, 3)
CHECKPOINTING = ("none", "operators", "every_layer")
SCHEDULES = ("1f1b", "zb_h1", "zb_v", "interleaved_1f1b")
#: One of :func:`candidates`: ``(tp, pp, cp, dp, zero_stage, activation_checkpointing, schedule)``.
Candidate = tuple[int, int, int, int, int, str, str]


@dataclass(frozen=True)
class PlanRow:
    """One candidate layout and what it is predicted to cost (``step`` and ``peak`` None when refused).

    Attributes:
        tp, pp, cp, dp, zero_stage, activation_checkpointing, schedule: the layout (the schedule
            only matters with pipeline stages).
        micro_batches: micro-batches per rank and step.
        peak: the largest stage's predicted peak bytes per rank.
        step: the predicted step.
        refused: why it is not ranked (None: it fits).
    """

    tp: int
    pp: int
    cp: int
    dp: int
    zero_stage: int
    activation_checkpointing: str
    schedule: str = "1f1b"
    micro_batches: int = 0
    peak: int | None = None
    step: StepTime | None = None
    refused: str | None = None

    @property
    def layout(self) -> str:
        sizes = " ".join(f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("dp", self.dp)))
        schedule = f" {self.schedule}" if self.pp > 1 else ""
        return f"{sizes} ZeRO-{self.zero_stage} {self.activation_checkpointing}{schedule}"

    @property
    def candidate(self) -> Candidate:
        return (self.tp, self.pp, self.cp, self.dp, self.zero_stage, self.activation_checkpointing, self.schedule)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(devices: int, devices_per_node: int, schedule: str = "1f1b") -> Iterator[Candidate]:
    """``(tp, pp, cp, dp, zero_stage, activation_checkpointing, schedule)`` over ``devices`` ranks; TP a
    power of two within one node; each of :data:`SCHEDULES` with pipeline stages, ``schedule`` without."""
    for tp in _divisors(devices):
        if tp & (tp - 1) or tp > devices_per_node:
            continue
        for pp in _divisors(devices // tp):
            for cp in _divisors(devices // tp // pp):
                dp = devices // tp // pp // cp
                for zero, checkpointing in itertools.product(ZERO_STAGES, CHECKPOINTING):
                    for name in SCHEDULES if pp > 1 else (schedule,):
                        yield tp, pp, cp, dp, zero, checkpointing, name


def _with_layout(config: TransformerConfig, candidate: Candidate) -> TransformerConfig:
    tp, pp, cp, dp, zero, ac, schedule = candidate
    data = config.model_dump(mode="json")
    data["topology"].update(
        model_parallel_size=tp,
        pipe_parallel_size=pp,
        context_parallel_size=cp,
        data_parallel_size=dp,
        gradient_accumulation_steps=None,
        world_size=None,
    )
    data["optimizer"]["zero_stage"] = zero
    data["transformer_architecture"]["activation_checkpointing"] = ac
    data["training"].update(schedule=schedule, num_virtual_stages=2 if schedule == "interleaved_1f1b" else 1)
    data["runner"]["nproc_per_node"] = tp * pp * cp * dp
    return TransformerConfig.from_dict(data)


def _first_line(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in err.errors())
    return str(err).splitlines()[0]


def rank_plans(
    config: TransformerConfig,
    profile: MachineProfile,
    devices: int,
    device_memory: float | None = None,
    search: Sequence[Candidate] | None = None,
) -> list[PlanRow]:
    """Every candidate layout of ``config`` on ``devices`` ranks of ``profile``'s machine: those that
    fit ``device_memory`` bytes (None: any) by predicted tokens/s per device, fastest first, then the
    refused ones with their reasons.

    Args:
        search: the candidates to try (default :func:`candidates`).

    Raises:
        ValueError: ``devices`` < 1.
    """
    if devices < 1:
        raise ValueError(f"devices={devices}: give the number of devices (ranks), >= 1")
    device = "cuda" if profile.device == "cuda" else "cpu"
    ranked: list[tuple[float, PlanRow]] = []
    refused: list[PlanRow] = []
    for layout in search or list(candidates(devices, profile.devices_per_node, config.training.schedule)):
        row = PlanRow(*layout)
        try:
            candidate = _with_layout(config, layout)
            peak = max(peak_memory(candidate, stage, device).peak for stage in range(row.pp))
            step = step_time(candidate, profile)
        except (ValueError, ValidationError) as err:
            refused.append(replace(row, refused=_first_line(err)))
            continue
        row = replace(row, micro_batches=candidate.topology.gradient_accumulation_steps or 1, peak=peak, step=step)
        if device_memory is not None and peak > device_memory:
            over = f"does not fit: peak {peak / 2**30:.2f} GiB, {(peak - device_memory) / 2**30:.2f} GiB over"
            refused.append(replace(row, refused=over))
        else:
            ranked.append((step.tokens_per_second_per_device, row))
    ranked.sort(key=lambda pair: -pair[0])
    return [row for _, row in ranked] + refused
