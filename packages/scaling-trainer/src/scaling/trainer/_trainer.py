"""BaseTrainer: the training loop of the MLP walkthrough.

One optimizer step = the data loader's micro-batches of one global batch, run through
the parallel module's schedule (``train_step``), then logging, evaluation, saving and
the signal check, in that order, at the step boundary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from scaling.data import BaseDataset, DataLoader
from scaling.trainer._config import TrainerConfig
from scaling.trainer._context import BaseContext
from scaling.trainer._signals import SignalWatcher, exit_code_for
from scaling.trainer._state import TrainerCheckpointer
from scaling.trainer.loggers import LoggerConfig, MetricsLogger

ContextT = TypeVar("ContextT", bound=BaseContext[Any])


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
        parallel_module: Any,
        optimizer: Any,
        dataset: BaseDataset[Any, Any],
        dataset_evaluation: BaseDataset[Any, Any] | None,
        sync_batch_to_model_parallel: Callable[..., Any] | None,
        metrics_aggregation_fn: Callable[..., Any] | None,
        loss_function: Callable[..., Any],
        metrics_logger: MetricsLogger | None = None,
    ) -> None:
        self.config = config
        self.context = context
        self.parallel_module = parallel_module
        self.optimizer = optimizer
        self.dataset = dataset
        self.dataset_evaluation = dataset_evaluation
        self.sync_batch_to_model_parallel = sync_batch_to_model_parallel
        self.metrics_aggregation_fn = metrics_aggregation_fn
        self.loss_function = loss_function
        topology = context.topology
        if metrics_logger is None:
            # The app config's `logger` section (as in the walkthrough's configs), if any.
            section = getattr(context.config, "logger", None)
            metrics_logger = MetricsLogger(section if isinstance(section, LoggerConfig) else None, topology=topology)
        self.metrics_logger = metrics_logger
        self.loader = DataLoader(
            dataset, seed=config.seed, topology=topology, num_workers=config.dataloader_num_workers
        )
        self.checkpointer = TrainerCheckpointer(self)
        self.history: list[dict[str, Any]] = []
        self._running_max_loss: float | None = None
        if config.load_dir is not None:
            self.checkpointer.load(config.load_dir)

    # ---------------------------------------------------------------- steps
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns the metrics of that step (same on every rank)."""
        start = time.perf_counter()
        micro_batches = self.loader.next_step()
        out = self.parallel_module.train_step(
            micro_batches,
            self.optimizer,
            self.loss_function,
            metrics_aggregation_fn=self.metrics_aggregation_fn,
            sync_batch_to_model_parallel=self.sync_batch_to_model_parallel,
        )
        self.context.step()
        duration = time.perf_counter() - start
        gbs = self.context.topology.config.global_batch_size or 0
        loss = float(out.loss)
        metrics: dict[str, Any] = {
            "step": self.context.iterations,
            "training/loss": loss,
            **{f"training/{k}": _scalar(v) for k, v in (out.metrics or {}).items()},
            "training/global_grad_norm": out.global_grad_norm,
            **{f"training/lr_{k}": v for k, v in (out.learning_rates or {}).items()},
            "training/loss_scale": out.loss_scale,
            "runtime/step_duration": duration,
            "runtime/samples_per_second": gbs / duration if duration > 0 else 0.0,
            "training/loss_spike": self._is_spike(loss),
        }
        return {k: v for k, v in metrics.items() if v is not None}

    def _is_spike(self, loss: float) -> bool:
        if not torch.isfinite(torch.tensor(loss)):
            return False
        spike = self._running_max_loss is not None and loss > self.config.loss_spike_factor * self._running_max_loss
        self._running_max_loss = loss if self._running_max_loss is None else max(self._running_max_loss, loss)
        return bool(spike)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Forward-only over ``eval_iterations`` global batches of the evaluation set, in order."""
        if self.dataset_evaluation is None:
            return {}
        loader = DataLoader(
            self.dataset_evaluation, seed=self.config.seed, topology=self.context.topology, shuffle=False
        )
        losses: list[float] = []
        sums: dict[str, float] = {}
        for _ in range(self.config.eval_iterations):
            out = self.parallel_module.evaluation_step(
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
    def run_training(self, return_metrics: bool = False) -> list[dict[str, Any]] | None:
        """Train until ``train_iterations``; evaluate, log and save on their intervals.

        SIGTERM or SIGINT on any rank stops every rank after the same step, saves a
        checkpoint (when ``save_dir`` is set; not twice when the step was just saved) and
        exits with ``128 + signal``. A rank that cannot reach the step boundary within the
        collective timeout exits with the same code without saving.
        """
        cfg = self.config
        topology = self.context.topology
        watcher = SignalWatcher(topology.device, grace_seconds=topology.config.timeout_seconds).install()
        try:
            while self.context.iterations < cfg.train_iterations:
                metrics = self.train_step()
                step = self.context.iterations
                last = step == cfg.train_iterations
                if step % cfg.log_interval == 0 or last:
                    self.metrics_logger.log(metrics, step)
                self.history.append(metrics)
                if cfg.eval_interval is not None and (step % cfg.eval_interval == 0 or last):
                    eval_metrics = self.evaluate()
                    self.metrics_logger.log(eval_metrics, step)
                    self.history.append(eval_metrics)
                if cfg.save_dir is not None and (last or (cfg.save_interval and step % cfg.save_interval == 0)):
                    self.checkpointer.save(cfg.save_dir)
                signum = watcher.agreed_signal()
                if signum:
                    watcher.disarm()
                    self._stop_on_signal(signum)
        finally:
            watcher.uninstall()
            self.checkpointer.wait()
            self.metrics_logger.close()
        return self.history if return_metrics else None

    def _stop_on_signal(self, signum: int) -> None:
        step = self.context.iterations
        if self.config.save_dir is not None:
            self.checkpointer.save(self.config.save_dir)
            self.checkpointer.wait()
        self.metrics_logger.console(f"signal {signum} received: stopped after step {step}; checkpoint saved")
        self.metrics_logger.close()
        sys.exit(exit_code_for(signum))


def _scalar(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item())
    return float(value)
