"""The training step: one function, read top to bottom, shared by BaseTrainer and both apps.

A step takes one global batch's micro-batches on this rank and

1. moves each to ``topology.device`` and, on the stages that read data, syncs it over the
   tensor-parallel group (only TP rank 0 reads) and, under context parallelism, cuts it to
   this CP rank's slice of each sequence (``batch.context_parallel_split``);
2. runs the stage's pipeline schedule (forward, backward, transfers: ``scaling.pipeline``),
   the loss going through the optimizer's ``backward`` (loss scaling);
3. finishes the data-parallel gradient reduction (the optimizer's ``data_parallel``
   component; under ZeRO 0-1 it starts in the last micro-batch's backward: once per step)
   and sums tied weights' gradients over the stages that hold a copy;
4. steps the optimizer;
5. returns the loss and metrics, the same on every rank (``_results.py``).

It takes the parts themselves (``ParallelModule``, ``scaling.optim.Optimizer``, batches of
``scaling.data.BaseDatasetBatch``) and meets them through their public methods only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch.profiler import record_function

from scaling.data import BaseDatasetBatch
from scaling.optim import Optimizer
from scaling.pipeline import LossFunction, ParallelModule, PhaseMark
from scaling.topology import Topology
from scaling.trainer._placement import to_device
from scaling.trainer._results import MetricsAggregation, StepResults
from scaling.trainer._stragglers import PhaseTimer

B = TypeVar("B", bound=BaseDatasetBatch)

#: ``(topology, batch or None) -> batch``: TP rank 0's batch on every rank of its TP group
#: (``BaseDataset.sync_batch_to_model_parallel``).
SyncBatch = Callable[[Topology, B | None], B]


@dataclasses.dataclass(frozen=True)
class TrainStepOutput:
    """Result of one :func:`train_step` / :func:`evaluation_step`, the same on every rank.

    Attributes:
        loss: mean loss over micro-batches and data-parallel ranks.
        metrics: aggregated metrics (floats).
        global_grad_norm: from the optimizer step (None in evaluation).
        learning_rates: per parameter group (empty in evaluation).
        loss_scale: the loss scale after the step (None in evaluation).
        step_duration: wall-clock seconds of the step on this rank.
    """

    loss: float
    metrics: dict[str, float]
    global_grad_norm: float | None
    learning_rates: dict[str, float]
    loss_scale: float | None
    step_duration: float


def train_step(
    module: ParallelModule,
    micro_batches: Sequence[B | None],
    optimizer: Optimizer,
    loss_function: LossFunction,
    metrics_aggregation_fn: MetricsAggregation | None = None,
    sync_batch_to_model_parallel: SyncBatch[B] | None = None,
    phases: PhaseTimer | None = None,
) -> TrainStepOutput:
    """One optimizer step over this rank's ``micro_batches`` (see the module docstring).

    A module in eval mode is switched to training mode first; one already in training
    mode is left as it is, so a submodule the caller put in eval mode (a frozen norm, say)
    stays there, as in a Megatron-LM or torchtitan loop.

    Args:
        module: this rank's stage (``ParallelModule``).
        micro_batches: one batch per micro-batch, in host or device memory (stages other
            than the first and last never read them, so they may hold ``None`` there).
        optimizer: the stage's ``scaling.optim.Optimizer``.
        loss_function: ``(last_layer_output, batch.only_targets()) -> (loss, metrics)``.
        metrics_aggregation_fn: ``(topology, [metrics per micro-batch]) -> metrics``;
            default: mean per key over micro-batches, then over data-parallel ranks.
        sync_batch_to_model_parallel: ``(topology, batch) -> batch``, applied to each
            micro-batch on the stages that read data (broadcast from TP rank 0).
        phases: the straggler detector's timer, told each phase of the step (the caller
            starts it, in ``data``, before loading the micro-batches, and ends it).

    Returns:
        :class:`TrainStepOutput`, identical on every rank.
    """
    start = time.perf_counter()
    mark = phases.mark if phases is not None else None
    batches = _placed(module, micro_batches, sync_batch_to_model_parallel)
    if not module.training:  # train() walks every submodule: only when needed, not every step
        module.train()
    data_parallel = optimizer.data_parallel  # what DP does to gradients; the optimizer updates
    optimizer.zero_grad()
    data_parallel.set_gradient_accumulation_steps(len(batches))  # DP reduction in the last backward
    results = StepResults(module, metrics_aggregation_fn)
    try:
        with record_function("train_step: schedule"):  # the phases, named in a profiler's trace
            outputs = module.run_schedule(
                batches,
                loss_function,
                loss_backward=optimizer.backward,
                loss_scale=optimizer.loss_scaler.scale,
                before_first_wait=results.post_receive,
                mark=mark,
            )
        # An overlapped DP reduction adds its averages into .grad: finish it before the tied sum.
        _mark(mark, "gradient_reduction")
        data_parallel.finish_gradient_reduction()
        module.reduce_tied_gradients()
        _mark(mark, "optimizer")
        with record_function("train_step: optimizer"):
            report = optimizer.step()
    except BaseException:
        results.abandon()  # every rank keeps one result broadcast per step
        raise
    _mark(mark, "results")
    loss, metrics = results.gather(outputs)
    return TrainStepOutput(
        loss=loss,
        metrics=metrics,
        global_grad_norm=report.global_grad_norm,
        learning_rates=dict(report.learning_rates),
        loss_scale=report.current_loss_scale,
        step_duration=time.perf_counter() - start,
    )


@torch.no_grad()
def evaluation_step(
    module: ParallelModule,
    micro_batches: Sequence[B | None],
    loss_function: LossFunction,
    metrics_aggregation_fn: MetricsAggregation | None = None,
    sync_batch_to_model_parallel: SyncBatch[B] | None = None,
) -> TrainStepOutput:
    """Forward-only pass over ``micro_batches``: loss and metrics on every rank, no update.

    The module runs in eval mode and goes back to its previous mode afterwards.

    Returns:
        :class:`TrainStepOutput` whose optimizer fields are ``None``/empty.
    """
    start = time.perf_counter()
    batches = _placed(module, micro_batches, sync_batch_to_model_parallel)
    was_training = module.training
    module.train(False)
    results = StepResults(module, metrics_aggregation_fn)
    try:
        outputs = module.run_schedule(batches, loss_function, forward_only=True, before_first_wait=results.post_receive)
    except BaseException:
        results.abandon()
        raise
    finally:
        module.train(was_training)
    loss, metrics = results.gather(outputs)
    return TrainStepOutput(loss, metrics, None, {}, None, time.perf_counter() - start)


def _mark(mark: PhaseMark | None, phase: str) -> None:
    if mark is not None:
        mark(phase)


def _placed(module: ParallelModule, micro_batches: Sequence[B | None], sync: SyncBatch[B] | None) -> list[B | None]:
    """On the stages that read data (the first and the loss's: the last, or the first again in a
    V), each micro-batch on the device, synced over TP and cut to this CP rank's slice; None on the
    others, which never read them."""
    topology = module.topology
    if topology.axis("pp").rank not in module.data_stages:
        return [None] * len(micro_batches)
    batches = [to_device(b, topology.device) for b in micro_batches]
    if sync is not None:
        batches = [sync(topology, b) for b in batches]
    cp = topology.axis("cp")
    if cp.size > 1:
        batches = [b if b is None else b.context_parallel_split(cp.rank, cp.size) for b in batches]
    return batches
