"""TrainerConfig: iterations, evaluation, saving and loading."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from scaling.config import BaseConfig


class TrainerConfig(BaseConfig):
    """The training loop's own settings (topology, optimizer and data live elsewhere)."""

    train_iterations: int = Field(100, ge=1, description="Optimizer steps to train for, >= 1.")
    seed: int = Field(42, ge=0, description="Seed of model initialisation, data order and dropout; >= 0.")
    deterministic: bool = Field(
        False,
        description=(
            "Deterministic kernels only (torch.use_deterministic_algorithms, cuDNN deterministic, "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8), so a run repeats bit for bit on GPUs too; slower there. "
            "An operator without a deterministic kernel raises, naming itself."
        ),
    )
    log_interval: int = Field(1, ge=1, description="Log metrics every this many steps (>= 1).")
    eval_interval: int | None = Field(
        None, ge=1, description="Evaluate every this many steps and after the last; None = never."
    )
    eval_iterations: int = Field(1, ge=1, description="Global batches per evaluation, >= 1.")
    save_dir: Path | None = Field(None, description="Folder for checkpoints; None = never save.")
    save_interval: int | None = Field(
        None, ge=1, description="Save every this many steps and after the last; None = only at the end (with save_dir)."
    )
    keep_last_n_checkpoints: int | None = Field(
        None, ge=1, description="Keep only the newest N committed checkpoints; None = keep all."
    )
    diagnostics_dir: Path | None = Field(
        None,
        description=(
            "Folder where each rank writes rank_<R>.json (step, last collectives, byte counters) when a "
            "collective fails or a stuck rank is ended, and on NCCL torch's flight record when a collective "
            "times out (flight_recorder_rank_<R>); None = <save_dir>/diagnostics when save_dir is set, "
            "else no files."
        ),
    )
    load_dir: Path | None = Field(
        None,
        description=(
            "Load the latest committed checkpoint in this folder; None = resume from save_dir when it holds one "
            "(see resume), else start from step 0."
        ),
    )
    resume: Literal["auto", "fresh"] = Field(
        "auto",
        description=(
            "What a run does with committed checkpoints already in save_dir: 'auto' resumes from the latest "
            "(when load_dir is unset; a run that already reached train_iterations says so and stops), as "
            "torchtitan and Megatron-LM do; 'fresh' deletes them and their 'latest' pointer before training and "
            "starts from load_dir, or from step 0."
        ),
    )
    load_optimizer_states: bool = Field(
        True, description="Load optimizer state (moments, master weights, loss scale) with the model."
    )
    load_context: bool = Field(
        True, description="Load counters, data-loader position and RNG states (False = fine-tune from weights)."
    )
    fallback_to_previous_checkpoint: bool = Field(
        False, description="When the newest checkpoint is corrupt, load the previous good one instead of failing."
    )
    allowed_missing_keys_in_checkpoint: list[str] = Field(
        default_factory=list, description="Regexes of model keys that may be absent from the checkpoint."
    )
    allowed_unexpected_keys_in_checkpoint: list[str] = Field(
        default_factory=list, description="Regexes of checkpoint keys the model may lack."
    )
    ignore_keys_in_checkpoint: list[str] = Field(
        default_factory=list, description="Regexes of checkpoint keys never loaded (the model keeps its values)."
    )
    async_save: bool = Field(False, description="Write checkpoints in the background after copying tensors to CPU.")
    dataloader_num_workers: int = Field(0, ge=0, description="Worker processes of each data loader (0 = in process).")
    loss_spike_factor: float = Field(
        10.0, gt=1, description="Flag a loss spike when the loss exceeds this factor times the running max."
    )
    peak_flops_per_second: float | None = Field(
        None,
        gt=0,
        description=(
            "Peak FLOP/s of one device (e.g. 989e12 for H100 bf16 dense; CPUs have no standard figure, so "
            "measure one); with the trainer's flops_per_sample the metrics get runtime/mfu (and runtime/hfu). "
            "None = the GPU's dense bf16 peak where the card is known (H100 SXM and H200 989e12, H100 PCIe 756e12, "
            "A100 312e12, B200 2.25e15; torchtitan's convention, also for runs in other precisions), else no MFU/HFU."
        ),
    )
    progress_bar: bool = Field(False, description="Show a tqdm progress bar on global rank 0 (needs tqdm).")
    gc_interval: int | None = Field(
        50,
        ge=1,
        description=(
            "Python's garbage collector runs only between steps: a young-generation pass every this many steps "
            "and a full pass before each evaluation and save (torchtitan's gc_freq, Megatron-LM's --manual-gc). "
            "Automatic collections pause each rank at a different moment, and its peers wait for it at the next "
            "collective. None = automatic collection."
        ),
    )

    memory_checkpoint_interval: int | None = Field(
        10,
        ge=1,
        description=(
            "When the launcher can restart the workers (torchrun --max-restarts > 0, runner.max_restarts), each rank "
            "copies its own state (model and optimizer pieces, RNG, data position, counters) into host memory every "
            "this many steps and at each save, written in the background to memory_checkpoint_dir; after a restart "
            "the ranks resume from the newest step every rank holds, reading nothing from save_dir. Holds two copies "
            "of each rank's state in the node's memory. None = off."
        ),
    )
    memory_checkpoint_dir: Path | None = Field(
        None,
        description=(
            "Folder of the in-memory copies on each node, on a memory filesystem; None = /dev/shm/scaling-<torchrun's "
            "run id> (the system's temporary folder where there is no /dev/shm)."
        ),
    )
    straggler_interval: int | None = Field(
        5,
        ge=2,
        description=(
            "Name chronically slow ranks: every this many steps the ranks compare the time of each phase of their "
            "last this many steps (data, forward, backward, transfer, gradient_reduction, optimizer, results; "
            "collective waits left out), and a rank slow in a phase at two checks in a row is logged as a "
            "straggler, with stragglers/<phase>/rank in the metrics and a line in <diagnostics_dir>/stragglers.jsonl. "
            "None = off. Costs one small all-gather per check."
        ),
    )
    straggler_threshold: float = Field(
        1.2,
        gt=1,
        description=(
            "A rank is slow in a phase when its median time in it is at least this many times that of the other ranks "
            "of its pipeline stage (and at least 10% of the step and 5 ms more)."
        ),
    )

    def resolved_diagnostics_dir(self) -> Path | None:
        """``diagnostics_dir``, else ``save_dir / "diagnostics"``, else ``None`` (no files)."""
        if self.diagnostics_dir is not None:
            return self.diagnostics_dir
        return None if self.save_dir is None else self.save_dir / "diagnostics"

    def resolved_memory_checkpoint_dir(self) -> Path | None:
        """Where this run's in-memory copies go, or ``None`` when there are none: off, or no restart
        can happen (not under torchrun, or torchrun's ``--max-restarts`` is 0)."""
        if self.memory_checkpoint_interval is None or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
            return None
        if self.memory_checkpoint_dir is not None:
            return self.memory_checkpoint_dir
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if not run_id:
            return None
        shm = Path("/dev/shm")
        return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"scaling-{run_id}"

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.save_interval is not None and self.save_dir is None:
            raise ValueError(
                f"trainer.save_interval={self.save_interval} needs trainer.save_dir; set save_dir or save_interval=null"
            )
        return self
