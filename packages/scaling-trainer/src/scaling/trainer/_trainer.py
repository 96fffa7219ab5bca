"""BaseTrainer: the training loop of the MLP walkthrough.

One optimizer step = the data loader's micro-batches of one global batch through
:func:`scaling.trainer.train_step` (placement, the schedule, the update, the results),
then logging, evaluation, saving and the signal check, in that order, at the step boundary.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist

from scaling.collectives import all_reduce, get_recorder
from scaling.data import BaseDataset, DataLoader
from scaling.nn import compile_loss
from scaling.optim import Optimizer
from scaling.pipeline import LossFunction, ParallelModule
from scaling.topology import set_flight_recorder_folder, use_deterministic_algorithms
from scaling.trainer._compiled import CompileLog
from scaling.trainer._config import TrainerConfig
from scaling.trainer._context import BaseContext
from scaling.trainer._profiler import (
    ProfilerConfig,
    StepProfiler,
    device_peak_flops,
    num_tokens,
    peak_memory_mib,
    progress_bar,
)
from scaling.trainer._results import MetricsAggregation
from scaling.trainer._signals import SignalWatcher, exit_code_for
from scaling.trainer._state import ModelState, RNGState, TrainerCheckpointer
from scaling.trainer._step import SyncBatch, evaluation_step, train_step
from scaling.trainer._stragglers import StragglerDetector
from scaling.trainer.loggers import LoggerConfig, MetricsLogger

if TYPE_CHECKING:
    from scaling.config import Metrics

# Any: a context of any config type (BaseContext's parameter; the subclass's ContextT fixes it).
ContextT = TypeVar("ContextT", bound=BaseContext[Any])
FlopsEstimate = float | Callable[[], float]


class BaseTrainer(Generic[ContextT]):
    """Trains a ``ParallelModule`` with an ``Optimizer`` on a ``BaseDataset``.

    Args:
        config: the trainer section of the app config.
        context: topology, whole config and counters (already ``initialize``\\ d).
        parallel_module: the model (its stage on this rank).
        optimizer: the optimizer over the module's parameter groups.
        dataset: training data; each rank reads its DP shard.
        dataset_evaluation: evaluation data, or None.
        sync_batch_to_model_parallel: broadcasts a batch from TP rank 0 to its TP group
            (usually ``dataset.sync_batch_to_model_parallel``).
        metrics_aggregation_fn: combines per-micro-batch metrics across ranks, or None.
        loss_function: ``loss_function(output, batch) -> (loss, metrics)``.
        metrics_logger: where metrics go; default: the sinks of ``context.config.logger``
            when the app config has that section, else a console line on rank 0.
        profiler_config: the step window to profile; default: ``context.config.profiler``
            when the app config has that section, else no profiling.
        flops_per_sample: model FLOPs of forward + backward for one sample (e.g.
            ``6 * parameters * tokens_per_sample``), or a zero-argument callable returning
            it; the metrics get ``runtime/tflops_per_device`` and, with a peak
            (``config.peak_flops_per_second``, else a known GPU's bf16 peak), ``runtime/mfu``.
        hardware_flops_per_sample: as ``flops_per_sample`` but counting recomputation
            (activation checkpointing); with a peak the metrics get ``runtime/hfu``.

    Example::

        trainer = BaseTrainer(config=config.trainer, context=context, parallel_module=module,
                              optimizer=optimizer, dataset=train, dataset_evaluation=test,
                              sync_batch_to_model_parallel=train.sync_batch_to_model_parallel,
                              metrics_aggregation_fn=aggregate, loss_function=loss_fn)
        trainer.run_training()
    """

    def __init__(
        self,
        config: TrainerConfig,
        context: ContextT,
        parallel_module: ParallelModule,
        optimizer: Optimizer,
        # Any: the trainer is generic in its context only (the seeds' BaseTrainer[Context]), so
        # the items and batches of its datasets are whatever the user's dataset makes.
        dataset: BaseDataset[Any, Any],
        dataset_evaluation: BaseDataset[Any, Any] | None,
        sync_batch_to_model_parallel: SyncBatch[Any] | None,  # Any: as for the datasets
        metrics_aggregation_fn: MetricsAggregation | None,
        loss_function: LossFunction,
        metrics_logger: MetricsLogger | None = None,
        *,
        profiler_config: ProfilerConfig | None = None,
        flops_per_sample: FlopsEstimate | None = None,
        hardware_flops_per_sample: FlopsEstimate | None = None,
    ) -> None:
        if config.deterministic:
            use_deterministic_algorithms()
        self.config = config
        self.context = context
        self.parallel_module = parallel_module
        self.optimizer = optimizer
        self.dataset = dataset
        self.dataset_evaluation = dataset_evaluation
        self.sync_batch_to_model_parallel = sync_batch_to_model_parallel
        self.metrics_aggregation_fn = metrics_aggregation_fn
        # Compiled with the module's layers unless its compile_config says otherwise (torchtitan's 'loss').
        self.loss_function = compile_loss(loss_function, getattr(parallel_module, "compile_config", None))
        attach_model = getattr(optimizer, "attach_model", None)
        if attach_model is not None:  # ZeRO-3 and overlap_param_gather hook into the model
            attach_model(parallel_module)
        topology = context.topology
        if metrics_logger is None:
            # The app config's `logger` section (as in the walkthrough's configs), if any.
            section = getattr(context.config, "logger", None)
            metrics_logger = MetricsLogger(section if isinstance(section, LoggerConfig) else None, topology=topology)
        self.metrics_logger = metrics_logger
        if profiler_config is None:
            section = getattr(context.config, "profiler", None)
            profiler_config = section if isinstance(section, ProfilerConfig) else None
        self.profiler_config = profiler_config
        self.flops_per_sample = flops_per_sample
        self.hardware_flops_per_sample = hardware_flops_per_sample
        # MFU's denominator: the config's, else the card's dense bf16 peak where it is known (as torchtitan).
        self.peak_flops_per_second = config.peak_flops_per_second or device_peak_flops(topology.device)
        self.loader = DataLoader(
            dataset,
            seed=config.seed,
            topology=topology,
            num_workers=config.dataloader_num_workers,
            pin_memory=topology.device.type == "cuda",
            reading_stages=parallel_module.data_stages,
        )
        self.compile_log = CompileLog(parallel_module, topology.global_rank, topology.device)
        model_state = ModelState(
            parallel_module.named_parameters_with_meta,
            topology,
            self.wait_for_parameters,
            self.parameters_loaded,
            tied_copies=parallel_module.tied_copies(),
        )
        self.checkpointer = TrainerCheckpointer(
            config,
            topology,
            {
                "model": model_state,
                "optimizer": optimizer,
                "context": context,
                "data_loader": self.loader,
                "rng": RNGState(context.rng_tracker),
            },
            step=lambda: self.context.iterations,
            console=self.metrics_logger.console,
            whole_parameters=self.whole_parameters,
            metadata={"config": context.config.as_dict()},
        )
        self.stragglers = StragglerDetector(
            topology,
            config.straggler_interval,
            config.straggler_threshold,
            self.metrics_logger.console,
            config.resolved_diagnostics_dir(),
        )
        self.history: list[Metrics] = []
        self._running_max_loss: float | None = None
        self.checkpointer.start()
        if self.checkpointer.last_loaded_step is not None:
            self.metrics_logger.resumed_at(self.context.iterations)

    # ---------------------------------------------------------------- steps
    def train_step(self) -> Metrics:
        """One optimizer step; returns the metrics of that step (same on every rank).

        Peak memory and tokens per second (each a collective over the ranks) are measured on
        the steps the trainer logs (``log_interval``, and the last) only.
        """
        start = time.perf_counter()
        phases = self.stragglers.timer
        if phases is not None:
            phases.start_step()  # in "data" from here
        micro_batches = self.loader.next_step()
        out = train_step(
            self.parallel_module,
            micro_batches,
            self.optimizer,
            self.loss_function,
            metrics_aggregation_fn=self.metrics_aggregation_fn,
            sync_batch_to_model_parallel=self.sync_batch_to_model_parallel,
            phases=phases,
        )
        if phases is not None:
            phases.end_step()
        self.context.step()
        duration = time.perf_counter() - start
        topology = self.context.topology
        gbs = topology.config.global_batch_size or 0
        samples_per_second = gbs / duration if duration > 0 else 0.0
        step = self.context.iterations
        peak, tokens = self._peak_memory_and_tokens(micro_batches) if self.logs_step(step) else (None, None)
        loss = float(out.loss)
        metrics: Metrics = {
            "step": self.context.iterations,
            "training/loss": loss,
            **{f"training/{k}": _scalar(v) for k, v in (out.metrics or {}).items()},
            "training/global_grad_norm": out.global_grad_norm,
            **{f"training/lr_{k}": v for k, v in (out.learning_rates or {}).items()},
            "training/loss_scale": out.loss_scale,
            "runtime/step_duration": duration,
            "runtime/samples_per_second": samples_per_second,
            "runtime/tokens_per_second": tokens / duration if tokens is not None and duration > 0 else None,
            "runtime/peak_memory_mib": peak,
            **self._utilization(samples_per_second),
            "training/loss_spike": self._is_spike(loss),
            **self.compile_log.step_metrics(self.context.iterations),
            **self.stragglers.check(step),
        }
        return {k: v for k, v in metrics.items() if v is not None}

    def logs_step(self, step: int) -> bool:
        """Whether step ``step`` is logged (``log_interval``, and the last): measurements that cost
        a collective or a host sync run on those steps only."""
        return step % self.config.log_interval == 0 or step == self.config.train_iterations

    def _peak_memory_and_tokens(self, micro_batches: Sequence[object]) -> tuple[float | None, float | None]:
        """Peak memory (MiB, max over all ranks) and this step's tokens (summed over DP), or None."""
        topology = self.context.topology
        device = topology.device
        peak = peak_memory_mib(device)
        counts = [num_tokens(b) for b in micro_batches]
        tokens = None if not counts or any(c is None for c in counts) else float(sum(c or 0 for c in counts))
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank logs the same numbers: the largest peak of any rank (default group).
            peak_t = torch.tensor([peak], dtype=torch.float64, device=device)
            peak = float(all_reduce(peak_t, dist.group.WORLD, op=dist.ReduceOp.MAX)[0])
            if tokens is not None and topology.axis("dp").size > 1:
                tokens_t = torch.tensor([tokens], dtype=torch.float64, device=device)
                tokens = float(all_reduce(tokens_t, topology.axis("dp").group)[0])
        return peak, tokens

    def _flops_estimates(self) -> list[tuple[str, float]]:
        """``(name, FLOPs per sample)`` for MFU and, when given, HFU."""
        pairs = (("mfu", self.flops_per_sample), ("hfu", self.hardware_flops_per_sample))
        return [(name, float(e() if callable(e) else e)) for name, e in pairs if e is not None]

    def _utilization(self, samples_per_second: float) -> dict[str, float]:
        """Model TFLOP/s per device and MFU / HFU: achieved FLOP/s over the peak FLOP/s times the world size."""
        if self.flops_per_sample is None:
            return {}
        world = self.context.topology.world_size
        estimates = self._flops_estimates()
        metrics = {"runtime/tflops_per_device": estimates[0][1] * samples_per_second / world / 1e12}
        peak = self.peak_flops_per_second
        if peak is not None:
            metrics.update({f"runtime/{n}": flops * samples_per_second / (peak * world) for n, flops in estimates})
        return metrics

    def _print_flops_formula(self) -> None:
        peak = self.peak_flops_per_second
        if peak is None:
            return
        world = self.context.topology.world_size
        for name, flops in self._flops_estimates():
            self.metrics_logger.console(
                f"{name.upper()} = flops_per_sample ({flops:.4g}) * samples_per_second / "
                f"(peak_flops_per_second ({peak:.4g}) * world_size ({world}))"
            )

    def _is_spike(self, loss: float) -> bool:
        if not torch.isfinite(torch.tensor(loss)):
            return False
        spike = self._running_max_loss is not None and loss > self.config.loss_spike_factor * self._running_max_loss
        self._running_max_loss = loss if self._running_max_loss is None else max(self._running_max_loss, loss)
        return bool(spike)

    @torch.no_grad()
    def evaluate(self) -> Metrics:
        """Forward-only over ``eval_iterations`` global batches of the evaluation set, in order."""
        if self.dataset_evaluation is None:
            return {}
        loader = DataLoader(
            self.dataset_evaluation,
            seed=self.config.seed,
            topology=self.context.topology,
            shuffle=False,
            pin_memory=self.context.topology.device.type == "cuda",
        )
        losses: list[float] = []
        sums: dict[str, float] = {}
        for _ in range(self.config.eval_iterations):
            out = evaluation_step(
                self.parallel_module,
                loader.next_step(),
                self.loss_function,
                metrics_aggregation_fn=self.metrics_aggregation_fn,
                sync_batch_to_model_parallel=self.sync_batch_to_model_parallel,
            )
            losses.append(float(out.loss))
            for k, v in (out.metrics or {}).items():
                sums[k] = sums.get(k, 0.0) + _scalar(v)
        n = len(losses)
        return {
            "step": self.context.iterations,
            "evaluation/loss": sum(losses) / n,
            **{f"evaluation/{k}": v / n for k, v in sums.items()},
        }

    # ----------------------------------------------------------------- loop
    def run_training(self, return_metrics: bool = False) -> list[Metrics] | None:
        """Train until ``train_iterations``; evaluate, log and save on their intervals.

        SIGTERM or SIGINT on any rank stops every rank after the same step, saves a
        checkpoint (when ``save_dir`` is set; not twice when the step was just saved) and
        exits with ``128 + signal``. A rank that cannot reach the step boundary within the
        collective timeout exits with the same code without saving. A rank whose collective
        fails, or that the watchdog ends, first writes ``rank_<R>.json`` (step, last
        collectives, byte counters) to ``diagnostics_dir`` (default ``<save_dir>/diagnostics``);
        on NCCL, where a hung collective is ended by NCCL's watchdog instead, each rank's
        flight record goes there (``flight_recorder_rank_<R>``, ``TopologyConfig.flight_recorder_entries``).
        """
        cfg = self.config
        topology = self.context.topology
        if self.context.iterations >= cfg.train_iterations:
            self.metrics_logger.console(
                f"nothing to train: the run already reached step {self.context.iterations} of "
                f"trainer.train_iterations={cfg.train_iterations} (raise it to train on, or trainer.resume=fresh "
                "to start over)"
            )
            self.metrics_logger.close()
            return self.history if return_metrics else None
        profiler = StepProfiler(self.profiler_config, topology.global_rank, self.parallel_module, topology.device)
        progress = progress_bar(cfg, topology.global_rank, self.context.iterations)
        self.metrics_logger.start(self.context.iterations, cfg.train_iterations)
        self._print_flops_formula()
        # A failed collective, or the watchdog ending a stuck rank, leaves <dir>/rank_<R>.json;
        # on NCCL a collective that times out leaves torch's flight record there too.
        recorder = get_recorder()
        previous_diagnostics = (recorder.diagnostics_dir, recorder.rank)
        diagnostics_dir = cfg.resolved_diagnostics_dir()
        if diagnostics_dir is not None:
            recorder.configure(diagnostics_dir=diagnostics_dir, rank=topology.global_rank)
            set_flight_recorder_folder(topology.backend, diagnostics_dir)
        watcher = SignalWatcher(topology.device, grace_seconds=topology.config.timeout_seconds).install()
        gc_was_enabled = gc.isenabled()
        if cfg.gc_interval is not None:
            gc.disable()
            gc.collect()
        try:
            while self.context.iterations < cfg.train_iterations:
                recorder.step = self.context.iterations + 1
                profiler.step_begin(self.context.iterations + 1)
                with profiler.out_of_memory():
                    metrics = self.train_step()
                step = self.context.iterations
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{metrics['training/loss']:.4g}", refresh=False)
                last = step == cfg.train_iterations
                if step % cfg.log_interval == 0 or last:
                    self.metrics_logger.log(metrics, step)
                self.history.append(metrics)
                evaluating = cfg.eval_interval is not None and (step % cfg.eval_interval == 0 or last)
                save_dir = cfg.save_dir if last or (cfg.save_interval and step % cfg.save_interval == 0) else None
                if cfg.gc_interval is not None:
                    if evaluating or save_dir is not None:
                        gc.collect()
                    elif step % cfg.gc_interval == 0:
                        gc.collect(1)
                if evaluating:
                    eval_metrics = self.evaluate()
                    self.metrics_logger.log(eval_metrics, step)
                    self.history.append(eval_metrics)
                self.checkpointer.after_step(step, save_dir)
                profiler.step_end(step)
                signum = watcher.agreed_signal()
                if signum:
                    watcher.disarm()
                    self._stop_on_signal(signum)
        finally:
            if gc_was_enabled:
                gc.enable()
            watcher.uninstall()
            recorder.step = None
            recorder.configure(*previous_diagnostics)
            profiler.close()
            if progress is not None:
                progress.close()
            self.checkpointer.wait()
            if self.context.iterations >= cfg.train_iterations:
                self.checkpointer.drop_memory()
                self.metrics_logger.finish(self.context.iterations, self.history, self.checkpointer.last_saved_path())
            self.metrics_logger.close()
        self.wait_for_parameters()
        return self.history if return_metrics else None

    def wait_for_parameters(self) -> None:
        """Wait for parameter updates still in flight (``overlap_param_gather``); a no-op otherwise.

        Called before a checkpoint reads the parameters and when training returns.
        """
        finish = getattr(self.optimizer, "finish_parameter_gather", None)
        if finish is not None:
            finish()

    def whole_parameters(self) -> AbstractContextManager[None]:
        """A context in which every parameter is whole (ZeRO-3 gathers them); a no-op otherwise."""
        full = getattr(self.optimizer, "full_parameters", None)
        return full() if full is not None else nullcontext()

    def parameters_loaded(self) -> None:
        """Tell the optimizer that the parameters were written (a checkpoint load), if it keeps a copy."""
        sync = getattr(self.optimizer, "sync_from_parameters", None)
        if sync is not None:
            sync()

    def _stop_on_signal(self, signum: int) -> None:
        step = self.context.iterations
        if self.config.save_dir is not None:
            self.checkpointer.save(self.config.save_dir)
            self.checkpointer.wait()
        self.metrics_logger.console(f"signal {signum} received: stopped after step {step}; checkpoint saved")
        self.metrics_logger.close()
        sys.exit(exit_code_for(signum))


def _scalar(value: float | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item())
    return float(value)
