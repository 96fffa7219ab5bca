"""ProfilerConfig and StepProfiler (torch.profiler traces, instruction timers) and runtime measurements.

The window is steps ``profile_start_step`` .. ``profile_start_step + profile_steps - 1``
(1-based optimizer steps, as in the logged ``step``). Inside it the trainer's
``StepProfiler`` keeps a ``torch.profiler.profile`` open and gives the module an
``instruction_timings`` list, which the pipeline executor fills with one
``(repr(instruction), start, end)`` per instruction (and marks with
``record_function(repr(instruction))`` in the torch trace). At the end of the window it
writes, on each profiled rank:

- ``trace_dir/torch_trace_rank{r}_steps{a}-{b}.json``: Chrome trace (chrome://tracing, Perfetto);
- ``trace_dir/tensorboard/rank{r}.*.pt.trace.json``: the same trace for TensorBoard's profiler plugin;
- ``trace_dir/instructions_rank{r}_steps{a}-{b}.json``: the executor's instruction timers as a Chrome trace.

With ``memory_snapshot`` (CUDA), torch's record of the caching allocator's history runs from
the first step, as torchtitan's memory snapshots do, and is dumped (a pickle that
https://pytorch.org/memory_viz opens) to ``trace_dir/memory_snapshot_rank{r}_step{b}.pickle``
at the window's last step (or at the last step run, when training ends or stops before it)
and to ``trace_dir/memory_snapshot_rank{r}_oom.pickle`` when a step runs out of device memory
(the error is raised on after).
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from pydantic import Field, model_validator

from scaling.config import BaseConfig
from scaling.pipeline import ParallelModule
from scaling.trainer._config import TrainerConfig

if TYPE_CHECKING:
    from collections.abc import Iterator

    from scaling.config import JsonDict

logger = logging.getLogger("scaling.trainer")
#: Allocator events a memory snapshot keeps (torchtitan's default): the last ones before the dump.
SNAPSHOT_ENTRIES = 100_000


class ProgressBar(Protocol):
    """The part of a tqdm bar the trainer uses."""

    def update(self, n: int = 1) -> object: ...

    def set_postfix(self, refresh: bool = True, **kwargs: str) -> None: ...

    def close(self) -> None: ...


class ProfilerConfig(BaseConfig):
    """Which steps to profile with ``torch.profiler`` and where the traces go."""

    enabled: bool = Field(False, description="Profile the step window below; False = no profiler, no timers.")
    profile_start_step: int = Field(
        2, ge=1, description="First profiled optimizer step (1-based, as logged); >= 1. Step 1 includes warm-up."
    )
    profile_steps: int = Field(2, ge=1, description="Number of consecutive steps profiled, >= 1.")
    trace_dir: Path | None = Field(
        None, description="Folder for the Chrome trace JSON, the TensorBoard traces and the instruction timers."
    )
    all_ranks: bool = Field(
        False, description="Profile every rank (file names carry the rank); False = global rank 0 only."
    )
    record_shapes: bool = Field(False, description="Record operator input shapes (torch.profiler record_shapes).")
    with_stack: bool = Field(False, description="Record Python stacks of operators (larger traces, slower).")
    profile_memory: bool = Field(False, description="Track tensor allocations (torch.profiler profile_memory).")
    instruction_timers: bool = Field(
        True, description="Time each pipeline-executor instruction in the window and export the timers."
    )
    memory_snapshot: bool = Field(
        False,
        description=(
            "CUDA: record the caching allocator from step 1 and dump its snapshot to trace_dir at the window's "
            "last step (or the last step run, if training ends first) and when a step runs out of memory (open it "
            "at https://pytorch.org/memory_viz); "
            "independent of enabled. Without CUDA nothing is recorded (the log says so)."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> ProfilerConfig:
        for name in ("enabled", "memory_snapshot"):
            if getattr(self, name) and self.trace_dir is None:
                raise ValueError(f"profiler.{name}=true needs profiler.trace_dir; set trace_dir or {name}=false")
        return self


class StepProfiler:
    """Drives ``torch.profiler`` over the configured window; used by ``BaseTrainer.run_training``.

    Args:
        config: the profiler section, or None (nothing is profiled).
        rank: this process's global rank (goes into file names).
        module: the parallel module; it gets ``instruction_timings`` during the window.
        device: the training device (CUDA activity is recorded on a CUDA device).

    Example::

        profiler = StepProfiler(ProfilerConfig(enabled=True, trace_dir="traces"), rank=0, module=module)
        for step in range(1, 11):
            profiler.step_begin(step)
            train_one_step()
            profiler.step_end(step)
        profiler.close()
    """

    def __init__(
        self, config: ProfilerConfig | None, rank: int, module: ParallelModule, device: torch.device | str | None = None
    ) -> None:
        self.config = config or ProfilerConfig()
        self.rank, self.module = rank, module
        chosen = self.config.all_ranks or rank == 0
        self.active = self.config.enabled and chosen
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.snapshots = self.config.memory_snapshot and chosen and self.device.type == "cuda"
        if self.config.memory_snapshot and chosen and not self.snapshots:
            logger.warning("profiler.memory_snapshot: %s has no CUDA caching allocator; no snapshot", self.device)
        self._recording = False
        self._snapshot_step = 0  # the last step that ended while recording
        self._prof: torch.profiler.profile | None = None
        self._first: int | None = None
        self._last: int | None = None
        self.files: list[Path] = []

    @property
    def window(self) -> range:
        """The profiled steps."""
        start = self.config.profile_start_step
        return range(start, start + self.config.profile_steps)

    def step_begin(self, step: int) -> None:
        """Call before optimizer step ``step`` (1-based); opens the profiler at the window."""
        if self.snapshots and not self._recording and step <= self.window[-1]:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
            self._recording = True
        if not self.active or self._prof is not None or step not in self.window or self._first is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        cfg = self.config
        self._prof = torch.profiler.profile(
            activities=activities,
            record_shapes=cfg.record_shapes,
            with_stack=cfg.with_stack,
            profile_memory=cfg.profile_memory,
        )
        self._prof.__enter__()
        self._first = step
        self._clock_offset = time.time() - time.perf_counter()
        if cfg.instruction_timers:
            self.module.instruction_timings = []
        self._step_marks: list[tuple[int, int]] = []

    def step_end(self, step: int) -> None:
        """Call after optimizer step ``step``; closes and exports at the window's last step."""
        self._snapshot_step = step
        if self._recording and step >= self.window[-1]:
            self._dump_snapshot(f"step{step}")
        if self._prof is None:
            return
        timings = self.module.instruction_timings
        self._step_marks.append((step, len(timings) if timings is not None else 0))
        self._prof.step()
        self._last = step
        if step >= self.window[-1]:
            self._export()

    @contextlib.contextmanager
    def out_of_memory(self) -> Iterator[None]:
        """Around a step: when it runs out of device memory, dump the snapshot (``_oom``), then raise on."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self._recording:
                self._dump_snapshot("oom")
            raise

    def close(self) -> None:
        """Export a window cut short (training ended or stopped inside it); safe to call twice."""
        if self._prof is not None:
            self._export()
        if self._recording:  # training ended (or stopped) before the window's end: what there is
            self._dump_snapshot(f"step{self._snapshot_step}")

    def _dump_snapshot(self, tag: str) -> None:
        """The allocator's history so far to ``memory_snapshot_rank{r}_{tag}.pickle``; recording stops."""
        trace_dir = Path(self.config.trace_dir or ".")
        trace_dir.mkdir(parents=True, exist_ok=True)
        path = trace_dir / f"memory_snapshot_rank{self.rank}_{tag}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        self.files.append(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self._recording = False

    def _export(self) -> None:
        assert self._prof is not None and self._first is not None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        last = self._last if self._last is not None else self._first
        trace_dir = Path(self.config.trace_dir or ".")
        trace_dir.mkdir(parents=True, exist_ok=True)
        suffix = f"rank{self.rank}_steps{self._first}-{last}"
        chrome = trace_dir / f"torch_trace_{suffix}.json"
        prof.export_chrome_trace(str(chrome))
        self.files.append(chrome)
        # A kineto trace can be saved only once; TensorBoard's profiler plugin reads the same
        # JSON under tensorboard_trace_handler's name pattern, so it gets a copy.
        tensorboard = trace_dir / "tensorboard"
        tensorboard.mkdir(exist_ok=True)
        board = tensorboard / f"rank{self.rank}.{int(time.time() * 1000)}.pt.trace.json"
        shutil.copyfile(chrome, board)
        self.files.append(board)
        timings = self.module.instruction_timings
        if timings is not None:
            self.module.instruction_timings = None
            path = trace_dir / f"instructions_{suffix}.json"
            path.write_text(json.dumps(self._instruction_trace(timings)))
            self.files.append(path)

    def _instruction_trace(self, timings: list[tuple[str, float, float]]) -> JsonDict:
        """Chrome trace "complete" events (microseconds since the epoch), one per instruction."""
        steps, begin = [], 0
        for step, end in self._step_marks:
            steps.extend([step] * (end - begin))
            begin = end
        events = [
            {
                "name": name,
                "cat": "pipeline_instruction",
                "ph": "X",
                "ts": (start + self._clock_offset) * 1e6,
                "dur": (end - start) * 1e6,
                "pid": self.rank,
                "tid": "executor",
                "args": {"step": step},
            }
            for (name, start, end), step in zip(timings, steps)
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}


# Dense bf16 peak FLOP/s of one GPU by the vendor's datasheet, matched on torch.cuda.get_device_name:
# the more specific name first (an "H100 PCIe" is not an SXM H100). torchtitan reports MFU the same way.
BF16_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("B200", 2.25e15))


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU called ``device_name`` when it is in ``BF16_PEAK_FLOPS``, else None."""
    return next((flops for key, flops in BF16_PEAK_FLOPS if key in device_name), None)


def device_peak_flops(device: torch.device) -> float | None:
    """:func:`peak_flops_of` this CUDA device; None on CPU (no standard figure) and for an unknown card."""
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA max allocated on a GPU, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: the process's peak resident set size, KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def num_tokens(batch: object) -> int | None:
    """Tokens a batch reports through a ``num_tokens`` attribute or method, else None."""
    value = getattr(batch, "num_tokens", None)
    if callable(value):
        value = value()
    return None if value is None else int(value)


def progress_bar(config: TrainerConfig, rank: int, initial: int) -> ProgressBar | None:
    """A tqdm bar over ``train_iterations`` on global rank 0 when ``progress_bar`` is set, else None."""
    if not config.progress_bar or rank != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise ImportError(
            "trainer.progress_bar=True needs tqdm; pip install tqdm or set trainer.progress_bar=false"
        ) from exc
    return tqdm(total=config.train_iterations, initial=initial, desc="training", unit="step")
